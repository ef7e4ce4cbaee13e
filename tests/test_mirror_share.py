"""The mirrors' device share (serving.policies.mirror_share, FERRY_SHADOW_DEVICE_PERCENT): a token bucket that
lets a batch of mirrors run ahead of callers' due work when it can pay for it, and lets admission judge a
mirror by its share instead of by the callers' backlog. On a fake clock, with stand-in runtimes."""

from __future__ import annotations

import asyncio

import pytest

from serving.dataplane.errors import Shed
from serving.dataplane.node.node import Node
from serving.policies import admission, mirror_share
from serving.policies.batching import SHADOW_PRIORITY
from serving.policies.mirror_share import MirrorShare
from tests.test_admission import Clock, StandIn, entry, rows

# -- the bucket ----------------------------------------------------------------------------------------


def test_the_bucket_earns_its_share_up_to_its_burst_and_pays_the_longest_prefix() -> None:
    bucket = MirrorShare(0.1, burst=0.5, now=0.0)
    # given a full bucket: 0.1 x 0.5 = 50 ms of device
    assert bucket.credit(0.0) == pytest.approx(0.05)
    # then it pays for the prefixes within it, and not one past it
    assert bucket.affordable([0.01, 0.03, 0.05, 0.07], 0.0) == 3
    assert bucket.affordable([0.06], 0.0) == 0
    # when it spends 50 ms / then it earns 10 ms a second back, and no more than its burst however long idle
    bucket.spend(0.05, 0.0)
    assert bucket.credit(0.0) == pytest.approx(0.0)
    assert bucket.credit(0.2) == pytest.approx(0.02)
    assert bucket.credit(100.0) == pytest.approx(0.05)


def test_no_share_pays_for_nothing_and_admits_nothing() -> None:
    bucket = MirrorShare(0.0)
    assert not bucket.enabled and bucket.affordable([0.0001], 10.0) == 0
    assert not mirror_share.admit(now=0.0, deadline=10.0, queued_work=0.0, own=0.001, share=0.0, headroom=0.8)


@pytest.mark.parametrize("share", [-0.1, 0.51, 1.0])
def test_a_share_outside_0_to_half_is_refused(share: float) -> None:
    with pytest.raises(ValueError):
        MirrorShare(share)


def test_admission_on_the_share_counts_the_mirrors_queued_ahead() -> None:
    # 10% of the device: 20 ms of mirrors ahead and 10 ms of its own take 300 ms, within 80% of 400 ms
    assert mirror_share.admit(now=0.0, deadline=0.4, queued_work=0.02, own=0.01, share=0.1, headroom=0.8)
    # and not within 80% of 300 ms
    assert not mirror_share.admit(now=0.0, deadline=0.3, queued_work=0.02, own=0.01, share=0.1, headroom=0.8)


# -- on the node ------------------------------------------------------------------------------------------


class Recording(StandIn):
    def __init__(self, name: str, order: list[str]) -> None:
        super().__init__()
        self.name, self.order = name, order

    def run(self, requests):  # noqa: ANN001, ANN201
        self.order.append(self.name)
        return super().run(requests)


def node_with(share: float, clock: Clock) -> Node:
    return Node(artifact_path=lambda sha: None, device="cpu", clock=clock, mirror_share=share)  # type: ignore[arg-type]


def stop(node: Node) -> None:
    for hosted in node.hosted.values():
        hosted.batcher.queue.drain()
    node._device_pool.shutdown(wait=False)
    node._load_pool.shutdown(wait=False)


async def test_a_share_runs_a_mirror_batch_ahead_of_a_callers_due_batch_while_it_can_pay() -> None:
    order: list[str] = []
    clock = Clock()
    # given a node with a 10% share (25 ms of burst), a caller's version and a shadow whose batch takes 1 ms
    node = node_with(0.1, clock)
    caller = node.host(entry("caller"), Recording("caller", order), {1: 0.001, 8: 0.001}, start=False)
    shadow = node.host(entry("shadow"), Recording("shadow", order), {1: 0.001, 8: 0.001}, start=False)
    try:
        mirrored = asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 100, SHADOW_PRIORITY))
        called = asyncio.ensure_future(node.infer("caller:1", rows(1), 1, clock.now + 100, 1))
        await asyncio.sleep(0)
        # when the mirrors' batch is due while the caller's is due too (both windows past)
        clock.now += 20
        # then the share pays for it: it runs at once, before the caller's (gaps only would hold it back)
        assert await asyncio.wait_for(shadow.batcher.process_one_batch(), 10)
        assert order == ["shadow"]
        await mirrored
        assert await caller.batcher.process_one_batch()
        await called
        assert order == ["shadow", "caller"]
        # and what it ran is spent: 1 ms of the 25 ms saved up
        assert node.mirror_share.credit(clock.now) < 0.025
    finally:
        stop(node)


async def test_a_mirror_batch_the_share_cannot_pay_for_still_waits_for_callers() -> None:
    order: list[str] = []
    clock = Clock()
    # given a 10% share (25 ms of burst) and a shadow whose batch takes 1 s
    node = node_with(0.1, clock)
    caller = node.host(entry("caller"), Recording("caller", order), {1: 0.001, 8: 0.001}, start=False)
    shadow = node.host(entry("shadow"), Recording("shadow", order), {1: 1.0, 8: 1.0}, start=False)
    try:
        mirrored = asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 100, SHADOW_PRIORITY))
        called = asyncio.ensure_future(node.infer("caller:1", rows(1), 1, clock.now + 100, 1))
        await asyncio.sleep(0)
        clock.now += 20
        shadow_step = asyncio.ensure_future(shadow.batcher.process_one_batch())
        for _ in range(20):
            await asyncio.sleep(0)
        # then it holds the device back for the caller's due batch, as without a share
        assert order == [] and not shadow_step.done()
        assert await caller.batcher.process_one_batch()
        assert await asyncio.wait_for(shadow_step, 10)
        assert order == ["caller", "shadow"]
        await asyncio.gather(called, mirrored)
    finally:
        stop(node)


@pytest.mark.parametrize("share", [0.0, 0.1])
async def test_admission_judges_a_mirror_by_its_share_not_by_the_callers_backlog(share: float) -> None:
    clock = Clock()
    node = node_with(share, clock)
    node.host(entry("caller", queue=1000), StandIn(), {1: 0.01, 8: 0.05}, start=False)
    node.host(entry("shadow"), StandIn(), {1: 0.01, 8: 0.05}, start=False)
    try:
        # given a callers' backlog of 80 rows (0.5 s of device) on the other version
        callers = [asyncio.ensure_future(node.infer("caller:1", rows(8), 8, clock.now + 100, 1)) for _ in range(10)]
        await asyncio.sleep(0)
        # when a one-row mirror with 200 ms left asks
        asked = node.infer("shadow:1", rows(1), 1, clock.now + 0.2, SHADOW_PRIORITY)
        if share == 0.0:
            # then without a share the lowest tier's slice of the budget cannot hold it behind the callers
            with pytest.raises(Shed):
                await asked
        else:
            # and with 10% its own 10 ms takes 100 ms at the share, within 80% of the 200 ms: it is queued
            mirrored = asyncio.ensure_future(asked)
            await asyncio.sleep(0)
            assert not mirrored.done()
            queue = node.hosted["shadow:1"].batcher.queue
            assert queue.rows == 1
            mirrored.cancel()
        for c in callers:
            c.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        assert admission.HEADROOM == 0.8  # the figures above assume it
    finally:
        stop(node)
