"""What a node's and placement's messages say to a tenant, and how a batch's failures are answered.

- A tenant reads its own versions' evictions and refusals (the fleet page, /v2/repository/index, a 503) without
  the names of the versions that took or hold the room: they may be another tenant's private ones.
- In a batch's path, only the device's or the runtime machinery's failures (out of memory, a lost device) are 503;
  a bug there is a 500, logged and counted, for every request of the batch not yet answered, never a 503 that
  invites a retry and the fallback, nor a wait for the deadline (504).
- The gateway answers a node's reply that lacks an output asked for with 500: a bug, not a refusal.

Stand-in runtimes (tests.test_admission) on a fake clock: no model, no process, no timing assertion.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout.routing import RouteTable
from serving.dataplane.errors import ServingError, Unavailable
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub
from serving.dataplane.http.consumers import load_failure, repository_state
from serving.dataplane.metrics.metrics import INTERNAL_ERRORS
from serving.dataplane.node.batcher import Batcher
from serving.dataplane.node.node import EVICTED_LRU, Node, device_error
from serving.dataplane.node.runtime import RuntimeFailure
from serving.dataplane.transport.fleet_events import FleetEvent
from serving.fleet_state import embedded_info, node_doc, scoped
from serving.policies.batching import BatchingConfig, BatchQueue, Pending
from serving.policies.placement import HELD, NodeState, Resident, VersionSpec, fit
from tests.test_admission import Clock, StandIn, entry, rows

GUARD = 10.0  # seconds; only a hang guard, never a timing assertion


def internal_errors(component: str) -> float:
    return INTERNAL_ERRORS.labels(component)._value.get()


# -- what a tenant reads about room on a node ------------------------------------------------------------------


def test_a_refusal_for_want_of_room_counts_the_versions_holding_it_without_naming_them() -> None:
    # given a node whose memory other versions hold: one pinned, one serving requests
    node = NodeState(
        "n1",
        "cpu",
        100,
        {
            "secret:1": Resident(VersionSpec("secret:1", 50, pinned=True), last_used=0.0),
            "other:3": Resident(VersionSpec("other:3", 40), last_used=0.0, in_flight=2),
        },
    )
    # when a version needs more than is free / then it is refused, transiently, with a count and no names
    verdict = fit(VersionSpec("mine:1", 30), node, now=10.0)
    assert not verdict.fits and verdict.constraint == HELD and verdict.short_bytes == 20
    assert "held by 2 other versions that must stay" in verdict.reason
    assert "secret" not in verdict.reason and "other:3" not in verdict.reason
    assert verdict.reason.startswith("mine:1 needs")  # its own name it may read


class Loadable(StandIn):
    """A stand-in runtime a node loads through its factory: 100 bytes, profiled at once."""

    def __init__(self, *_: object) -> None:
        super().__init__(memory_bytes=100)

    def load(self) -> None:
        self.loaded = True

    def profile(self, sizes, repeats: int = 3) -> dict[int, float]:  # noqa: ANN001
        return dict.fromkeys(sizes, 0.001)


async def test_a_tenant_whose_version_was_evicted_for_another_tenants_reads_no_name_of_it() -> None:
    # given a node with room for one version, holding tenant A's `mine:1`
    clock = Clock()
    node = Node(
        artifact_path=lambda sha: Path("/nonexistent"),
        device="cpu",
        clock=clock,
        memory_budget=150,
        runtime_factory=Loadable,
    )
    mine, secret = entry("mine"), entry("secret")
    try:
        assert await node.load(mine) is not None
        clock.now += 10
        # when tenant B's private `secret:1` loads, evicting it (least recently used)
        hosted = await node.load(secret)
        assert hosted is not None and set(node.hosted) == {"secret:1"}
        # and then a request for `mine:1` finds the room held (the other version has work in flight)
        hosted.in_flight = 1
        with pytest.raises(Unavailable) as refused:
            await node.infer("mine:1", rows(1), 1, clock.now + 30, 1)
        # then the eviction says why without naming what took the room
        evicted = [e for e in node.packing.events if e.kind == "evict"]
        assert [(e.key, e.detail) for e in evicted] == [("mine:1", EVICTED_LRU)]
        # and neither the refusal's 503 nor the reason the repository index gives names it
        assert refused.value.status == 503 and "held by 1 other version" in refused.value.message
        assert "secret" not in refused.value.message
        plane = SimpleNamespace(node=node)
        assert repository_state(plane, mine) == "UNAVAILABLE"
        assert load_failure(plane, mine).startswith("cold: no room now") and "secret" not in load_failure(plane, mine)
        # and the fleet as tenant A sees it (`/api/fleet/`, the socket) holds the name nowhere
        now = time.time()
        state = {
            "at": now,
            "nodes": [node_doc(embedded_info(node, now), "live", now)],
            "events": [FleetEvent.of("n1", e).to_doc() for e in node.packing.events],
            "versions": [{"key": v.key, "state": "", "reason": load_failure(plane, v)} for v in (mine, secret)],
        }
        seen = scoped(state, {"mine"})
        assert {e["kind"] for e in seen["events"]} >= {"evict", "no_room"}
        assert "secret" not in json.dumps(seen)
        # while platform staff still see which version is resident, by name
        assert [r["key"] for r in scoped(state, None)["nodes"][0]["resident"]] == ["secret:1"]
    finally:
        await node.close()


# -- a batch's failures ---------------------------------------------------------------------------------------


class Raises(StandIn):
    """Raises `error` on every batch (or only on batches of `on_rows` rows)."""

    def __init__(self, error: BaseException, on_rows: int | None = None) -> None:
        super().__init__()
        self.error = error
        self.on_rows = on_rows

    def run(self, requests):  # noqa: ANN001, ANN201
        if self.on_rows is None or sum(r["input"].shape[0] for r in requests) == self.on_rows:
            raise self.error
        return super().run(requests)


@pytest.fixture
async def node():  # noqa: ANN201
    clock = Clock()
    n = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    n.clock = clock
    yield n
    for hosted in n.hosted.values():
        await hosted.batcher.close()
    n._device_pool.shutdown(wait=False)
    n._load_pool.shutdown(wait=False)


async def run_one_batch(node: Node, runtime: StandIn, n: int = 4, *, start: bool = False) -> list[object]:
    """Queue `n` one-row requests for a version on `runtime` (a batch of `n`), run that batch, and return each
    request's answer or exception."""
    hosted = node.host(entry("v", max_batch=n), runtime, {1: 0.001, n: 0.001}, start=start)
    tasks = [asyncio.ensure_future(node.infer("v:1", rows(1), 1, node.clock.now + 100, 1)) for _ in range(n)]
    await asyncio.sleep(0)
    if not start:
        assert await hosted.batcher.process_one_batch()
    return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), GUARD)


def statuses(results: list[object]) -> list[int]:
    return [getattr(r, "status", 200) for r in results]


async def test_a_bug_in_the_device_path_is_a_500_logged_and_counted_not_a_503(node, caplog) -> None:  # noqa: ANN001
    # given a runtime whose batch fails with an error of this code's, not the device's (a numpy bug, say)
    before = internal_errors("node_batch")
    with caplog.at_level(logging.ERROR, logger="serving.dataplane.node.node"):
        results = await run_one_batch(node, Raises(IndexError("index 4 is out of bounds")))
    # then every request of the batch is answered 500, not a retryable 503 (which the fallback would take)
    assert statuses(results) == [500] * 4
    assert all(type(r) is ServingError and r.retry_after is None for r in results)
    assert "internal error" in results[0].message and "index 4" not in results[0].message
    # and the bug is counted once and logged with its traceback
    assert internal_errors("node_batch") == before + 1
    logged = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None and logged[0].exc_info[0] is IndexError


@pytest.mark.parametrize(
    "error",
    [
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        OSError(errno.EAGAIN, "Resource temporarily unavailable"),  # starting a runtime's process again
        MemoryError(),
    ],
    ids=["cuda-oom", "cuda-error", "fork-eagain", "host-oom"],
)
async def test_a_device_error_fails_its_batch_503_with_retry_after(node, error) -> None:  # noqa: ANN001
    before = internal_errors("node_batch")
    results = await run_one_batch(node, Raises(error))
    assert statuses(results) == [503] * 4
    assert all(isinstance(r, Unavailable) and r.retry_after == 1 for r in results)
    assert internal_errors("node_batch") == before  # not a bug of ours


def test_what_counts_as_a_device_error() -> None:
    assert device_error(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert device_error(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, ...)`"))
    assert device_error(OSError(errno.EMFILE, "Too many open files"))
    # a bug, whatever its type
    assert not device_error(OSError(errno.EBADF, "Bad file descriptor"))
    assert not device_error(RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"))
    assert not device_error(ValueError("zip() argument 2 is shorter than argument 1"))
    assert not device_error(TypeError("unsupported operand"))


async def test_a_bug_while_bisecting_answers_the_rest_of_the_batch_500(node) -> None:  # noqa: ANN001
    # given a model that fails the whole batch (the batch is bisected), and a bug on the halves' runs
    class FailsThenBreaks(StandIn):
        def run(self, requests):  # noqa: ANN001, ANN201
            if len(requests) == 4:
                raise RuntimeFailure("model raised ValueError: bad row")
            raise KeyError("scores")

    before = internal_errors("node_batch")
    results = await run_one_batch(node, FailsThenBreaks())
    # then no request is left to its deadline, none is told 503 or 422: 500 each, one bug counted
    assert statuses(results) == [500] * 4
    assert internal_errors("node_batch") == before + 1


async def test_a_runtime_answer_of_the_wrong_length_answers_no_request_with_another_ones_result(node) -> None:  # noqa: ANN001
    class OneShort(StandIn):
        def run(self, requests):  # noqa: ANN001, ANN201
            return super().run(requests)[:-1]

    before = internal_errors("node_batch")
    results = await run_one_batch(node, OneShort())
    assert statuses(results) == [500] * 4
    assert internal_errors("node_batch") == before + 1


async def test_a_bug_after_the_answers_keeps_them_and_is_still_counted(node, monkeypatch) -> None:  # noqa: ANN001
    # given a bug in the bookkeeping that follows a batch (the node's work meter, say)
    def broken(*args: object) -> None:
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(node.work, "batch", broken)
    before = internal_errors("node_batch")
    results = await run_one_batch(node, StandIn())
    # then the computed answers stand, and the bug is counted
    assert statuses(results) == [200] * 4 and results[0]["scores"].shape == (1, 2)
    assert internal_errors("node_batch") == before + 1


async def test_with_the_batcher_running_a_bug_leaves_no_request_waiting_for_its_deadline(node) -> None:  # noqa: ANN001
    # given a started batcher (its loop, not a test's step) and a runtime with a bug; deadlines 100 s away
    results = await run_one_batch(
        node, Raises(AttributeError("'NoneType' object has no attribute 'shape'")), 2, start=True
    )
    # then both are answered 500 now (wait_for's guard is far below their deadlines), not 504 later
    assert statuses(results) == [500, 500]


async def test_a_batcher_hands_what_a_failed_step_took_from_the_queue_to_on_failed() -> None:
    failed: list[tuple[list[str], str]] = []

    async def run_batch(batch: list[Pending]) -> None:
        raise RuntimeError("bug after the batch was computed")

    queue = BatchQueue(BatchingConfig(2, 100.0, 16))
    batcher = Batcher(
        queue,
        run_batch,
        lambda items: None,
        clock=lambda: 0.0,
        on_failed=lambda items, exc: failed.append(([p.payload for p in items], str(exc))),
    )
    batcher.submit(Pending("a", 1, 0.0, float("inf"), 1))
    batcher.submit(Pending("b", 1, 0.0, float("inf"), 1))
    # when the step fails / then it returns (the batch was taken) and the batch went to on_failed, not lost
    assert await batcher.process_one_batch()
    assert failed == [(["a", "b"], "bug after the batch was computed")]
    assert len(queue) == 0


# -- the gateway ----------------------------------------------------------------------------------------------


class Lacking:
    """A transport whose answer lacks the declared output (a node's or a codec's bug)."""

    async def infer(self, entry, inputs, rows, deadline, priority, **_):  # noqa: ANN001, ANN003, ANN201
        return {"other": np.zeros((rows, 2), np.float32)}


async def test_an_answer_lacking_an_output_is_a_500_logged_and_counted() -> None:
    model = ModelEntry("m", "", "", None, {1: entry("m")}, routes=RouteTable(stable=1))
    snapshot = RoutingSnapshot(serial=1, built_at=0.0, models={"m": model})
    hub = SnapshotHub()
    hub.set(snapshot)
    gateway = Gateway(hub, Lacking(), Clock())
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]})
    before = internal_errors("gateway_outputs")
    with pytest.raises(ServingError) as failed:
        await gateway.infer("m", None, body.encode(), None, None)
    assert failed.value.status == 500 and not isinstance(failed.value, Unavailable)
    assert "lacks output 'scores'" in failed.value.message
    assert internal_errors("gateway_outputs") == before + 1
