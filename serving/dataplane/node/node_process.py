"""A node process (`manage.py runnode`): hosts versions on its `Node` and serves their Redis streams.

Its loops, each a single step the loop repeats (a test drives one step directly):
- `heartbeat_once`: its facts, the versions it has ready and the snapshot serial it reconciled, in
  `ferry:node:<name>` with a TTL (`serving.dataplane.transport.fleet`);
- the snapshot follower (`serving.dataplane.gateway.snapshot_redis.follow`), then `Node.reconcile` on what
  `hosted(snapshot)` picks;
- `consume_once`: one XREADGROUP over the streams of its ready versions, COUNT up to the batch size,
  a short BLOCK, each entry handed to `Node.infer` (its batcher, admission and runtime), answered on
  the entry's reply stream, then acknowledged and deleted;
- `reclaim_once`: the pending entries of consumers whose node is lost are claimed and served while
  their deadline allows;
- `watch_fleet_once`: which versions other live nodes hold hot or are loading. A version cold here and
  hot (or loading) on another node is left to that node: taking its requests here would load a second
  copy, and evict for it, while a loaded one serves (two nodes each loading whatever came to them halve
  what the fleet holds and thrash). The heartbeat is sent at once when what this node holds changes, so
  the others learn of a load within about a fleet refresh.

Placement: `assign` and `release` are what the node's Celery queue (`serving.node_tasks`) runs on this loop
for the placement reconciler (`serving.reconciler`). A version assigned to some live node is hosted only by
the nodes it is assigned to; the others stop consuming it. A version assigned nowhere (desired replicas 0)
is hosted by every node, loaded on demand within its budget.

A stream is read only while this node holds few of its requests (READ_AHEAD batches), so a busy node
leaves the backlog to the other replicas, and a node that dies leaves little pending behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import redis

from serving.dataplane import tracing
from serving.dataplane.errors import DeadlineExceeded, ServingError
from serving.dataplane.gateway import snapshot_redis
from serving.dataplane.gateway.snapshot import RoutingSnapshot, SnapshotHub, VersionEntry
from serving.dataplane.metrics import metrics
from serving.dataplane.node.load_publisher import LoadPublisher
from serving.dataplane.node.node import Node
from serving.dataplane.transport import fleet, redis_pipe, stream_bound
from serving.dataplane.transport.fleet_events import EventPublisher
from serving.dataplane.transport.load_view import PUBLISH_SECONDS
from serving.dataplane.transport.stream_codec import (
    FIELD,
    GROUP,
    REPLIES,
    MalformedMessage,
    decode_request,
    encode_error,
    encode_success,
    pack_replies,
    request_stream,
)
from serving.policies.batching import READ_AHEAD

log = logging.getLogger(__name__)

READ_BLOCK_MS = 20  # short: the set of streams worth reading changes as this node's queues fill and drain
RECLAIM_SECONDS = 0.5
CLAIM_MIN_IDLE_MS = 500  # two live nodes claiming at once: the second finds the entry no longer idle
REPLY_MAXLEN = 10_000
# What became of each stream entry this node read: one outcome each (ferry_node_stream_entries_total{outcome}).
# "refused": answered with the node's refusal (shed, not ready, a bad input found by the model); "handed_back":
# put back on the stream for the node its version moved to.
OUTCOMES = ("served", "expired", "refused", "errors", "malformed", "handed_back")
# Of the entries run here, whether their version was loaded when they came: a dimension of its own
# (ferry_node_stream_entries_taken_total{state}), as is "claimed" (taken over from a lost node).
RESIDENCY = ("hot", "cold")
HOLDING_POLL_SECONDS = 0.02  # how soon a load or an eviction goes out in a heartbeat
HEARTBEAT_RETRY_SECONDS = 0.1  # after a failed heartbeat
JOIN_TIMEOUT_SECONDS = 60.0  # start-up gives up joining the fleet after Redis failed this long
UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """`24GiB`, `512MiB`, `1.5GB`, `4096` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS:
        raise ValueError(f"not a size: {text!r} (say 24GiB, 512MiB or a number of bytes)")
    return int(float(match.group(1)) * UNITS[unit])


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        for pair in item.split(","):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"a label is key=value, not {pair!r}")
            labels[key.strip()] = value.strip()
    return labels


def hosted(snapshot: RoutingSnapshot) -> set[str]:
    """The versions a node may host: every ready, loaded version, as the embedded node does. A node process
    narrows it by the reconciler's assignments (`NodeProcess.hosted_keys`)."""
    return {v.key for v in snapshot.hosted_versions()}


@dataclass(frozen=True)
class Facts:
    """What a node declares about itself. On CUDA the accelerator and memory are the device's own."""

    name: str
    device: str
    accelerator: str
    accelerator_count: int
    memory_total: int
    memory_budget: int
    labels: dict[str, str] = field(default_factory=dict)


def facts_for(
    name: str, device: str, accelerator: str | None, memory: int | None, labels: dict[str, str], default_memory: int
) -> Facts:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(index)
        budget = min(memory, props.total_memory) if memory else props.total_memory
        return Facts(name, device, props.name, torch.cuda.device_count(), props.total_memory, budget, labels)
    memory = memory or default_memory
    return Facts(name, device, accelerator or "cpu", 1 if accelerator else 0, memory, memory, labels)


class NodeProcess:
    def __init__(
        self,
        node: Node,
        url: str,
        facts: Facts,
        *,
        hub: SnapshotHub | None = None,
        hosted: Callable[[RoutingSnapshot], Collection[str]] = hosted,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_disk: Callable[[str], bool] | None = None,
    ) -> None:
        self.node = node
        # Whether an artifact (by sha256) is on this node's local disk, for the heartbeat's cold tier (`cached`).
        self.on_disk = on_disk
        self.url = url
        self.facts = facts
        self.hub = hub or SnapshotHub()
        self.hosted = hosted
        self._clock = clock
        self._wall = wall
        self.instance = uuid.uuid4().hex[:12]
        self.consumer = f"{facts.name}:{self.instance}"  # a restart under the same name is a new consumer
        self.started_at = wall()
        self._grouped: set[str] = set()  # version keys whose stream has its group (created or checked)
        self._held: dict[str, int] = {}  # version key -> its requests this node holds (queued or running)
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._reconciling: asyncio.Task[None] | None = None
        self._pending: RoutingSnapshot | None = None
        self._snapshot: RoutingSnapshot | None = None  # the last one reconciled: what an assignment loads from
        self._elsewhere: frozenset[str] = frozenset()  # versions assigned to other live nodes
        self.reconciled_serial = 0
        # reply stream -> the requests answered and their replies, not yet sent
        self._outbox: dict[bytes, tuple[list[int], list[bytes]]] = {}
        # version key -> (entry id, its size) answered, not yet acknowledged (the size: the stream's byte bound)
        self._acks: dict[str, list[tuple[bytes, int]]] = {}
        self._flush_scheduled = False
        # Stream entries by outcome (OUTCOMES: one each), those run by whether their version was loaded when they
        # came ("hot") or had to be loaded for them ("cold"; the hit rate of this node's packing), and those
        # claimed from lost nodes: three dimensions, in the heartbeat as one dict.
        self.counts = dict.fromkeys((*OUTCOMES, *RESIDENCY, "claimed"), 0)
        self._held_elsewhere: frozenset[str] = frozenset()  # hot or loading on another live node
        self._client = redis_pipe.client(url, name=f"ferry-node-{facts.name}")
        self._reader = redis_pipe.client(
            url,
            socket_timeout=READ_BLOCK_MS / 1000 + redis_pipe.COMMAND_TIMEOUT_S,
            name=f"ferry-node-reader-{facts.name}",
        )
        self._pipe = redis_pipe.Pipe(redis_pipe.client(url, name=f"ferry-node-replies-{facts.name}"), retry_once=True)
        self.events = EventPublisher(url, facts.name)  # its loads, evictions and failures, for the fleet page
        node.packing.listeners.append(self.events.add)
        # What the gateways' admission reads (serving.dataplane.transport.load_view), a few times a second.
        self.load = LoadPublisher(
            node, self._client, facts.name, held=lambda key: self._held.get(key, 0), clock=clock, wall=wall
        )

    # -- membership ------------------------------------------------------------------------

    def info(self) -> fleet.NodeInfo:
        node = self.node
        return fleet.NodeInfo(
            name=self.facts.name,
            instance=self.instance,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=str(node.device),
            accelerator=self.facts.accelerator,
            accelerator_count=self.facts.accelerator_count,
            memory_total=self.facts.memory_total,
            memory_budget=self.facts.memory_budget,
            memory_used=sum(h.runtime.memory_bytes for h in node.hosted.values()),
            labels=self.facts.labels,
            started_at=self.started_at,
            heartbeat_at=self._wall(),
            serial=self.reconciled_serial,
            ready=frozenset(k for k in self.servable() if k in self._grouped),
            hot=frozenset(node.hosted),
            loading=frozenset(node.packing.loading),
            failures={k: f.reason for k, f in node.failures.items()},
            counts={**self.counts, "loads": node.packing.loads, "evictions": node.packing.evictions},
            assigned=frozenset(node.packing.assigned),
            warm=frozenset(node.warm),
            busy=round(node.busy.fraction(), 4),
            work=round(node.work.fraction(), 4),
            utilisation=[list(sample) for sample in node.work.history()],
            resident=fleet.resident_of(node.hosted, node.warm),
            cached=self.cached(),
        )

    def cached(self) -> frozenset[str]:
        """The ready versions of the last snapshot whose artifact is on this node's local disk (the cold tier: a
        load here reads no network), whether or not this node serves them now: a stat each."""
        on_disk, snapshot = self.on_disk, self._snapshot
        if on_disk is None or snapshot is None:
            return frozenset()
        return frozenset(v.key for v in snapshot.hosted_versions() if on_disk(v.artifact_sha256))

    async def heartbeat_once(self) -> None:
        key = fleet.node_key(self.facts.name)
        pipe = self._client.pipeline(transaction=True)
        info = self.info()
        pipe.delete(key)  # fields of an older shape must not linger
        pipe.hset(key, mapping=info.to_hash())
        pipe.expire(key, fleet.TTL_SECONDS)
        pipe.sadd(fleet.NODES_KEY, self.facts.name)
        pipe.hset(fleet.SEEN_KEY, self.facts.name, fleet.seen_entry(info))
        await pipe.execute()

    def _holding(self) -> tuple:
        """Changes whenever what this node holds hot or is loading changes."""
        packing = self.node.packing
        return packing.loads, packing.evictions, tuple(packing.loading), len(self.node.hosted)

    async def _heartbeat_forever(self) -> None:
        """A heartbeat every HEARTBEAT_SECONDS, and one as soon as a load starts or ends or a version is evicted."""
        failing = False
        while True:
            try:
                holding = self._holding()
                await self.heartbeat_once()
                if failing:
                    log.info("heartbeat works again")
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("heartbeat failed (%s); retrying", exc)
                failing = True
            if failing:
                # Soon: a Redis that came back empty holds no heartbeat, and gateways read this node's versions
                # as not served until the next one.
                await asyncio.sleep(HEARTBEAT_RETRY_SECONDS)
                continue
            due = self._clock() + fleet.HEARTBEAT_SECONDS
            while self._clock() < due and self._holding() == holding:
                await asyncio.sleep(min(HOLDING_POLL_SECONDS, max(0.0, due - self._clock())))

    async def watch_fleet_once(self) -> None:
        nodes = await fleet.read_fleet(self._client)
        self._held_elsewhere = frozenset().union(*(n.hot | n.loading for n in nodes if n.name != self.facts.name))

    async def claim_name(self) -> None:
        """Join the fleet under this node's name. A heartbeat hash under it that is still renewed is a live
        node: refuse (two processes would overwrite one heartbeat). One that is not (a node killed moments
        ago, restarted at once) expires within the TTL: wait for that."""
        key = fleet.node_key(self.facts.name)
        deadline = self._clock() + fleet.TTL_SECONDS + 1
        while raw := await self._client.hgetall(key):
            other = fleet.NodeInfo.from_hash(raw)
            if other.instance == self.instance:
                break
            if self._clock() > deadline:
                raise RuntimeError(
                    f"a live node named {self.facts.name!r} exists (pid {other.pid} on {other.host});"
                    " pick another --name"
                )
            await asyncio.sleep(0.25)
        await self.heartbeat_once()

    async def leave(self) -> None:
        """Remove this node's heartbeat, if it is this process's (not a namesake's that refused this one)."""
        await self._client.eval(
            _LEAVE,
            3,
            fleet.node_key(self.facts.name),
            fleet.NODES_KEY,
            fleet.SEEN_KEY,
            fleet.NodeInfo.encode_field(self.instance),
            self.facts.name,
        )

    # -- what it hosts ---------------------------------------------------------------------

    def on_snapshot(self, snapshot: RoutingSnapshot) -> None:
        """Hub callback, on this loop (the follower runs here)."""
        self._pending = snapshot
        if self._reconciling is None or self._reconciling.done():
            self._reconciling = asyncio.get_running_loop().create_task(self._reconcile_latest())

    async def _reconcile_latest(self) -> None:
        while self._pending is not None:
            snapshot, self._pending = self._pending, None
            try:
                await self.reconcile(snapshot)
            except Exception:
                log.exception("reconcile failed")

    def hosted_keys(self, snapshot: RoutingSnapshot) -> set[str]:
        """What this node hosts of `snapshot`: what it may host, less the versions assigned to other live
        nodes and not to this one (those are served where the reconciler placed them)."""
        return set(self.hosted(snapshot)) - (self._elsewhere - self.node.packing.assigned)

    async def reconcile(self, snapshot: RoutingSnapshot) -> None:
        self._snapshot = snapshot
        await self.node.reconcile(snapshot, keys=self.hosted_keys(snapshot))
        self._grouped &= set(self.servable())
        try:
            await self.ensure_groups()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            log.warning("creating consumer groups failed (%s); the consumer loop retries", exc)
        self.reconciled_serial = snapshot.serial

    async def ensure_groups(self, keys: Collection[str] | None = None) -> None:
        """Each hosted version's stream has the group. Created reading from the stream's start, not `$`:
        what gateways added before the first node came (or while a restarted Redis had no group) is served
        if its deadline allows, never skipped."""
        servable = self.servable()
        for key in list(keys if keys is not None else servable):
            if keys is None and key in self._grouped:
                continue
            try:
                await self._client.xgroup_create(request_stream(key), GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            if key in servable:
                self._grouped.add(key)

    def servable(self) -> dict[str, VersionEntry]:
        """The versions whose requests this node takes: loaded, or cold (the node's packing keeps them out of
        memory until a request comes, then loads them, evicting idle ones, while the deadline allows)."""
        entries = {key: hosted.entry for key, hosted in self.node.hosted.items()}
        for key, entry in self.node.packing.cold.items():
            entries.setdefault(key, entry)
        return entries

    def held(self) -> dict[str, int]:
        """Per version, the requests this node took off its stream and holds (a copy: metrics read it)."""
        return dict(self._held)

    # -- placement (the node's Celery queue) --------------------------------------------------

    async def assign(self, key: str) -> dict[str, object]:
        """Load `key` here for the reconciler, evicting idle unassigned versions (LRU) if it must, and keep it
        (never evicted on demand) until released. Returns what came of it; the heartbeat says so at once."""
        snapshot = self._snapshot
        entry = next((v for v in snapshot.hosted_versions() if v.key == key), None) if snapshot else None
        if entry is None:
            serial = snapshot.serial if snapshot else 0
            return {"state": "unknown", "reason": f"{key} is not ready in snapshot {serial} on {self.facts.name}"}
        self.node.packing.assigned.add(key)  # first: a reconcile meanwhile keeps it, and the heartbeat shows it
        try:
            return await self._load_assigned(key, entry)
        finally:
            # Whatever came of it, a load that raised or was cancelled at its deadline too, a heartbeat shows it
            # before the node task clears the reconciler's record of the load (0020: records before heartbeats).
            await self.heartbeat_once()

    async def _load_assigned(self, key: str, entry: VersionEntry) -> dict[str, object]:
        started = self._clock()
        try:
            hosted = await self.node.load(entry, evict=True)
        except BaseException:
            self.node.packing.assigned.discard(key)
            raise
        if hosted is None:
            self.node.packing.assigned.discard(key)
            return {
                "state": "failed",
                "reason": self.node.unready_reason(key) or self.node.packing.no_room.get(key, "not loaded"),
            }
        await self.ensure_groups([key])
        return {"state": "hot", "seconds": round(self._clock() - started, 4)}

    async def release(self, key: str, *, unload: bool) -> dict[str, object]:
        """The reconciler no longer places `key` here: with `unload` (scaled in), unload it now; without (its
        desired replicas went to 0), it stays as any version does, evictable and loaded on demand."""
        self.node.packing.assigned.discard(key)
        try:
            if unload:
                await self.node.unload(key)
                self._grouped.discard(key)
        finally:
            await self.heartbeat_once()  # as for a load: before the node task clears the record
        return {"state": "unloaded" if unload else "released"}

    def _fleet_changed(self, nodes: list[fleet.NodeInfo]) -> None:
        """Versions assigned elsewhere changed (a placement, or a node lost): host again what this node now
        should."""
        elsewhere = frozenset().union(*(n.assigned for n in nodes if n.name != self.facts.name))
        if elsewhere != self._elsewhere:
            self._elsewhere = elsewhere
            if self._snapshot is not None and self._pending is None:  # a newer one pending covers it
                self.on_snapshot(self._snapshot)

    # -- serving ---------------------------------------------------------------------------

    def _readable(self) -> dict[str, str]:
        streams = {}
        node = self.node
        for key, entry in self.servable().items():
            if key not in node.hosted and key in self._held_elsewhere and key not in node.packing.loading:
                continue  # cold here, served hot (or being loaded) by another node
            if key in self._grouped and self._held.get(key, 0) < READ_AHEAD * entry.batching.max_batch_size:
                streams[request_stream(key)] = ">"
        return streams

    async def consume_once(self) -> int:
        """One read over the streams with room; returns the entries handed to the node."""
        if any(key not in self._grouped for key in self.servable()):
            # A group whose creation failed in `reconcile` (Redis timed out: a loaded machine stalls it) is
            # created here, or the version would stay unread, and not ready, until the next snapshot.
            await self.ensure_groups()
        streams = self._readable()
        if not streams:
            self._room.clear()
            try:
                async with asyncio.timeout(READ_BLOCK_MS / 1000):
                    await self._room.wait()
            except TimeoutError:
                pass
            return 0
        count = max(e.batching.max_batch_size for e in self.servable().values())
        try:
            answer = await self._reader.xreadgroup(GROUP, self.consumer, streams, count=count, block=READ_BLOCK_MS)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("a consumer group is missing (Redis restarted empty?); creating them again")
            await self.ensure_groups(list(self._grouped))
            return 0
        taken = 0
        for stream, entries in answer or ():
            key = _key_of(stream)
            for entry_id, fields in entries:
                self._start(key, stream, entry_id, fields.get(FIELD))
                taken += 1
        return taken

    def _start(self, key: str, stream: bytes | str, entry_id: bytes, raw: bytes | None) -> None:
        self._held[key] = self._held.get(key, 0) + 1
        task = asyncio.get_running_loop().create_task(self._serve(key, stream, entry_id, raw))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(key, t))

    def _done(self, key: str, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._held[key] -= 1
        self._room.set()

    async def _serve(self, key: str, stream: bytes | str, entry_id: bytes, raw: bytes | None) -> None:
        if raw is not None and self._moved_away(key):
            # Read while this node served it, moved to another since (a placement's reconcile ran between the
            # read and now): that node answers it, not a 503 from here saying "not loaded". One step puts it back
            # at the stream's end; its deadline stays the one it came with.
            self.counts["handed_back"] += 1
            self._pipe.send(*stream_bound.hand_back_args(key, GROUP, entry_id, FIELD, raw), wait=False)
            return
        try:
            await self._answer(key, raw)
        except Exception:  # a bug here must not end the consumer loop; the entry is still acknowledged
            self.counts["errors"] += 1
            metrics.INTERNAL_ERRORS.labels("node_stream").inc()
            log.exception("serving stream entry %s of %s failed", entry_id, key)
        # After its reply (queued first, flushed first): an entry is acknowledged once answered.
        self._acks.setdefault(key, []).append((entry_id, len(raw or b"")))
        self._schedule_flush()

    def _moved_away(self, key: str) -> bool:
        """Whether `key` is neither loaded nor loadable here while another live node holds it (assigned, hot or
        loading): a request of it here would only be refused."""
        node = self.node
        if key in node.hosted or key in node.packing.cold:
            return False
        return key in self._elsewhere or key in self._held_elsewhere

    async def _answer(self, key: str, raw: bytes | None) -> None:
        try:
            request = decode_request(raw if raw is not None else b"")
        except MalformedMessage as exc:
            self.counts["malformed"] += 1
            metrics.INTERNAL_ERRORS.labels("stream_request").inc()
            log.error("malformed request on %s: %s", key, exc)
            if exc.request_id is not None and exc.reply_to is not None:
                self._reply(
                    exc.reply_to,
                    exc.request_id,
                    encode_error(exc.request_id, ServingError(f"malformed request on the stream: {exc}")),
                )
            return
        left = request.deadline - self._wall()
        if left <= 0:
            # Never run. The gateway's timer has most likely answered it 504 already (a second answer is
            # ignored there), but the answer is said explicitly: a gateway whose clock runs behind this
            # node's still waits, and must not wait for nothing.
            self.counts["expired"] += 1
            expired = DeadlineExceeded("deadline passed in the stream")
            self._reply(request.reply_to, request.id, encode_error(request.id, expired))
            return
        self.counts["hot" if key in self.node.hosted else "cold"] += 1
        # The gateway's trace goes on here: this node's part of the request is one span under its span.
        span = None
        if request.trace is not None and tracing.ENABLED:
            parent = tracing.from_carrier(request.trace)
            span = tracing.start_request("ferry.node", parent, kind=tracing.CONSUMER, **{"ferry.version": key})
        # The span records what the entry was answered (a 5xx: ERROR); a cancellation leaving it, as 499.
        with tracing.active(span, tracing.answered):
            try:
                outputs = await self.node.infer(
                    key, request.inputs, request.rows, self._clock() + left, request.priority, nbytes=len(raw or b"")
                )
                with tracing.child("ferry.reply"):
                    payload = encode_success(request.id, outputs, request.outputs)
                self.counts["served"] += 1
                status = 200
            except DeadlineExceeded as exc:
                self.counts["expired"] += 1
                payload = encode_error(request.id, exc)  # as above: said, not left to the gateway's timer
                status = exc.status
            except ServingError as exc:
                self.counts["refused"] += 1
                payload = encode_error(request.id, exc)
                status = exc.status
            except Exception:
                self.counts["errors"] += 1
                metrics.INTERNAL_ERRORS.labels("node_stream").inc()
                log.exception("inference on %s failed unexpectedly", key)
                payload = encode_error(request.id, ServingError("internal error on the node; it logged it"))
                status = 500
            if span is not None:
                tracing.answered(span, status)
        self._reply(request.reply_to, request.id, payload)

    def _reply(self, reply_to: bytes, request_id: int, payload: bytes) -> None:
        ids, payloads = self._outbox.setdefault(reply_to, ([], []))
        ids.append(request_id)
        payloads.append(payload)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """What this turn of the loop answered: one XADD per gateway, one acknowledgement (XACK, XDEL) per stream."""
        self._flush_scheduled = False
        outbox, self._outbox = self._outbox, {}
        acks, self._acks = self._acks, {}
        for reply_to, (ids, payloads) in outbox.items():
            # NOMKSTREAM: a gateway that died took its reply stream with it (TTL); no stream is left behind.
            self._pipe.send(
                "XADD",
                reply_to,
                "NOMKSTREAM",
                "MAXLEN",
                "~",
                REPLY_MAXLEN,
                "*",
                REPLIES,
                pack_replies(ids, payloads),
                wait=False,
            )
        for key, answered in acks.items():
            # XACK, XDEL and the stream's byte counter in one step (stream_bound.ACK): idempotent on a resend.
            self._pipe.send(*stream_bound.ack_args(key, GROUP, answered), wait=False)

    # -- lost nodes ------------------------------------------------------------------------

    async def reclaim_once(self) -> int:
        """Claim and serve the pending entries of consumers whose node is lost; drop such consumers once they
        hold nothing. Not XAUTOCLAIM: it claims by idle time alone, so it would also take entries from a
        live node that is merely busy and run them twice. Returns the entries claimed."""
        nodes = await fleet.read_fleet(self._client)
        self._fleet_changed(nodes)
        live = {f"{n.name}:{n.instance}" for n in nodes}
        live.add(self.consumer)
        claimed = 0
        for key in [k for k in self.servable() if k in self._grouped]:
            stream = request_stream(key)
            pending = await self._client.xpending_range(
                stream, GROUP, min="-", max="+", count=1000, idle=CLAIM_MIN_IDLE_MS
            )
            orphans = [p["message_id"] for p in pending if p["consumer"].decode() not in live]
            if orphans:
                entries = await self._client.xclaim(stream, GROUP, self.consumer, CLAIM_MIN_IDLE_MS, orphans)
                for entry_id, fields in entries:
                    if fields is None:  # deleted meanwhile (trimmed)
                        continue
                    self._start(key, stream, entry_id, fields.get(FIELD))
                    claimed += 1
            for consumer in await self._client.xinfo_consumers(stream, GROUP):
                name = consumer["name"].decode() if isinstance(consumer["name"], bytes) else consumer["name"]
                if name not in live and consumer["pending"] == 0:
                    await self._client.xgroup_delconsumer(stream, GROUP, name)
        self.counts["claimed"] += claimed
        if claimed:
            log.info("claimed %d requests left pending by lost nodes", claimed)
        return claimed

    # -- the loops -------------------------------------------------------------------------

    async def _every(self, seconds: float, step: Callable[[], object], what: str) -> None:
        failing = False
        while True:
            try:
                await step()  # type: ignore[misc]
                if failing:
                    log.info("%s works again", what)
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("%s failed (%s); retrying", what, exc)
                failing = True
            await asyncio.sleep(seconds)

    async def _consume_forever(self) -> None:
        backoff = 0.05
        while True:
            try:
                await self.consume_once()
                if backoff > 0.05:  # back from an outage: the replies' pooled connection died in it
                    await self._pipe.reset()
                    log.info("reading requests works again")
                backoff = 0.05
            except (redis.RedisError, OSError) as exc:
                (log.warning if backoff == 0.05 else log.debug)("reading requests failed (%s); retrying", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    def serve(self) -> None:
        """Start consuming the hosted versions' streams, answering, and claiming from lost nodes."""
        loop = asyncio.get_running_loop()
        self._pipe.start()
        self._loops.append(loop.create_task(self._consume_forever()))
        self._loops.append(loop.create_task(self._every(RECLAIM_SECONDS, self.reclaim_once, "claiming")))

    async def start(self, first_snapshot_timeout: float = 60.0, join_timeout: float = JOIN_TIMEOUT_SECONDS) -> None:
        """Join the fleet, follow the snapshot, load what it hosts, then serve. A Redis command that fails on
        the way (a loaded machine stalls Redis past the client's timeout) is retried, not the process's end."""
        self.events.start()
        await self._join(join_timeout)
        loop = asyncio.get_running_loop()
        self._loops.append(loop.create_task(self._heartbeat_forever()))
        self._loops.append(loop.create_task(self._every(PUBLISH_SECONDS, self.load.publish_once, "publishing load")))
        self._loops.append(
            loop.create_task(self._every(fleet.REFRESH_SECONDS, self.watch_fleet_once, "reading the fleet"))
        )
        self.hub.subscribe(self.on_snapshot)
        self._loops.append(loop.create_task(snapshot_redis.follow(self.url, self.hub)))
        deadline = self._clock() + first_snapshot_timeout
        while self.reconciled_serial == 0 and self._clock() < deadline:
            await asyncio.sleep(0.05)
        if self.reconciled_serial == 0:
            log.warning(
                "no routing snapshot in Redis after %.0fs; serving once one is published", first_snapshot_timeout
            )
        self.serve()
        try:
            await self.heartbeat_once()  # what it now serves, at once: the heartbeat loop sends it too, later
        except (redis.RedisError, OSError) as exc:
            log.warning("heartbeat failed (%s); the heartbeat loop retries", exc)
        log.info(
            "node %s (%s, %s) serving %s",
            self.facts.name,
            self.facts.accelerator,
            self.node.device,
            sorted(self.servable()) or "nothing yet",
        )

    async def _join(self, timeout: float) -> None:
        """`claim_name`, retried while Redis fails (times out or refuses), for up to `timeout` seconds. A live
        namesake is not retried here: `claim_name` waits for it itself, then raises."""
        deadline = self._clock() + timeout
        while True:
            try:
                await self.claim_name()
                return
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if self._clock() > deadline:
                    raise
                log.warning("joining the fleet failed (%s); retrying", exc)
                await asyncio.sleep(HEARTBEAT_RETRY_SECONDS)

    async def stop(self, drain_seconds: float = 10.0) -> None:
        """Leave the fleet (gateways stop routing here at their next read), finish what it holds, close."""
        self.hub.unsubscribe(self.on_snapshot)
        for task in self._loops:
            task.cancel()
        if self._loops:  # bounded, as the gateway's close (streams.RedisStreamsTransport.close)
            await asyncio.wait(self._loops, timeout=redis_pipe.COMMAND_TIMEOUT_S)
        try:
            await self.leave()
        except (redis.RedisError, OSError) as exc:
            log.warning("leaving the fleet failed (%s); the heartbeat expires in %ds", exc, fleet.TTL_SECONDS)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=drain_seconds)
        if self._pipe.started:
            try:
                async with asyncio.timeout(redis_pipe.COMMAND_TIMEOUT_S * 2):
                    await self._pipe.send("PING")  # the replies queued before it are sent once it answers
            except (redis.RedisError, OSError, TimeoutError):
                pass
        await self._pipe.close()
        await self.node.close()
        await self.events.close()
        for client in (self._client, self._reader, self._pipe.client):
            await client.aclose()


# KEYS: the node's hash, the fleet set, the last heartbeats; ARGV: its instance (as the hash stores it), its name.
_LEAVE = """
if redis.call('HGET', KEYS[1], 'instance') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
  return 1
end
return 0
"""


def _key_of(stream: bytes | str) -> str:
    text = stream.decode() if isinstance(stream, bytes) else stream
    return text[text.index("{") + 1 : text.rindex("}")]
