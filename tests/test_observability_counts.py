"""Counts that mean what they say: a pipeline call whose client left is no 500; the WebSocket read stalls are a
counter (summed across web processes, rate()-able), not a gauge of a count; a node's stream entries are counted
once per family (an outcome each; hot or cold; claimed)."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from prometheus_client import REGISTRY

from serving.dataplane.gateway.pipeline import PipelineRunner
from serving.dataplane.http import websocket
from serving.dataplane.metrics import node_metrics
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_process import Facts, NodeProcess
from tests.test_pipeline_dataplane_audit import ENSEMBLE, Fleet, model, version


def pipeline_calls(status: str) -> float:
    return REGISTRY.get_sample_value("ferry_pipeline_requests_total", {"model": "p", "status": status}) or 0.0


def test_a_cancelled_pipeline_call_is_counted_as_its_client_leaving_not_a_500() -> None:
    # given a pipeline call waiting on a member (a long queue)
    fleet = Fleet([model("a", version("a", 1)), model("b", version("b", 1))], ENSEMBLE)
    fleet.hold.add("b:1")
    before = {status: pipeline_calls(status) for status in ("499", "500")}

    async def run() -> None:
        runner = PipelineRunner(fleet)  # type: ignore[arg-type]
        body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]})
        call = asyncio.ensure_future(runner.infer("p", None, body, None, None))
        while "b:1" not in fleet.ran:
            await asyncio.sleep(0)
        # when its client goes (a gRPC call cancelled, a stream closed: the task is cancelled)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(run())
    # then it is counted as 499, as the gateway counts a model's, and the server's errors are none the more
    assert pipeline_calls("499") - before["499"] == 1
    assert pipeline_calls("500") == before["500"]


def test_read_stalls_are_a_counter() -> None:
    (family,) = [m for m in REGISTRY.collect() if m.name == "ferry_ws_read_stalls"]
    assert family.type == "counter"
    before = REGISTRY.get_sample_value("ferry_ws_read_stalls_total") or 0.0
    websocket.READ_STALLS.inc()
    assert REGISTRY.get_sample_value("ferry_ws_read_stalls_total") == before + 1


def test_the_node_metrics_count_each_entry_once_per_family() -> None:
    node = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    process = NodeProcess(node, "redis://127.0.0.1:1/0", Facts("unit", "cpu", "cpu", 0, 1 << 30, 1 << 30))
    try:
        process.counts.update(served=3, refused=1, hot=3, cold=1, claimed=2)
        families = {m.name: {s.labels.get("outcome", s.labels.get("state", "")): s.value for s in m.samples}
                    for m in node_metrics.NodeCollector(process).collect()}  # fmt: skip
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    outcomes = families["ferry_node_stream_entries"]
    assert "hot" not in outcomes and "claimed" not in outcomes and outcomes["refused"] == 1
    assert sum(outcomes.values()) == 4  # four entries, one outcome each
    assert families["ferry_node_stream_entries_taken"] == {"hot": 3, "cold": 1}
    assert families["ferry_node_stream_entries_claimed"] == {"": 2}
