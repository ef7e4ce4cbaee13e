"""What the gateway meters per answer: the caller's tenant, the version that answered, status, rows and
device seconds. A stand-in transport and a fake clock; no server, no database."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from rollout.routing import RouteTable
from serving.dataplane.errors import ServingError, Shed
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub
from serving.dataplane.transport.transport import Outputs
from tests.test_admission import entry
from usage.recorder import UsageRecorder
from usage.sketch import bucket_of

TENANT = 7


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Transport:
    """Sheds every request for `big`; answers the rest after 0.25 s of the clock, with 0.5 device seconds."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    async def infer(self, entry, inputs, rows, deadline, priority, *, nbytes=0, gone=None, **_):  # noqa: ANN001, ANN003, ANN201
        if entry.model == "big":
            raise Shed("big is saturated", reason="deadline", tier=priority)
        self.clock.now += 0.25
        return Outputs({"scores": np.zeros((rows, 2), np.float32)}, compute_seconds=0.5)


def body(n: int, width: int = 4) -> bytes:
    return orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [n, width], "data": [0.0] * (n * width)}]}
    )


@pytest.fixture
def metered() -> tuple[Gateway, UsageRecorder]:
    clock = Clock()
    hub = SnapshotHub()
    hub.set(
        RoutingSnapshot(
            serial=1,
            built_at=0.0,
            models={
                "big": ModelEntry("big", "", "", "small", {1: entry("big")}, routes=RouteTable(stable=1)),
                "small": ModelEntry("small", "", "", None, {1: entry("small")}, routes=RouteTable(stable=1)),
            },
        )
    )
    recorder = UsageRecorder(clock)
    return Gateway(hub, Transport(clock), clock, usage=recorder), recorder


def cells(recorder: UsageRecorder) -> dict[tuple[str, int], dict]:
    return {(r["model"], r["tenant"]): r for r in recorder.drain().rows()}


async def test_a_served_answer_meters_rows_device_seconds_and_latency(metered) -> None:  # noqa: ANN001
    gateway, recorder = metered
    # when tenant 7 sends 3 rows to small
    reply = await gateway.infer("small", None, body(3), None, TENANT)
    # then one request of 3 items, 0.5 device seconds and 250 ms latency is metered for small v1
    assert reply.status == 200
    cell = cells(recorder)[("small", TENANT)]
    assert (cell["version"], cell["requests"], cell["items"], cell["errors_4xx"], cell["errors_5xx"]) == (1, 1, 3, 0, 0)
    assert cell["compute_seconds"] == pytest.approx(0.5)
    ((bucket, count),) = cell["latency"].items()
    assert (int(bucket), count) == (bucket_of(0.25), 1)


async def test_a_fallback_answer_counts_for_the_version_that_served_it(metered) -> None:  # noqa: ANN001
    gateway, recorder = metered
    reply = await gateway.infer("big", None, body(2), None, TENANT)
    assert reply.status == 200
    metered_cells = cells(recorder)
    # the answer is small's: one request, its rows
    small = metered_cells[("small", TENANT)]
    assert (small["requests"], small["items"], small["fell_back"]) == (1, 2, 0)
    # and the refusal is big's, the version asked: no answer of its own, one request its fallback answered
    big = metered_cells[("big", TENANT)]
    assert (big["requests"], big["errors_5xx"], big["items"], big["fell_back"]) == (0, 0, 0, 1)


async def test_errors_count_by_class_with_no_items(metered) -> None:  # noqa: ANN001
    gateway, recorder = metered
    # when a malformed request (4xx) and a shed one (503, fallback off) are answered
    with pytest.raises(ServingError) as bad:
        await gateway.infer("small", None, body(1, width=3), None, TENANT)
    gateway.use_fallback = False
    with pytest.raises(ServingError) as shed:
        await gateway.infer("big", None, body(1), None, TENANT)
    # then each is metered for the version asked, as an error of its class
    assert (bad.value.status, shed.value.status) == (400, 503)
    found = cells(recorder)
    small, big = found[("small", TENANT)], found[("big", TENANT)]
    assert (small["requests"], small["errors_4xx"], small["items"]) == (1, 1, 0)
    assert (big["requests"], big["errors_5xx"], big["items"], big["compute_seconds"]) == (1, 1, 0, 0.0)


async def test_no_tenant_and_no_recorder_meter_nothing(metered) -> None:  # noqa: ANN001
    gateway, recorder = metered
    await gateway.infer("small", None, body(1), None, None)  # the data plane's own call: no tenant
    assert len(recorder) == 0
    gateway.usage = None
    assert (await gateway.infer("small", None, body(1), None, TENANT)).status == 200
