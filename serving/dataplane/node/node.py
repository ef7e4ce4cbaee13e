"""A node hosts model runtimes on one device, each behind its own batcher.

Inference runs on one device thread per node (the device does one thing at a time anyway), so
the event loop stays free to parse, queue and answer while a batch computes. Loading happens on
a separate thread so a cold load never stalls the versions already serving.

Versions are packed into the node's memory budget (`serving.policies.placement`): a reconcile loads
what fits, a version that does not stays cold, and a request for a cold version loads it, evicting idle
versions least recently used first (`serving.dataplane.node.packing` keeps what that needs).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from serving.dataplane import tracing
from serving.dataplane.errors import DeadlineExceeded, ModelFailed, ServingError, Shed, Unavailable
from serving.dataplane.gateway.snapshot import RoutingSnapshot, VersionEntry
from serving.dataplane.metrics import metrics
from serving.dataplane.metrics.busy import BusyMeter, WorkMeter
from serving.dataplane.node.batcher import Batcher
from serving.dataplane.node.packing import LoadReport, Packing, Ticket, constraints
from serving.dataplane.node.runtime import ModelRuntime, RuntimeFailure, pick_device
from serving.dataplane.node.runtime_process import make_runtime
from serving.dataplane.transport.transport import Outputs
from serving.policies import admission, mirror_share
from serving.policies.admission import Calibration, DeviceShare
from serving.policies.batching import SHADOW_PRIORITY, BatchQueue, LatencyProfile, Pending, QueueFull
from serving.policies.mirror_share import MirrorShare
from serving.policies.placement import Fit, NodeState, Resident, VersionSpec, fit

log = logging.getLogger(__name__)
# A deliberate unload answers what is queued before the module goes; a queue still busy after this long (new
# requests kept coming) is cut off with 503. Each request keeps its own deadline meanwhile.
UNLOAD_DRAIN_S = 10.0
FULL_BATCHES_S = 0.1  # how often admission re-reads which hosted versions work arrives for
EVICTED_LRU = "evicted (least recently used) to make room for another version"
# What the device, or the runtime's machinery, raises on the device thread for reasons outside this code: out of the
# device's memory, a faulted or lost device (torch.AcceleratorError; older torch raises a RuntimeError saying so), the
# host out of memory, or of processes or descriptors when a sandboxed runtime's process is started again. The batch
# is answered 503 with Retry-After (the gateway's fallback may answer it). A RuntimeFailure (the model raised, broke
# its signature, or its runtime process died or hung) is bisected instead (`Node._isolate`). Anything else raised in
# a batch's path is a bug: 500, logged with its traceback and counted (`Node._batch_failed`).
DEVICE_ERRORS: tuple[type[BaseException], ...] = (
    torch.cuda.OutOfMemoryError,
    MemoryError,
    *((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()),
)
DEVICE_ERROR_TEXT = ("CUDA error", "CUBLAS_STATUS_", "CUDNN_STATUS_", "cuDNN error")
RESOURCE_ERRNOS = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC})
INTERNAL_ERROR = "internal error on the node; it logged it"


@dataclass(slots=True)
class Job:
    inputs: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, np.ndarray]]
    gone: Callable[[], bool] | None = None  # the client left: drop unrun
    trace: tracing.Span | None = None  # its `ferry.queue` span while it waits (traced requests only)


@dataclass
class Hosted:
    entry: VersionEntry
    runtime: ModelRuntime
    batcher: Batcher
    # Seconds per batch size from the device thread's pick-up to the loop resuming (compute plus the hand-back):
    # what admission predicts with.
    profile: LatencyProfile
    metrics: metrics.VersionMetrics
    # The device's own seconds per batch size: the work meter's reference (serving.dataplane.metrics.busy), which
    # the hand-back must not inflate. Hosting sets it.
    compute: LatencyProfile = field(default_factory=LatencyProfile)
    # Recent device work admitted per priority tier. Within a version the queue serves higher tiers
    # first, so a lower tier also waits behind what they add later; across versions the turns that
    # admission already counts bound the wait.
    share: DeviceShare = field(default_factory=DeviceShare)
    # For packing: the LRU order of evictions, and requests queued or running (never evicted then).
    last_used: float = 0.0
    in_flight: int = 0


@dataclass
class Warm:
    """An evicted version kept in host memory (the warm tier): its loaded module (on CUDA moved to the CPU)
    and its measured profile, so a reload skips the disk, the parse and the warm-up."""

    artifact_sha256: str
    runtime: ModelRuntime
    profile: dict[int, float]
    compute: dict[int, float]  # the device's own seconds (Hosted.compute)


@dataclass
class LoadFailure:
    entry: VersionEntry
    reason: str
    at: float = field(default_factory=time.time)
    transient: bool = False  # the artifact could not be had now (fetch failed): the next snapshot tries again


def warmup_sizes(entry: VersionEntry) -> list[int]:
    """Batch sizes measured at load: 1, each preferred size, powers of two up to the maximum."""
    top = entry.batching.max_batch_size
    sizes = {1, top, *entry.batching.preferred_batch_sizes}
    sizes.update(2**i for i in range(1, int(math.log2(top)) + 1) if 2**i <= top)
    return sorted(sizes)


class Node:
    def __init__(
        self,
        *,
        artifact_path: Callable[[str], Path],
        device: str = "",
        memory_budget: int = 4 * 1024**3,
        max_queue_bytes: int = 64 * 1024**2,
        admission: bool = True,
        clock: Callable[[], float] = time.monotonic,
        accelerator: str = "",
        report: Callable[[LoadReport], Awaitable[object]] | None = None,
        max_queued_loads: int = 16,
        warm_budget: int = 0,
        runtime_factory: Callable[..., ModelRuntime] = make_runtime,
        mirror_share: float = 0.0,
    ) -> None:
        self.device = pick_device(device)
        # How a version's runtime is made: sandboxed in a process of its own unless FERRY_RUNTIME_ISOLATION says
        # inline (serving.dataplane.node.runtime_process.make_runtime); called (path, format, inputs, outputs, device).
        self._runtime_factory = runtime_factory
        self.memory_budget = memory_budget
        self.max_queue_bytes = max_queue_bytes
        # Off only for contrast runs (FERRY_ADMISSION=false): queues and deadlines still bound the work.
        self.admission = admission
        self._artifact_path = artifact_path
        self._clock = clock
        self._device_pool = ThreadPoolExecutor(1, thread_name_prefix="ferry-device")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="ferry-load")
        self._busy = metrics.DEVICE_BUSY.labels(str(self.device))
        self.busy = BusyMeter(clock=clock)  # the device's busy share of the last seconds, for the heartbeat
        self.work = WorkMeter(self.busy, clock=clock)  # rows served at their best batch's cost, beside it
        self.hosted: dict[str, Hosted] = {}
        self._hosted_list: tuple[Hosted, ...] = ()  # hosted's values, for the per-request loops
        self.failures: dict[str, LoadFailure] = {}
        self._reconcile_lock = asyncio.Lock()
        self.reconciled_serial = 0
        # How far admission's device estimate falls short of what admitted requests take here (policies.admission).
        self.calibration = Calibration()
        # Every hosted version's admitted device share in one (each also keeps its own, `Hosted.share`): the
        # work arriving for the others, read in one step per request (`admission.Arrivals`). An unloaded
        # version's part stays until it decays (about a second): the cautious side of the estimate.
        self.device_share = DeviceShare()
        # For which hosted list, each active version's full batch (by id), their sum, until when.
        self._full_batches: tuple[tuple[Hosted, ...], dict[int, float], float, float] = ((), {}, 0.0, -math.inf)
        # Batches handed to the device thread and not finished: id -> estimated seconds. All versions
        # share the thread, so admission counts this work for every request.
        self._device_work: dict[int, float] = {}
        self._handed: dict[int, Hosted] = {}  # the same batches' versions: each hands the device its next later
        self._running_since: float | None = None
        # Set whenever a batch leaves the device: a batch of mirrored requests waits on it for callers' work
        # to be done (see _yield_to_callers).
        self._device_quiet = asyncio.Event()
        # The device share mirrors may take ahead of callers (FERRY_SHADOW_DEVICE_PERCENT; 0: gaps only), spent
        # in _yield_to_callers and judged by admission for mirrors (serving.policies.mirror_share).
        self.mirror_share = MirrorShare(mirror_share, now=clock())
        # Packing: the accelerator type placement constraints name (the device's kind unless declared), and
        # one load at a time, so a fit and its evictions hold until the load lands.
        self.accelerator = accelerator or self.device.type
        self.packing = Packing(self.accelerator, warmup_sizes, report=report)
        self._load_lock = asyncio.Lock()
        self.max_queued_loads = max_queued_loads  # loads requests may queue (one runs at a time)
        # The warm tier: evicted versions kept in host memory up to this many bytes, least recently evicted
        # dropped first. 0: an evicted version is dropped (its next load reads the artifact again).
        self.warm_budget = warm_budget
        self.warm: dict[str, Warm] = {}  # by key, in the order they were evicted

    # -- control -------------------------------------------------------------------------

    async def reconcile(self, snapshot: RoutingSnapshot, keys: Collection[str] | None = None) -> None:
        """Load what the snapshot says this node serves (of it, only `keys` when given: a node process
        hosts what its placement picks), unload the rest."""
        async with self._reconcile_lock:
            served = snapshot.hosted_versions()
            desired = {v.key: v for v in served if keys is None or v.key in keys}
            # Versions no node serves any more (deleted, or taken out of service): their work counts go with them.
            self.work.forget(self.work.rows.keys() - {v.key for v in served})
            self.packing.update(snapshot, desired)
            for key in [k for k in self.hosted if k not in desired]:
                await self.unload(key)
            for key in [k for k in self.warm if k not in desired]:
                self.warm.pop(key).runtime.release()
            # What must stay loaded first, then stable versions, then the rest while they fit.
            order = sorted(desired.values(), key=lambda e: (not self._kept(e), e.key not in self.packing.stable))
            for entry in order:
                key = entry.key
                hosted = self.hosted.get(key)
                if hosted is not None:
                    if hosted.entry.batching != entry.batching:
                        self._reconfigure(hosted, entry)
                    hosted.entry = entry
                    continue
                failed = self.failures.get(key)
                if failed is not None and failed.entry == entry and not failed.transient:
                    continue  # same version, same failure: wait for a change rather than loop
                if self.packing.refused(entry) is not None or (key in self.packing.cold and not self._kept(entry)):
                    continue  # cannot fit ever, or cold: a request loads it
                # Only what must stay evicts others here: the rest fills free memory and waits cold for a request.
                await self.load(entry, evict=self._kept(entry))
            self.reconciled_serial = snapshot.serial

    def _kept(self, entry: VersionEntry) -> bool:
        return self.packing.spec(entry).kept

    def _reconfigure(self, hosted: Hosted, entry: VersionEntry) -> None:
        """New batching settings apply to queued work too; what can no longer fit a batch is answered."""
        misfits = hosted.batcher.reconfigure(entry.batching)
        for pending in misfits:
            _fail(
                pending,
                Unavailable(
                    f"{entry.key}: max_batch_size changed to {entry.batching.max_batch_size} while this request of"
                    f" {pending.rows} rows waited; send it again in smaller requests",
                    retry_after=1,
                ),
            )

    @staticmethod
    def _dropped(hosted: Hosted, items: list[Pending]) -> None:
        """Queued requests whose clients left, dropped unrun: answered 499 (never sent), counted."""
        for pending in items:
            if not pending.payload.future.done():
                hosted.metrics.abandoned.inc()
                _fail(pending, ServingError("the client closed the connection", status=499))

    async def load(self, entry: VersionEntry, *, evict: bool = True) -> Hosted | None:
        """Load `entry` within the memory budget. With `evict`, idle versions are evicted least recently used
        first to make room; without, a version that does not fit stays cold until a request asks for it. A
        version that can never fit this node is marked unschedulable, with the reason, and not tried again
        until its artifact or constraints change."""
        async with self._load_lock:
            hosted = self.hosted.get(entry.key)
            if hosted is not None:
                return hosted
            started = self._clock()
            ticket = self.packing.loading.get(entry.key)
            if ticket is not None:
                ticket.started = started
            # Taken out of the warm tier first: the evictions that make room put versions there, and must not
            # push this one out.
            warm = self.warm.pop(entry.key, None)
            if warm is not None and warm.artifact_sha256 != entry.artifact_sha256:
                warm.runtime.release()
                warm = None
            if not await self._make_room(entry, self.packing.spec(entry), evict):
                if warm is not None:
                    self.warm[entry.key] = warm
                return None
            loop = asyncio.get_running_loop()
            try:
                if warm is not None:
                    runtime, profile, compute = await loop.run_in_executor(self._load_pool, self._from_warm, warm)
                else:
                    runtime, profile = await loop.run_in_executor(self._load_pool, self._load_blocking, entry)
                    compute = profile  # measured on the load thread around the model's calls: its own seconds
            except Exception as exc:
                reason = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                log.error("loading %s failed: %s", entry.key, reason)
                self.failures[entry.key] = LoadFailure(entry, reason, transient=isinstance(exc, Unavailable))
                self.packing.cold.pop(entry.key, None)
                self.packing.record("load_failed", entry.key, reason)
                return None
            # The estimate it was placed by may have been low (another device, or none measured yet): kept as
            # measured, so a version that fits no better is not loaded again to find out. (A warm reload is no
            # cold start: the estimates and the registry keep the cold one.)
            if warm is None:
                self.packing.measure(entry, runtime.memory_bytes, self._clock() - started)
            if not await self._make_room(entry, self.packing.spec(entry, runtime.memory_bytes), evict):
                runtime.release()
                return None
            self.failures.pop(entry.key, None)
            self.packing.cold.pop(entry.key, None)
            self.packing.no_room.pop(entry.key, None)
            hosted = self.host(entry, runtime, profile, compute=compute)
            hosted.last_used = self._clock()
            if ticket is not None:
                hosted.in_flight += ticket.waiters
                ticket.hosted = hosted
            cold_start = hosted.last_used - started
            tier = "from host memory, " if warm is not None else ""
            self.packing.record("load", entry.key, f"{tier}{cold_start:.2f} s, {runtime.memory_bytes} bytes")
            if warm is None:
                self.packing.measure(entry, runtime.memory_bytes, cold_start)
                metrics.COLD_START.labels(entry.model).observe(cold_start)
                self.packing.send(
                    LoadReport(entry.model, entry.version, self.accelerator, runtime.memory_bytes, cold_start)
                )
        log.info("loaded %s on %s in %.3fs (%d bytes)", entry.key, self.device, cold_start, runtime.memory_bytes)
        return hosted

    def placement_state(self) -> NodeState:
        """This node as the placement policy sees it: budget, accelerator, what is hot and how it is used."""
        hot = {
            key: Resident(self.packing.spec(h.entry, h.runtime.memory_bytes), h.last_used, h.in_flight)
            for key, h in self.hosted.items()
        }
        return NodeState("local", self.accelerator, self.memory_budget, hot)

    async def _make_room(self, entry: VersionEntry, spec: VersionSpec, evict: bool) -> bool:
        """Whether `entry` (as `spec`) may load now, after evicting what the policy names; if not, it is left
        cold (it may fit later), or marked unschedulable when it never can."""
        verdict = fit(spec, self.placement_state(), now=self._clock())
        if verdict.fits and (evict or not verdict.evict):
            # Detached at once, before any await, so no request can reach a victim between the verdict and here.
            victims = [self.hosted.pop(k) for k in verdict.evict]
            self._hosted_list = tuple(self.hosted.values())
            for victim in victims:
                metrics.EVICTIONS.labels(victim.entry.model, str(victim.entry.version), "lru").inc()
                # The event reaches the victim's tenant (the fleet page, its socket): it does not name the version
                # that took the room, which may be another tenant's private one. The log, operators' only, does.
                self.packing.record("evict", victim.entry.key, EVICTED_LRU)
                self.packing.cold[victim.entry.key] = victim.entry
                log.info(
                    "evicting %s (idle since %.1f s): LRU: room for %s",
                    victim.entry.key,
                    self._clock() - victim.last_used,
                    entry.key,
                )
                await self._release(victim, f"model version {victim.entry.key} was evicted", keep_warm=True)
            return True
        if verdict.permanent:
            self._unschedulable(entry, verdict)
        else:
            failed = self.failures.get(entry.key)
            if failed is not None and failed.reason.startswith("unschedulable"):
                del self.failures[entry.key]  # its constraints changed: it may fit, only not now
            self.packing.cold[entry.key] = entry
            if not verdict.fits:
                self.packing.no_room[entry.key] = verdict.reason
                self.packing.record("no_room", entry.key, verdict.reason)
        return False

    def _unschedulable(self, entry: VersionEntry, verdict: Fit) -> None:
        reason = f"unschedulable ({verdict.constraint}): {verdict.reason}"
        self.packing.unschedulable[entry.key] = (constraints(entry), reason)
        self.packing.cold.pop(entry.key, None)
        self.failures[entry.key] = LoadFailure(entry, reason)
        metrics.UNSCHEDULABLE.labels(entry.model, str(entry.version), verdict.constraint).inc()
        self.packing.record("unschedulable", entry.key, reason)
        log.error("%s", reason)
        if entry.placement.unschedulable != reason:
            self.packing.send(
                LoadReport(
                    entry.model, entry.version, self.accelerator, self.packing.footprint(entry), unschedulable=reason
                )
            )

    def unready_reason(self, key: str) -> str:
        failure = self.failures.get(key)
        return failure.reason if failure is not None else ""

    def routable(self, key: str) -> bool:
        """Whether routing may send a request here: loaded, or cold and loadable (the request loads it)."""
        return key in self.hosted or key in self.packing.cold

    def host(
        self,
        entry: VersionEntry,
        runtime: ModelRuntime,
        profile: dict[int, float],
        *,
        compute: dict[int, float] | None = None,
        start: bool = True,
    ) -> Hosted:
        """Serve a loaded runtime: its queue, its batcher, its metrics. `profile` seeds both the admission profile
        and, unless `compute` is given (a warm reload's), the device's own. (Tests host stand-in runtimes
        here and leave the batcher stopped to decide admission on a fake clock.)"""
        vm = metrics.for_version(entry.model, entry.version)
        latency = LatencyProfile(profile)
        queue = BatchQueue(entry.batching, latency.estimate, max_bytes=self.max_queue_bytes, abandoned=_abandoned)
        own = LatencyProfile(profile if compute is None else compute)
        hosted = Hosted(entry, runtime, None, latency, vm, own)  # type: ignore[arg-type]
        hosted.batcher = Batcher(
            queue,
            lambda batch: self._run_batch(hosted, batch),
            self._expired,
            clock=self._clock,
            on_dropped=lambda items: self._dropped(hosted, items),
            on_failed=lambda items, exc: self._batch_failed(hosted, items, exc),
        )
        if start:
            hosted.batcher.start()
        self.hosted[entry.key] = hosted
        self._hosted_list = tuple(self.hosted.values())
        # Resolved here rather than kept: `_release` removes these children, so a reload makes them afresh.
        labels = (entry.model, str(entry.version))
        metrics.LOADED.labels(*labels).set(1)
        # Read when scraped, not set per request: the batcher is replaced on reconfiguration, so read through hosted.
        metrics.QUEUE_DEPTH.labels(*labels).set_function(lambda: len(hosted.batcher.queue))
        return hosted

    def _load_blocking(self, entry: VersionEntry) -> tuple[ModelRuntime, dict[int, float]]:
        runtime = self._runtime_factory(
            self._artifact_path(entry.artifact_sha256), entry.format, entry.inputs, entry.outputs, self.device
        )
        try:
            runtime.load()
            return runtime, runtime.profile(warmup_sizes(entry), repeats=3)
        except BaseException:
            runtime.release()  # a sandboxed runtime's process goes with it
            raise

    def _from_warm(self, warm: Warm) -> tuple[ModelRuntime, dict[int, float], dict[int, float]]:
        runtime = warm.runtime
        if self.device.type == "cuda" and runtime.loaded:
            runtime.to_device()
        return runtime, warm.profile, warm.compute

    def _keep_warm(self, hosted: Hosted) -> bool:
        """Keep an evicted version's module in host memory if the warm budget can hold it, dropping the
        versions evicted longest ago to make room (on CUDA, `_release` then moves the module to the CPU)."""
        size = hosted.runtime.memory_bytes
        if not hosted.runtime.loaded or size > self.warm_budget:
            return False
        while self.warm and sum(w.runtime.memory_bytes for w in self.warm.values()) + size > self.warm_budget:
            self.warm.pop(next(iter(self.warm))).runtime.release()
        self.warm[hosted.entry.key] = Warm(
            hosted.entry.artifact_sha256, hosted.runtime, hosted.profile.points(), hosted.compute.points()
        )
        return True

    async def unload(self, key: str) -> None:
        """Unload a version on purpose (the reconciler moved it or scaled it in, or the node stops): what is
        queued for it here runs first, for at most UNLOAD_DRAIN_S, so callers get their answers rather than a
        503; what arrives after the drain, or outlasts it, gets 503 with Retry-After."""
        warm = self.warm.pop(key, None)
        if warm is not None:
            warm.runtime.release()
        self.packing.cold.pop(key, None)
        hosted = self.hosted.get(key)
        if hosted is None:
            return
        if not await hosted.batcher.drain(UNLOAD_DRAIN_S):
            log.warning("unloading %s: its queue did not empty within %.0f s; the rest gets 503", key, UNLOAD_DRAIN_S)
        if self.hosted.get(key) is not hosted:  # unloaded, or replaced, while it drained
            return
        del self.hosted[key]
        self._hosted_list = tuple(self.hosted.values())
        await self._release(hosted, f"model version {key} was unloaded")

    async def _release(self, hosted: Hosted, why: str, *, keep_warm: bool = False) -> None:
        key = hosted.entry.key
        waiting = await hosted.batcher.close()
        for pending in waiting:
            _fail(pending, Unavailable(why, retry_after=1))
        if key not in self.hosted:  # not loaded again meanwhile: its gauges go, rather than read 0 for ever
            labels = (hosted.entry.model, str(hosted.entry.version))
            metrics.LOADED.remove(*labels)
            metrics.QUEUE_DEPTH.remove(*labels)
        if not (keep_warm and self._keep_warm(hosted)):
            hosted.runtime.release()  # a sandboxed runtime's process exits
        elif self.device.type == "cuda":  # off the loop: a copy of the weights
            await asyncio.get_running_loop().run_in_executor(self._load_pool, hosted.runtime.to_host)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("unloaded %s", key)

    async def close(self) -> None:
        for key in list(self.hosted):
            await self.unload(key)
        for key in list(self.warm):
            self.warm.pop(key).runtime.release()
        self._device_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)

    # -- data plane -------------------------------------------------------------------------

    def is_ready(self, key: str) -> bool:
        return key in self.hosted

    def queue_depth(self, key: str) -> int:
        hosted = self.hosted.get(key)
        return len(hosted.batcher.queue) if hosted else 0

    async def infer(
        self,
        key: str,
        inputs: dict[str, np.ndarray],
        rows: int,
        deadline: float,
        priority: int,
        nbytes: int = 0,
        gone: Callable[[], bool] | None = None,
    ) -> dict[str, np.ndarray]:
        hosted = self.hosted.get(key)
        if hosted is None:
            if priority >= SHADOW_PRIORITY:  # a mirror never pays for a load, nor evicts what callers use
                raise Shed(
                    f"model version {key} is not loaded; mirrors do not load it", reason="not_loaded", tier=priority
                )
            hosted = await self._wake(key, rows, deadline)
        if rows > hosted.entry.batching.max_batch_size:
            raise ServingError(
                f"batch of {rows} rows exceeds {key}'s max_batch_size {hosted.entry.batching.max_batch_size}",
                status=400,
            )
        now = self._clock()
        hosted.last_used = now
        if deadline <= now:
            raise DeadlineExceeded("request deadline passed before it was queued")
        estimated = 0.0  # the device estimate this request was admitted on, which then teaches the calibration
        if self.admission and not (
            priority >= SHADOW_PRIORITY and self._mirror_fits_share(hosted, rows, deadline, now)
        ):
            begun = tracing.since() if tracing.ENABLED else 0
            estimated = self._completion(hosted, rows, priority, now, deadline)
            verdict = admission.decide(
                now=now,
                deadline=deadline,
                priority=priority,
                completion=estimated * self.calibration.factor(now),
                higher_share=hosted.share.higher_than(priority, now),
            )
            if begun:
                tracing.mark("ferry.admission", begun, **({} if verdict.admit else {"ferry.shed": verdict.reason}))
            if not verdict.admit:
                completion = verdict.completion
                why = "the request's deadline" if verdict.reason == "deadline" else f"priority {priority}'s share of"
                raise Shed(
                    f"{key}: estimated completion {completion * 1000:.0f} ms (device backlog included) exceeds {why}"
                    f" budget ({admission.HEADROOM:.0%} of the {max(0.0, deadline - now) * 1000:.0f} ms left)",
                    reason=verdict.reason,
                    tier=priority,
                    retry_after=self.retry_after(now),
                )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
        job = Job(inputs, future, gone, tracing.start_child("ferry.queue") if tracing.ENABLED else None)
        try:
            evicted = hosted.batcher.submit(Pending(job, rows, now, deadline, priority, nbytes))
        except QueueFull as exc:
            if job.trace is not None:
                tracing.end(job.trace, "queue_full")
            raise Shed(f"{key}: {exc}", reason="queue_full", tier=priority, retry_after=self.retry_after(now)) from None
        top = hosted.entry.batching.max_batch_size
        seconds = hosted.profile.estimate(top) * rows / top
        hosted.share.add(priority, seconds, now)
        self.device_share.add(priority, seconds, now)
        for victim in evicted:
            _fail(
                victim,
                Shed(
                    f"{key}: evicted from the queue by higher-priority work",
                    reason="evicted",
                    tier=victim.priority,
                    retry_after=self.retry_after(now),
                ),
            )
        timer = loop.call_at(loop.time() + (deadline - now), _expire_future, future)
        hosted.in_flight += 1
        try:
            try:
                result = await future
            except DeadlineExceeded:  # took at least its whole budget
                if estimated:
                    done = self._clock()
                    self.calibration.observe(estimated, done - now, done)
                raise
            if estimated:
                done = self._clock()
                self.calibration.observe(estimated, done - now, done)
            return result
        finally:
            hosted.in_flight -= 1
            timer.cancel()
            if not future.done():  # the caller went away: the queue drops it before it runs
                future.cancel()
            if job.trace is not None:  # answered without running: expired, evicted, dropped
                tracing.end(job.trace, "not_run")
                job.trace = None

    async def _wake(self, key: str, rows: int, deadline: float) -> Hosted:
        """A request for a version not loaded here: if it is cold (loadable), start its load, or join the one
        under way, and wait when the load's remaining time (measured cold start, or an estimate) and the
        request's compute fit its deadline; otherwise 503 with Retry-After the remaining load time, which
        the gateway answers with the model's fallback when it has one."""
        entry = self.packing.cold.get(key)
        if entry is None:
            failure = self.failures.get(key)
            detail = f": {failure.reason}" if failure else " yet"
            raise Unavailable(f"model version {key} is not loaded on this node{detail}", retry_after=1)
        vm = metrics.COLD_LOADS
        now = self._clock()
        ticket = self.packing.loading.get(key)
        if ticket is None and len(self.packing.loading) >= self.max_queued_loads:
            # Bounded: a burst over many cold versions would otherwise queue loads that evict one another
            # before their callers could use them.
            vm.labels(entry.model, str(entry.version), "load_queue_full").inc()
            drain = self.packing.remaining(now) + self.packing.cold_start(entry)
            raise Unavailable(
                f"model version {key} is cold and this node is already loading {len(self.packing.loading)}"
                f" versions (its limit); try again in about {drain:.1f} s",
                retry_after=admission.retry_after(drain),
            )
        if ticket is None:
            task = asyncio.get_running_loop().create_task(self._load_on_demand(entry))
            self.packing.loading[key] = Ticket(task, self.packing.cold_start(entry))
            ticket = self.packing.loading[key]
        remaining = self.packing.remaining(now, key)
        compute = LatencyProfile(entry.latency_profile).estimate(rows) if entry.latency_profile else 0.0
        if remaining + compute > admission.HEADROOM * (deadline - now):
            vm.labels(entry.model, str(entry.version), "refused").inc()
            raise Unavailable(
                f"model version {key} is cold and loading, about {remaining:.1f} s left: more than this request's"
                f" deadline allows",
                retry_after=admission.retry_after(remaining),
            )
        ticket.waiters += 1
        try:
            async with asyncio.timeout(deadline - now):
                await asyncio.shield(ticket.task)
        except TimeoutError:
            vm.labels(entry.model, str(entry.version), "deadline").inc()
            raise DeadlineExceeded(f"request deadline passed while model version {key} loaded") from None
        finally:
            ticket.waiters -= 1
            if isinstance(ticket.hosted, Hosted):
                # From here to its own place in the queue nothing awaits: the hold can go.
                ticket.hosted.in_flight -= 1
        hosted = self.hosted.get(key)
        if hosted is None:
            vm.labels(entry.model, str(entry.version), "failed").inc()
            failure = self.failures.get(key)
            why = failure.reason if failure else self.packing.no_room.get(key, "evicted again while loading")
            raise Unavailable(f"model version {key} could not be loaded: {why}", retry_after=1)
        vm.labels(entry.model, str(entry.version), "waited").inc()
        metrics.COLD_WAIT.labels(entry.model).observe(self._clock() - now)
        return hosted

    async def _load_on_demand(self, entry: VersionEntry) -> None:
        try:
            await self.load(entry, evict=True)
        except Exception:  # a bug: every waiter's shield sees it too, and answers 500
            log.exception("loading %s on demand failed", entry.key)
            raise
        finally:
            self.packing.loading.pop(entry.key, None)

    def _in_flight(self, now: float) -> float:
        """Estimated seconds of device work already handed to the device thread."""
        total = sum(self._device_work.values())
        if self._running_since is not None:
            total -= now - self._running_since
        return max(0.0, total)

    def _mirror_fits_share(self, hosted: Hosted, rows: int, deadline: float, now: float) -> bool:
        """Whether a mirror of `rows` finishes by its deadline on the mirrors' device share alone: the mirrors
        queued ahead of it on this version and its own rows, run at the share (callers' backlog aside: the
        share runs ahead of it). False with no share; admission then judges it as any lowest-tier request."""
        if not self.mirror_share.enabled:
            return False
        queue, top = hosted.batcher.queue, hosted.entry.batching.max_batch_size
        queued = queue.rows - queue.rows_ahead(SHADOW_PRIORITY - 1)
        before = admission.work_seconds(queued, top, hosted.profile.estimate)
        after = admission.work_seconds(queued + rows, top, hosted.profile.estimate)
        return mirror_share.admit(
            now=now,
            deadline=deadline,
            queued_work=before,
            own=after - before,
            share=self.mirror_share.share,
            headroom=admission.HEADROOM,
        )

    def _completion(self, hosted: Hosted, rows: int, priority: int, now: float, deadline: float) -> float:
        top = hosted.entry.batching.max_batch_size
        own = admission.VersionLoad(hosted.batcher.queue.rows_ahead(priority), top, hosted.profile.estimate)
        # The versions with a batch handed to the device thread, and whether this request's batch is handed
        # before the one running now ends (`admission.completion_seconds`'s `first`).
        handed = {id(h) for h in self._handed.values()} if self._handed else set()
        first = bool(handed) and admission.hands_first(
            on_device=True,
            own_on_device=id(hosted) in handed,
            running_left=self._running_left(now),
            window=hosted.entry.batching.max_queue_delay,
        )
        # Per request: a plain loop over the hosted versions, a VersionLoad only for those with work.
        others = []
        for h in self._hosted_list:
            queued = h.batcher.queue.rows
            if queued and h is not hosted and priority < SHADOW_PRIORITY:
                queued = h.batcher.queue.rows_ahead(SHADOW_PRIORITY - 1)  # mirrored work yields to callers
            if queued and h is not hosted:
                others.append(
                    admission.VersionLoad(queued, h.entry.batching.max_batch_size, h.profile.estimate, id(h) in handed)
                )
        in_flight = self._in_flight(now) if self._device_work else 0.0
        arrivals = None
        if len(self._hosted_list) > 1:
            if priority < SHADOW_PRIORITY:  # mirrored work yields to callers: their tiers only
                coming = self.device_share.higher_than(SHADOW_PRIORITY, now) - hosted.share.higher_than(
                    SHADOW_PRIORITY, now
                )
            else:
                coming = self.device_share.total(now) - hosted.share.total(now)
            if coming > 1e-9:
                each, total = self._active_full_batches(now)
                own_full = each.get(id(hosted), 0.0)
                arrivals = admission.Arrivals(
                    coming,
                    max(0.0, total - own_full),
                    sum(each.get(key, 0.0) for key in handed) if first else 0.0,
                )
        return admission.completion_seconds(
            own=own,
            rows=rows,
            others=others,
            in_flight=in_flight,
            arrivals=arrivals,
            horizon=deadline - now,
            first=first,
        )

    def _running_left(self, now: float) -> float:
        """Estimated seconds left of the batch the device thread runs now (or takes next): the first handed."""
        if not self._device_work:
            return 0.0
        estimate = next(iter(self._device_work.values()))
        since = self._running_since
        return max(0.0, estimate - (now - since)) if since is not None else estimate

    def _active_full_batches(self, now: float) -> tuple[dict[int, float], float]:
        """One full batch of every hosted version that work arrives for (an admitted device share of
        `admission.ACTIVE_SHARE` or more), by id, and their sum: re-read at most every FULL_BATCHES_S (shares
        move within a second, profiles slowly) or when what is hosted changes."""
        hosted_list = self._hosted_list
        of, each, total, until = self._full_batches
        if of is not hosted_list or now >= until:
            each = {
                id(h): h.profile.estimate(h.entry.batching.max_batch_size)
                for h in hosted_list
                if h.share.total(now) >= admission.ACTIVE_SHARE
            }
            total = sum(each.values())
            self._full_batches = (hosted_list, each, total, now + FULL_BATCHES_S)
        return each, total

    def handed_keys(self) -> frozenset[str]:
        """The versions with a batch handed to the device thread now (published for the gateways' admission)."""
        return frozenset(h.entry.key for h in self._handed.values())

    def running_left_seconds(self, now: float | None = None) -> float:
        """Estimated seconds left of the batch the device thread runs now (published beside `handed_keys`)."""
        return self._running_left(self._clock() if now is None else now)

    def in_flight_seconds(self, now: float | None = None) -> float:
        """Estimated seconds left of the batches on the device now (what a node process publishes for the
        gateways' admission, `serving.dataplane.node.load_publisher`)."""
        return self._in_flight(self._clock() if now is None else now) if self._device_work else 0.0

    def backlog_seconds(self, now: float | None = None) -> float:
        """Estimated seconds the device needs to finish everything queued and in flight now."""
        now = self._clock() if now is None else now
        loads = [
            admission.VersionLoad(h.batcher.queue.rows, h.entry.batching.max_batch_size, h.profile.estimate)
            for h in self.hosted.values()
        ]
        return admission.drain_seconds(loads, self._in_flight(now))

    def retry_after(self, now: float | None = None) -> float:
        return admission.retry_after(self.backlog_seconds(now))

    def _expired(self, items: Sequence[Pending]) -> None:
        for pending in items:
            _fail(pending, DeadlineExceeded("deadline passed while queued"))

    async def _run_batch(self, hosted: Hosted, batch: list[Pending]) -> None:
        live = [p for p in batch if not p.payload.future.done()]
        if live and live[0].priority >= SHADOW_PRIORITY:  # a batch takes its queue's highest tier first
            # Mirrors run in what fits the gaps callers' batches leave, the longest part first that fits,
            # then the rest in later gaps (each part waits again), rather than all or nothing.
            while live:
                fits = await self._yield_to_callers(hosted, live)
                now, live = live[:fits], live[fits:]
                await self._run_live(hosted, [p for p in now if not p.payload.future.done()])
                live = [p for p in live if not p.payload.future.done()]
            return
        await self._run_live(hosted, live)

    async def _run_live(self, hosted: Hosted, live: list[Pending]) -> None:
        if not live:
            return
        started = self._clock()
        for p in live:
            hosted.metrics.queue_wait.observe(started - p.arrival)
        rows = sum(p.rows for p in live)
        queued = _left_queue(live) if tracing.ENABLED else None
        try:
            results, seconds, began = await self._on_device(hosted, [p.payload.inputs for p in live], rows)
        except RuntimeFailure as exc:
            if queued:  # the batch's span says it failed; its requests' answers say what each got
                tracing.batch_failed(queued[1], rows, queued[0], exc)
            served: list[tuple[int, float, float, float]] = []
            await self._isolate(hosted, live, exc, served)
            # Recorded once every part is answered: a bug in the bookkeeping costs no part its run.
            for part in served:
                self._served(hosted, *part)
            return
        except Exception as exc:
            if queued:
                tracing.batch_failed(queued[1], rows, queued[0], exc)
            if not device_error(exc):
                raise  # a bug: the batcher hands the batch to `_batch_failed` (500)
            self._device_failed(hosted, live, exc)  # out of memory, a lost device: this batch only, 503
            return
        # Answered first: a bug in the bookkeeping below costs no caller its computed answer (it is still a bug:
        # the batcher's `_batch_failed` logs and counts it, and answers 500 whatever is left unanswered).
        _answer(live, results, seconds, rows)
        if queued:
            tracing.batch(queued[1], rows, queued[0], began - started, seconds)
        self._served(hosted, rows, seconds, began, self._clock())

    def _served(self, hosted: Hosted, rows: int, seconds: float, began: float, resumed: float) -> None:
        """The bookkeeping of a batch answered (a whole one, or a bisected one's half that ran clean), which the
        device thread began at `began`, computed for `seconds`, and the event loop resumed after at `resumed`.
        Its device time is in both busy measures already (`_on_device`, failed calls too)."""
        # Admission predicts when answers are back on the event loop, so its profile learns the batch's
        # time from the device thread picking it up to the loop resuming: compute plus the hand-back,
        # which grows when the loop is busy. The compute metric and the work meter's profile keep the device's
        # own time: the work a row is worth is what the device spends on it.
        hosted.profile.observe(rows, max(seconds, resumed - began))
        hosted.compute.observe(rows, seconds)
        hosted.metrics.compute.observe(seconds)
        hosted.metrics.batch_size.observe(rows)
        hosted.metrics.live.batch(rows)
        self.work.batch(
            hosted.entry.key, rows, began, seconds, hosted.compute.estimate, hosted.entry.batching.max_batch_size
        )

    async def _yield_to_callers(self, hosted: Hosted, live: list[Pending]) -> int:
        """Hold a batch of mirrored (shadow) requests while it would delay callers' work: a batch is on the
        device, or another version's callers' batch would come due before this one could finish (by the
        profile's estimate). A batch cannot be preempted, so this keeps a mirror from holding up a caller's
        request. Returns how many of `live` (a prefix) may run now: the most whose estimate finishes before
        any callers' batch comes due, so a short gap still runs a few mirrors; all of them when a caller's
        request is queued behind the mirrors on this same version (it runs next), or when all are done.
        Mirrors that wait past their deadline are answered 504 by their timers (the mirror counts them as
        dropped)."""
        callers = SHADOW_PRIORITY - 1
        others = [h for h in self._hosted_list if h is not hosted]
        while not all(p.payload.future.done() for p in live):
            if hosted.batcher.queue.rows and hosted.batcher.queue.rows_ahead(callers):
                return len(live)
            if not self._device_work:
                now, rows, fits = self._clock(), 0, 0
                for p in live:
                    rows += p.rows
                    finish = now + hosted.profile.estimate(rows)
                    if any(self._callers_due(h, finish) for h in others):
                        break
                    fits += 1
                if fits:
                    return fits
                # No gap: the mirrors' device share pays for what it can, callers' due batches wait for it.
                if self.mirror_share.enabled:
                    estimates, rows = [], 0
                    for p in live:
                        rows += p.rows
                        estimates.append(hosted.profile.estimate(rows))
                    paid = self.mirror_share.affordable(estimates, now)
                    if paid:
                        self.mirror_share.spend(estimates[paid - 1], now)
                        return paid
            self._device_quiet.clear()
            try:  # bounded: a queue emptied without a batch (expiry, a stopped batcher) sets no event
                await asyncio.wait_for(self._device_quiet.wait(), 0.05)
            except TimeoutError:
                pass
        return len(live)  # every one is done: nothing left to run

    @staticmethod
    def _callers_due(hosted: Hosted, by: float) -> bool:
        """Whether `hosted` has callers' requests whose batch comes due before `by` (full, or its window ends)."""
        queue = hosted.batcher.queue
        if not queue.rows:
            return False
        waiting = queue.rows_ahead(SHADOW_PRIORITY - 1)
        if not waiting:
            return False
        batching = hosted.entry.batching
        if waiting >= batching.max_batch_size:
            return True
        oldest = queue.oldest_arrival(SHADOW_PRIORITY - 1)
        return oldest is None or oldest + batching.max_queue_delay <= by

    async def _on_device(
        self, hosted: Hosted, requests: list[dict[str, np.ndarray]], rows: int
    ) -> tuple[list[dict[str, np.ndarray]], float, float]:
        """Run one batch on the device thread, keeping its estimate in the device backlog meanwhile.
        Returns the results, the compute seconds, and when the device thread began it (node clock). Its device
        time counts in both busy measures, the meter's and ferry_device_busy_seconds, whether it succeeded or
        raised (then raised here)."""
        token = id(requests)
        self._device_work[token] = hosted.profile.estimate(rows)
        self._handed[token] = hosted
        try:
            outcome, seconds, began = await asyncio.get_running_loop().run_in_executor(
                self._device_pool, self._timed, hosted.runtime, requests
            )
            self.busy.add(began, seconds)
            self._busy.inc(seconds)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome, seconds, began
        finally:
            del self._device_work[token]
            del self._handed[token]
            self._device_quiet.set()

    def _timed(
        self, runtime: ModelRuntime, requests: list[dict[str, np.ndarray]]
    ) -> tuple[list[dict[str, np.ndarray]] | Exception, float, float]:
        """The results, or what the runtime raised (returned, so that its device time is counted too), the
        seconds it took, and when it began (node clock)."""
        started = time.perf_counter()
        self._running_since = began = self._clock()
        try:
            results: list[dict[str, np.ndarray]] | Exception = runtime.run(requests)
        except Exception as exc:
            results = exc
        finally:
            self._running_since = None
        return results, time.perf_counter() - started, began

    async def _isolate(
        self, hosted: Hosted, live: list[Pending], exc: RuntimeFailure, served: list[tuple[int, float, float, float]]
    ) -> None:
        """A batch failed: bisect it, so the requests that poison it fail alone and the rest are served
        in a few batches (about log2 of the batch per bad request) rather than one device call each. Each part
        answered adds (rows, seconds, began, resumed) to `served`, for `_served`."""
        if len(live) == 1:
            hosted.metrics.poison.inc()
            _fail(live[0], ModelFailed(f"model failed on this input: {exc}"))
            return
        middle = len(live) // 2
        for half in (live[:middle], live[middle:]):
            half = [p for p in half if not p.payload.future.done()]
            if not half:
                continue
            rows = sum(p.rows for p in half)
            try:
                results, seconds, began = await self._on_device(hosted, [p.payload.inputs for p in half], rows)
            except RuntimeFailure as failure:
                await self._isolate(hosted, half, failure, served)
            except Exception as other:
                if not device_error(other):
                    raise  # a bug: the batcher hands the whole batch to `_batch_failed` (500)
                self._device_failed(hosted, half, other)
            else:
                _answer(half, results, seconds, rows)
                served.append((rows, seconds, began, self._clock()))  # its rows were served: a batch as any other

    @staticmethod
    def _device_failed(hosted: Hosted, items: list[Pending], exc: Exception) -> None:
        """The device (or the runtime's machinery) failed a batch: its requests get 503 with Retry-After."""
        log.error("a batch of %s failed on the device", hosted.entry.key, exc_info=exc)
        for p in items:
            _fail(p, Unavailable(f"inference failed on the device: {type(exc).__name__}", retry_after=1))

    @staticmethod
    def _batch_failed(hosted: Hosted, items: list[Pending], exc: Exception) -> None:
        """A bug in a batch's path (this code's, neither the device's nor the model's): every request of the batch
        not answered yet gets 500, never a 503 that invites a retry and the fallback, nor a wait for its deadline;
        the bug is logged with its traceback and counted once."""
        metrics.INTERNAL_ERRORS.labels("node_batch").inc()
        unanswered = [p for p in items if not p.payload.future.done()]
        log.error(
            "a batch of %s failed unexpectedly; answering its %d unanswered requests 500",
            hosted.entry.key,
            len(unanswered),
            exc_info=exc,
        )
        for p in unanswered:
            _fail(p, ServingError(INTERNAL_ERROR))


def _left_queue(live: list[Pending]) -> tuple[int, list[tracing.Span]] | None:
    """End the queue spans of the traced requests of a batch that starts now: (now in ns, their spans)."""
    spans = []
    for p in live:
        span = p.payload.trace
        if span is not None:
            spans.append(span)
            p.payload.trace = None
    if not spans:
        return None
    at = tracing.now_ns()
    for span in spans:
        span.end(end_time=at)
    return at, spans


def device_error(exc: BaseException) -> bool:
    """Whether an exception from the device thread is the device's or the runtime machinery's (`DEVICE_ERRORS`),
    not a bug of this code's."""
    if isinstance(exc, DEVICE_ERRORS):
        return True
    if isinstance(exc, OSError):
        return exc.errno in RESOURCE_ERRNOS
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in DEVICE_ERROR_TEXT)


def _answer(live: list[Pending], results: list[dict[str, np.ndarray]], seconds: float, rows: int) -> None:
    # Checked before any answer: with a result missing, none can be matched to its request.
    if len(results) != len(live):
        raise ValueError(f"the runtime returned {len(results)} results for {len(live)} requests")
    for p, result in zip(live, results, strict=True):
        if not p.payload.future.done():
            p.payload.future.set_result(Outputs(result, seconds * p.rows / rows))


def _fail(pending: Pending, error: Exception) -> None:
    future = pending.payload.future
    if not future.done():
        future.set_exception(error)


def _abandoned(pending: Pending) -> bool:
    """Nobody waits for it any more: its client left, or it was answered already (its deadline timer)."""
    job = pending.payload
    return job.future.done() or (job.gone is not None and job.gone())


def _expire_future(future: asyncio.Future[dict[str, np.ndarray]]) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded("request deadline exceeded"))
