"""One traced REST request's span tree in embedded mode, exported by the SDK's OTLP/HTTP exporter to a real
OTLP receiver in this process (tests/otlp_receiver.py), as a collector would get it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from serving.dataplane import tracing
from tests import otlp_receiver
from tests.conftest import LiveServer, register
from tests.test_inference_http import call, digits_request

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
SPANS_WAIT_S = 30  # a bound on waiting for the exporter, not a timing assertion
ROOT = "POST /v2/models/{model_name}/infer"  # a REST inference's server span (OpenTelemetry's `{method} {route}`)


@pytest.fixture
def receiver() -> Iterator[otlp_receiver.Receiver]:
    got = otlp_receiver.start()
    yield got
    got.close()


@pytest.fixture
def traced_server(transactional_db, model_files, receiver, monkeypatch, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    # Not a saturation test: a busy machine must not shed these requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    # The web process turns tracing on at start, from the standard variables alone.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "ferry-test-web")
    register(model_files.digits, "digits", max_batch_size=16, max_queue_delay_ms=2)
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()
        tracing.shutdown()


def wait_for_spans(receiver: otlp_receiver.Receiver, trace_id: str, names: set[str]) -> list:
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        tracing.force_flush()
        spans = receiver.take(trace_id)
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def tree(spans: list) -> dict[str, list[str]]:
    """Each span's name -> its children's names, sorted."""
    names = {s.span_id: s.name for s in spans}
    children: dict[str, list[str]] = {}
    for s in spans:
        children.setdefault(names.get(s.parent_id, s.parent_id), []).append(s.name)
    return {k: sorted(v) for k, v in children.items()}


def test_a_traced_request_has_its_whole_span_tree_under_the_callers_span(traced_server, receiver) -> None:  # noqa: ANN001
    assert tracing.ENABLED
    plane = traced_server.plane()
    # when a client sends a request inside its own trace
    response = call(
        traced_server,
        "POST",
        "/v2/models/digits/infer",
        digits_request(np.zeros((2, 64), np.float32)),
        headers={"traceparent": TRACEPARENT},
    )
    assert response.status == 200, response.body
    expected = {ROOT, "ferry.auth", "ferry.route", "ferry.admission", "ferry.queue", "ferry.batch"}
    expected |= {"ferry.device", "ferry.reply"} | ({"ferry.quota"} if plane.quota is not None else set())
    spans = wait_for_spans(receiver, TRACE_ID, expected)
    # then the collector got the gateway's, the queue's, the batch's and the device's spans, in the caller's trace
    (root,) = [s for s in spans if s.name == ROOT]
    assert root.parent_id == CALLER_SPAN and root.kind == 2  # SPAN_KIND_SERVER
    assert root.service == "ferry-test-web"
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["ferry.model"] == "digits"
    shape = tree(spans)
    assert shape[ROOT] == sorted(expected - {ROOT, "ferry.device"})
    assert shape["ferry.batch"] == ["ferry.device"]
    (batch,) = [s for s in spans if s.name == "ferry.batch"]
    assert root.span_id in batch.links and batch.attributes["ferry.batch.rows"] == 2
    # and every child lies within the request's span
    assert all(root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns for s in spans if s is not root)


def test_a_request_without_a_traceparent_starts_its_own_trace(traced_server, receiver) -> None:  # noqa: ANN001
    before = {s.trace_id for s in receiver.take()}
    response = call(traced_server, "POST", "/v2/models/digits/infer", digits_request(np.zeros((1, 64), np.float32)))
    assert response.status == 200, response.body
    deadline = time.monotonic() + SPANS_WAIT_S
    while time.monotonic() < deadline:
        tracing.force_flush()
        roots = [s for s in receiver.take() if s.name == ROOT and s.trace_id not in before]
        if roots:
            break
        time.sleep(0.05)
    (root,) = roots
    assert root.parent_id == ""
