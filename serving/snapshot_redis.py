"""Routing snapshots through Redis, for distributed mode.

The control plane publishes each snapshot as one value (`ferry:snapshot`) with a cluster-wide
serial from INCR, then announces the serial on a pub/sub channel. Gateways and nodes read the
value at start and again on each announcement, so none of them queries PostgreSQL to serve, and
a missed announcement is repaired by the next one (the value is always the latest).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import orjson
import redis
import redis.asyncio as aioredis

from serving.batching import BatchingConfig
from serving.protocol import TensorSpec
from serving.snapshot import KeyEntry, ModelEntry, RoutingSnapshot, SnapshotHub, TenantEntry, VersionEntry

log = logging.getLogger(__name__)

PREFIX = "ferry:snapshot"
VALUE_KEY = PREFIX
SERIAL_KEY = f"{PREFIX}:serial"
CHANNEL = f"{PREFIX}:changed"


def _plain(value: object) -> object:
    if isinstance(value, frozenset | set):
        return sorted(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def encode(snapshot: RoutingSnapshot) -> bytes:
    return orjson.dumps(dataclasses.asdict(snapshot), option=orjson.OPT_NON_STR_KEYS, default=_plain)


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
            versions[int(number)] = VersionEntry(**v)
        models[name] = ModelEntry(name=m["name"], task=m["task"], description=m["description"],
                                  fallback=m["fallback"], versions=versions, tenant_id=m.get("tenant_id"),
                                  visibility=m.get("visibility", "public"),
                                  shared_with=frozenset(m.get("shared_with", ())))
    keys = {
        prefix: KeyEntry(digest=k["digest"], tenant_id=k["tenant_id"], scopes=tuple(k["scopes"]),
                         expires_at=k["expires_at"])
        for prefix, k in doc.get("keys", {}).items()
    }
    tenants = {int(tid): TenantEntry(**t) for tid, t in doc.get("tenants", {}).items()}
    return RoutingSnapshot(serial=doc["serial"], built_at=doc["built_at"], models=models, keys=keys,
                           tenants=tenants)


class RedisSnapshotStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self._client = redis.Redis.from_url(url)

    def publish(self, snapshot: RoutingSnapshot) -> RoutingSnapshot:
        """Store the snapshot under a fresh cluster-wide serial and announce it; returns it renumbered."""
        serial = int(self._client.incr(SERIAL_KEY))
        numbered = dataclasses.replace(snapshot, serial=serial)
        pipe = self._client.pipeline(transaction=True)
        pipe.set(VALUE_KEY, encode(numbered))
        pipe.publish(CHANNEL, str(serial))
        pipe.execute()
        return numbered

    def load(self) -> RoutingSnapshot | None:
        raw = self._client.get(VALUE_KEY)
        return decode(raw) if raw else None

    def close(self) -> None:
        self._client.close()


async def follow(url: str, hub: SnapshotHub, *, ready: asyncio.Event | None = None) -> None:
    """Keep `hub` on the latest published snapshot until cancelled; reconnects after Redis errors."""
    backoff = 0.5
    while True:
        client = aioredis.Redis.from_url(url)
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(CHANNEL)
                # Read the value after subscribing, so a publish in between is not missed.
                raw = await client.get(VALUE_KEY)
                if raw:
                    hub.set(decode(raw))
                if ready is not None:
                    ready.set()
                backoff = 0.5
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    raw = await client.get(VALUE_KEY)
                    if raw:
                        hub.set(decode(raw))
        except asyncio.CancelledError:
            raise
        except (redis.RedisError, OSError) as exc:
            log.warning("snapshot feed from Redis lost (%s); serving the last snapshot, retrying", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)
        finally:
            await client.aclose()
