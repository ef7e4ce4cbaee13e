"""Admission: the pure estimate and every branch of the node's decision, on a fake clock.

The node here hosts stand-in runtimes with fixed latency profiles and stopped batchers, so what
is queued stays queued and each decision is exactly the policy's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import pytest

from serving.dataplane.errors import DeadlineExceeded, ServingError, Shed
from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node.node import Node
from serving.policies import admission
from serving.policies.batching import SHADOW_PRIORITY, BatchingConfig

X = (TensorSpec("input", "FP32", (4,)),)
Y = (TensorSpec("scores", "FP32", (2,)),)


def linear(per_batch: float, per_row: float = 0.0):  # noqa: ANN201
    return lambda rows: per_batch + per_row * rows


# -- the pure estimate ---------------------------------------------------------------------------


def test_work_seconds_counts_full_batches_then_the_rest() -> None:
    est = linear(0.010, 0.001)
    assert admission.work_seconds(0, 8, est) == 0.0
    assert admission.work_seconds(8, 8, est) == pytest.approx(0.018)
    assert admission.work_seconds(20, 8, est) == pytest.approx(2 * 0.018 + 0.014)


def test_completion_counts_own_queue_in_flight_and_other_versions_per_round() -> None:
    # given 12 rows ahead on a version of batch 8, and two other versions with work on the device
    own = admission.VersionLoad(12, 8, linear(0.010))
    busy = admission.VersionLoad(100, 10, linear(0.020))  # far more work than it can run meanwhile
    light = admission.VersionLoad(3, 10, linear(0.005))  # less than one batch
    # when a 1-row request's completion is estimated
    completion = admission.completion_seconds(own=own, rows=1, others=[busy, light], in_flight=0.004)
    # then: in flight + own 2 batches (13 rows) + busy runs at most 2 batches (one per round) + light's one batch
    assert completion == pytest.approx(0.004 + 2 * 0.010 + 2 * 0.020 + 0.005)


def test_completion_counts_the_work_arriving_for_the_other_versions_within_the_horizon() -> None:
    # given 20 rows ahead on a version of batch 8 (3 rounds with a newcomer), and other versions with nothing
    # queued now but 0.5 device seconds a second arriving for them, whose full batches take 20 ms in all
    own = admission.VersionLoad(20, 8, linear(0.010))
    fed = admission.Arrivals(0.5, 0.020)
    # when estimated over no horizon / then the arrivals are not counted
    assert admission.completion_seconds(own=own, rows=1, others=[], in_flight=0.0, arrivals=fed) == pytest.approx(0.030)
    # and over 0.1 s: 0.05 s of their work comes meanwhile, within the 3 rounds' 0.06 s it may take
    assert admission.completion_seconds(
        own=own, rows=1, others=[], in_flight=0.0, arrivals=fed, horizon=0.1
    ) == pytest.approx(0.030 + 0.05)
    # and over 1 s: never more than one full batch of each a round
    assert admission.completion_seconds(
        own=own, rows=1, others=[], in_flight=0.0, arrivals=fed, horizon=1.0
    ) == pytest.approx(0.030 + 3 * 0.020)


def test_a_version_with_a_batch_on_the_device_takes_its_next_turn_after_the_request_handed_first() -> None:
    # given a request of 1 row (one round) and another version with a full batch queued, whose batch is on the
    # device now (its 50 ms remainder is the in-flight time), and 0.5 device seconds a second arriving for it
    own = admission.VersionLoad(0, 8, linear(0.010))
    busy = admission.VersionLoad(8, 8, linear(0.020), handed=True)
    fed = admission.Arrivals(0.5, 0.020, handed=0.020)
    # when the request's batch is handed before that batch ends (`first`) / then the busy version's next batch
    # runs after it: the remainder and its own batch, nothing of the busy one's queue or arrivals
    handed_first = admission.completion_seconds(
        own=own, rows=1, others=[busy], in_flight=0.050, arrivals=fed, horizon=0.3, first=True
    )
    assert handed_first == pytest.approx(0.050 + 0.010)
    # and when it is not (the batch ends within the request's window): a full batch of the busy one first
    assert admission.completion_seconds(
        own=own, rows=1, others=[busy], in_flight=0.050, arrivals=fed, horizon=0.3
    ) == pytest.approx(0.050 + 0.020 + 0.010)
    # and a version not on the device keeps its turn either way
    idle_now = admission.VersionLoad(8, 8, linear(0.020))
    assert admission.completion_seconds(
        own=own, rows=1, others=[idle_now], in_flight=0.050, first=True
    ) == pytest.approx(0.050 + 0.020 + 0.010)
    # and over two rounds the handed one runs one batch fewer than the others, queued or arriving
    two = admission.VersionLoad(8, 8, linear(0.010))
    assert admission.completion_seconds(own=two, rows=1, others=[busy], in_flight=0.050, first=True) == pytest.approx(
        0.050 + 2 * 0.010 + 0.020
    )
    assert admission.completion_seconds(
        own=two, rows=1, others=[], in_flight=0.050, arrivals=fed, horizon=1.0, first=True
    ) == pytest.approx(0.050 + 2 * 0.010 + 0.020)


def test_device_share_total_counts_every_tier() -> None:
    share = admission.DeviceShare(tau=1.0)
    assert share.total(0.0) == 0.0
    share.add(1, 0.3, now=0.0)
    share.add(10, 0.2, now=0.0)
    assert share.total(0.0) == pytest.approx(0.5)
    assert share.total(2.0) == pytest.approx(0.5 * math.exp(-2))


def test_drain_and_retry_after() -> None:
    loads = [admission.VersionLoad(16, 8, linear(0.5)), admission.VersionLoad(0, 8, linear(0.5))]
    assert admission.drain_seconds(loads, 0.25) == pytest.approx(1.25)
    assert admission.retry_after(1.25) == 2.0
    assert admission.retry_after(0.0) == 1.0


@pytest.mark.parametrize(
    ("priority", "completion", "admit", "reason"),
    [
        # a 0.1 s budget, of which the device estimate may use HEADROOM (0.8): 0.08 s
        (1, 0.079, True, ""),  # fits
        (1, 0.081, False, "deadline"),  # would meet the deadline, but not with the front end's headroom
        (2, 0.059, True, ""),  # within tier 2's three quarters
        (2, 0.061, False, "tier"),  # fits the headroom but not tier 2's share
        (3, 0.039, True, ""),
        (3, 0.041, False, "tier"),  # lower tiers get half
    ],
)
def test_decide_by_deadline_and_tier(priority: int, completion: float, admit: bool, reason: str) -> None:
    assert admission.HEADROOM == 0.8
    verdict = admission.decide(now=10.0, deadline=10.1, priority=priority, completion=completion)
    assert verdict.admit is admit and verdict.reason == reason
    assert verdict.completion == completion


def test_higher_tiers_share_of_the_device_slows_a_lower_tier() -> None:
    # given higher tiers that recently took half the device / then a lower tier's estimate doubles
    verdict = admission.decide(now=0.0, deadline=1.0, priority=2, completion=0.2, higher_share=0.5)
    assert verdict.admit and verdict.completion == pytest.approx(0.4)
    assert not admission.decide(now=0.0, deadline=1.0, priority=2, completion=0.35, higher_share=0.5).admit
    # and past MAX_HIGHER_SHARE nothing of a lower tier is admitted
    refused = admission.decide(now=0.0, deadline=1.0, priority=2, completion=0.0, higher_share=0.95)
    assert not refused.admit and refused.reason == "tier"


def test_device_share_decays_and_counts_only_higher_tiers() -> None:
    share = admission.DeviceShare(tau=1.0)
    share.add(1, 0.3, now=0.0)
    share.add(2, 0.2, now=0.0)
    assert share.higher_than(1, 0.0) == 0.0
    assert share.higher_than(2, 0.0) == pytest.approx(0.3)
    assert share.higher_than(3, 0.0) == pytest.approx(0.5)
    assert share.higher_than(3, 1.0) == pytest.approx(0.5 * math.exp(-1))


# -- the node's decisions on a fake clock --------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class StandIn:
    """What the node needs of a runtime: run(), release(), and the footprint fields."""

    memory_bytes: int = 0
    load_seconds: float = 0.0
    loaded: bool = True

    def release(self) -> None:
        self.loaded = False

    def run(self, requests):  # noqa: ANN001, ANN201
        return [{"scores": np.zeros((r["input"].shape[0], 2), np.float32)} for r in requests]


def entry(name: str, *, max_batch: int = 8, queue: int = 100) -> VersionEntry:
    return VersionEntry(
        model=name,
        version=1,
        state="ready",
        loaded=True,
        artifact_sha256="0" * 64,
        format="torchscript",
        inputs=X,
        outputs=Y,
        batching=BatchingConfig(max_batch, 10.0, queue),
        default_timeout_ms=1000,
        latency_profile={},
    )


def rows(n: int) -> dict[str, np.ndarray]:
    return {"input": np.zeros((n, 4), np.float32)}


@pytest.fixture
async def node():  # noqa: ANN201
    clock = Clock()
    n = Node(artifact_path=lambda sha: None, device="cpu", clock=clock, max_queue_bytes=10_000)  # type: ignore[arg-type]
    n.clock = clock
    yield n
    for hosted in n.hosted.values():
        hosted.batcher.queue.drain()
    n._device_pool.shutdown(wait=False)
    n._load_pool.shutdown(wait=False)


def host(node: Node, name: str, per_batch: float, **kw: int):  # noqa: ANN201
    # a batch of any size takes `per_batch` seconds; the batcher is stopped, so queued work stays queued
    return node.host(entry(name, **kw), StandIn(), {1: per_batch, kw.get("max_batch", 8): per_batch}, start=False)


async def queued(node: Node, name: str, n: int, *, deadline_s: float = 100.0, priority: int = 1):  # noqa: ANN201
    """Submit n one-row requests that stay queued; returns their tasks."""
    tasks = [
        asyncio.ensure_future(node.infer(f"{name}:1", rows(1), 1, node.clock.now + deadline_s, priority))
        for _ in range(n)
    ]
    await asyncio.sleep(0)
    return tasks


async def test_expired_request_is_504_before_it_queues(node) -> None:  # noqa: ANN001
    host(node, "a", 0.010)
    with pytest.raises(DeadlineExceeded):
        await node.infer("a:1", rows(1), 1, node.clock.now - 0.001, 1)
    assert len(node.hosted["a:1"].batcher.queue) == 0


async def test_admits_when_the_backlog_meets_the_deadline(node) -> None:  # noqa: ANN001
    host(node, "a", 0.010)
    tasks = await queued(node, "a", 3, deadline_s=0.05)
    assert len(node.hosted["a:1"].batcher.queue) == 3
    assert not any(t.done() for t in tasks)
    for t in tasks:
        t.cancel()


async def test_refuses_past_the_deadline_with_retry_after_from_the_drain(node) -> None:  # noqa: ANN001
    # given 40 rows queued on a version whose batch of 8 takes 0.4 s: 5 batches, 2 s of work
    host(node, "a", 0.4)
    tasks = await queued(node, "a", 40)
    # when a request with 1 s left arrives
    with pytest.raises(Shed) as refused:
        await node.infer("a:1", rows(1), 1, node.clock.now + 1.0, 1)
    # then it is shed for its deadline, and told to come back when the 2 s backlog has drained
    assert refused.value.reason == "deadline" and refused.value.status == 503
    assert refused.value.retry_after == 2.0
    assert "exceeds the request's deadline" in refused.value.message
    for t in tasks:
        t.cancel()


async def test_other_versions_on_the_device_count(node) -> None:  # noqa: ANN001
    # given version b idle, but version a on the same device with 2.4 s of queued work
    host(node, "a", 0.4)
    host(node, "b", 0.01)
    tasks = await queued(node, "a", 48)
    # when b gets a request with 0.5 s left (0.4 s of headroom): b's own queue is empty, but a runs a
    # batch (0.4 s) per round, and b's own batch comes on top
    with pytest.raises(Shed) as refused:
        await node.infer("b:1", rows(1), 1, node.clock.now + 0.5, 1)
    assert refused.value.reason == "deadline"
    # and with 0.6 s left (0.48 s of headroom) it fits: one round of a (0.4 s) plus b's own batch
    admitted = asyncio.ensure_future(node.infer("b:1", rows(1), 1, node.clock.now + 0.6, 1))
    await asyncio.sleep(0)
    assert len(node.hosted["b:1"].batcher.queue) == 1
    for t in [*tasks, admitted]:
        t.cancel()


def admitted_to_a(node: Node, priority: int, seconds: float) -> None:
    """As `Node.infer` counts work it admits to a:1 (then run at once), `seconds` of device time just now."""
    node.hosted["a:1"].share.add(priority, seconds, node.clock.now)
    node.device_share.add(priority, seconds, node.clock.now)


async def test_work_arriving_for_other_versions_counts_though_none_is_queued(node) -> None:  # noqa: ANN001
    # given version a with nothing queued, but just admitted at 2 device seconds a second (its batches leave
    # as soon as they come), beside version b, on the same device
    host(node, "a", 0.4)
    host(node, "b", 0.01)
    admitted_to_a(node, 1, 2.0)
    # when b gets a request with 0.3 s left (0.24 s of headroom) / then it is refused: a batch of a (0.4 s)
    # arrives and takes its turn before b's
    with pytest.raises(Shed) as refused:
        await node.infer("b:1", rows(1), 1, node.clock.now + 0.3, 1)
    assert refused.value.reason == "deadline"
    # and with 0.6 s left (0.48 s) it fits: one batch of a per round, then b's own
    admitted = asyncio.ensure_future(node.infer("b:1", rows(1), 1, node.clock.now + 0.6, 1))
    await asyncio.sleep(0)
    assert len(node.hosted["b:1"].batcher.queue) == 1
    # and mirrored work arriving for a yields to b's callers: it is not counted against them
    node.hosted["a:1"].share = node.device_share = admission.DeviceShare()
    admitted_to_a(node, SHADOW_PRIORITY, 2.0)
    mirrored = asyncio.ensure_future(node.infer("b:1", rows(1), 1, node.clock.now + 0.3, 1))
    await asyncio.sleep(0)
    assert len(node.hosted["b:1"].batcher.queue) == 2
    for t in (admitted, mirrored):
        t.cancel()


async def busy_beside_quick(node: Node, quick: VersionEntry) -> list:
    """A saturated primary and its fallback on one device: a's 0.4 s batch on the device for 0.1 s already, a
    full batch more of a's queued and 2 device seconds a second arriving for it, beside `quick` (a 0.01 s model
    with a 5 ms batch window). Returns a's queued requests' tasks."""
    host(node, "a", 0.4)
    node.host(
        dataclasses.replace(quick, batching=dataclasses.replace(quick.batching, max_queue_delay=0.005)),
        StandIn(),
        {1: 0.01, 8: 0.01},
        start=False,
    )
    waiting = await queued(node, "a", 8)
    admitted_to_a(node, 1, 2.0)
    node._device_work[7], node._handed[7] = 0.4, node.hosted["a:1"]
    node._running_since = node.clock.now - 0.1
    return waiting


async def test_a_quiet_version_waits_for_the_batch_on_the_device_not_for_its_versions_next(node) -> None:  # noqa: ANN001
    # given a saturated a's batch on the device, beside a quick b
    waiting = await busy_beside_quick(node, entry("b"))
    # when b gets a request with 0.45 s left (0.36 s of headroom) / then it is admitted: b's batch is handed
    # to the device thread before a's batch ends, so a's next runs after it (0.3 + 0.01 s)
    ok = asyncio.ensure_future(node.infer("b:1", rows(1), 1, node.clock.now + 0.45, 1))
    await asyncio.sleep(0)
    assert len(node.hosted["b:1"].batcher.queue) == 1
    # and when a's batch is about to end (under b's window), a's next may go first: refused (0.41 s)
    node._running_since = node.clock.now - 0.399
    with pytest.raises(Shed):
        await node.infer("b:1", rows(1), 1, node.clock.now + 0.45, 1)
    # and so when b's own batch is on the device too: b's next waits for it, and a's may go first
    node._running_since = node.clock.now - 0.1
    node._device_work[8], node._handed[8] = 0.01, node.hosted["b:1"]
    with pytest.raises(Shed):
        await node.infer("b:1", rows(1), 1, node.clock.now + 0.45, 1)
    for t in (ok, *waiting):
        t.cancel()
    node._device_work.clear()
    node._handed.clear()
    node._running_since = None


async def test_work_in_flight_on_the_device_counts(node) -> None:  # noqa: ANN001
    host(node, "a", 0.01)
    # given a 1 s batch of another version running on the device since 0.2 s ago
    node._device_work[1] = 1.0
    node._running_since = node.clock.now - 0.2
    # then a request with 0.9 s left is refused (0.8 s left of that batch, its own on top, 0.72 s of
    # headroom), one with 1.1 s admitted
    with pytest.raises(Shed):
        await node.infer("a:1", rows(1), 1, node.clock.now + 0.9, 1)
    ok = asyncio.ensure_future(node.infer("a:1", rows(1), 1, node.clock.now + 1.1, 1))
    await asyncio.sleep(0)
    assert len(node.hosted["a:1"].batcher.queue) == 1
    ok.cancel()


async def test_lower_tiers_are_shed_first(node) -> None:  # noqa: ANN001
    # given 0.4 s of queued tier-1 work (2 batches of 0.2 s), and requests with 2 s left (1.6 s of headroom)
    host(node, "a", 0.2)
    tasks = await queued(node, "a", 16)
    # then tier 1 is admitted (0.6 s with its own batch), and tier 2 too (0.6 s, slowed by the share of
    # the device tier 1 just took, within three quarters of 1.6 s)...
    for tier in (1, 2):
        tasks.append(asyncio.ensure_future(node.infer("a:1", rows(1), 1, node.clock.now + 2.0, tier)))
    await asyncio.sleep(0)
    assert len(node.hosted["a:1"].batcher.queue) == 18
    # ...but tier 3 must finish within half, and is shed for its tier
    with pytest.raises(Shed) as refused:
        await node.infer("a:1", rows(1), 1, node.clock.now + 2.0, 3)
    assert refused.value.reason == "tier" and refused.value.tier == 3
    for t in tasks:
        t.cancel()


async def test_a_high_priority_request_evicts_queued_low_priority_work(node) -> None:  # noqa: ANN001
    # given a queue of 4 full with tier-2 work... (tier 2 may fill 3 of 4, tier 1 all 4)
    host(node, "a", 0.001, queue=4)
    low = await queued(node, "a", 3, priority=2)
    with pytest.raises(Shed) as full:
        await node.infer("a:1", rows(1), 1, node.clock.now + 100, 2)
    assert full.value.reason == "queue_full"
    high = await queued(node, "a", 1, priority=1)
    # when one more tier-1 request arrives
    high += await queued(node, "a", 1, priority=1)
    # then the newest tier-2 request was evicted with a 503 to its caller, and both tier-1 ones wait
    await asyncio.sleep(0)
    assert [t.done() for t in low] == [False, False, True]
    with pytest.raises(Shed) as evicted:
        low[2].result()
    assert evicted.value.reason == "evicted" and evicted.value.tier == 2
    assert not any(t.done() for t in high)
    # and once the tier-2 work is all evicted, another tier-1 request is refused: nothing lower to evict
    more = await queued(node, "a", 3, priority=1)
    await asyncio.sleep(0)
    assert all(t.done() for t in low) and not more[0].done() and not more[1].done()
    with pytest.raises(Shed) as refused:
        more[2].result()
    assert refused.value.reason == "queue_full"
    for t in [*low, *high, *more]:
        t.cancel()


async def test_queues_are_bounded_in_bytes(node) -> None:  # noqa: ANN001
    # given a node whose queues hold at most 10,000 bytes each
    host(node, "a", 0.001)
    first = asyncio.ensure_future(node.infer("a:1", rows(1), 1, node.clock.now + 100, 1, 8000))
    await asyncio.sleep(0)
    # when a request of 4,000 more bytes arrives / then it is shed for the queue's byte bound
    with pytest.raises(Shed) as refused:
        await node.infer("a:1", rows(1), 1, node.clock.now + 100, 1, 4000)
    assert refused.value.reason == "queue_full" and "bytes" in refused.value.message
    first.cancel()


async def test_admission_off_admits_what_the_estimate_would_refuse(node) -> None:  # noqa: ANN001
    host(node, "a", 0.4)
    tasks = await queued(node, "a", 40)
    node.admission = False
    late = asyncio.ensure_future(node.infer("a:1", rows(1), 1, node.clock.now + 1.0, 1))
    await asyncio.sleep(0)
    assert len(node.hosted["a:1"].batcher.queue) == 41
    for t in [*tasks, late]:
        t.cancel()


async def test_more_rows_than_the_version_takes_is_400(node) -> None:  # noqa: ANN001
    host(node, "a", 0.001, max_batch=4)
    with pytest.raises(ServingError) as refused:
        await node.infer("a:1", rows(5), 5, node.clock.now + 1, 1)
    assert refused.value.status == 400


async def test_a_caller_that_leaves_is_dropped_before_its_batch_runs(node) -> None:  # noqa: ANN001
    # given three queued requests, the middle one's caller gone
    hosted = host(node, "a", 0.001)
    ran: list[int] = []

    async def run_batch(batch):  # noqa: ANN001, ANN202
        ran.extend(p.rows for p in batch)
        for p in batch:
            p.payload.future.set_result({})

    hosted.batcher._run_batch = run_batch
    left = {1: False, 2: False, 3: False}
    tasks = [
        asyncio.ensure_future(node.infer("a:1", rows(1), 1, node.clock.now + 100, 1, 0, lambda i=i: left[i]))
        for i in (1, 2, 3)
    ]
    await asyncio.sleep(0)
    before = hosted.metrics.abandoned._value.get()
    # when the middle one's client leaves, and then the batch leaves (the fake clock passes the window)
    left[2] = True
    node.clock.now += 11
    await hosted.batcher.process_one_batch()
    # then only the two live requests ran, and the abandoned one was answered 499 (never sent) and counted
    assert ran == [1, 1]
    assert hosted.metrics.abandoned._value.get() == before + 1
    assert len(hosted.batcher.queue) == 0
    await asyncio.gather(tasks[0], tasks[2])
    with pytest.raises(ServingError) as gone:
        tasks[1].result()
    assert gone.value.status == 499


async def test_shrinking_max_batch_answers_queued_requests_that_no_longer_fit(node) -> None:  # noqa: ANN001
    # given a 6-row and a 2-row request queued under max_batch_size 8
    hosted = host(node, "a", 0.001)
    big = asyncio.ensure_future(node.infer("a:1", rows(6), 6, node.clock.now + 100, 1))
    small = asyncio.ensure_future(node.infer("a:1", rows(2), 2, node.clock.now + 100, 1))
    await asyncio.sleep(0)
    # when the registry shrinks max_batch_size to 4
    node._reconfigure(hosted, entry("a", max_batch=4))
    await asyncio.sleep(0)
    # then the 6-row request is answered 503 with the reason, and the 2-row one stays queued to be served
    with pytest.raises(ServingError) as refused:
        big.result()
    assert refused.value.status == 503 and "max_batch_size changed to 4" in refused.value.message
    assert not small.done() and hosted.batcher.queue.rows == 2
    small.cancel()


def test_calibration_is_the_recent_slow_tail_of_took_over_estimated() -> None:
    cal = admission.Calibration(tau=2.0)
    assert cal.factor(0.0) == 1.0  # nothing learned: the estimate stands
    for i in range(admission.CALIBRATION_MIN_SAMPLES - 1):
        cal.observe(0.1, 0.2, 1.0 + i * 0.001)
    assert cal.factor(1.1) == 1.0  # too few to say
    cal = admission.Calibration(tau=2.0)
    for i in range(100):  # 91 at 1.5x, 9 at 3x: the 90th percentile is 1.5x
        cal.observe(0.1, 0.15 if i < 91 else 0.3, 1.2 + i * 0.001)
    assert cal.factor(1.3) == pytest.approx(1.5)
    cal.observe(0.1, 0.4, 1.31)
    assert cal.factor(1.35) == pytest.approx(1.5)  # kept between refreshes
    assert cal.factor(3.35) == 1.0  # all older than tau: forgotten
    fast = admission.Calibration()
    for i in range(50):
        fast.observe(0.1, 0.05, float(i) / 100)  # faster than estimated
        fast.observe(0.01, 1.0, float(i) / 100)  # a short estimate: a request's fixed cost, not taught
    assert fast.factor(0.6) == 1.0  # never below 1
    slow = admission.Calibration()
    for i in range(50):
        slow.observe(0.1, 10.0, float(i) / 100)
    assert slow.factor(0.6) == admission.MAX_CORRECTION


async def test_a_calibrated_node_refuses_what_the_raw_estimate_would_admit(node) -> None:  # noqa: ANN001
    # given 16 rows queued on a version whose batch of 8 takes 0.1 s: the raw estimate for one more is 0.3 s
    host(node, "a", 0.1)
    tasks = await queued(node, "a", 16)
    # and a node whose admitted requests lately took twice their estimate
    for _ in range(admission.CALIBRATION_MIN_SAMPLES):
        node.calibration.observe(0.1, 0.2, node.clock.now)
    node.clock.now += admission.CALIBRATION_REFRESH_S  # the factor is recomputed at most this often
    # when a request with 0.5 s left arrives (headroom 0.4 s: the raw 0.3 s fits, the calibrated 0.6 s does not)
    with pytest.raises(Shed) as refused:
        await node.infer("a:1", rows(1), 1, node.clock.now + 0.5, 1)
    assert refused.value.reason == "deadline"
    for t in tasks:
        t.cancel()


async def test_an_admitted_request_that_misses_its_deadline_teaches_the_calibration(node) -> None:  # noqa: ANN001
    host(node, "a", 0.06)
    task = asyncio.ensure_future(node.infer("a:1", rows(1), 1, node.clock.now + 0.1, 1))
    await asyncio.sleep(0)
    node.clock.now += 0.12  # its batch never ran (the batcher is stopped): its deadline timer answers
    with pytest.raises(DeadlineExceeded):
        await task
    (when, ratio), *_ = node.calibration._samples
    assert ratio == pytest.approx(0.12 / 0.06)
