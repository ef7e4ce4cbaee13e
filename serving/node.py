"""A node hosts model runtimes on one device, each behind its own batcher.

Inference runs on one device thread per node (the device does one thing at a time anyway), so
the event loop stays free to parse, queue and answer while a batch computes. Loading happens on
a separate thread so a cold load never stalls the versions already serving.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from serving import metrics
from serving.batcher import Batcher
from serving.batching import BatchQueue, LatencyProfile, Pending, QueueFull
from serving.errors import DeadlineExceeded, ModelFailed, Unavailable
from serving.runtime import ModelRuntime, RuntimeFailure, pick_device
from serving.snapshot import RoutingSnapshot, VersionEntry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Job:
    inputs: dict[str, np.ndarray]
    future: asyncio.Future[dict[str, np.ndarray]]


@dataclass
class Hosted:
    entry: VersionEntry
    runtime: ModelRuntime
    batcher: Batcher
    profile: LatencyProfile
    metrics: metrics.VersionMetrics


@dataclass
class LoadFailure:
    entry: VersionEntry
    reason: str
    at: float = field(default_factory=time.time)


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = pick_device(device)
        self.memory_budget = memory_budget
        self._artifact_path = artifact_path
        self._clock = clock
        self._device_pool = ThreadPoolExecutor(1, thread_name_prefix="ferry-device")
        self._load_pool = ThreadPoolExecutor(1, thread_name_prefix="ferry-load")
        self._busy = metrics.DEVICE_BUSY.labels(str(self.device))
        self.hosted: dict[str, Hosted] = {}
        self.failures: dict[str, LoadFailure] = {}
        self._reconcile_lock = asyncio.Lock()
        self.reconciled_serial = 0

    # -- control -------------------------------------------------------------------------

    async def reconcile(self, snapshot: RoutingSnapshot) -> None:
        """Load what the snapshot says this node serves, unload the rest."""
        async with self._reconcile_lock:
            desired = {v.key: v for v in snapshot.hosted_versions()}
            for key in [k for k in self.hosted if k not in desired]:
                await self.unload(key)
            for key, entry in desired.items():
                hosted = self.hosted.get(key)
                if hosted is not None:
                    if hosted.entry.batching != entry.batching:
                        hosted.batcher.queue.config = entry.batching
                    hosted.entry = entry
                    continue
                failed = self.failures.get(key)
                if failed is not None and failed.entry == entry:
                    continue  # same version, same failure: wait for a change rather than loop
                await self.load(entry)
            self.reconciled_serial = snapshot.serial

    async def load(self, entry: VersionEntry) -> Hosted | None:
        loop = asyncio.get_running_loop()
        try:
            runtime, profile = await loop.run_in_executor(self._load_pool, self._load_blocking, entry)
        except Exception as exc:
            reason = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            log.error("loading %s failed: %s", entry.key, reason)
            self.failures[entry.key] = LoadFailure(entry, reason)
            return None
        self.failures.pop(entry.key, None)
        vm = metrics.for_version(entry.model, entry.version)
        latency = LatencyProfile(profile)
        queue = BatchQueue(entry.batching, latency.estimate)
        hosted = Hosted(entry, runtime, None, latency, vm)  # type: ignore[arg-type]
        hosted.batcher = Batcher(
            queue, lambda batch: self._run_batch(hosted, batch), self._expired, clock=self._clock
        )
        hosted.batcher.start()
        self.hosted[entry.key] = hosted
        vm.loaded.set(1)
        log.info("loaded %s on %s in %.2fs (%d bytes)", entry.key, self.device, runtime.load_seconds,
                 runtime.memory_bytes)
        return hosted

    def _load_blocking(self, entry: VersionEntry) -> tuple[ModelRuntime, dict[int, float]]:
        runtime = ModelRuntime(
            self._artifact_path(entry.artifact_sha256), entry.format, entry.inputs, entry.outputs, self.device
        )
        runtime.load()
        used = sum(h.runtime.memory_bytes for h in self.hosted.values())
        if used + runtime.memory_bytes > self.memory_budget:
            raise Unavailable(
                f"{entry.key} needs {runtime.memory_bytes} bytes; node budget {self.memory_budget}, {used} in use"
            )
        return runtime, runtime.profile(warmup_sizes(entry), repeats=3)

    async def unload(self, key: str) -> None:
        hosted = self.hosted.pop(key, None)
        if hosted is None:
            return
        waiting = await hosted.batcher.close()
        for pending in waiting:
            _fail(pending, Unavailable(f"model version {key} was unloaded", retry_after=1))
        hosted.metrics.loaded.set(0)
        hosted.metrics.queue_depth.set(0)
        hosted.runtime.module = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("unloaded %s", key)

    async def close(self) -> None:
        for key in list(self.hosted):
            await self.unload(key)
        self._device_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)

    # -- data plane -------------------------------------------------------------------------

    def is_ready(self, key: str) -> bool:
        return key in self.hosted

    def queue_depth(self, key: str) -> int:
        hosted = self.hosted.get(key)
        return len(hosted.batcher.queue) if hosted else 0

    async def infer(
        self, key: str, inputs: dict[str, np.ndarray], rows: int, deadline: float, priority: int
    ) -> dict[str, np.ndarray]:
        hosted = self.hosted.get(key)
        if hosted is None:
            failure = self.failures.get(key)
            detail = f": {failure.reason}" if failure else " yet"
            raise Unavailable(f"model version {key} is not loaded on this node{detail}", retry_after=1)
        now = self._clock()
        if deadline <= now:
            raise DeadlineExceeded("request deadline passed before it was queued")
        wait = self._estimated_wait(hosted, rows)
        if now + wait > deadline:
            raise Unavailable(
                f"{key}: estimated wait {wait * 1000:.0f} ms exceeds the request's deadline",
                retry_after=self._retry_after(hosted),
            )
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()
        try:
            hosted.batcher.submit(Pending(Job(inputs, future), rows, now, deadline, priority))
        except QueueFull as exc:
            raise Unavailable(f"{key}: {exc}", retry_after=self._retry_after(hosted)) from None
        hosted.metrics.queue_depth.set(len(hosted.batcher.queue))
        timer = loop.call_later(deadline - now, _expire_future, future)
        try:
            return await future
        finally:
            timer.cancel()
            if not future.done():  # the caller went away: the batcher skips it
                future.cancel()

    def _estimated_wait(self, hosted: Hosted, rows: int) -> float:
        """Admission: batches ahead of this request at full size, then its own batch's compute."""
        top = hosted.entry.batching.max_batch_size
        queued = hosted.batcher.queue.rows
        return (queued // top) * hosted.profile.estimate(top) + hosted.profile.estimate(min(top, queued + rows))

    def _retry_after(self, hosted: Hosted) -> float:
        top = hosted.entry.batching.max_batch_size
        per_batch = hosted.profile.estimate(top) or 0.01
        return max(1.0, math.ceil(hosted.batcher.queue.rows / top * per_batch))

    def _expired(self, items: Sequence[Pending]) -> None:
        for pending in items:
            _fail(pending, DeadlineExceeded("deadline passed while queued"))

    async def _run_batch(self, hosted: Hosted, batch: list[Pending]) -> None:
        live = [p for p in batch if not p.payload.future.done()]
        hosted.metrics.queue_depth.set(len(hosted.batcher.queue))
        if not live:
            return
        started = self._clock()
        for p in live:
            hosted.metrics.queue_wait.observe(started - p.arrival)
        loop = asyncio.get_running_loop()
        requests = [p.payload.inputs for p in live]
        try:
            results, seconds = await loop.run_in_executor(self._device_pool, _timed, hosted.runtime, requests)
        except RuntimeFailure as exc:
            await self._isolate(hosted, live, exc)
            return
        except Exception as exc:  # device errors (out of memory, lost device) fail this batch only
            log.exception("batch on %s failed", hosted.entry.key)
            for p in live:
                _fail(p, Unavailable(f"inference failed on the device: {type(exc).__name__}", retry_after=1))
            return
        rows = sum(p.rows for p in live)
        hosted.profile.observe(rows, seconds)
        hosted.metrics.compute.observe(seconds)
        hosted.metrics.batch_size.observe(rows)
        hosted.metrics.live.batch(rows)
        self._busy.inc(seconds)
        for p, result in zip(live, results, strict=True):
            if not p.payload.future.done():
                p.payload.future.set_result(result)

    async def _isolate(self, hosted: Hosted, live: list[Pending], exc: RuntimeFailure) -> None:
        """A batch failed: rerun each request alone so one bad input fails only itself."""
        if len(live) == 1:
            _fail(live[0], ModelFailed(f"model failed on this input: {exc}"))
            return
        loop = asyncio.get_running_loop()
        for p in live:
            if p.payload.future.done():
                continue
            try:
                results, _ = await loop.run_in_executor(self._device_pool, _timed, hosted.runtime, [p.payload.inputs])
            except RuntimeFailure as single:
                _fail(p, ModelFailed(f"model failed on this input: {single}"))
            except Exception as other:
                _fail(p, Unavailable(f"inference failed on the device: {type(other).__name__}", retry_after=1))
            else:
                if not p.payload.future.done():
                    p.payload.future.set_result(results[0])


def _timed(runtime: ModelRuntime, requests: list[dict[str, np.ndarray]]) -> tuple[list[dict[str, np.ndarray]], float]:
    started = time.perf_counter()
    results = runtime.run(requests)
    return results, time.perf_counter() - started


def _fail(pending: Pending, error: Exception) -> None:
    future = pending.payload.future
    if not future.done():
        future.set_exception(error)


def _expire_future(future: asyncio.Future[dict[str, np.ndarray]]) -> None:
    if not future.done():
        future.set_exception(DeadlineExceeded("request deadline exceeded"))
