"""Tests for serving.dataplane.node.batcher: the asyncio driver around a BatchQueue, with a fake clock.

`process_one_batch()` is driven directly; the background loop is exercised with a zero window so
no test depends on how fast anything runs. Waits on events carry a generous timeout only so that
a broken batcher fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio

import pytest

from serving.dataplane.node.batcher import Batcher
from serving.policies.batching import BatchingConfig, BatchQueue, Pending, QueueFull

INF = float("inf")
GUARD = 10.0  # seconds; only a hang guard, never a timing assertion


class FakeClock:
    """Returns `now`; each call may first advance by the next value of `steps`."""

    def __init__(self, now: float = 0.0, steps: list[float] | None = None) -> None:
        self.now = now
        self.steps = list(steps or [])

    def __call__(self) -> float:
        if self.steps:
            self.now += self.steps.pop(0)
        return self.now


class Recorder:
    def __init__(self, fail_first: int = 0) -> None:
        self.batches: list[list[str]] = []
        self.expired: list[list[str]] = []
        self.fail_first = fail_first
        self.ran = asyncio.Event()

    async def run_batch(self, batch: list[Pending]) -> None:
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("device lost")
        self.batches.append([p.payload for p in batch])
        self.ran.set()

    def on_expired(self, items: list[Pending]) -> None:
        self.expired.append([p.payload for p in items])


def item(name: str, rows: int = 1, arrival: float = 0.0, deadline: float = INF, priority: int = 1) -> Pending:
    return Pending(name, rows, arrival, deadline, priority)


def make(
    max_batch_size: int = 4, delay: float = 1.0, max_queue_size: int = 16, clock=None, recorder: Recorder | None = None
) -> tuple[Batcher, Recorder, FakeClock]:
    recorder = recorder or Recorder()
    clock = clock or FakeClock()
    queue = BatchQueue(BatchingConfig(max_batch_size, delay, max_queue_size))
    return Batcher(queue, recorder.run_batch, recorder.on_expired, clock=clock), recorder, clock


async def test_process_one_batch_runs_a_full_batch() -> None:
    # given a batcher with max_batch_size 2 and two requests at fake time 0
    batcher, rec, _ = make(max_batch_size=2, delay=100.0)
    batcher.submit(item("a"))
    batcher.submit(item("b"))
    batcher.submit(item("c"))
    # when one step runs
    ran = await asyncio.wait_for(batcher.process_one_batch(), GUARD)
    # then run_batch received the first two, in order, and the third still waits
    assert ran is True
    assert rec.batches == [["a", "b"]]
    assert len(batcher.queue) == 1


async def test_process_one_batch_runs_when_the_fake_clock_reaches_the_window() -> None:
    # given a 1 s window, one request at 0, and the fake clock at the window's end
    batcher, rec, clock = make(delay=1.0)
    batcher.submit(item("a", arrival=0.0))
    clock.now = 1.0
    # when one step runs
    ran = await asyncio.wait_for(batcher.process_one_batch(), GUARD)
    # then the request left alone
    assert ran is True
    assert rec.batches == [["a"]]
    assert len(batcher.queue) == 0


async def test_process_one_batch_waits_until_the_wake_time_when_nothing_is_due() -> None:
    # given a 1 s window and a request at 0; the fake clock reads 0 at the poll, then 1.0
    clock = FakeClock(0.0, steps=[0.0, 1.0])
    batcher, rec, _ = make(delay=1.0, clock=clock)
    batcher.submit(item("a", arrival=0.0))
    # when one step runs: the computed wait (wake_at 1.0 - clock 1.0) is zero
    ran = await asyncio.wait_for(batcher.process_one_batch(), GUARD)
    # then nothing ran yet
    assert ran is False
    assert rec.batches == []
    # and the next step, at the window's end, sends the batch
    assert await asyncio.wait_for(batcher.process_one_batch(), GUARD) is True
    assert rec.batches == [["a"]]


async def test_a_new_arrival_wakes_a_waiting_step() -> None:
    # given a long window and one request: the step waits (fake clock frozen at 0)
    batcher, rec, _ = make(max_batch_size=2, delay=1000.0)
    batcher.submit(item("a"))
    step = asyncio.create_task(batcher.process_one_batch())
    await asyncio.sleep(0)  # let the step poll and start waiting
    assert not step.done()
    # when a second request arrives
    batcher.submit(item("b"))
    # then the waiting step returns without running anything
    assert await asyncio.wait_for(step, GUARD) is False
    # and the next step sends the now-full batch
    assert await asyncio.wait_for(batcher.process_one_batch(), GUARD) is True
    assert rec.batches == [["a", "b"]]


async def test_expired_requests_go_to_on_expired_not_run_batch() -> None:
    # given max 2: one request past its deadline and two live ones
    batcher, rec, clock = make(max_batch_size=2, delay=100.0)
    batcher.submit(item("late", deadline=1.0))
    batcher.submit(item("b", deadline=50.0))
    batcher.submit(item("c"))
    clock.now = 2.0
    # when one step runs
    assert await asyncio.wait_for(batcher.process_one_batch(), GUARD) is True
    # then the expired request went to on_expired and the live pair to run_batch
    assert rec.expired == [["late"]]
    assert rec.batches == [["b", "c"]]


async def test_expiry_alone_is_reported_before_the_step_waits() -> None:
    # given a single request past its deadline
    batcher, rec, clock = make(delay=100.0)
    batcher.submit(item("late", deadline=1.0))
    clock.now = 5.0
    # when a step runs (nothing is left, so it waits for an arrival)
    step = asyncio.create_task(batcher.process_one_batch())
    await asyncio.sleep(0)
    # then the expiry has been reported already, and no batch ran
    assert rec.expired == [["late"]]
    assert rec.batches == []
    assert not step.done()
    # and an arrival ends the wait
    batcher.submit(item("x", arrival=5.0))
    assert await asyncio.wait_for(step, GUARD) is False


async def test_submit_refuses_what_the_queue_refuses() -> None:
    # given a batcher whose queue holds at most one request of at most 2 rows
    batcher, _, _ = make(max_batch_size=2, max_queue_size=1)
    # then too many rows is a ValueError, one request too many is QueueFull
    with pytest.raises(ValueError):
        batcher.submit(item("big", rows=3))
    batcher.submit(item("a"))
    with pytest.raises(QueueFull):
        batcher.submit(item("b"))


async def test_close_returns_waiting_requests_and_submit_after_close_raises() -> None:
    # given two waiting requests and a batcher that was never started
    batcher, rec, _ = make(delay=100.0)
    batcher.submit(item("a"))
    batcher.submit(item("b", priority=0))
    # when closed
    waiting = await asyncio.wait_for(batcher.close(), GUARD)
    # then the waiting requests come back (priority order) for the caller to answer
    assert [p.payload for p in waiting] == ["b", "a"]
    assert len(batcher.queue) == 0
    assert rec.batches == []
    # and new requests are refused
    with pytest.raises(QueueFull, match="unloading"):
        batcher.submit(item("c"))


async def test_background_loop_dispatches_a_submitted_request_with_zero_window() -> None:
    # given a started batcher with a zero window and a frozen fake clock
    batcher, rec, _ = make(delay=0.0)
    batcher.start()
    await asyncio.sleep(0)  # the loop is now waiting for an arrival
    # when a request is submitted
    batcher.submit(item("a"))
    # then the loop hands it to run_batch
    await asyncio.wait_for(rec.ran.wait(), GUARD)
    assert rec.batches == [["a"]]
    # and close() stops the loop with nothing left waiting
    assert await asyncio.wait_for(batcher.close(), GUARD) == []
    assert batcher._task is not None and batcher._task.done()


async def test_start_twice_keeps_one_loop() -> None:
    # given a started batcher
    batcher, rec, _ = make(delay=0.0)
    batcher.start()
    task = batcher._task
    # when started again
    batcher.start()
    # then the same loop task runs
    assert batcher._task is task
    await asyncio.wait_for(batcher.close(), GUARD)


async def test_a_failing_run_batch_does_not_kill_the_loop() -> None:
    # given a started batcher (one request per batch) whose first batch raises
    batcher, rec, _ = make(max_batch_size=1, delay=0.0, recorder=Recorder(fail_first=1))
    batcher.start()
    batcher.submit(item("doomed"))
    # when a second request is queued behind it
    batcher.submit(item("ok"))
    # then the loop survives the failure and runs the second batch
    await asyncio.wait_for(rec.ran.wait(), GUARD)
    assert rec.batches == [["ok"]]
    assert not batcher._task.done()
    await asyncio.wait_for(batcher.close(), GUARD)


async def test_a_failing_on_expired_does_not_kill_the_loop() -> None:
    # given a started batcher whose on_expired raises once
    calls: list[list[str]] = []

    def on_expired(items: list[Pending]) -> None:
        calls.append([p.payload for p in items])
        if len(calls) == 1:
            raise RuntimeError("bug in the expiry handler")

    clock = FakeClock(10.0)
    rec = Recorder()
    queue = BatchQueue(BatchingConfig(4, 0.0, 16))
    batcher = Batcher(queue, rec.run_batch, on_expired, clock=clock)
    batcher.submit(item("late", deadline=1.0))
    batcher.start()
    # when a live request follows
    await asyncio.sleep(0)
    batcher.submit(item("ok", arrival=10.0))
    # then it is still served
    await asyncio.wait_for(rec.ran.wait(), GUARD)
    assert calls[0] == ["late"]
    assert rec.batches == [["ok"]]
    await asyncio.wait_for(batcher.close(), GUARD)


async def test_close_waits_for_the_batch_in_flight() -> None:
    # given a started batcher whose run_batch blocks until released
    release = asyncio.Event()
    started = asyncio.Event()
    finished: list[str] = []

    async def run_batch(batch: list[Pending]) -> None:
        started.set()
        await release.wait()
        finished.extend(p.payload for p in batch)

    queue = BatchQueue(BatchingConfig(1, 0.0, 16))
    batcher = Batcher(queue, run_batch, lambda items: None, clock=FakeClock())
    batcher.start()
    batcher.submit(item("in-flight"))
    batcher.submit(item("waiting"))
    await asyncio.wait_for(started.wait(), GUARD)
    # when close() is called while the first batch runs
    closing = asyncio.create_task(batcher.close())
    await asyncio.sleep(0)
    assert not closing.done()
    release.set()
    waiting = await asyncio.wait_for(closing, GUARD)
    # then the batch in flight finished and the other request is handed back, not run
    assert finished == ["in-flight"]
    assert [p.payload for p in waiting] == ["waiting"]
