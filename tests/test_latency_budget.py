"""The platform's latency budget (FERRY_LATENCY_BUDGET_MS): the deadline of a request without one, the most
a client's `timeout` may ask, lowered by a version's `default_timeout_ms`; carried by the routing snapshot.

The gateway runs on a fake clock: a stand-in transport records the deadline it is handed, and a real node
with stand-in runtimes (tests.test_admission) shows admission refusing what cannot finish within it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from autoscaling.observe import target_for
from rollout.routing import RouteTable
from serving.dataplane.errors import Shed
from serving.dataplane.gateway import snapshot_redis
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.shadow import Mirror
from serving.dataplane.gateway.snapshot import DEFAULT_LATENCY_BUDGET_MS, ModelEntry, RoutingSnapshot, SnapshotHub
from serving.dataplane.http.consumers import _config
from serving.dataplane.transport.transport import InProcessTransport
from serving.publish import build_snapshot
from tests.test_admission import Clock, StandIn, entry, node  # noqa: F401 (node: the fixture)

ROOT = Path(__file__).resolve().parent.parent


class Recording:
    """A transport that answers at once and keeps the deadline each request was handed."""

    def __init__(self) -> None:
        self.deadlines: list[float] = []

    async def infer(self, entry, inputs, rows, deadline, priority, **_):  # noqa: ANN001, ANN003, ANN201
        self.deadlines.append(deadline)
        return {"scores": np.zeros((rows, 2), np.float32)}


def body(timeout_us: int | None = None) -> bytes:
    doc: dict = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [0.0] * 4}]}
    if timeout_us is not None:
        doc["parameters"] = {"timeout": timeout_us}
    return orjson.dumps(doc)


def snapshot(budget_ms: int, *, default_timeout_ms: int = 1000, shadow: bool = False) -> RoutingSnapshot:
    versions = {1: dataclasses.replace(entry("m"), default_timeout_ms=default_timeout_ms)}
    routes = RouteTable(stable=1)
    if shadow:
        versions[2] = dataclasses.replace(entry("m"), version=2, default_timeout_ms=default_timeout_ms)
        routes = RouteTable(stable=1, shadow=2, shadow_fraction=1.0)
    return RoutingSnapshot(
        serial=1,
        built_at=0.0,
        models={"m": ModelEntry("m", "", "", None, versions, routes=routes)},
        latency_budget_ms=budget_ms,
    )


def gateway(snap: RoutingSnapshot, transport, clock: Clock, mirror: Mirror | None = None) -> Gateway:  # noqa: ANN001
    hub = SnapshotHub()
    hub.set(snap)
    return Gateway(hub, transport, clock, mirror=mirror)


async def deadline_left(snap: RoutingSnapshot, timeout_us: int | None = None, waited: float = 0.0) -> float:
    """The seconds from the handler's start to the deadline the gateway hands the transport for one request
    that had waited `waited` seconds before it."""
    clock, transport = Clock(), Recording()
    reply = await gateway(snap, transport, clock).infer("m", None, body(timeout_us), None, None, waited=waited)
    assert reply.status == 200
    return transport.deadlines[0] - clock.now


# -- the deadline the gateway decides ----------------------------------------------------------------


async def test_without_a_client_timeout_the_deadline_is_the_budget() -> None:
    # given a 300 ms platform budget and a version whose default_timeout_ms is 1 s / then 300 ms, not 1 s
    assert await deadline_left(snapshot(300)) == pytest.approx(0.300)


async def test_what_a_request_waited_before_its_handler_is_spent_from_its_deadline() -> None:
    # given a request that waited 120 ms between reaching the machine and its handler (the listen queue, a
    # socket's buffer, the loop's backlog: the front door's measure) / then 180 ms of the 300 ms budget are left
    assert await deadline_left(snapshot(300), waited=0.120) == pytest.approx(0.180)
    # and of a client's own shorter deadline too (it counts from the client's send)
    assert await deadline_left(snapshot(300), timeout_us=150_000, waited=0.120) == pytest.approx(0.030)


async def test_a_longer_client_timeout_is_cut_to_the_budget() -> None:
    # when the client asks 5 s, and 60 s / then it still gets the 300 ms budget
    assert await deadline_left(snapshot(300), timeout_us=5_000_000) == pytest.approx(0.300)
    assert await deadline_left(snapshot(300), timeout_us=60_000_000) == pytest.approx(0.300)


async def test_a_shorter_client_timeout_is_kept() -> None:
    assert await deadline_left(snapshot(300), timeout_us=120_000) == pytest.approx(0.120)


async def test_a_version_with_a_lower_default_timeout_has_that_budget() -> None:
    # given a version whose default_timeout_ms (200) is below the platform's 300 ms
    snap = snapshot(300, default_timeout_ms=200)
    # then a request without a deadline gets 200 ms, and a client asking 250 ms gets 200 ms too
    assert await deadline_left(snap) == pytest.approx(0.200)
    assert await deadline_left(snap, timeout_us=250_000) == pytest.approx(0.200)
    # and a version's higher default does not raise the budget
    assert await deadline_left(snapshot(300, default_timeout_ms=5000)) == pytest.approx(0.300)


async def test_the_budget_is_the_snapshots() -> None:
    # given two snapshots that differ in the platform budget only / then each one's applies
    assert await deadline_left(snapshot(50)) == pytest.approx(0.050)
    assert await deadline_left(snapshot(800)) == pytest.approx(0.800)


# -- admission keeps within the budget -----------------------------------------------------------------


async def test_admission_refuses_what_cannot_finish_within_the_budget_whatever_the_client_asks(node) -> None:  # noqa: ANN001, F811
    # given a version whose batch takes 0.4 s (its batcher stopped, so what is admitted stays queued)
    node.host(entry("m"), StandIn(), {1: 0.4, 8: 0.4}, start=False)
    transport = InProcessTransport(node)
    tight = gateway(snapshot(300), transport, node.clock)
    # when a request without a deadline, or with a 5 s one, arrives under a 300 ms budget
    for timeout_us in (None, 5_000_000):
        with pytest.raises(Shed) as refused:
            await tight.infer("m", None, body(timeout_us), None, None)
        # then it is refused (no fallback here): 503 for the deadline, with Retry-After
        assert refused.value.status == 503 and refused.value.reason == "deadline"
        assert refused.value.retry_after is not None
    assert len(node.hosted["m:1"].batcher.queue) == 0
    # and under a 1 s budget the same request is admitted (queued)
    roomy = gateway(snapshot(1000), transport, node.clock)
    admitted = asyncio.ensure_future(roomy.infer("m", None, body(), None, None))
    await asyncio.sleep(0)
    assert not admitted.done() and len(node.hosted["m:1"].batcher.queue) == 1
    admitted.cancel()
    # while a client's own shorter deadline under that budget is refused
    with pytest.raises(Shed):
        await roomy.infer("m", None, body(400_000), None, None)


# -- the other places a request's deadline is stated -------------------------------------------------


async def test_the_shadow_mirror_gets_the_candidates_budget() -> None:
    # given a model mirrored to a shadow, with a 250 ms platform budget
    clock = Clock()
    transport = Recording()
    mirror = Mirror(transport, clock=clock)  # its workers are not started: the mirror stays queued
    reply = await gateway(snapshot(250, shadow=True), transport, clock, mirror).infer("m", None, body(), None, None)
    # then the mirror's deadline is the candidate's budget from when it was offered
    assert reply.status == 200 and len(mirror.queue) == 1
    assert mirror.queue[0].deadline - mirror.queue[0].offered == pytest.approx(0.250)


def test_model_config_reports_the_effective_default_timeout() -> None:
    snap = snapshot(300)
    version = snap.models["m"].versions[1]
    policy = _config(version, snap.budget_ms(version))["dynamic_batching"]["default_queue_policy"]
    assert policy["default_timeout_microseconds"] == 300_000


def test_the_autoscaler_plans_for_the_budget(settings) -> None:  # noqa: ANN001
    # given a version whose default_timeout_ms is 1 s under a 300 ms platform budget, and one of 200 ms
    settings.FERRY_LATENCY_BUDGET_MS = 300
    policy = SimpleNamespace(
        target_utilisation=0.7, warm_pool=0, max_replicas=4, cool_down_seconds=60, idle_to_zero_seconds=None
    )

    def version(default_timeout_ms: int) -> SimpleNamespace:
        return SimpleNamespace(
            placement_measurements={},
            memory_bytes=1,
            min_memory_bytes=0,
            load_seconds=1.0,
            latency_profile={"1": 0.01},
            default_timeout_ms=default_timeout_ms,
            max_batch_size=8,
            min_replicas=1,
            model=SimpleNamespace(name="m"),
            version=1,
            pk=1,
        )

    # then capacity is planned for the deadline the gateways give its requests
    assert target_for(version(1000), policy, "cpu", 0.0).config.latency_budget == pytest.approx(0.300)
    assert target_for(version(200), policy, "cpu", 0.0).config.latency_budget == pytest.approx(0.200)


# -- the setting and its journey in the snapshot ------------------------------------------------------


@pytest.mark.django_db
def test_the_published_snapshot_carries_the_setting(settings) -> None:  # noqa: ANN001
    settings.FERRY_LATENCY_BUDGET_MS = 123
    built = build_snapshot()
    assert built.latency_budget_ms == 123
    # and it survives the trip through Redis' encoding
    assert snapshot_redis.decode(snapshot_redis.encode(built)).latency_budget_ms == 123


def test_a_snapshot_from_an_older_publisher_gets_the_default() -> None:
    doc = orjson.loads(snapshot_redis.encode(snapshot(77)))
    del doc["latency_budget_ms"]
    assert snapshot_redis.decode(orjson.dumps(doc)).latency_budget_ms == DEFAULT_LATENCY_BUDGET_MS == 300


def _settings_budget(value: str | None) -> subprocess.CompletedProcess:
    """config.settings imported in a fresh interpreter with FERRY_LATENCY_BUDGET_MS `value` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "FERRY_LATENCY_BUDGET_MS"}
    if value is not None:
        env["FERRY_LATENCY_BUDGET_MS"] = value
    read = "from config import settings; print(settings.FERRY_LATENCY_BUDGET_MS)"
    return subprocess.run([sys.executable, "-c", read], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_setting_is_read_and_validated() -> None:
    assert _settings_budget(None).stdout.strip() == "300"
    assert _settings_budget("1").stdout.strip() == "1"
    for bad in ("0", "-5", "soon"):
        refused = _settings_budget(bad)
        assert refused.returncode != 0 and "FERRY_LATENCY_BUDGET_MS" in refused.stderr, (bad, refused.stderr[-500:])
