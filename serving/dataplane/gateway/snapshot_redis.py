"""Routing snapshots through Redis, for distributed mode.

The control plane publishes each snapshot as one value (`ferry:snapshot`) with a cluster-wide
serial from a Redis counter, then announces the serial on a pub/sub channel. Gateways and nodes
read the value at start, on each announcement, and whenever the stored serial (checked every
second) is newer than theirs, so none of them queries PostgreSQL to serve, and a missed
announcement costs about a second (the value is always the latest).

A publisher takes its serial before it reads the registry, and the value is replaced only by a
higher serial (one script call), so a slow publisher that read the registry before a change (a
revocation) cannot overwrite the snapshot that carries the change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

import orjson
import redis
import redis.asyncio as aioredis

from rollout.routing import RouteTable
from serving.dataplane.gateway.snapshot import (
    DEFAULT_LATENCY_BUDGET_MS,
    NO_PLACEMENT,
    KeyEntry,
    ModelEntry,
    PipelineEntry,
    PipelineVersionEntry,
    PlacementEntry,
    RoutingSnapshot,
    SnapshotHub,
    TenantEntry,
    VersionEntry,
)
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.metrics import metrics
from serving.policies.batching import BatchingConfig

log = logging.getLogger(__name__)

PREFIX = "ferry:snapshot"
VALUE_KEY = PREFIX
SERIAL_KEY = f"{PREFIX}:serial"  # the last serial handed out
STORED_KEY = f"{PREFIX}:stored"  # the serial of the value
KEYS = (VALUE_KEY, SERIAL_KEY, STORED_KEY)
CHANNEL = f"{PREFIX}:changed"
# Followers name their connections after their process, so CLIENT LIST shows who follows the feed.
CLIENT_NAME_PREFIX = "ferry-snapshots-"


def _plain(value: object) -> object:
    if isinstance(value, frozenset | set):
        return sorted(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode(snapshot: RoutingSnapshot) -> bytes:
    doc = dataclasses.asdict(snapshot)
    for name, model in snapshot.models.items():  # the rules only: the receiver recomputes the cumulative weights
        doc["models"][name]["routes"] = model.routes.to_dict()
    return orjson.dumps(doc, option=orjson.OPT_NON_STR_KEYS, default=_plain)


def _placement(p: dict | None) -> PlacementEntry:
    """A version's placement facts; a snapshot from a publisher that predates them has none."""
    if not p:
        return NO_PLACEMENT
    return PlacementEntry(
        **{
            **p,
            "measured": tuple(tuple(m) for m in p.get("measured", ())),
            "accelerators": frozenset(p.get("accelerators", ())),
        }
    )


def decode(raw: bytes) -> RoutingSnapshot:
    doc = orjson.loads(raw)
    models = {}
    for name, m in doc["models"].items():
        versions = {}
        for number, v in m["versions"].items():
            v = dict(v)
            v["inputs"] = tuple(TensorSpec.from_dict(s) for s in v["inputs"])
            v["outputs"] = tuple(TensorSpec.from_dict(s) for s in v["outputs"])
            v["batching"] = BatchingConfig(**v["batching"])
            v["latency_profile"] = {int(k): float(s) for k, s in v["latency_profile"].items()}
            v["placement"] = _placement(v.get("placement"))
            versions[int(number)] = VersionEntry(**v)
        models[name] = ModelEntry(
            name=m["name"],
            task=m["task"],
            description=m["description"],
            fallback=m["fallback"],
            versions=versions,
            tenant_id=m.get("tenant_id"),
            visibility=m.get("visibility", "public"),
            shared_with=frozenset(m.get("shared_with", ())),
            routes=RouteTable.from_dict(m.get("routes") or {}),
        )
    keys = {
        prefix: KeyEntry(
            digest=k["digest"], tenant_id=k["tenant_id"], scopes=tuple(k["scopes"]), expires_at=k["expires_at"]
        )
        for prefix, k in doc.get("keys", {}).items()
    }
    tenants = {int(tid): TenantEntry(**t) for tid, t in doc.get("tenants", {}).items()}
    return RoutingSnapshot(
        serial=doc["serial"],
        built_at=doc["built_at"],
        models=models,
        keys=keys,
        tenants=tenants,
        latency_budget_ms=doc.get("latency_budget_ms", DEFAULT_LATENCY_BUDGET_MS),
        pipelines={name: _pipeline(p) for name, p in doc.get("pipelines", {}).items()},
    )


def _pipeline(p: dict) -> PipelineEntry:
    versions = {
        int(number): PipelineVersionEntry(
            **{
                **v,
                "inputs": tuple(TensorSpec.from_dict(s) for s in v["inputs"]),
                "outputs": tuple(TensorSpec.from_dict(s) for s in v["outputs"]),
            }
        )
        for number, v in p["versions"].items()
    }
    return PipelineEntry(**{**p, "versions": versions})


# A serial sequence starts at Redis' clock in milliseconds, not at 1: when Redis loses its data (a
# restart without persistence, a flush) the new serials are still above what running gateways hold,
# which otherwise would ignore every publication, revocations included, until the count caught up.
# This holds while the cluster averages under 1,000 publications a second. KEYS: serial.
_NEXT_SERIAL = """
local serial = redis.call('INCR', KEYS[1])
if serial == 1 then
  local now = redis.call('TIME')
  serial = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('SET', KEYS[1], string.format('%d', serial))
end
return serial
"""
# KEYS: value, stored serial; ARGV: serial, encoded snapshot, channel. 1 if stored and announced.
_STORE_IF_NEWER = """
if tonumber(ARGV[1]) <= tonumber(redis.call('GET', KEYS[2]) or '0') then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[3], ARGV[1])
return 1
"""


class RedisSnapshotStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self._client = redis.Redis.from_url(url)
        self._next_serial = self._client.register_script(_NEXT_SERIAL)
        self._store_if_newer = self._client.register_script(_STORE_IF_NEWER)

    def next_serial(self) -> int:
        """A fresh cluster-wide serial; take it before reading the registry for the snapshot."""
        return int(self._next_serial(keys=[SERIAL_KEY]))

    def publish(self, snapshot: RoutingSnapshot) -> bool:
        """Store the snapshot and announce it, unless one with a higher serial is stored already
        (then False: that one was read from the registry later)."""
        stored = self._store_if_newer(keys=[VALUE_KEY, STORED_KEY], args=[snapshot.serial, encode(snapshot), CHANNEL])
        return bool(stored)

    def load(self) -> RoutingSnapshot | None:
        raw = self._client.get(VALUE_KEY)
        return decode(raw) if raw else None

    def close(self) -> None:
        self._client.close()


# Between announcements a follower compares the stored serial with its own this often, so an
# announcement lost while the connection looked alive (one that died without a FIN or RST reaching
# this side, where a blocked read would wait forever) costs about this long, not beat's 30 s.
CHECK_SECONDS = 1.0
SOCKET_TIMEOUT_SECONDS = 5.0  # a reply slower than this: the connection is dropped and reopened


async def _catch_up(client: aioredis.Redis, hub: SnapshotHub) -> None:
    """Load the stored snapshot into `hub` when it is newer. The serial is read first: pub/sub ignores
    database numbers, so another deployment's announcements on this Redis cost a small GET, no decode."""
    stored = await client.get(STORED_KEY)
    if stored is not None and hub.current is not None and int(stored) <= hub.current.serial:
        return
    raw = await client.get(VALUE_KEY)
    if raw:
        hub.set(decode(raw))


async def follow(url: str, hub: SnapshotHub, *, ready: asyncio.Event | None = None) -> None:
    """Keep `hub` on the latest published snapshot until cancelled; reconnects after Redis errors."""
    backoff = 0.5
    while True:
        client = aioredis.Redis.from_url(
            url, client_name=f"{CLIENT_NAME_PREFIX}{os.getpid()}", socket_timeout=SOCKET_TIMEOUT_SECONDS
        )
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(CHANNEL)
                # Read after subscribing, so a publish in between is not missed.
                await _catch_up(client, hub)
                if ready is not None:
                    ready.set()
                backoff = 0.5
                while True:
                    # An announcement, or CHECK_SECONDS without one: compare serials either way.
                    await pubsub.get_message(ignore_subscribe_messages=True, timeout=CHECK_SECONDS)
                    await _catch_up(client, hub)
        except asyncio.CancelledError:
            raise
        except (redis.RedisError, OSError) as exc:
            log.warning("snapshot feed from Redis lost (%s); serving the last snapshot, retrying", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        except Exception:
            # A bug, not an outage: a stored snapshot this process cannot decode (a publisher of another
            # version), a subscriber that raised. Logged and counted; the feed goes on (a newer snapshot, a
            # revocation among them, must still arrive), backing off as for an outage.
            metrics.INTERNAL_ERRORS.labels("snapshot_feed").inc()
            log.exception("following the snapshot feed failed; serving the last snapshot, retrying")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        finally:
            await client.aclose()
