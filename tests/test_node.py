"""The node: poison requests found by bisection, and the memory budget of real loads."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.node.node import Node
from serving.dataplane.node.runtime import RuntimeFailure
from serving.policies.batching import BatchingConfig
from tests.test_admission import Clock, StandIn, entry, rows


class Poisoned(StandIn):
    """Fails any batch holding a row whose first value is negative; records each call's batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def run(self, requests):  # noqa: ANN001, ANN201
        self.calls.append(sum(r["input"].shape[0] for r in requests))
        if any((r["input"][:, 0] < 0).any() for r in requests):
            raise RuntimeFailure("negative input")
        return super().run(requests)


async def test_a_poison_request_is_found_by_bisection_not_by_rerunning_each_alone() -> None:
    # given 8 queued one-row requests, the fourth of which makes the model raise
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    runtime = Poisoned()
    hosted = node.host(entry("p"), runtime, {1: 0.001, 8: 0.001}, start=False)
    poison_before = hosted.metrics.poison._value.get()
    bodies = [rows(1) for _ in range(8)]
    bodies[3]["input"][0, 0] = -1.0
    tasks = [asyncio.ensure_future(node.infer("p:1", b, 1, clock.now + 100, 1)) for b in bodies]
    await asyncio.sleep(0)
    try:
        # when the full batch leaves
        assert await hosted.batcher.process_one_batch()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    # then the bad request alone gets 422, every other one its answer
    assert [getattr(r, "status", 200) for r in results] == [200, 200, 200, 422, 200, 200, 200, 200]
    # and the batch was bisected (8; 4 fails: its clean half 2, its bad half 2 split to 1 and 1; then the
    # other 4) rather than rerun request by request (8, then eight calls of 1)
    assert runtime.calls == [8, 4, 2, 2, 1, 1, 4]
    assert hosted.metrics.poison._value.get() == poison_before + 1


async def test_a_version_bigger_than_the_budget_is_unschedulable_and_others_keep_serving(model_files) -> None:  # noqa: ANN001
    # given a node whose budget holds one digits model
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")

    def digits(name: str, footprint: int = 0) -> VersionEntry:
        from serving.dataplane.gateway.snapshot import PlacementEntry
        from serving.dataplane.http.protocol import TensorSpec

        return VersionEntry(
            model=name,
            version=1,
            state="ready",
            loaded=True,
            artifact_sha256="0" * 64,
            format="torchscript",
            inputs=(TensorSpec("input", "FP32", (64,)),),
            outputs=(TensorSpec("scores", "FP32", (10,)),),
            batching=BatchingConfig(8, 0.0, 100),
            default_timeout_ms=1000,
            latency_profile={},
            placement=PlacementEntry(memory_bytes=footprint),
        )

    try:
        first = await node.load(digits("one"))
        assert first is not None
        node.memory_budget = int(first.runtime.memory_bytes * 1.5)
        # when another is loaded whose registered footprint is larger than the node's whole budget
        second = await node.load(digits("two", footprint=node.memory_budget + 1))
        # then it is unschedulable without a load, saying how much it needs against the budget, and evicts
        # nothing
        assert second is None
        reason = node.failures["two:1"].reason
        assert reason.startswith("unschedulable (memory)") and "whole budget" in reason
        assert "two:1" not in node.hosted and "two:1" not in node.packing.cold
        # and the first keeps serving
        out = await node.infer("one:1", {"input": np.zeros((1, 64), np.float32)}, 1, node._clock() + 5, 1)
        assert out["scores"].shape == (1, 10)
    finally:
        await node.close()


class Slow(StandIn):
    def run(self, requests):  # noqa: ANN001, ANN201
        import time

        time.sleep(0.02)  # device time the node measures; only a floor is asserted, never a ceiling
        return super().run(requests)


async def test_each_answer_carries_its_rows_share_of_the_batchs_device_time() -> None:
    # given a request of 1 row and one of 3 queued together, filling a batch of 4
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    hosted = node.host(entry("s", max_batch=4), Slow(), {1: 0.001, 4: 0.001}, start=False)
    tasks = [asyncio.ensure_future(node.infer("s:1", rows(n), n, clock.now + 100, 1)) for n in (1, 3)]
    await asyncio.sleep(0)
    try:
        # when the batch runs
        assert await hosted.batcher.process_one_batch()
        one, three = await asyncio.gather(*tasks)
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    # then the outputs are still the plain tensors, and the device time is split 1:3 between them
    assert set(one) == {"scores"} and one["scores"].shape == (1, 2)
    assert three.compute_seconds == pytest.approx(3 * one.compute_seconds)
    assert one.compute_seconds + three.compute_seconds >= 0.02
