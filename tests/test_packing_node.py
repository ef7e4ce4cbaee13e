"""The node's side of packing (serving.dataplane.node.packing and the node's loads), on the real digits model and
without a server: estimates, the load queue, what eviction spares, and the placement facts in Redis snapshots."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import orjson
import pytest

from serving.dataplane.errors import Unavailable
from serving.dataplane.gateway.snapshot import ModelEntry, PlacementEntry, RoutingSnapshot, VersionEntry
from serving.dataplane.gateway.snapshot_redis import decode, encode
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node.node import Node, warmup_sizes
from serving.dataplane.node.packing import DEFAULT_COLD_START, Packing, Ticket
from serving.policies.batching import BatchingConfig


def digits(name: str, sha: str = "a" * 64, **placement: object) -> VersionEntry:
    return VersionEntry(
        model=name,
        version=1,
        state="ready",
        loaded=True,
        artifact_sha256=sha,
        format="torchscript",
        inputs=(TensorSpec("input", "FP32", (64,)),),
        outputs=(TensorSpec("scores", "FP32", (10,)),),
        batching=BatchingConfig(8, 0.0, 100),
        default_timeout_ms=1000,
        latency_profile={1: 0.001, 8: 0.002},
        placement=PlacementEntry(**placement),  # type: ignore[arg-type]
    )


def x(rows: int = 1) -> dict[str, np.ndarray]:
    return {"input": np.zeros((rows, 64), np.float32)}


# -- estimates ------------------------------------------------------------------------------------------


def test_cold_start_estimates_prefer_what_is_closest_to_this_node() -> None:
    packing = Packing("a10g", warmup_sizes)
    # nothing known: the default
    assert packing.cold_start(digits("m")) == DEFAULT_COLD_START
    # validation's load time plus the warm-up its profile implies (sizes 1, 2, 4, 8; four runs each)
    validated = digits("m", load_seconds=0.5)
    assert packing.cold_start(validated) == pytest.approx(0.5 + 4 * (0.001 + 0.002))
    # another version of the same artifact measured here beats validation's
    packing.measure(digits("other"), 100, 0.25)
    assert packing.cold_start(validated) == 0.25
    # what a node of this accelerator type reported beats that (another type's report does not count)
    reported = digits("m", load_seconds=0.5, measured=(("h100", 1, 9.0), ("a10g", 1, 3.0)))
    assert packing.cold_start(reported) == 3.0
    # and this node's own measurement of the version beats everything
    packing.measure(reported, 100, 0.125)
    assert packing.cold_start(reported) == 0.125
    assert packing.footprint(reported) == 100


def test_footprint_estimates_before_a_measurement() -> None:
    packing = Packing("a10g", warmup_sizes)
    assert packing.footprint(digits("m", memory_bytes=5)) == 5
    assert packing.footprint(digits("m", memory_bytes=5, measured=(("a10g", 7, 1.0),))) == 7


def test_a_load_waits_for_the_loads_queued_ahead_of_it() -> None:
    async def scenario() -> None:
        packing = Packing("a10g", warmup_sizes)
        never = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(never)
        packing.loading["a:1"] = Ticket(task, 2.0, started=100.0)  # running for 0.5 s at 100.5
        packing.loading["b:1"] = Ticket(task, 1.0)
        packing.loading["c:1"] = Ticket(task, 3.0)
        assert packing.remaining(100.5, "a:1") == 1.5
        assert packing.remaining(100.5, "b:1") == 2.5
        assert packing.remaining(100.5) == 5.5
        assert packing.remaining(110.0, "a:1") == 0.0  # overdue: expected any moment
        task.cancel()

    asyncio.run(scenario())


# -- loads ----------------------------------------------------------------------------------------------


async def test_a_busy_version_is_not_evicted_even_when_least_recently_used(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    try:
        first = await node.load(digits("one"))
        assert first is not None
        node.memory_budget = int(first.runtime.memory_bytes * 2.5)
        assert await node.load(digits("two")) is not None
        first.last_used, node.hosted["two:1"].last_used = 1.0, 2.0  # one is the least recently used
        first.in_flight = 1  # but has work queued or running
        # when a third needs room
        third = await node.load(digits("three"))
        # then the idle one goes, though used more recently
        assert third is not None and set(node.hosted) == {"one:1", "three:1"}
        assert [(e.kind, e.key) for e in node.packing.events if e.kind == "evict"] == [("evict", "two:1")]
        assert "two:1" in node.packing.cold and node.routable("two:1") and not node.is_ready("two:1")
    finally:
        await node.close()


async def test_without_eviction_a_version_that_does_not_fit_stays_cold(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    try:
        first = await node.load(digits("one"))
        assert first is not None
        node.memory_budget = int(first.runtime.memory_bytes * 1.5)
        # when a reconcile-style load (no eviction) does not fit
        assert await node.load(digits("two", memory_bytes=first.runtime.memory_bytes), evict=False) is None
        # then nothing was evicted and it waits cold, with no failure recorded
        assert set(node.hosted) == {"one:1"} and "two:1" in node.packing.cold and "two:1" not in node.failures
    finally:
        await node.close()


async def test_a_full_load_queue_refuses_with_retry_after(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu", max_queued_loads=1)
    try:
        node.packing.cold["one:1"] = digits("one")
        node.packing.cold["two:1"] = digits("two")
        waiting = asyncio.ensure_future(node.infer("one:1", x(), 1, node._clock() + 30, 1))
        await asyncio.sleep(0)  # its load is queued
        with pytest.raises(Unavailable) as refused:
            await node.infer("two:1", x(), 1, node._clock() + 30, 1)
        assert "already loading 1 versions" in refused.value.message and refused.value.retry_after >= 1
        assert (await waiting)["scores"].shape == (1, 10)
    finally:
        await node.close()


# -- Redis ----------------------------------------------------------------------------------------------


def test_placement_facts_survive_redis_encoding() -> None:
    entry = digits(
        "m",
        memory_bytes=10,
        load_seconds=0.5,
        measured=(("a10g", 12, 0.75),),
        min_memory=1 << 30,
        accelerators=frozenset({"a10g", "h100"}),
        pinned=True,
        min_replicas=2,
        unschedulable="why",
    )
    snapshot = RoutingSnapshot(serial=3, built_at=1.0, models={"m": ModelEntry("m", "t", "", None, {1: entry})})
    assert decode(encode(snapshot)).models["m"].versions[1] == entry
    # a publisher that predates placement sends none: the defaults
    doc = orjson.loads(encode(snapshot))
    del doc["models"]["m"]["versions"]["1"]["placement"]
    assert decode(orjson.dumps(doc)).models["m"].versions[1] == dataclasses.replace(entry, placement=PlacementEntry())


async def test_a_load_queued_behind_cannot_evict_the_one_its_waiters_are_about_to_use(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    try:
        first = await node.load(digits("probe"))
        assert first is not None
        footprint = first.runtime.memory_bytes
        await node.unload("probe:1")
        # given a budget for one version and two cold ones, each asked for at once
        node.memory_budget = int(footprint * 1.5)
        node.packing.cold["x:1"] = digits("x", memory_bytes=footprint)
        node.packing.cold["y:1"] = digits("y", memory_bytes=footprint)
        x_answer = asyncio.ensure_future(node.infer("x:1", x(), 1, node._clock() + 30, 1))
        y_answer = asyncio.ensure_future(node.infer("y:1", x(), 1, node._clock() + 30, 1))
        # when x's load lands, y's (queued behind it) runs before x's caller resumes
        done = await asyncio.gather(x_answer, y_answer, return_exceptions=True)
        # then x's caller is served: its version was held for it, so y found no room instead of evicting it
        assert not isinstance(done[0], BaseException), done[0]
        assert done[0]["scores"].shape == (1, 10)
        assert isinstance(done[1], Unavailable) and "could not be loaded" in done[1].message
        assert not [e for e in node.packing.events if e.kind == "evict"]
        assert node.hosted["x:1"].in_flight == 0
    finally:
        await node.close()


async def test_an_evicted_version_stays_warm_in_host_memory_within_its_budget(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    try:
        first = await node.load(digits("one"))
        assert first is not None
        size = first.runtime.memory_bytes
        runtime = first.runtime  # its loaded model (in its runtime process) is what the warm tier keeps
        child = getattr(runtime, "process", None)
        # given room for one version on the device and for one in host memory
        node.memory_budget = int(size * 1.5)
        node.warm_budget = int(size * 1.5)
        # when a second version evicts the first
        assert await node.load(digits("two")) is not None
        # then the first is warm: its loaded module kept, not dropped (its runtime process too)
        assert set(node.hosted) == {"two:1"} and set(node.warm) == {"one:1"}
        assert node.warm["one:1"].runtime is runtime and runtime.loaded
        assert getattr(runtime, "process", None) is child
        # and its reload takes that module back (no artifact read), evicting the second into the warm tier
        # (the first leaves it: the budget holds one)
        node.hosted["two:1"].last_used = 0.0
        again = await node.load(digits("one"))
        assert again is not None and again.runtime is runtime and getattr(runtime, "process", None) is child
        assert set(node.warm) == {"two:1"}
        assert [e.detail.startswith("from host memory") for e in node.packing.events if e.kind == "load"] == [
            False,
            False,
            True,
        ]
        out = await node.infer("one:1", x(), 1, node._clock() + 5, 0)
        assert out["scores"].shape == (1, 10)
        # a version whose artifact changed is not taken from the warm tier
        node.hosted["one:1"].last_used = 0.0
        kept = node.warm["two:1"].runtime
        changed = await node.load(digits("two", sha="b" * 64))
        assert changed is not None and changed.runtime is not kept and not kept.loaded
        assert not [e for e in node.packing.events if e.kind == "load"][-1].detail.startswith("from host memory")
    finally:
        await node.close()


async def test_without_a_warm_budget_an_evicted_version_is_dropped(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    try:
        first = await node.load(digits("one"))
        assert first is not None
        node.memory_budget = int(first.runtime.memory_bytes * 1.5)
        assert await node.load(digits("two")) is not None
        assert node.warm == {} and not first.runtime.loaded
    finally:
        await node.close()


async def test_an_unload_answers_what_is_queued_before_the_module_goes(model_files) -> None:  # noqa: ANN001
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu")
    try:
        # given a loaded version with requests queued behind the batch in flight (batches of up to 8 rows)
        assert await node.load(digits("probe")) is not None
        answers = [asyncio.ensure_future(node.infer("probe:1", x(), 1, node._clock() + 30, 1)) for _ in range(40)]
        await asyncio.sleep(0)  # each request is queued
        assert node.queue_depth("probe:1") > 8
        # when the version is unloaded, twice at once (a reconcile and a release, say)
        await asyncio.wait_for(asyncio.gather(node.unload("probe:1"), node.unload("probe:1")), 5)
        # then both return once the queue is worked off (neither waits out the drain's 10 s bound), every
        # request queued before the unload was answered, none refused; the version is gone
        done = await asyncio.gather(*answers, return_exceptions=True)
        assert [d for d in done if isinstance(d, BaseException)] == []
        assert all(d["scores"].shape == (1, 10) for d in done)
        assert not node.is_ready("probe:1")
    finally:
        await node.close()
