"""The asyncio driver around a `BatchQueue`: one loop per hosted model version.

The loop only repeats `process_one_batch()`; a test drives that step directly. One batch per
version runs at a time, so while it computes, the next one gathers in the queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from serving.dataplane.metrics import metrics
from serving.policies.batching import BatchingConfig, BatchQueue, Pending, QueueFull

log = logging.getLogger(__name__)

RunBatch = Callable[[list[Pending]], Awaitable[None]]
OnExpired = Callable[[list[Pending]], None]
OnDropped = Callable[[list[Pending]], None]
# A step failed past the poll (a bug: in the batch's run, or in answering what expired or was dropped): the
# requests it took from the queue, which no queue holds any more, and the exception. It answers them.
OnFailed = Callable[[list[Pending], Exception], None]


class Batcher:
    def __init__(
        self,
        queue: BatchQueue,
        run_batch: RunBatch,
        on_expired: OnExpired,
        clock: Callable[[], float] = time.monotonic,
        on_dropped: OnDropped | None = None,
        on_failed: OnFailed | None = None,
    ) -> None:
        self.queue = queue
        self._run_batch = run_batch
        self._on_expired = on_expired
        self._on_dropped = on_dropped
        self._on_failed = on_failed
        self._clock = clock
        self._arrival = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._emptied: asyncio.Event | None = None  # made by the first drain; the loop sets it when the queue empties

    def submit(self, item: Pending) -> list[Pending]:
        """Queue a request; raises `QueueFull` (answer 503) or `ValueError` (too many rows). Returns the
        lower-priority requests evicted to make room, for the caller to answer."""
        if self._closed:
            raise QueueFull("model version is unloading")
        evicted = self.queue.put(item)
        self._arrival.set()
        return evicted

    def reconfigure(self, config: BatchingConfig) -> list[Pending]:
        """New batching settings; returns the queued requests that no longer fit, and wakes the loop so
        the rest are decided under the new settings at once."""
        misfits = self.queue.reconfigure(config)
        self._arrival.set()
        return misfits

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="batcher")

    async def drain(self, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until every queued request has run or expired; the loop goes on as
        usual meanwhile. True when the queue emptied (a batch may still be in flight: `close` waits for it)."""
        if not len(self.queue):
            return True
        if self._task is None or self._closed:
            return False
        if self._emptied is None:
            self._emptied = asyncio.Event()
        self._emptied.clear()  # shared by drains waiting at once; set again when the queue next empties
        try:
            await asyncio.wait_for(self._emptied.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> list[Pending]:
        """Stop after the batch in flight; return the requests still waiting so the caller answers them."""
        self._closed = True
        self._arrival.set()
        if self._task is not None:
            await self._task
        return self.queue.drain()

    async def process_one_batch(self) -> bool:
        """Run at most one batch; wait (bounded) when none is due. True when a batch ran (or failed).

        What the poll takes from the queue is answered whatever happens: when a step fails past it, `on_failed`
        gets those requests and the exception (without one, the exception propagates)."""
        decision = self.queue.poll(self._clock())
        try:
            if decision.expired:
                self._on_expired(decision.expired)
            if decision.dropped and self._on_dropped is not None:
                self._on_dropped(decision.dropped)
            if decision.batch:
                await self._run_batch(decision.batch)
                return True
        except Exception as exc:
            if self._on_failed is None:
                raise
            self._on_failed([*decision.expired, *decision.dropped, *decision.batch], exc)
            return bool(decision.batch)
        self._arrival.clear()
        timeout = None if decision.wake_at is None else max(0.0, decision.wake_at - self._clock())
        try:
            await asyncio.wait_for(self._arrival.wait(), timeout)
        except TimeoutError:
            pass
        return False

    async def _loop(self) -> None:
        while not self._closed:
            try:
                await self.process_one_batch()
            except Exception:  # a bug here (or in `on_failed`) must not strand the queue's requests
                log.exception("batcher step failed")
                metrics.INTERNAL_ERRORS.labels("batcher").inc()
                await asyncio.sleep(0.01)
            if self._emptied is not None and not len(self.queue):
                self._emptied.set()
