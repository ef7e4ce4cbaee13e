"""Shadow traffic without a server: the route table's shadow rule, the comparison per task kind, the mirror's
sampling and bounds, the lowest tier in admission, and the gateway mirroring on a real node with the digits
model (no database)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import numpy as np
import orjson
import pytest

from rollout import shadow_compare
from rollout.routing import RouteTable
from serving.dataplane.gateway.gateway import Gateway, _priority
from serving.dataplane.gateway.shadow import DROPPED, Mirror, Mirrored, Pair, stack_rows
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub, VersionEntry
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node.node import Node
from serving.dataplane.transport.transport import InProcessTransport, Outputs
from serving.policies import admission
from serving.policies.batching import SHADOW_PRIORITY, BatchingConfig, BatchQueue, Pending, tier_share
from tests.load import eventually
from usage.sketch import bucket_of

DIGITS_IN = (TensorSpec("input", "FP32", (64,)),)
DIGITS_OUT = (TensorSpec("scores", "FP32", (10,)),)


def version(v: int, model: str = "m", *, timeout_ms: int = 1000) -> VersionEntry:
    return VersionEntry(
        model=model,
        version=v,
        state="ready",
        loaded=True,
        artifact_sha256=f"{v:064d}",
        format="torchscript",
        inputs=DIGITS_IN,
        outputs=DIGITS_OUT,
        default_timeout_ms=timeout_ms,
        latency_profile={},
        batching=BatchingConfig(max_batch_size=8, max_queue_delay=0.001, max_queue_size=64),
    )


def model(
    shadow: int | None = 2, fraction: float = 1.0, task: str = "classification", *, timeout_ms: int = 1000
) -> ModelEntry:
    return ModelEntry(
        "m",
        task,
        "",
        None,
        {1: version(1, timeout_ms=timeout_ms), 2: version(2, timeout_ms=timeout_ms)},
        routes=RouteTable(stable=1, shadow=shadow, shadow_fraction=fraction if shadow else 0.0),
    )


def dropped(reason: str, v: int = 2) -> float:
    return DROPPED.labels("m", str(v), reason)._value.get()


# -- the rule --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rules", "fragment"),
    [
        ({"shadow": 0}, "shadow: 0 is not a version"),
        ({"shadow": 2, "shadow_fraction": 1.5}, "shadow_fraction: must be a number from 0 to 1"),
        ({"shadow": 2, "shadow_fraction": float("nan")}, "shadow_fraction"),
        ({"shadow_fraction": 0.5}, "needs a shadow version"),
    ],
)
def test_bad_shadow_rules_are_refused(rules: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        RouteTable(stable=1, **rules)


def test_the_shadow_travels_with_the_table_and_mirrors_other_versions_only() -> None:
    table = RouteTable(stable=1, weights={1: 0.9, 3: 0.1}, shadow=2, shadow_fraction=0.25)
    assert RouteTable.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    assert table.versions() == {1, 2, 3}
    assert table.mirrors(1) and table.mirrors(3) and not table.mirrors(2)
    assert not RouteTable(stable=1, shadow=2, shadow_fraction=0.0).mirrors(1)


# -- comparison per task kind ---------------------------------------------------------------------


def test_classification_compares_top1_and_counts_the_confusion() -> None:
    primary = np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.3, 0.5]], np.float32)
    shadow = np.array([[0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [0.2, 0.3, 0.5]], np.float32)
    c = shadow_compare.compare("classification", primary, shadow)
    assert c.agree.tolist() == [True, False, True]
    assert c.top1[0].tolist() == [1, 0, 2] and c.top1[1].tolist() == [1, 2, 2]
    assert c.difference == pytest.approx([0.2, 0.7, 0.0])
    cell = shadow_compare.Cell("classification")
    cell.add(c)
    assert (cell.compared, cell.agreed) == (3, 2)
    assert cell.confusion == {"1,1": 1, "0,2": 1, "2,2": 1}


def test_regression_keeps_mean_and_max_absolute_difference() -> None:
    primary = np.array([[1.0, 2.0], [10.0, -4.0]], np.float32)
    shadow = np.array([[1.0005, 2.0], [10.5, -4.0]], np.float32)
    c = shadow_compare.compare("regression", primary, shadow)
    # within 1e-3 + 1e-2 x |primary| agrees; 0.5 off a primary of 10 (tolerance 0.101) does not
    assert c.agree.tolist() == [True, False]
    assert c.abs_count == 4
    assert c.abs_sum == pytest.approx(0.5005, abs=1e-5)
    assert c.abs_max == pytest.approx(0.5)


def test_embedding_compares_cosine_similarity() -> None:
    primary = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]], np.float32)
    shadow = np.array([[2.0, 0.0], [1.0, -1.0], [0.0, 0.0]], np.float32)
    c = shadow_compare.compare("embedding", primary, shadow)
    assert c.similarity == pytest.approx([1.0, 0.0, 1.0])
    assert c.agree.tolist() == [True, False, True]
    assert c.difference == pytest.approx([0.0, 1.0, 0.0])


def test_outputs_of_other_shapes_cannot_be_compared() -> None:
    with pytest.raises(ValueError, match="cannot be compared"):
        shadow_compare.compare("classification", np.zeros((2, 3)), np.zeros((2, 4)))


def pair(
    primary: np.ndarray, shadow: np.ndarray | None, *, status: int = 200, at: float = 6000.0, keep_sample: bool = True
) -> Pair:
    rows = primary.shape[0]
    item = Mirrored(
        "classification",
        version(1),
        version(2),
        {"input": np.arange(rows * 64, dtype=np.float32).reshape(rows, 64)},
        rows,
        100,
        {"scores": primary},
        0.002,
        0.0,
        1.0,
        at,
        keep_sample,
    )
    return Pair(
        item,
        None if shadow is None else {"scores": shadow},
        status,
        0.004,
        "" if shadow is not None else "model failed on this input",
    )


def test_aggregate_sums_a_minute_and_keeps_a_bounded_sample_with_inputs() -> None:
    eye = np.eye(10, dtype=np.float32)
    agreeing = pair(eye[:4], eye[:4])
    disagreeing = pair(eye[:3], eye[[3, 4, 5]])
    failed = pair(eye[:1], None, status=422)
    many = [pair(eye[:10], np.roll(eye[:10], 1, axis=1)) for _ in range(5)]  # 50 disagreeing rows
    rows, samples = shadow_compare.aggregate([agreeing, disagreeing, failed, *many])
    (row,) = rows
    assert (row["model"], row["baseline"], row["candidate"], row["minute"]) == ("m", 1, 2, 100)
    assert (row["mirrored"], row["shadow_errors"], row["compared"], row["agreed"]) == (8, 1, 57, 4)
    assert row["confusion"]["0,3"] == 1 and row["confusion"]["0,0"] == 1 + 0
    assert row["statuses"] == {"422": 1}
    # latency counts the pairs both sides answered: the failed one has no device time to compare
    assert sum(row["primary_latency"].values()) == sum(row["shadow_latency"].values()) == 7
    # the sample is bounded per flush, and each disagreement carries its row's inputs and both outputs
    assert len(samples) == shadow_compare.SAMPLES_PER_FLUSH
    (failure,) = [s for s in samples if s["summary"].startswith("shadow failed (422)")]
    assert failure["shadow"] is None and failure["inputs"] == {"input": [list(range(64))]}  # the whole request
    first = next(s for s in samples if s["summary"].startswith("class "))
    assert first["summary"] == "class 0 vs 3"
    assert first["inputs"] == {"input": list(range(64))}
    assert first["primary"] == eye[0].tolist() and first["shadow"] == eye[3].tolist()
    # the rows of the fourth pair (the first of `many`) map back to their own inputs
    later = [s for s in samples if s["summary"].startswith("class ")][3]
    assert later["summary"] == "class 0 vs 1" and later["inputs"] == {"input": list(range(64))}


def test_bf16_answers_are_compared_and_kept_as_their_values_not_their_bits() -> None:
    # BF16 travels as its bits (uint16). Read as integers, 0.5 against 0.25 is 16128 against 16000: a
    # regression "difference" of 128 and a class picked by bit order, not value.
    signature = {"outputs": (TensorSpec("scores", "BF16", (3,)),)}
    bits = np.array([[0x3F00, 0x3E80, 0xBF80]], dtype=np.uint16)  # 0.5, 0.25, -1.0
    shifted = np.array([[0x3F00, 0x3F80, 0xBF80]], dtype=np.uint16)  # 0.5, 1.0, -1.0
    item = pair(bits, shifted)
    item.item.baseline = replace(version(1), **signature)
    item.item.candidate = replace(version(2), **signature)
    item.item.task = "regression"
    (row,), (sample,) = shadow_compare.aggregate([item])
    assert row["compared"] == 1 and row["agreed"] == 0
    assert row["abs_max"] == pytest.approx(0.75)
    assert sample["primary"] == [0.5, 0.25, -1.0] and sample["shadow"] == [0.5, 1.0, -1.0]


def test_vectorised_buckets_are_the_sketchs() -> None:
    values = np.concatenate([[0.0, 1e-5, 1e-4, 1.5e-4], np.geomspace(1e-4, 1e3, 500)])
    assert shadow_compare.buckets_of(values).tolist() == [bucket_of(float(v)) for v in values]


# -- the mirror's sampling and bounds -------------------------------------------------------------


def test_sampling_is_deterministic_and_exact() -> None:
    mirror = Mirror(transport=None)  # type: ignore[arg-type]
    entry = model(fraction=0.25)
    chosen = [mirror.candidate(entry, entry.versions[1]) is not None for _ in range(100)]
    assert sum(chosen) == 25
    assert chosen[:8] == [False, False, False, True] * 2
    # requests the shadow serves itself (pinned to it) are not mirrored to it
    assert mirror.candidate(model(fraction=1.0), version(2)) is None


def test_a_shadow_that_is_not_ready_is_skipped_and_counted() -> None:
    mirror = Mirror(transport=None, ready=lambda key: key != "m:2")  # type: ignore[arg-type]
    before = dropped("not_ready")
    assert mirror.candidate(model(), version(1)) is None
    assert dropped("not_ready") == before + 1


def test_a_shadow_with_other_inputs_is_skipped_and_counted() -> None:
    from dataclasses import replace

    entry = model()
    entry.versions[2] = replace(version(2), inputs=(TensorSpec("input", "FP32", (32,)),))
    before = dropped("incompatible")
    assert Mirror(transport=None).candidate(entry, entry.versions[1]) is None  # type: ignore[arg-type]
    assert dropped("incompatible") == before + 1


def test_a_full_mirror_queue_drops_and_counts_by_items_and_by_bytes() -> None:
    mirror = Mirror(transport=None, max_items=2, max_bytes=1000)  # type: ignore[arg-type]
    before = dropped("queue_full")
    args = ("classification", version(1), version(2), {}, 1)
    assert mirror.offer(*args, 400, {}, 0.0) and mirror.offer(*args, 400, {}, 0.0)
    assert not mirror.offer(*args, 10, {}, 0.0)  # a third item
    assert (len(mirror.queue), mirror.queued_bytes) == (2, 800)
    mirror.take()
    assert not mirror.offer(*args, 700, {}, 0.0)  # room for an item, not for its bytes
    assert mirror.offer(*args, 600, {}, 0.0)
    assert dropped("queue_full") == before + 2


def test_the_mirror_queue_bounds_the_answers_it_holds_too() -> None:
    # given a queue of 1000 bytes, and requests of 100 bytes whose primary answered 400 bytes each
    mirror = Mirror(transport=None, max_bytes=1000)  # type: ignore[arg-type]
    args = ("classification", version(1), version(2), {}, 1, 100)
    answer = {"scores": np.zeros(100, np.float32)}
    # then two fit, and a third is dropped: the queue holds 1000 bytes, not the 300 of their requests
    assert mirror.offer(*args, answer, 0.0) and mirror.offer(*args, answer, 0.0)
    assert not mirror.offer(*args, answer, 0.0)
    assert mirror.queued_bytes == 1000
    mirror.take()
    assert mirror.queued_bytes == 500


def test_mirrors_queued_together_travel_in_one_call_up_to_a_batch() -> None:
    mirror = Mirror(transport=None)  # type: ignore[arg-type]
    shadow, other = version(2), version(3)

    def offer(rows: int, candidate: VersionEntry = shadow, width: int = 64) -> None:
        inputs = {"input": np.zeros((rows, width), np.float32)}
        assert mirror.offer("classification", version(1), candidate, inputs, rows, 10, {}, 0.0)

    for rows in (3, 4, 2, 1):  # the batch holds 8: 3 + 4, then 2 + 1
        offer(rows)
    offer(1, other)  # another candidate travels apart
    offer(1, width=32)  # and so do inputs that do not stack
    batches = [[i.rows for i in mirror.take_batch()] for _ in range(4)]
    assert batches == [[3, 4], [2, 1], [1], [1]]
    assert not mirror.queue and mirror.queued_bytes == 0


class _Answering:
    """A transport answering every call as a node does: the outputs and the batch's device seconds."""

    def __init__(self, compute: float) -> None:
        self.compute = compute

    async def infer(self, entry, inputs, rows, deadline, priority, **kw):  # noqa: ANN001, ANN003, ANN201
        return Outputs({"scores": np.eye(10, dtype=np.float32)[:rows]}, self.compute)


async def test_stacked_mirrors_share_their_calls_device_seconds_by_rows() -> None:
    # given mirrors of 1 and 3 rows stacked into one call that took 8 ms of device time
    mirror = Mirror(transport=_Answering(0.008))  # type: ignore[arg-type]
    eye = np.eye(10, dtype=np.float32)
    for rows, primary_compute in ((1, 0.001), (3, 0.005)):
        mirror.offer(
            "classification",
            version(1),
            version(2),
            {"input": np.zeros((rows, 64), np.float32)},
            rows,
            10,
            {"scores": eye[:rows]},
            primary_compute,
        )
    # when they are sent together
    await mirror.send(mirror.take_batch())
    # then each keeps its rows' share of the call, beside its primary's own device seconds
    kept = mirror.drain()
    assert [p.shadow_compute for p in kept] == pytest.approx([0.002, 0.006])
    assert [p.item.primary_compute for p in kept] == [0.001, 0.005]


def test_the_pair_buffer_is_bounded_and_drained_whole() -> None:
    mirror = Mirror(transport=None, max_pairs=2)  # type: ignore[arg-type]
    before = dropped("uncompared")
    eye = np.eye(10, dtype=np.float32)
    for _ in range(3):
        mirror.keep(pair(eye[:1], eye[:1]))
    assert len(mirror.pairs) == 2 and dropped("uncompared") == before + 1
    assert len(mirror.drain()) == 2 and mirror.pairs == [] and mirror.pair_bytes == 0


# -- the lowest tier -------------------------------------------------------------------------------


@pytest.mark.parametrize("completion", [0.21, 0.3, 0.39])
def test_admission_refuses_a_mirror_where_every_callers_tier_is_admitted(completion: float) -> None:
    # given a backlog that any caller's tier (1 to 3, and any priority a caller may ask for) still fits
    for tier in (1, 2, 3, SHADOW_PRIORITY - 1):
        assert admission.decide(now=0.0, deadline=1.0, priority=tier, completion=completion).admit
    # then the mirror, at the shadow's tier, is refused first
    verdict = admission.decide(now=0.0, deadline=1.0, priority=SHADOW_PRIORITY, completion=completion)
    assert not verdict.admit and verdict.reason == "tier"
    assert tier_share(SHADOW_PRIORITY) < min(tier_share(p) for p in range(1, SHADOW_PRIORITY))


def test_callers_cannot_ask_for_the_shadows_tier() -> None:
    assert _priority({"priority": 50}, 1) == SHADOW_PRIORITY - 1
    assert _priority({}, 3) == 3


def test_a_full_queue_evicts_mirrors_for_a_callers_request() -> None:
    queue = BatchQueue(BatchingConfig(max_batch_size=4, max_queue_delay=0.01, max_queue_size=8))
    for i in range(2):  # the shadow tier may fill a quarter of the queue
        queue.put(Pending(f"mirror{i}", 1, 0.0, 10.0, SHADOW_PRIORITY, 0))
    with pytest.raises(Exception, match="queue full"):
        queue.put(Pending("mirror2", 1, 0.0, 10.0, SHADOW_PRIORITY, 0))
    for i in range(6):  # callers fill the rest
        assert queue.put(Pending(f"caller{i}", 1, 0.0, 10.0, 1, 0)) == []
    # when the queue is full, a caller's request takes a mirror's place, the newest first
    assert [p.payload for p in queue.put(Pending("caller6", 1, 0.0, 10.0, 1, 0))] == ["mirror1"]
    assert [p.payload for p in queue.put(Pending("caller7", 1, 0.0, 10.0, 1, 0))] == ["mirror0"]


# -- the gateway, on a real node with the digits model ----------------------------------------------


@pytest.fixture
async def digits_node(model_files):  # noqa: ANN001, ANN201
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    for v in (1, 2):
        assert await node.load(version(v)) is not None
    yield node
    await node.close()


def digits_body(rows: int) -> bytes:
    data = np.random.default_rng(rows).uniform(0, 16, (rows, 64)).astype(np.float32)
    return orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 64], "data": data.ravel().tolist()}]}
    )


# The gateway tests below check what is mirrored, not how fast: a mirror's deadline is its candidate's budget
# from the moment it is offered, and the platform's 300 ms passed on a loaded machine (a load average of 20 on
# 2 cores) before the queued mirror ran, so it was dropped as expired and no pair was left. A budget no busy
# machine exhausts, as these tests do not check the deadline.
UNHURRIED_MS = 60_000


def gateway_over(node: Node, mirror: Mirror, routes: ModelEntry) -> Gateway:
    hub = SnapshotHub()
    hub.set(RoutingSnapshot(serial=1, built_at=0.0, models={"m": routes}, latency_budget_ms=UNHURRIED_MS))
    return Gateway(hub, mirror.transport, ready=node.is_ready, mirror=mirror)


async def test_a_full_mirror_queue_never_holds_or_fails_the_primary(digits_node: Node) -> None:
    # given a mirror whose queue holds one request and whose workers are not running, so nothing drains it
    mirror = Mirror(InProcessTransport(digits_node), max_items=1, ready=digits_node.is_ready)
    gateway = gateway_over(digits_node, mirror, model(fraction=1.0, timeout_ms=UNHURRIED_MS))
    before = dropped("queue_full")
    # when five requests are answered, each of them due a mirror
    replies = [await gateway.infer("m", None, digits_body(2), None, None) for _ in range(5)]
    # then every caller got version 1's answer, one mirror waits and four were dropped and counted
    assert [r.status for r in replies] == [200] * 5
    assert all(orjson.loads(r.body)["model_version"] == "1" for r in replies)
    assert len(mirror.queue) == 1 and dropped("queue_full") == before + 4
    # and the waiting mirror, once sent, leaves a pair of identical answers (same weights in both versions)
    late = dropped("expired") + dropped("shed")
    await mirror.send([mirror.take()])
    pairs = mirror.drain()
    assert len(pairs) == 1, f"{dropped('expired') + dropped('shed') - late:.0f} dropped as expired or shed"
    (kept,) = pairs
    assert kept.shadow_status == 200 and kept.item.baseline.version == 1 and kept.item.candidate.version == 2
    # both sides' latency is the node's device time for the request, measured alike
    assert kept.item.primary_compute > 0 and kept.shadow_compute > 0
    np.testing.assert_allclose(kept.shadow["scores"], kept.item.primary["scores"], rtol=1e-5)


async def test_workers_mirror_every_request_at_the_shadow_tier(digits_node: Node) -> None:
    # given a started mirror at 100%
    seen: list[tuple[int, int]] = []
    transport = InProcessTransport(digits_node)
    original = transport.infer

    async def watching(entry, inputs, rows, deadline, priority, **kw):  # noqa: ANN001, ANN202
        if entry.version == 2:
            seen.append((priority, rows))
        return await original(entry, inputs, rows, deadline, priority, **kw)

    transport.infer = watching  # type: ignore[method-assign]
    mirror = Mirror(transport, workers=2, ready=digits_node.is_ready)
    gateway = gateway_over(digits_node, mirror, model(fraction=1.0, timeout_ms=UNHURRIED_MS))
    mirror.start()
    try:
        for _ in range(6):
            assert (await gateway.infer("m", None, digits_body(1), None, None)).status == 200
        # the workers finish within a few batches: seconds on a machine with a core to spare, more on a busy one
        await eventually("six mirrors compared", lambda: len(mirror.pairs) == 6, timeout=10.0)
    finally:
        await mirror.stop()
    # then each was sent once (those queued together in one call), at the shadow's tier, and compared equal
    assert {priority for priority, _ in seen} == {SHADOW_PRIORITY}
    assert sum(rows for _, rows in seen) == 6
    rows, _ = shadow_compare.aggregate(mirror.drain())
    assert sum(r["compared"] for r in rows) == sum(r["agreed"] for r in rows) == 6


async def test_the_node_runs_a_batch_of_mirrors_only_when_no_callers_work_waits() -> None:
    from tests.test_admission import Clock, StandIn, entry, rows

    order: list[str] = []

    class Recording(StandIn):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def run(self, requests):  # noqa: ANN001, ANN201
            order.append(self.name)
            return super().run(requests)

    # given a node with a caller's version and a shadow version, their batchers driven by hand
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    caller = node.host(entry("caller"), Recording("caller"), {1: 0.001, 8: 0.001}, start=False)
    shadow = node.host(entry("shadow"), Recording("shadow"), {1: 0.001, 8: 0.001}, start=False)
    try:
        mirrored = asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 100, SHADOW_PRIORITY))
        called = asyncio.ensure_future(node.infer("caller:1", rows(1), 1, clock.now + 100, 1))
        await asyncio.sleep(0)
        # when the shadow's batch is due while a caller's request is queued on the other version
        clock.now += 20  # past both batch windows (10 s)
        shadow_step = asyncio.ensure_future(shadow.batcher.process_one_batch())
        for _ in range(20):
            await asyncio.sleep(0)
        # then it holds the device back: nothing has run
        assert order == [] and not shadow_step.done()
        # and once the caller's batch has run, the mirrors' follows
        assert await caller.batcher.process_one_batch()
        assert await asyncio.wait_for(shadow_step, 10)
        assert order == ["caller", "shadow"]
        assert (await called)["scores"].shape == (await mirrored)["scores"].shape == (1, 2)
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)


async def test_mirrors_run_ahead_of_callers_work_that_is_not_due_before_they_finish() -> None:
    from tests.test_admission import Clock, StandIn, entry, rows

    order: list[str] = []

    class Recording(StandIn):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def run(self, requests):  # noqa: ANN001, ANN201
            order.append(self.name)
            return super().run(requests)

    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    caller = node.host(entry("caller"), Recording("caller"), {1: 0.001, 8: 0.001}, start=False)
    shadow = node.host(entry("shadow"), Recording("shadow"), {1: 0.001, 8: 0.001}, start=False)
    try:
        # given mirrors past their window, and a caller's request that has just arrived (its 10 s window open)
        mirrored = asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 100, SHADOW_PRIORITY))
        await asyncio.sleep(0)
        clock.now += 20
        called = asyncio.ensure_future(node.infer("caller:1", rows(1), 1, clock.now + 100, 1))
        await asyncio.sleep(0)
        # when the mirrors' batch is due: it runs at once, finishing (1 ms) long before the caller's is due
        assert await asyncio.wait_for(shadow.batcher.process_one_batch(), 10)
        assert order == ["shadow"] and not called.done()
        await mirrored
        clock.now += 20
        assert await caller.batcher.process_one_batch()
        await called
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)


async def test_mirrors_run_in_the_parts_that_fit_before_callers_work_comes_due() -> None:
    from tests.test_admission import Clock, StandIn, entry, rows

    order: list[tuple[str, int]] = []

    class Recording(StandIn):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        def run(self, requests):  # noqa: ANN001, ANN201
            order.append((self.name, sum(r["input"].shape[0] for r in requests)))
            return super().run(requests)

    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    caller = node.host(entry("caller"), Recording("caller"), {1: 0.001, 8: 0.001}, start=False)
    # a shadow whose one-row batch takes 1 s and two rows 30 s (the clock is the test's)
    shadow = node.host(entry("shadow"), Recording("shadow"), {1: 1.0, 2: 30.0}, start=False)
    try:
        # given two one-row mirrors past their window, and a caller's request due 5 s from now
        mirrored = [
            asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 1000, SHADOW_PRIORITY))
            for _ in range(2)
        ]
        await asyncio.sleep(0)
        clock.now += 15
        called = asyncio.ensure_future(node.infer("caller:1", rows(1), 1, clock.now + 100, 1))
        await asyncio.sleep(0)
        clock.now += 5
        # when the mirrors' batch is due: both together (30 s) would delay the caller, each alone (1 s) not
        assert await asyncio.wait_for(shadow.batcher.process_one_batch(), 10)
        # then each ran in its own part, ahead of the caller, who was not held up
        assert order == [("shadow", 1), ("shadow", 1)] and not called.done()
        await asyncio.gather(*mirrored)
        clock.now += 20
        assert await caller.batcher.process_one_batch()
        await called
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)


def test_a_stacked_mirror_call_computes_within_the_candidates_window() -> None:
    profiled = replace(
        version(2),
        latency_profile={1: 0.0016, 2: 0.0029, 4: 0.0053, 8: 0.0103},
        batching=BatchingConfig(max_batch_size=8, max_queue_delay=0.005, max_queue_size=64),
    )
    assert stack_rows(profiled) == 2
    slow = replace(profiled, latency_profile={1: 0.02, 8: 0.05})
    assert stack_rows(slow) == 1  # even one row is over the window: one at a time
    assert stack_rows(version(2)) == 8  # no profile yet: a full batch


async def test_a_caller_queued_behind_mirrors_on_their_own_version_lets_them_go() -> None:
    from tests.test_admission import Clock, StandIn, entry, rows

    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    other = node.host(entry("other"), StandIn(), {1: 0.001, 8: 0.001}, start=False)
    shadow = node.host(entry("shadow"), StandIn(), {1: 0.001, 8: 0.001}, start=False)
    try:
        # given mirrors held back by callers' work due on another version
        mirrored = asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 100, SHADOW_PRIORITY))
        waiting = asyncio.ensure_future(node.infer("other:1", rows(1), 1, clock.now + 100, 1))
        await asyncio.sleep(0)
        clock.now += 20
        shadow_step = asyncio.ensure_future(shadow.batcher.process_one_batch())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not shadow_step.done()
        # when a caller's request (pinned to the shadow version) queues behind them
        pinned = asyncio.ensure_future(node.infer("shadow:1", rows(1), 1, clock.now + 100, 1))
        # then the mirrors go at once, so the caller's batch is next
        assert await asyncio.wait_for(shadow_step, 10)
        await mirrored
        assert not pinned.done() and shadow.batcher.queue.rows == 1
        clock.now += 20
        assert await other.batcher.process_one_batch() and await shadow.batcher.process_one_batch()
        await asyncio.gather(waiting, pinned)
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)


async def test_a_mirror_never_loads_a_version_that_is_not_loaded() -> None:
    from serving.dataplane.errors import Shed

    node = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    try:
        with pytest.raises(Shed, match="mirrors do not load it") as refused:
            await node.infer("m:2", {"input": np.zeros((1, 64), np.float32)}, 1, 1e12, SHADOW_PRIORITY)
        assert refused.value.reason == "not_loaded" and not node.hosted
    finally:
        await node.close()
