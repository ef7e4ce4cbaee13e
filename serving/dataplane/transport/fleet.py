"""The fleet of node processes as Redis holds it: each node's facts in a hash that its heartbeat renews.

A node (`serving.dataplane.node.node_process`) writes `ferry:node:<name>` every HEARTBEAT_SECONDS with
a TTL of TTL_SECONDS and adds its name to `ferry:nodes`. A hash that expired is a lost node: its
versions are no longer counted ready, and its pending requests are claimed by the live ones.

`FleetView` is a gateway's reading of it. It stands where the embedded `Node` stands on the data
plane (`is_ready`, `failures`, `reconciled_serial`), so routing, readiness and the repository
index work the same in both modes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import orjson
import redis
import redis.asyncio as aioredis

from serving.dataplane.gateway.snapshot import RoutingSnapshot
from serving.dataplane.transport import redis_pipe

log = logging.getLogger(__name__)

NODES_KEY = "ferry:nodes"
# Each node's last heartbeat, kept after its hash expires, so the fleet page can show a lost node (and what it
# held) for SEEN_SECONDS; a node that leaves cleanly removes its entry.
SEEN_KEY = "ferry:fleet:seen"
SEEN_SECONDS = 3600
HEARTBEAT_SECONDS = 1.0
TTL_SECONDS = 3  # three missed heartbeats: lost
REFRESH_SECONDS = 0.25


def node_key(name: str) -> str:
    return f"ferry:node:{name}"


@dataclass(frozen=True)
class NodeInfo:
    name: str
    instance: str  # unique per process start: two processes under one name are told apart
    host: str
    pid: int
    device: str
    accelerator: str
    accelerator_count: int
    memory_total: int
    memory_budget: int
    memory_used: int
    labels: dict[str, str]
    started_at: float
    heartbeat_at: float
    serial: int  # the last routing snapshot this node reconciled
    ready: frozenset[str] = frozenset()  # version keys it consumes: loaded, or cold and loaded on request
    hot: frozenset[str] = frozenset()  # of those, the loaded ones
    loading: frozenset[str] = frozenset()  # of those, the ones a request is loading now
    failures: dict[str, str] = field(default_factory=dict)  # version key -> why its load failed
    # Placed here by the placement reconciler (serving.reconciler): hosted here, and by no unassigned node.
    assigned: frozenset[str] = frozenset()
    warm: frozenset[str] = frozenset()  # evicted, kept in host memory: a reload skips the disk and warm-up
    cached: frozenset[str] = frozenset()  # its artifact on this node's local disk: a load reads no network
    counts: dict[str, int] = field(default_factory=dict)  # stream entries: served, expired, claimed, ...
    busy: float = 0.0  # the device's busy share of the last seconds (serving.dataplane.metrics.busy)
    # Its work utilisation over the same seconds (rows at their best batch's cost); None from a node of a release
    # before it measured one (its heartbeat lacks the field): unknown, which the fleet page shows as "—", not 0%.
    work: float | None = None
    # (seconds ago, busy, work) per 10 s, oldest first: the last minutes of both, for the fleet page
    utilisation: list = field(default_factory=list)
    # What it holds, per version key: {"tier": "hot" | "warm", "bytes": n}. Hot counts against the device budget;
    # warm (in host memory) does not.
    resident: dict[str, dict] = field(default_factory=dict)

    @staticmethod
    def encode_field(value: object) -> bytes:
        return orjson.dumps(value)

    def to_hash(self) -> dict[str, bytes]:
        return {k: self.encode_field(v) for k, v in self.to_doc().items()}

    def to_doc(self) -> dict[str, object]:
        return {
            "name": self.name,
            "instance": self.instance,
            "host": self.host,
            "pid": self.pid,
            "device": self.device,
            "accelerator": self.accelerator,
            "accelerator_count": self.accelerator_count,
            "memory_total": self.memory_total,
            "memory_budget": self.memory_budget,
            "memory_used": self.memory_used,
            "labels": self.labels,
            "started_at": self.started_at,
            "heartbeat_at": self.heartbeat_at,
            "serial": self.serial,
            "ready": sorted(self.ready),
            "hot": sorted(self.hot),
            "loading": sorted(self.loading),
            "failures": self.failures,
            "counts": self.counts,
            "assigned": sorted(self.assigned),
            "warm": sorted(self.warm),
            "cached": sorted(self.cached),
            "busy": self.busy,
            "work": self.work,
            "utilisation": self.utilisation,
            "resident": self.resident,
        }

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> NodeInfo:
        return cls.from_doc({k.decode(): orjson.loads(v) for k, v in raw.items()})

    @classmethod
    def from_doc(cls, doc: dict) -> NodeInfo:
        # Fields a newer node adds are left out, so a process one release behind still reads its heartbeat.
        doc = {k: v for k, v in doc.items() if k in _FIELDS}
        doc["ready"] = frozenset(doc.get("ready", ()))
        doc["hot"] = frozenset(doc.get("hot", ()))
        doc["assigned"] = frozenset(doc.get("assigned", ()))
        doc["warm"] = frozenset(doc.get("warm", ()))
        doc["cached"] = frozenset(doc.get("cached", ()))
        doc["loading"] = frozenset(doc.get("loading", ()))
        return cls(**doc)


_FIELDS = frozenset(f.name for f in fields(NodeInfo))


def resident_of(hosted: Mapping[str, object], warm: Mapping[str, object] | None = None) -> dict[str, dict]:
    """A node's versions as the heartbeat's `resident`: each loaded one (`Node.hosted`) hot, each kept in host
    memory after eviction (`Node.warm`) warm, with its footprint."""
    resident = {
        key: {"tier": "hot", "bytes": h.runtime.memory_bytes}  # type: ignore[attr-defined]
        for key, h in hosted.items()
    }
    for key, w in (warm or {}).items():
        resident.setdefault(key, {"tier": "warm", "bytes": w.runtime.memory_bytes})  # type: ignore[attr-defined]
    return resident


@dataclass(frozen=True)
class LoadFailure:
    """What the repository index shows for a version that failed to load on the nodes."""

    reason: str


@dataclass(frozen=True)
class FleetPacking:
    """What the repository index reads of an embedded node's packing (`Node.packing`), across the fleet."""

    cold: frozenset[str] = frozenset()  # served by a live node, loaded on none: the next request loads it
    loading: frozenset[str] = frozenset()  # loads in progress: not announced by nodes yet
    no_room: dict[str, str] = field(default_factory=dict)


async def read_fleet(client: aioredis.Redis) -> list[NodeInfo]:
    """The live nodes: those whose heartbeat hash has not expired (names left by lost nodes are dropped)."""
    names = sorted(n.decode() for n in await client.smembers(NODES_KEY))
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(node_key(name))
    nodes, lost = [], []
    for name, raw in zip(names, await pipe.execute(), strict=True):
        if not raw:
            lost.append(name)
            continue
        try:
            nodes.append(NodeInfo.from_hash(raw))
        except (TypeError, ValueError) as exc:
            log.warning("node %s wrote a heartbeat this process cannot read: %s", name, exc)
    if lost:
        await client.srem(NODES_KEY, *lost)
    return nodes


def seen_entry(info: NodeInfo) -> bytes:
    """A node's entry in SEEN_KEY: its whole last heartbeat."""
    return orjson.dumps(info.to_doc())


async def read_lost(client: aioredis.Redis, live: list[NodeInfo], now: float) -> list[NodeInfo]:
    """Nodes whose heartbeat expired within the last SEEN_SECONDS, as they last announced themselves (older
    entries are dropped). A name that is live again is not lost, whatever instance it runs."""
    names = {n.name for n in live}
    lost, stale = [], []
    for name, raw in (await client.hgetall(SEEN_KEY)).items():
        name = name.decode()
        if name in names:
            continue
        try:
            info = NodeInfo.from_doc(orjson.loads(raw))
        except (TypeError, ValueError) as exc:
            log.warning("node %s left a last heartbeat this process cannot read: %s", name, exc)
            stale.append(name)
            continue
        if now - info.heartbeat_at > SEEN_SECONDS:
            stale.append(name)
        elif now - info.heartbeat_at > TTL_SECONDS:  # not yet expired: a node between two reads, not lost
            lost.append(info)
    if stale:
        await client.hdel(SEEN_KEY, *stale)
    return sorted(lost, key=lambda n: n.name)


class RemoteVersions:
    """What a gateway asks of the node(s) beside it when they are other processes, answered from the last view
    it read: what `FleetView` reads from Redis and `host_link.HostView` from the node host."""

    def __init__(self) -> None:
        self._ready: frozenset[str] = frozenset()  # served by some live node, loaded or cold
        self._hot: frozenset[str] = frozenset()  # loaded on some live node
        self.failures: dict[str, LoadFailure] = {}
        self.reconciled_serial = 0

    def is_ready(self, key: str) -> bool:
        """Loaded on a live node (an embedded `Node.is_ready`)."""
        return key in self._hot

    def routable(self, key: str) -> bool:
        """Ready on a live node: loaded, or cold there and loaded by the request (the node's packing)."""
        return key in self._ready

    def unready_reason(self, key: str) -> str:
        failure = self.failures.get(key)
        return failure.reason if failure is not None else ""


class FleetView(RemoteVersions):
    """A gateway's view of the live nodes, re-read every REFRESH_SECONDS. If Redis is unreachable the
    last view stays (the transport refuses requests meanwhile; routing on a stale view costs nothing)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.nodes: list[NodeInfo] = []
        self.packing = FleetPacking()
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._client = redis_pipe.client(self.url)
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever(), name="ferry-fleet")

    def update(self, nodes: list[NodeInfo]) -> None:
        self.nodes = nodes
        self._ready = frozenset().union(*(n.ready for n in nodes))
        self._hot = frozenset().union(*(n.hot for n in nodes))
        self.packing = FleetPacking(
            cold=self._ready - self._hot, loading=frozenset().union(*(n.loading for n in nodes)) - self._hot
        )
        self.failures = {
            key: LoadFailure(reason) for n in nodes for key, reason in n.failures.items() if key not in self._ready
        }
        # Every live node has reconciled this serial: what a repository load waits for.
        self.reconciled_serial = min((n.serial for n in nodes), default=0)

    async def refresh_once(self) -> None:
        assert self._client is not None
        self.update(await read_fleet(self._client))

    async def _refresh_forever(self) -> None:
        failing = False
        while True:
            try:
                await self.refresh_once()
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("reading the fleet from Redis failed (%s); keeping the last view", exc)
                failing = True
            await asyncio.sleep(REFRESH_SECONDS)

    async def reconcile(self, snapshot: RoutingSnapshot) -> None:
        """The nodes reconcile themselves from the snapshot they follow; nothing to do in the gateway."""

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._client is not None:
            await self._client.aclose()
