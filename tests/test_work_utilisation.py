"""Work utilisation on real nodes (issue 20, item 2): beside busy time, the rows served at their version's
best-batch cost over the time, from the version's profile and the rows actually served; on /metrics and on the
fleet page. Batch-one traffic on a model whose best batch is large keeps the device busy and does little work:
these tests say so, and would not if the meter counted busy time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from bench.gil_contention import Chain
from serving.dataplane.gateway.snapshot import PlacementEntry, RoutingSnapshot, VersionEntry
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.metrics.busy import SAMPLE_SECONDS, BusyMeter, WorkMeter
from serving.dataplane.metrics.metrics import DEVICE_BUSY, LOADED, QUEUE_DEPTH
from serving.dataplane.metrics.node_metrics import utilisation_families
from serving.dataplane.node import node as node_module
from serving.dataplane.node.node import Hosted, Node
from serving.dataplane.node.runtime import RuntimeFailure
from serving.dataplane.transport.fleet import NodeInfo
from serving.demo import save_artifact
from serving.fleet_chart import utilisation_svg
from serving.fleet_state import node_doc
from serving.policies.utilisation import best_row_seconds
from tests.test_admission import Clock, StandIn, entry, rows

# A profile whose batch of 32 takes twice a batch of one: 16 times the rows per second at its best.
PROFILE = {1: 0.010, 8: 0.012, 32: 0.020}


def estimate(rows: int) -> float:
    return PROFILE.get(rows, 0.010 + (rows - 1) * (0.010 / 31))


def test_batch_one_back_to_back_reads_busy_but_a_sixteenth_of_the_work() -> None:
    now = [100.0]
    busy = BusyMeter(window=10, clock=lambda: now[0])
    work = WorkMeter(busy, window=10, clock=lambda: now[0])
    # given batches of one row, back to back for 10 s (each 10 ms, as the profile says)
    at = 100.0
    for _ in range(1000):
        busy.add(at, 0.010)
        work.batch("m:1", 1, at, 0.010, estimate, 32)
        at += 0.010
    now[0] = 110.0
    # then the device reads fully busy, and its work is what 1000 rows cost at batch 32: 1000 x 20/32 ms in 10 s
    assert busy.fraction() == pytest.approx(1.0)
    assert work.fraction() == pytest.approx(1000 * 0.020 / 32 / 10)
    assert work.rows == {"m:1": 1000}
    assert work.work_seconds["m:1"] == pytest.approx(0.625)


def test_full_batches_read_as_much_work_as_busy_time_and_the_history_keeps_both() -> None:
    now = [0.0]
    busy = BusyMeter(window=10, clock=lambda: now[0])
    work = WorkMeter(busy, window=10, clock=lambda: now[0])
    # given ten seconds of batch-one traffic, then ten of full batches (each 20 ms)
    at = 0.0
    while at < 10.0 - 1e-9:
        busy.add(at, 0.010)
        work.batch("m:1", 1, at, 0.010, estimate, 32)
        at += 0.010
    now[0] = 10.0
    first = work.history()
    while at < 20.0 - 1e-9:
        busy.add(at, 0.020)
        work.batch("m:1", 32, at, 0.020, estimate, 32)
        at += 0.020
    now[0] = 20.0
    assert work.fraction() == pytest.approx(busy.fraction()) == pytest.approx(1.0)
    # then the history holds one sample per window: busy both times, the work a sixteenth, then all of it
    samples = work.history()
    assert first == [(0.0, pytest.approx(1.0), pytest.approx(0.0625))]
    assert [(age, b, w) for age, b, w in samples] == [
        (float(SAMPLE_SECONDS), pytest.approx(1.0), pytest.approx(0.0625)),
        (0.0, pytest.approx(1.0), pytest.approx(1.0)),
    ]
    # and asking again within the sample interval adds nothing
    now[0] = 25.0
    assert len(work.history()) == 2


def test_a_version_served_several_ways_counts_each_batchs_rows_at_the_best_batch() -> None:
    work = WorkMeter(window=10, clock=lambda: 0.0)
    work.batch("a:1", 3, 0.0, 0.011, estimate, 32)
    work.batch("b:1", 2, 0.5, 0.003, lambda b: 0.001 * b, 4)  # linear: every batch size as good as another
    assert work.rows == {"a:1": 3, "b:1": 2}
    assert work.work_seconds == {"a:1": pytest.approx(3 * 0.020 / 32), "b:1": pytest.approx(0.002)}


def test_a_reference_that_prices_a_row_above_its_device_time_reads_above_busy_and_above_one() -> None:
    now = [0.0]
    busy = BusyMeter(window=10, clock=lambda: now[0])
    work = WorkMeter(busy, window=10, clock=lambda: now[0])

    # given a reference 1.5 times what the device spends (a batch of 32 computes in 20 ms, priced at 30 ms)
    def priced(rows: int) -> float:
        return 1.5 * estimate(rows)

    # when the device computes 60% of the time, then all the time
    at = 0.0
    while at < 10.0 - 1e-9:
        busy.add(at, 0.020)
        work.batch("m:1", 32, at, 0.020, priced, 32)
        at += 0.020 / 0.6
    now[0] = at = 10.0
    # then work reads 1.5 times busy, as counted: 0.9 beside 0.6
    assert busy.fraction() == pytest.approx(0.6, abs=0.01)
    assert work.fraction() == pytest.approx(1.5 * busy.fraction())
    while at < 20.0 - 1e-9:
        busy.add(at, 0.020)
        work.batch("m:1", 32, at, 0.020, priced, 32)
        at += 0.020
    now[0] = 20.0
    # and at full load 1.5, not a busy-looking 100%: the over-count shows, on /metrics and in the history
    assert busy.fraction() == pytest.approx(1.0)
    assert work.fraction() == pytest.approx(1.5)
    assert work.history()[-1][1:] == (pytest.approx(1.0), pytest.approx(1.5))


# -- a real node ---------------------------------------------------------------------------------------------


@pytest.fixture
def chain_artifact(tmp_path: Path) -> Path:
    """A model of many small matrix-vector steps: batch 32 serves several times the rows per second of batch one
    on a CPU (measured 3.3 ms at one row, 15 ms at 32 on this machine, one thread)."""
    path = tmp_path / "chain.pt"
    save_artifact(Chain(256, 100).eval(), "torchscript", torch.zeros(1, 64), path)
    return path


def chain_entry(sha: str = "c" * 64) -> VersionEntry:
    from serving.policies.batching import BatchingConfig

    return VersionEntry(
        model="chain",
        version=1,
        state="ready",
        loaded=True,
        artifact_sha256=sha,
        format="torchscript",
        inputs=(TensorSpec("input", "FP32", (64,)),),
        outputs=(TensorSpec("output", "FP32", (10,)),),
        batching=BatchingConfig(32, 0.0, 100),
        default_timeout_ms=5000,
        latency_profile={1: 0.004, 32: 0.016},
        placement=PlacementEntry(),
    )


class Families(Collector):
    def __init__(self, node: Node) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        yield from utilisation_families(self.node)


async def test_a_node_serving_batch_one_on_a_batching_model_reads_busy_above_its_work(chain_artifact: Path) -> None:
    node = Node(artifact_path=lambda sha: chain_artifact, device="cpu")
    try:
        hosted = await node.load(chain_entry())
        assert hosted is not None
        loop = asyncio.get_running_loop()
        # when it serves requests of one row, one at a time: every batch is a batch of one
        for _ in range(60):
            await node.infer("chain:1", {"input": np.zeros((1, 64), np.float32)}, 1, loop.time() + 30, 1)
        best = best_row_seconds(hosted.compute.estimate, 32)
        # then it counted the rows served, each worth the version's best-batch seconds by its measured profile
        assert node.work.rows == {"chain:1": 60}
        assert node.work.work_seconds["chain:1"] == pytest.approx(60 * best)
        # and by that profile batch one costs several times a row's share of a full batch, so the work it did
        # reads below its busy time (a meter of busy time would read the two alike)
        assert hosted.profile.estimate(1) > 2 * best
        assert 0.0 < node.work.fraction() < node.busy.fraction()
        # and /metrics says both, with the rows and their work per version
        registry = CollectorRegistry()
        registry.register(Families(node))
        text = generate_latest(registry).decode()
        assert 'ferry_node_rows_served_total{model="chain",version="1"} 60.0' in text
        assert "ferry_node_busy_ratio " in text and "ferry_node_work_utilisation_ratio " in text
        value = float(text.split('ferry_node_work_seconds_total{model="chain",version="1"} ')[1].split()[0])
        assert value == pytest.approx(60 * best)
    finally:
        await node.close()


class DeviceClock:
    """The device thread's stopwatch (the node's `time.perf_counter`), moved only by the stand-in runtime."""

    def __init__(self) -> None:
        self.now = 50.0

    def perf_counter(self) -> float:
        return self.now


class Costed(StandIn):
    """Takes `per_row` seconds of the device a row, then `hand_back` more before the node's event loop resumes
    (a loop busy with other work); fails any batch that holds a row whose first value is negative."""

    def __init__(self, node_clock: Clock, device: DeviceClock, per_row: float, hand_back: float = 0.0) -> None:
        super().__init__()
        self.node_clock, self.device, self.per_row, self.hand_back = node_clock, device, per_row, hand_back
        self.calls: list[int] = []

    def run(self, requests):  # noqa: ANN001, ANN201
        n = sum(r["input"].shape[0] for r in requests)
        self.calls.append(n)
        self.device.now += self.per_row * n
        self.node_clock.now += self.per_row * n + self.hand_back
        if any((r["input"][:, 0] < 0).any() for r in requests):
            raise RuntimeFailure("negative input")
        return super().run(requests)


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> DeviceClock:
    """The node's device stopwatch made the stand-in's: no real time in these tests, so none is asserted."""
    stopwatch = DeviceClock()
    monkeypatch.setattr(node_module, "time", SimpleNamespace(perf_counter=stopwatch.perf_counter))
    return stopwatch


async def serve(node: Node, hosted: Hosted, bodies: list[dict[str, np.ndarray]]) -> list[object]:
    """Queue `bodies` (stopped batcher), run one batch of them, and return their answers or errors."""
    tasks = [asyncio.ensure_future(node.infer(hosted.entry.key, b, 1, node._clock() + 100, 1)) for b in bodies]
    await asyncio.sleep(0)
    assert await hosted.batcher.process_one_batch()
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_the_work_reference_is_the_devices_own_time_not_the_event_loops_hand_back(device: DeviceClock) -> None:
    # given a version whose batch of one takes 10 ms of the device, its profile saying so, and an event loop that
    # resumes 5 ms after each batch ends (admission's profile learns that: its answers come back that late)
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    hosted = node.host(entry("handback", max_batch=1), Costed(clock, device, 0.010, 0.005), {1: 0.010}, start=False)
    try:
        # when it serves a batch every 25 ms for a second
        for _ in range(40):
            assert [getattr(r, "status", 200) for r in await serve(node, hosted, [rows(1)])] == [200]
            clock.now += 0.010
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    # then admission predicts with the hand-back, and the work reference is the device's 10 ms all the same
    assert hosted.profile.estimate(1) > 0.014
    assert hosted.compute.estimate(1) == pytest.approx(0.010)
    # so the device, busy 40% of the time at its best batch size, did 40% of the work it could (priced with the
    # hand-back it would read 60%: more work than the device had time for)
    assert node.busy.fraction() == pytest.approx(0.4)
    assert node.work.fraction() == pytest.approx(node.busy.fraction())
    assert node.work.work_seconds["handback:1"] == pytest.approx(40 * 0.010)


async def test_a_bisected_batch_counts_its_answered_parts_as_work_and_every_device_call_as_busy(
    device: DeviceClock,
) -> None:
    # given 8 queued one-row requests, the fourth of which makes the model raise; each row 1 ms of the device
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    runtime = Costed(clock, device, 0.001)
    hosted = node.host(entry("bisected"), runtime, {1: 0.001, 8: 0.008}, start=False)
    device_busy = DEVICE_BUSY.labels("cpu")
    busy_before = device_busy._value.get()
    bodies = [rows(1) for _ in range(8)]
    bodies[3]["input"][0, 0] = -1.0
    try:
        # when the batch fails and is bisected (8; 4 fails: its clean 2, its bad 2 split to 1 and 1; the other 4)
        statuses = [getattr(r, "status", 200) for r in await serve(node, hosted, bodies)]
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    assert statuses == [200, 200, 200, 422, 200, 200, 200, 200]
    assert runtime.calls == [8, 4, 2, 2, 1, 1, 4]
    clock.now += 1.0
    # then both busy measures count every call, failed ones too: 22 rows' time (the meter over its age)
    assert device_busy._value.get() - busy_before == pytest.approx(0.022)
    assert node.busy.fraction() == pytest.approx(0.022 / (clock.now - Clock().now))
    # and the parts answered (2, 1 and 4 rows) are batches as any other: in the work, the compute time and the
    # batch sizes; the failed calls in none of them
    assert node.work.rows == {"bisected:1": 7}
    assert node.work.work_seconds["bisected:1"] == pytest.approx(0.007)
    counts, total = hosted.metrics.batch_size.snapshot()
    assert (sum(counts), total) == (3, 7)
    counts, total = hosted.metrics.compute.snapshot()
    assert (sum(counts), total) == (3, pytest.approx(0.007))


def served_series(family: object, model: str) -> list[float]:
    """The values of `family`'s samples for `model` version 1 (none once the series is gone)."""
    return [
        sample.value
        for metric in family.collect()  # type: ignore[attr-defined]
        for sample in metric.samples
        if sample.labels == {"model": model, "version": "1"}
    ]


async def test_an_unloaded_versions_gauges_are_gone_not_zero_and_a_reload_brings_them_back() -> None:
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    try:
        # given a loaded version that has served
        hosted = node.host(entry("leaving"), StandIn(), {1: 0.001, 8: 0.001}, start=False)
        node.work.batch("leaving:1", 1, clock.now, 0.001, hosted.compute.estimate, 8)
        assert served_series(LOADED, "leaving") == [1.0] and served_series(QUEUE_DEPTH, "leaving") == [0.0]
        # when it leaves the snapshot (deleted): the node unloads it
        await node.reconcile(RoutingSnapshot(serial=1, built_at=0.0))
        # then its gauges no longer say anything of it, and the node keeps no work counts for it
        assert "leaving:1" not in node.hosted
        assert served_series(LOADED, "leaving") == [] and served_series(QUEUE_DEPTH, "leaving") == []
        assert node.work.rows == {} and node.work.work_seconds == {}
        # and when it is loaded again, they are back
        node.host(entry("leaving"), StandIn(), {1: 0.001, 8: 0.001}, start=False)
        assert served_series(LOADED, "leaving") == [1.0] and served_series(QUEUE_DEPTH, "leaving") == [0.0]
        await node.unload("leaving:1")
        assert served_series(LOADED, "leaving") == []
    finally:
        await node.close()


# -- the fleet page ------------------------------------------------------------------------------------------


def heartbeat(**utilisation: object) -> NodeInfo:
    return NodeInfo(
        name="node-a",
        instance="node-a-1",
        host="box",
        pid=42,
        device="cpu",
        accelerator="a10g",
        accelerator_count=1,
        memory_total=1 << 30,
        memory_budget=1 << 30,
        memory_used=0,
        labels={},
        started_at=0.0,
        heartbeat_at=1000.0,
        serial=1,
        **utilisation,  # type: ignore[arg-type]
    )


def test_a_heartbeat_carries_work_utilisation_and_its_history_to_the_page() -> None:
    from serving.fleet_views import parts

    info = heartbeat(busy=0.97, work=0.06, utilisation=[[20.0, 0.95, 0.05], [10.0, 0.97, 0.06], [0.0, 0.97, 0.06]])
    # the heartbeat's round trip through Redis's hash keeps both
    assert NodeInfo.from_hash({k.encode(): v for k, v in info.to_hash().items()}) == info
    doc = node_doc(info, "live", now=1001.0)
    # ages become times on the heartbeat's clock
    assert (doc["busy"], doc["work"]) == (0.97, 0.06)
    assert doc["utilisation"] == [[980.0, 0.95, 0.05], [990.0, 0.97, 0.06], [1000.0, 0.97, 0.06]]
    svg = utilisation_svg(doc)
    assert 'data-samples="3"' in svg and svg.count("<polyline") == 2
    # the work line sits near the bottom (6%), the busy line near the top (97%), at the right edge for "now"
    work_line = svg.split('class="work" points="')[1].split('"')[0]
    busy_line = svg.split('class="busy" points="')[1].split('"')[0]
    assert work_line.split()[-1] == "160.0,26.3" and busy_line.split()[-1] == "160.0,0.8"
    html = parts({"nodes": [doc | {"embedded": False}], "events": [], "versions": []})["nodes"]
    assert '<td class="busy" data-busy="0.97">97%</td>' in html
    assert '<td class="work" data-work="0.06">6%</td>' in html
    assert 'class="utilisation"' in html


def test_an_older_heartbeat_without_work_reads_as_unknown_not_as_none_done() -> None:
    from serving.fleet_views import parts  # here, as in the test above: the views module loads Django's models

    info = heartbeat(busy=0.5)
    raw = {k.encode(): v for k, v in info.to_hash().items() if k not in ("work", "utilisation")}
    older = NodeInfo.from_hash(raw)
    # then its work utilisation is unknown, not 0%: the page shows "—" and a chart that says it has no data
    assert (older.work, older.utilisation) == (None, [])
    doc = node_doc(older, "live", now=time.time())
    html = parts({"nodes": [doc | {"embedded": False}], "events": [], "versions": []})["nodes"]
    assert '<td class="work" data-work="">—</td>' in html and '<td class="busy" data-busy="0.5">50%</td>' in html
    svg = utilisation_svg(doc)
    assert 'data-samples="0"' in svg and ">no data</text>" in svg
