"""Shadow traffic: a share of live requests mirrored to a candidate version, its answers kept for comparison.

The gateway calls `Mirror.offer` once its primary has been answered: a few attribute reads and, for a
sampled request, one append to a bounded queue (items and bytes). Nothing here is awaited by the
primary, and nothing here can fail it: a full queue drops the mirror and counts it. A few worker tasks
send queued mirrors to the transport, those queued together stacked into one call of up to a batch (so
mirroring costs the node few admissions and few device calls), at `SHADOW_PRIORITY`, the lowest tier,
whose share of every queue and
deadline budget is the smallest, so admission refuses mirrors before any caller's request as a backlog
grows (those refusals are counted too, never retried), and the node runs a batch of mirrors only when
no caller's work waits for the device. Each finished mirror leaves a `Pair` (both
answers, both latencies, both statuses, the inputs) in a bounded buffer that the data plane's flush
hands to the control plane (`rollout.shadow_compare` aggregates, `rollout.tasks.record_shadow` stores),
so the comparison runs off the request path.

Sampling is deterministic: each model carries a credit that grows by its `shadow_fraction` per request
and mirrors one request each time it reaches 1, so 10% mirrors exactly every tenth request.

Every mirrored request counts in the comparison's aggregates, whoever sent it; its inputs and outputs may be
kept as a sample of a disagreement only when its tenant owns the model or lets other tenants keep samples
of its traffic (`may_keep_sample`, decided here from the routing snapshot, so a sample of another tenant's
traffic is never produced, sent or stored).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter

from serving.dataplane.errors import DeadlineExceeded, ServingError, Shed
from serving.dataplane.gateway.snapshot import ModelEntry, TenantEntry, VersionEntry, version_budget_ms
from serving.dataplane.metrics import metrics
from serving.dataplane.transport.transport import Transport
from serving.policies.batching import SHADOW_PRIORITY

log = logging.getLogger(__name__)

MIRRORED = Counter(
    "ferry_shadow_mirrored",
    "Mirrored requests the shadow version answered, by outcome",
    ["model", "version", "outcome"],
)
DROPPED = Counter(
    "ferry_shadow_dropped",
    "Mirrored requests dropped: queue_full (no room in the mirror queue), shed (refused by admission),"
    " expired (waited past their deadline), not_ready (shadow not loaded), incompatible (other inputs than the"
    " version that served), uncompared (pair buffer full, or their flush failed)",
    ["model", "version", "reason"],
)


@dataclass(slots=True)
class Mirrored:
    """A request to mirror: its inputs and its primary's answer."""

    task: str
    baseline: VersionEntry  # the version that answered the caller
    candidate: VersionEntry  # the shadow
    inputs: dict[str, np.ndarray]
    rows: int
    nbytes: int
    primary: dict[str, np.ndarray]
    primary_compute: float  # device seconds of the primary's rows: its share, by rows, of its batch's compute
    offered: float  # monotonic
    deadline: float  # monotonic
    at: float  # wall clock, for the minute it is counted in
    keep_sample: bool = False  # whether its inputs and outputs may be kept as a sample (`may_keep_sample`)
    held: int = 0  # the bytes it holds while queued, its primary's answer with its inputs (the queue's bound)


@dataclass(slots=True)
class Pair:
    """Both answers to one mirrored request; `shadow` is None when the shadow failed (`shadow_status`).
    Latency is compared as device seconds per request on both sides, the node's own measure (each request's
    share, by rows, of its batch's compute), because the end-to-end times are not alike: a mirror waits at
    the lowest tier behind every caller and travels stacked with other mirrors."""

    item: Mirrored
    shadow: dict[str, np.ndarray] | None
    shadow_status: int
    shadow_compute: float  # device seconds of the mirror's rows, measured as `Mirrored.primary_compute` is
    error: str = ""

    @property
    def nbytes(self) -> int:
        outputs = sum(a.nbytes for a in self.item.primary.values())
        if self.shadow is not None:
            outputs += sum(a.nbytes for a in self.shadow.values())
        return self.item.nbytes + outputs


def may_keep_sample(model: ModelEntry, tenant_id: int | None, tenants: dict[int, TenantEntry]) -> bool:
    """Whether a request of tenant `tenant_id` to `model` may be kept as a shadow sample (its inputs and
    outputs, shown in the model's shadow report): its owner's own traffic, or a tenant that opted in
    (`Tenant.share_shadow_samples`). A platform model has no owning tenant: only opted-in tenants' traffic.
    A request without a tenant, or of a tenant the snapshot does not hold, is not kept."""
    if tenant_id is None:
        return False
    if model.tenant_id is not None and tenant_id == model.tenant_id:
        return True
    entry = tenants.get(tenant_id)
    return entry is not None and entry.share_shadow_samples


def stack_rows(candidate: VersionEntry) -> int:
    """The most rows one stacked mirror call carries: the largest measured batch that computes within the
    candidate's batch window (at least one). The window is about the longest gap callers' batches leave a
    busy device, and the node runs a mirror only in such a gap, so a call of a full batch would wait for an
    idle device; with no profile yet, a full batch."""
    limit = candidate.batching.max_batch_size
    profile = candidate.latency_profile
    if not profile:
        return limit
    window = candidate.batching.max_queue_delay
    fitting = [int(b) for b, seconds in profile.items() if seconds <= window and int(b) <= limit]
    return max(fitting, default=1)


def _stackable(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Whether two requests' inputs concatenate along the rows: same names, dtypes and per-row shapes."""
    if a.keys() != b.keys():
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape[1:] == b[k].shape[1:] for k in a)


class Mirror:
    """The mirror queue, its workers and the pairs they leave. Belongs to one event loop."""

    def __init__(
        self,
        transport: Transport,
        *,
        max_items: int = 256,
        max_bytes: int = 16 * 2**20,
        workers: int = 2,
        max_pairs: int = 4096,
        max_pair_bytes: int = 32 * 2**20,
        ready: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        if min(max_items, max_bytes, workers, max_pairs, max_pair_bytes) < 1:
            raise ValueError("mirror bounds and workers must be at least 1")
        self.transport = transport
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.workers = workers
        self.max_pairs = max_pairs
        self.max_pair_bytes = max_pair_bytes
        self.ready = ready
        self._clock = clock
        self._wall = wall
        self.queue: deque[Mirrored] = deque()
        self.queued_bytes = 0
        self.pairs: list[Pair] = []
        self.pair_bytes = 0
        self._credit: dict[str, float] = {}
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- the request path --------------------------------------------------------------------

    def candidate(self, model: ModelEntry, served: VersionEntry) -> VersionEntry | None:
        """The shadow version to mirror this request to, or None: not configured, not this request's turn
        (deterministic sampling), or the shadow is not ready (counted)."""
        routes = model.routes
        if routes.shadow is None or not routes.mirrors(served.version):
            return None
        credit = self._credit.get(model.name, 0.0) + routes.shadow_fraction
        if credit < 1.0:
            self._credit[model.name] = credit
            return None
        self._credit[model.name] = credit - 1.0
        shadow = model.versions.get(routes.shadow)
        if shadow is None or not shadow.servable or (self.ready is not None and not self.ready(shadow.key)):
            DROPPED.labels(model.name, str(routes.shadow), "not_ready").inc()
            return None
        if shadow.inputs != served.inputs:  # a shadow that takes other inputs cannot be asked the same thing
            DROPPED.labels(model.name, str(routes.shadow), "incompatible").inc()
            return None
        return shadow

    def offer(
        self,
        task: str,
        baseline: VersionEntry,
        candidate: VersionEntry,
        inputs: dict[str, np.ndarray],
        rows: int,
        nbytes: int,
        primary: dict[str, np.ndarray],
        primary_compute: float,
        *,
        keep_sample: bool = False,
        budget_ms: int | None = None,
    ) -> bool:
        """Queue a mirror, or drop it (counted) when the queue has no room. Never blocks, never raises
        for the caller's request: True when queued. `keep_sample`: `may_keep_sample` for its caller.
        `budget_ms`: the candidate's latency budget (`RoutingSnapshot.budget_ms`), the mirror's deadline as
        it is a caller's without one; None (no snapshot at hand) takes the platform default's."""
        held = nbytes + sum(a.nbytes for a in primary.values())  # an answer may outweigh its request
        if len(self.queue) >= self.max_items or self.queued_bytes + held > self.max_bytes:
            DROPPED.labels(candidate.model, str(candidate.version), "queue_full").inc()
            return False
        now = self._clock()
        self.queue.append(
            Mirrored(
                task,
                baseline,
                candidate,
                inputs,
                rows,
                nbytes,
                primary,
                primary_compute,
                now,
                now + (version_budget_ms(candidate) if budget_ms is None else budget_ms) / 1000.0,
                self._wall(),
                keep_sample,
                held,
            )
        )
        self.queued_bytes += held
        if self._wake is not None:
            self._wake.set()
        return True

    # -- the workers --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers on the running loop."""
        if self._tasks:
            return
        self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._work()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for item in self.queue:
            DROPPED.labels(item.candidate.model, str(item.candidate.version), "expired").inc()
        self.queue.clear()
        self.queued_bytes = 0

    async def _work(self) -> None:
        wake = self._wake
        assert wake is not None
        while True:
            if not self.queue:
                wake.clear()
                await wake.wait()
                continue
            items = self.take_batch()
            if items:
                await self.send(items)

    def take(self) -> Mirrored | None:
        """The next mirror still within its deadline (older ones are dropped, counted), or None."""
        while self.queue:
            item = self.queue.popleft()
            self.queued_bytes -= item.held
            if item.deadline > self._clock():
                return item
            DROPPED.labels(item.candidate.model, str(item.candidate.version), "expired").inc()
        return None

    def take_batch(self) -> list[Mirrored]:
        """The next mirror and those queued behind it that can travel with it in one call: same candidate,
        same inputs but for the rows, up to `stack_rows`. One call instead of many costs the node one
        admission, one future and a share of one batch, which is what keeps mirroring cheap."""
        first = self.take()
        if first is None:
            return []
        items, rows = [first], first.rows
        limit = stack_rows(first.candidate)
        while self.queue:
            following = self.queue[0]
            if (
                following.candidate != first.candidate
                or rows + following.rows > limit
                or not _stackable(first.inputs, following.inputs)
            ):
                break
            item = self.take()
            if item is not None:
                items.append(item)
                rows += item.rows
        return items

    async def send(self, items: list[Mirrored]) -> None:
        """Run mirrors (of one candidate, stackable) on the shadow in one call and keep a pair for each. A
        shed is counted as a drop; any other failure is the shadow's answer, kept with each pair."""
        candidate = items[0].candidate
        rows = sum(i.rows for i in items)
        inputs = (
            items[0].inputs
            if len(items) == 1
            else {name: np.concatenate([i.inputs[name] for i in items]) for name in items[0].inputs}
        )
        shadow: dict[str, np.ndarray] | None = None
        error = ""
        try:
            shadow = await self.transport.infer(
                candidate,
                inputs,
                rows,
                min(i.deadline for i in items),
                SHADOW_PRIORITY,
                nbytes=sum(i.nbytes for i in items),
            )
            status = 200
        except Shed:
            DROPPED.labels(candidate.model, str(candidate.version), "shed").inc(len(items))
            return
        except DeadlineExceeded:  # at the lowest tier a mirror waits for callers' work: no fault of the candidate
            DROPPED.labels(candidate.model, str(candidate.version), "expired").inc(len(items))
            return
        except ServingError as exc:
            status, error = exc.status, exc.message
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the shadow path: counted, logged, and the primary never knows
            log.exception("mirroring to %s failed", candidate.key)
            metrics.INTERNAL_ERRORS.labels("shadow").inc()
            status, error = 500, f"{type(exc).__name__}: {exc}"
        # The node's compute for the whole stacked call, shared out by rows as the node shares a batch's.
        per_row = getattr(shadow, "compute_seconds", 0.0) / rows
        MIRRORED.labels(candidate.model, str(candidate.version), "ok" if status == 200 else "error").inc(len(items))
        start = 0
        for item in items:
            mine = None if shadow is None else {k: v[start : start + item.rows] for k, v in shadow.items()}
            start += item.rows
            self.keep(Pair(item, mine, status, per_row * item.rows, error))

    def keep(self, pair: Pair) -> None:
        size = pair.nbytes
        if len(self.pairs) >= self.max_pairs or self.pair_bytes + size > self.max_pair_bytes:
            DROPPED.labels(pair.item.candidate.model, str(pair.item.candidate.version), "uncompared").inc()
            return
        self.pairs.append(pair)
        self.pair_bytes += size

    def drain(self) -> list[Pair]:
        """The pairs kept since the last drain (no longer touched here: safe to read on another thread)."""
        pairs, self.pairs, self.pair_bytes = self.pairs, [], 0
        return pairs
