"""Admission at the gateway in distributed mode: what the nodes publish of their load, and each gateway's view.

Each node process (`serving.dataplane.node.load_publisher`) writes `ferry:load:<node>` every PUBLISH_SECONDS,
one SET with a TTL: for each version it hosts, the rows queued at and above each priority level, the
stream entries it holds, its largest batch, its latency profile and the device share higher tiers took;
and the device's in-flight remainder. The versions in one document share the node's device, so each is
one of the others admission counts for the rest.

A gateway's `LoadView` reads every live node's document and the length of each version's stream in one
pipelined round trip every REFRESH_SECONDS, in the background: a request never waits on Redis for it.
Before a request enters a stream, `LoadView.admit` runs the node's own admission functions
(`serving.policies.admission`) on that view, with the stream's unread entries (its length less what the
nodes hold) and this gateway's rows on their way in added to the queue, spread over the nodes that host the
version. The length is the last read's, or fresher: each XADD's reply carries the stream's length as it
found it, every gateway's requests included (`settled`). It admits if any node could answer in time, and
otherwise raises the same `Shed` the node would (503, Retry-After from the backlog's drain), which
`Gateway.serve` answers with the model's fallback when it has one, exactly as for a refusal from an embedded
node.

A view is a guess a little old: a document older than STALE_S, a node announced hot for the version
without a fresh document, or a version no document names, is unknown, and the request is admitted; the
node decides on arrival (`Node.infer`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import orjson
import redis

from serving.dataplane.errors import Shed
from serving.dataplane.transport import redis_pipe
from serving.dataplane.transport.fleet import NodeInfo
from serving.dataplane.transport.stream_codec import request_stream
from serving.policies import admission
from serving.policies.batching import SHADOW_PRIORITY, LatencyProfile

log = logging.getLogger(__name__)

LOAD_PREFIX = "ferry:load:"
PUBLISH_SECONDS = 0.1  # a node's publication; one SET
TTL_MS = 2000  # a node that stops publishing leaves no document behind for long
REFRESH_SECONDS = 0.1  # a gateway's read of the documents and the streams' lengths; one round trip
STALE_S = 1.0  # past this age a document says nothing: admit, the node decides
LEVELS = SHADOW_PRIORITY + 1  # priority levels 0 (highest) .. SHADOW_PRIORITY (mirrors)
CALLERS = SHADOW_PRIORITY - 1  # the lowest callers' level: mirrored work yields to callers


def load_key(node: str) -> str:
    return f"{LOAD_PREFIX}{node}"


@dataclass(slots=True)
class VersionState:
    """One version's queue on one node, as admission reads it."""

    key: str
    ahead: list[int]  # rows queued at each priority level or above it (BatchQueue.rows_ahead), 0..SHADOW_PRIORITY
    held: int  # stream entries the node holds for it: queued, loading or running
    max_batch: int
    profile: dict[int, float]  # seconds per batch size (LatencyProfile.points)
    higher: list[float]  # device share taken by tiers above each level (DeviceShare.higher_than), 0..SHADOW_PRIORITY
    estimate: admission.Estimate = field(default=lambda rows: 0.0, repr=False)

    def __post_init__(self) -> None:
        self.estimate = LatencyProfile(self.profile).estimate


@dataclass(slots=True)
class NodeLoad:
    node: str
    at: float  # the node's wall clock when it published
    in_flight: float  # estimated seconds left of the work already on its device then
    versions: dict[str, VersionState]


def encode_load(load: NodeLoad) -> bytes:
    return orjson.dumps(
        {
            "node": load.node,
            "at": load.at,
            "in_flight": load.in_flight,
            "versions": [
                [v.key, v.ahead, v.held, v.max_batch, sorted(v.profile.items()), v.higher]
                for v in load.versions.values()
            ],
        }
    )


def decode_load(raw: bytes) -> NodeLoad:
    """A node's document; ValueError when it is not one this process can read (a version skew)."""
    try:
        doc = orjson.loads(raw)
        versions = {}
        for key, ahead, held, max_batch, profile, higher in doc["versions"]:
            if len(ahead) != LEVELS or len(higher) != LEVELS or int(max_batch) < 1:
                raise ValueError(f"{key}: {len(ahead)} levels, max batch {max_batch}")
            versions[str(key)] = VersionState(
                str(key),
                [int(r) for r in ahead],
                int(held),
                int(max_batch),
                {int(size): float(seconds) for size, seconds in profile},
                [float(s) for s in higher],
            )
        return NodeLoad(str(doc["node"]), float(doc["at"]), float(doc["in_flight"]), versions)
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"not a load document: {exc}") from None


@dataclass(slots=True)
class _Sent:
    """What this gateway sent to one version's stream whose XADD has not come back yet."""

    rows: int = 0
    mean_rows: float = 1.0  # rows per request, recently: what an unread entry is taken to hold


class LoadView:
    """A gateway's view of the nodes' load, refreshed in the background; `check` decides per request."""

    def __init__(
        self,
        url: str,
        nodes: Callable[[], Iterable[NodeInfo]],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        stale_s: float = STALE_S,
    ) -> None:
        self.url = url
        self.nodes = nodes  # the live nodes (FleetView.nodes): whose documents to read, which hold what hot
        self._clock = clock
        self._wall = wall
        self.stale_s = stale_s
        self.loads: dict[str, NodeLoad] = {}  # by node name
        self.lengths: dict[str, int] = {}  # version key -> its stream's length when last read
        self._hosting: dict[str, list[NodeLoad]] = {}  # version key -> the documents that name it
        self._hot: dict[str, set[str]] = {}  # version key -> the live nodes announcing it hot
        self._sent: dict[str, _Sent] = {}
        # Requests by what the view said: refused here, admitted on the view, admitted because it knew nothing.
        self.counts = {"refused": 0, "admitted": 0, "unknown": 0}
        self._client: redis.asyncio.Redis | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._client = redis_pipe.client(self.url, name="ferry-load-view")
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever(), name="ferry-load-view")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=redis_pipe.COMMAND_TIMEOUT_S)
        if self._client is not None:
            await self._client.aclose()

    # -- the view --------------------------------------------------------------------------

    async def refresh_once(self) -> None:
        assert self._client is not None
        live = list(self.nodes())
        names = [n.name for n in live]
        keys = sorted({k for load in self.loads.values() for k in load.versions})  # last read's versions
        pipe = self._client.pipeline(transaction=False)
        if names:
            pipe.mget([load_key(n) for n in names])
        for key in keys:
            pipe.xlen(request_stream(key))
        results = await pipe.execute() if names or keys else []
        raws = results[0] if names else []
        loads = []
        for name, raw in zip(names, raws, strict=True):
            if raw is None:
                continue
            try:
                loads.append(decode_load(raw))
            except ValueError as exc:
                log.warning("node %s published a load this gateway cannot read: %s", name, exc)
        self.update(loads, dict(zip(keys, results[1 if names else 0 :], strict=True)), live)

    def update(self, loads: list[NodeLoad], lengths: dict[str, int], live: Iterable[NodeInfo]) -> None:
        self.loads = {load.node: load for load in loads}
        self.lengths = lengths
        hosting: dict[str, list[NodeLoad]] = {}
        for load in loads:
            for key in load.versions:
                hosting.setdefault(key, []).append(load)
        self._hosting = hosting
        hot: dict[str, set[str]] = {}
        for node in live:
            for key in node.hot:
                hot.setdefault(key, set()).add(node.name)
        self._hot = hot

    async def _refresh_forever(self) -> None:
        failing = False
        while True:
            try:
                await self.refresh_once()
                failing = False
            except (redis.RedisError, OSError) as exc:
                # The documents age past STALE_S meanwhile: requests are admitted (the transport refuses them
                # anyway while Redis is away).
                if not failing:
                    log.warning("reading the nodes' load failed (%s); the view ages", exc)
                failing = True
            await asyncio.sleep(REFRESH_SECONDS)

    # -- per request -----------------------------------------------------------------------

    def sent(self, key: str, rows: int) -> None:
        """A request of `rows` rows is on its way into `key`'s stream from this gateway."""
        sent = self._sent.get(key)
        if sent is None:
            sent = self._sent[key] = _Sent()
        sent.rows += rows
        sent.mean_rows += 0.1 * (rows - sent.mean_rows)

    def settled(self, key: str, rows: int, length: int | None) -> None:
        """Its XADD came back, with the stream's length as it found it (None: it failed). That length counts
        what every gateway sent, fresher than the last read: it stands until the next read or reply."""
        sent = self._sent.get(key)
        if sent is not None:
            sent.rows = max(0, sent.rows - rows)
        if length is not None:
            self.lengths[key] = length

    def admit(self, key: str, rows: int, deadline: float, priority: int) -> None:
        """Raise `Shed` when no node hosting `key` could answer this request by its deadline, as the node's
        admission would judge it; otherwise count its rows as sent to the stream (the caller sends it next)."""
        refusal = self.refusal(key, rows, deadline, priority)
        if refusal is not None:
            raise refusal
        self.sent(key, rows)

    def refusal(self, key: str, rows: int, deadline: float, priority: int) -> Shed | None:
        loads = self._hosting.get(key)
        wall = self._wall()
        if not loads or any(wall - load.at > self.stale_s for load in loads):
            self.counts["unknown"] += 1
            return None
        hot = self._hot.get(key)
        if hot is not None and not hot <= {load.node for load in loads}:
            self.counts["unknown"] += 1  # a node serves it hot and said nothing of its load
            return None
        now = self._clock()
        level = min(max(priority, 0), SHADOW_PRIORITY)
        others_level = CALLERS if priority < SHADOW_PRIORITY else SHADOW_PRIORITY
        best: admission.Verdict | None = None
        drain = math.inf
        unread = self._unread_share(key, len(loads))
        for load in loads:
            in_flight = max(0.0, load.in_flight - max(0.0, wall - load.at))  # less what ran since it published
            state = load.versions[key]
            own = admission.VersionLoad(state.ahead[level] + unread, state.max_batch, state.estimate)
            others = []
            queued = [admission.VersionLoad(state.ahead[SHADOW_PRIORITY] + unread, state.max_batch, state.estimate)]
            for other in load.versions.values():
                if other is state:
                    continue
                share = self._unread_share(other.key, len(self._hosting.get(other.key, ())))
                if other.ahead[others_level] + share:
                    others.append(
                        admission.VersionLoad(other.ahead[others_level] + share, other.max_batch, other.estimate)
                    )
                if other.ahead[SHADOW_PRIORITY] + share:
                    queued.append(
                        admission.VersionLoad(other.ahead[SHADOW_PRIORITY] + share, other.max_batch, other.estimate)
                    )
            completion = admission.completion_seconds(own=own, rows=rows, others=others, in_flight=in_flight)
            verdict = admission.decide(
                now=now, deadline=deadline, priority=priority, completion=completion, higher_share=state.higher[level]
            )
            if verdict.admit:
                self.counts["admitted"] += 1
                return None
            if best is None or verdict.completion < best.completion:
                best = verdict
            drain = min(drain, admission.drain_seconds(queued, in_flight))
        assert best is not None
        self.counts["refused"] += 1
        why = "the request's deadline" if best.reason == "deadline" else f"priority {priority}'s share of"
        return Shed(
            f"{key}: estimated completion {best.completion * 1000:.0f} ms on the least loaded of {len(loads)} node(s)"
            f" (its device backlog and the stream's unread requests included) exceeds {why} budget"
            f" ({admission.HEADROOM:.0%} of the {max(0.0, deadline - now) * 1000:.0f} ms left); refused at the gateway",
            reason=best.reason,
            tier=priority,
            retry_after=admission.retry_after(drain),
        )

    def _unread_share(self, key: str, nodes: int) -> int:
        """Rows of `key`'s stream no node has read yet (its length less what the nodes hold, taken at this
        gateway's recent rows per request), plus the rows this gateway is sending, split over its `nodes`."""
        loads = self._hosting.get(key, ())
        unread = max(0, self.lengths.get(key, 0) - sum(load.versions[key].held for load in loads))
        sent = self._sent.get(key)
        rows = unread * (sent.mean_rows if sent is not None else 1.0) + (sent.rows if sent is not None else 0)
        return math.ceil(rows / max(1, nodes))
