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
found it, every gateway's requests included (`settled`). Each estimate is scaled by the view's own
`admission.Calibration` of the version, taught by what the requests it admitted took to their answer
(`observe`). It admits if any node could answer in time, and otherwise raises the same `Shed` the node would
(503, Retry-After from the backlog's drain), which `Gateway.serve` answers with the model's fallback when it
has one, exactly as for a refusal from an embedded node.

A view is a guess a little old: a document older than STALE_S, a node announced hot for the version
without a fresh document, or a version no document names, is unknown, and the request is admitted; the
node decides on arrival (`Node.infer`).

A node that stopped publishing is lost well before its heartbeat expires (`fleet.TTL_SECONDS`): once this
view has seen a node's document change, a node whose document then stays the same (or is gone) across
LOST_S of this view's reads is taken as not serving anything. The silence is timed on this gateway's
clock between its own reads, and only while they keep coming (a gap past FRESH_S, this process stalled or
Redis away, starts the count again), so the gateway's own stall is not mistaken for the node's death; a
node never seen publishing (an older release) is never judged. A node whose loop stalls (a cold load, a
loaded machine) is as silent as a dead one, so the refusal also needs this gateway's own evidence: requests
it added to the version's stream with no answer of any kind for LOST_S (`answered`). When every live node
consuming a version is lost, and that evidence is there, the request is refused before it enters a stream
no one reads (`Shed`, reason "node_lost", Retry-After the heartbeat's time left plus the version's cold
start), so it gets the fallback or a quick 503 instead of 504 at its deadline. A lost node's document is
left out of the estimate for the others (none left: unknown, admitted).
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
from serving.dataplane.transport.fleet import TTL_SECONDS, NodeInfo
from serving.dataplane.transport.stream_codec import request_stream
from serving.policies import admission
from serving.policies.batching import SHADOW_PRIORITY, LatencyProfile

log = logging.getLogger(__name__)

LOAD_PREFIX = "ferry:load:"
PUBLISH_SECONDS = 0.1  # a node's publication; one SET
TTL_MS = 2000  # a node that stops publishing leaves no document behind for long
REFRESH_SECONDS = 0.1  # a gateway's read of the documents and the streams' lengths; one round trip
STALE_S = 1.0  # past this age a document says nothing: admit, the node decides
LOST_S = 0.5  # five publications missed across this view's reads: the node is not serving (dead or stalled)
FRESH_S = 0.3  # reads further apart than this: this view stalled, and says nothing of who went silent
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
    window: float = 0.0  # its batch window, seconds (0 in an older node's document)
    estimate: admission.Estimate = field(default=lambda rows: 0.0, repr=False)
    full_batch: float = field(default=0.0, repr=False)  # seconds of its largest batch: read once per document

    def __post_init__(self) -> None:
        self.estimate = LatencyProfile(self.profile).estimate
        self.full_batch = self.estimate(self.max_batch)


@dataclass(slots=True)
class NodeLoad:
    node: str
    at: float  # the node's wall clock when it published
    in_flight: float  # estimated seconds left of the work already on its device then
    versions: dict[str, VersionState]
    handed: frozenset[str] = frozenset()  # versions with a batch on its device then (none: an older node)
    running_left: float = 0.0  # estimated seconds left then of the batch running


def encode_load(load: NodeLoad) -> bytes:
    return orjson.dumps(
        {
            "node": load.node,
            "at": load.at,
            "in_flight": load.in_flight,
            # Beside the versions' rows, so a gateway one release older reads the document as before.
            "handed": sorted(load.handed),
            "running_left": load.running_left,
            "windows": {v.key: v.window for v in load.versions.values()},
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
        windows = doc.get("windows") or {}
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
                window=float(windows.get(key, 0.0)),
            )
        return NodeLoad(
            str(doc["node"]),
            float(doc["at"]),
            float(doc["in_flight"]),
            versions,
            frozenset(str(k) for k in doc.get("handed") or ()),
            float(doc.get("running_left", 0.0)),
        )
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
        lost_s: float = LOST_S,
        fresh_s: float = FRESH_S,
    ) -> None:
        self.url = url
        self.nodes = nodes  # the live nodes (FleetView.nodes): whose documents to read, which hold what hot
        self._clock = clock
        self._wall = wall
        self.stale_s = stale_s
        self.lost_s = lost_s
        self.fresh_s = fresh_s
        self.loads: dict[str, NodeLoad] = {}  # by node name
        self.lengths: dict[str, int] = {}  # version key -> its stream's length when last read
        self._hosting: dict[str, list[NodeLoad]] = {}  # version key -> the documents that name it
        self._hot: dict[str, set[str]] = {}  # version key -> the live nodes announcing it hot
        self._sent: dict[str, _Sent] = {}
        self._ready: dict[str, set[str]] = {}  # version key -> the live nodes consuming its stream
        # node -> (its document's `at` when it last changed, this view's clock at that read): a node seen publishing
        self._progress: dict[str, tuple[float, float]] = {}
        self._lost: dict[str, float] = {}  # node -> seconds its document has not changed, past lost_s
        self._read_at = -math.inf  # this view's clock at its last successful read
        self._unanswered: dict[str, float] = {}  # version key -> when this gateway's first unanswered XADD went in
        # Requests by what the view said: refused here, admitted on the view, admitted because it knew nothing.
        self.counts = {"refused": 0, "admitted": 0, "unknown": 0}
        # Per version: what admitted requests really took from this gateway's admission to their answer, over
        # the estimate they were admitted on. The node's own calibration covers its device and loop, not the
        # streams both ways, the node's read-ahead or this process's hand-back, all of which a gateway's
        # request waits on; and how far the estimate falls short differs by version (a saturated primary's
        # backlog in its stream, its quick fallback's none), so one factor for all refused the fallback what
        # the primary had taught it (`digits-wide`'s fallback answered 7/s at 3x instead of 200/s).
        self.calibrations: dict[str, admission.Calibration] = {}
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
        ready: dict[str, set[str]] = {}
        names = set()
        for node in live:
            names.add(node.name)
            for key in node.hot:
                hot.setdefault(key, set()).add(node.name)
            for key in node.ready:
                ready.setdefault(key, set()).add(node.name)
        self._hot = hot
        self._ready = ready
        self._judge(loads, names)

    def _judge(self, loads: list[NodeLoad], live: set[str]) -> None:
        """Which live nodes have gone silent: a document unchanged across lost_s of this view's reads."""
        read_at = self._clock()
        if read_at - self._read_at > self.fresh_s:
            # This view missed reads (its loop stalled, Redis was away): what it did not see says nothing of the
            # nodes. Their silence is timed again from this read.
            self._progress = {name: (at, read_at) for name, (at, _) in self._progress.items()}
        self._read_at = read_at
        for load in loads:
            seen = self._progress.get(load.node)
            if seen is None or seen[0] != load.at:
                self._progress[load.node] = (load.at, read_at)
        for name in [n for n in self._progress if n not in live]:
            del self._progress[name]  # left the fleet (its heartbeat expired): routing no longer counts it
        self._lost = {
            name: read_at - since for name, (_, since) in self._progress.items() if read_at - since > self.lost_s
        }

    def lost(self) -> dict[str, float]:
        """The live nodes judged not serving, with how long they have been silent; none while this view is
        itself not fresh (its last read further back than fresh_s)."""
        return self._lost if self._lost and self._clock() - self._read_at <= self.fresh_s else {}

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
            self._unanswered.setdefault(key, self._clock())

    def answered(self, key: str) -> None:
        """A node answered a request of `key`'s stream (a result or an error: it is reading the stream)."""
        self._unanswered.pop(key, None)

    def admit(self, key: str, rows: int, deadline: float, priority: int, *, cold_start_s: float = 0.0) -> float:
        """Raise `Shed` when no node hosting `key` could answer this request by its deadline, as the node's
        admission would judge it (times this gateway's calibration for `key`), or when every node consuming its
        stream is lost (`cold_start_s`: the version's load time, for Retry-After); otherwise count its rows as
        sent to the stream (the caller sends it next) and return the device estimate it was admitted on (0.0:
        unknown), which the caller hands to `observe` with what the request took."""
        refusal, estimated = self.refusal(key, rows, deadline, priority, cold_start_s=cold_start_s)
        if refusal is not None:
            raise refusal
        self.sent(key, rows)
        return estimated

    def observe(self, key: str, estimated: float, took: float) -> None:
        """A request for `key` admitted on `estimated` seconds was answered `took` seconds after its admission
        (or hit its deadline then): what teaches the version's calibration."""
        if estimated > 0.0:
            calibration = self.calibrations.get(key)
            if calibration is None:
                if len(self.calibrations) > 4096:  # versions gone over a long life
                    self.calibrations.clear()
                calibration = self.calibrations[key] = admission.Calibration()
            calibration.observe(estimated, took, self._clock())

    def refusal(
        self, key: str, rows: int, deadline: float, priority: int, *, cold_start_s: float = 0.0
    ) -> tuple[Shed | None, float]:
        """(the refusal, or None to admit; the estimate admitted on, 0.0 when unknown or refused)."""
        loads = self._hosting.get(key)
        hot = self._hot.get(key)
        lost = self.lost()
        if lost:
            ready = self._ready.get(key)
            since = self._unanswered.get(key)
            if ready and ready <= lost.keys() and since is not None and self._clock() - since > self.lost_s:
                self.counts["refused"] += 1
                silent = min(lost[name] for name in ready)
                return (
                    Shed(
                        f"{key}: no live node serves it: the {len(ready)} node(s) consuming its stream published"
                        f" no load for {silent * 1000:.0f} ms (lost until their heartbeat expires); refused at"
                        " the gateway",
                        reason="node_lost",
                        tier=priority,
                        retry_after=admission.retry_after(max(0.0, TTL_SECONDS - silent) + cold_start_s),
                    ),
                    0.0,
                )
            # a lost node reads nothing from the stream: the others' documents decide
            loads = [load for load in loads or () if load.node not in lost]
            hot = hot - lost.keys() if hot is not None else None
        wall = self._wall()
        if not loads or any(wall - load.at > self.stale_s for load in loads):
            self.counts["unknown"] += 1
            return None, 0.0
        if hot is not None and not hot <= {load.node for load in loads}:
            self.counts["unknown"] += 1  # a node serves it hot and said nothing of its load
            return None, 0.0
        now = self._clock()
        calibration = self.calibrations.get(key)
        factor = calibration.factor(now) if calibration is not None else 1.0
        level = min(max(priority, 0), SHADOW_PRIORITY)
        others_level = CALLERS if priority < SHADOW_PRIORITY else SHADOW_PRIORITY
        best: admission.Verdict | None = None
        drain = math.inf
        unread = self._unread_share(key, len(loads))
        for load in loads:
            since = max(0.0, wall - load.at)
            in_flight = max(0.0, load.in_flight - since)  # less what ran since it published
            state = load.versions[key]
            # whether this request's batch is handed before the batch running then ends (as `Node._completion`)
            first = admission.hands_first(
                on_device=bool(load.handed),
                own_on_device=key in load.handed,
                running_left=load.running_left - since,
                window=state.window,
            )
            own = admission.VersionLoad(state.ahead[level] + unread, state.max_batch, state.estimate)
            others = []
            queued = [admission.VersionLoad(state.ahead[SHADOW_PRIORITY] + unread, state.max_batch, state.estimate)]
            coming = batches = handed = 0.0
            for other in load.versions.values():
                if other is state:
                    continue
                share = self._unread_share(other.key, len(self._hosting.get(other.key, ())))
                on_device = other.key in load.handed
                # the work arriving for it: its callers' device share (tiers above the mirrors' level)
                coming += other.higher[SHADOW_PRIORITY]
                if other.higher[SHADOW_PRIORITY] >= admission.ACTIVE_SHARE:  # a version nothing arrives for
                    batches += other.full_batch  # takes no turn
                    if first and on_device:
                        handed += other.full_batch
                if other.ahead[others_level] + share:
                    others.append(
                        admission.VersionLoad(
                            other.ahead[others_level] + share, other.max_batch, other.estimate, on_device
                        )
                    )
                if other.ahead[SHADOW_PRIORITY] + share:
                    queued.append(
                        admission.VersionLoad(other.ahead[SHADOW_PRIORITY] + share, other.max_batch, other.estimate)
                    )
            arrivals = admission.Arrivals(coming, batches, handed) if coming > 1e-9 else None
            completion = admission.completion_seconds(
                own=own,
                rows=rows,
                others=others,
                in_flight=in_flight,
                arrivals=arrivals,
                horizon=deadline - now,
                first=first,
            )
            verdict = admission.decide(
                now=now,
                deadline=deadline,
                priority=priority,
                completion=completion * factor,
                higher_share=state.higher[level],
            )
            if verdict.admit:
                self.counts["admitted"] += 1
                return None, completion
            if best is None or verdict.completion < best.completion:
                best = verdict
            drain = min(drain, admission.drain_seconds(queued, in_flight))
        assert best is not None
        self.counts["refused"] += 1
        why = "the request's deadline" if best.reason == "deadline" else f"priority {priority}'s share of"
        return (
            Shed(
                f"{key}: estimated completion {best.completion * 1000:.0f} ms on the least loaded of {len(loads)}"
                f" node(s) (its device backlog and the stream's unread requests included) exceeds {why} budget"
                f" ({admission.HEADROOM:.0%} of the {max(0.0, deadline - now) * 1000:.0f} ms left); refused at the"
                " gateway",
                reason=best.reason,
                tier=priority,
                retry_after=admission.retry_after(drain),
            ),
            0.0,
        )

    def _unread_share(self, key: str, nodes: int) -> int:
        """Rows of `key`'s stream no node has read yet (its length less what the nodes hold, taken at this
        gateway's recent rows per request), plus the rows this gateway is sending, split over its `nodes`."""
        loads = self._hosting.get(key, ())
        unread = max(0, self.lengths.get(key, 0) - sum(load.versions[key].held for load in loads))
        sent = self._sent.get(key)
        rows = unread * (sent.mean_rows if sent is not None else 1.0) + (sent.rows if sent is not None else 0)
        return math.ceil(rows / max(1, nodes))
