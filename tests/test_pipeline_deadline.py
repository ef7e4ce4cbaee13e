"""A pipeline's shared deadline, on the runner alone (a stand-in gateway, a clock the test moves): it counts
from the request's first byte, the steps run against admission's HEADROOM of it, each step gets what is left,
and a step that would start after it is refused (503 with Retry-After) without being sent."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from serving.dataplane.errors import ServingError
from serving.dataplane.gateway.pipeline import PipelineRunner
from serving.dataplane.gateway.snapshot import PipelineEntry, PipelineVersionEntry, RoutingSnapshot
from serving.dataplane.http.protocol import TensorSpec
from serving.policies.admission import HEADROOM

BUDGET_MS = 300
SPEC = {"sequence": [{"model": "first", "name": "a"}, {"model": "second", "name": "b"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StandIn:
    """What the runner uses of a Gateway: the snapshot and `serve`, each step taking `step_s` of the clock."""

    def __init__(self, clock: Clock, step_s: float) -> None:
        version = PipelineVersionEntry(
            1, SPEC, (TensorSpec("input", "FP32", (4,)),), (TensorSpec("scores", "FP32", (4,)),), max_rows=8
        )
        pipeline = PipelineEntry("p", "", {1: version}, 1, visibility="public")
        self.snapshot = RoutingSnapshot(1, 0.0, latency_budget_ms=BUDGET_MS, pipelines={"p": pipeline})
        self.hub = SimpleNamespace(current=self.snapshot)
        self.clock, self.step_s = clock, step_s
        self.asked: list[tuple[str, float]] = []  # (model, the timeout its request carried)

    async def serve(self, request):  # noqa: ANN001, ANN201
        self.asked.append((request.name, request.timeout))
        self.clock.now += self.step_s
        return SimpleNamespace(outputs={"scores": np.ones((1, 4), dtype=np.float32)})


def call(gateway: StandIn, clock: Clock, waited: float):  # noqa: ANN201
    body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0, 1, 2, 3]}]})
    runner = PipelineRunner(gateway, clock)  # type: ignore[arg-type]
    return asyncio.run(runner.infer("p", None, body, None, None, waited=waited))


def test_steps_share_headroom_of_the_budget_from_the_first_byte() -> None:
    clock = Clock()
    gateway = StandIn(clock, step_s=0.1)
    reply = call(gateway, clock, waited=0.05)
    assert reply.status == 200
    (first, t1), (second, t2) = gateway.asked
    assert (first, second) == ("first", "second")
    steps_s = HEADROOM * BUDGET_MS / 1000
    assert t1 == pytest.approx(steps_s - 0.05)  # the front door's wait is spent from it
    assert t2 == pytest.approx(steps_s - 0.05 - 0.1)  # what the first step left


def test_a_step_after_the_deadline_is_refused_unsent() -> None:
    clock = Clock()
    gateway = StandIn(clock, step_s=HEADROOM * BUDGET_MS / 1000)  # the first step spends it all
    with pytest.raises(ServingError) as refused:
        call(gateway, clock, waited=0.0)
    assert refused.value.status == 503 and refused.value.retry_after
    assert "before step 'b'" in refused.value.message
    assert [name for name, _ in gateway.asked] == ["first"]
