"""Each protocol's server span against a live Ferry, as OpenTelemetry's conventions describe it (the SDK's
in-memory exporter, turned on once the server is up): REST's `POST {route}` with the HTTP attributes, gRPC's
`{service}/{method}` with the RPC ones, a WebSocket message's span the child of its handshake's `traceparent`;
a 5xx (a server error's gRPC code) is ERROR, a 4xx leaves the status unset."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator

import numpy as np
import orjson
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tritonclient.utils import InferenceServerException

from serving.dataplane import tracing
from tests.conftest import LiveServer, free_port
from tests.test_grpc import digits_input
from tests.test_inference_http import call, digits_request, infer
from tests.test_websocket import DEADLINE_S, json_message, keyed, recv_json

SPANS_WAIT_S = 30  # a bound on waiting for a span to end, not a timing assertion
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def traced(settings, digits_server) -> Iterator[tuple[LiveServer, InMemorySpanExporter]]:  # noqa: ANN001
    # Not a saturation test: a busy machine must not shed these requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    exporter = InMemorySpanExporter()
    tracing.configure({}, exporter=exporter)  # after the server's start, which found no OTEL_* variable
    yield digits_server, exporter
    tracing.shutdown()


@pytest.fixture
def grpc_port(settings) -> int:  # noqa: ANN001
    settings.FERRY_GRPC_PORT = port = free_port()  # before the server starts: its lifespan reads it
    return port


def traceparent() -> tuple[str, str]:
    """A caller's new trace: (its id, its traceparent, sampled)."""
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{CALLER_SPAN}-01"


def root(exporter: InMemorySpanExporter, trace_id: str) -> ReadableSpan:
    """The server span of the caller's trace `trace_id`: the one whose parent is the caller's span."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        found = [
            s
            for s in exporter.get_finished_spans()
            if format(s.context.trace_id, "032x") == trace_id and s.parent is not None and s.parent.is_remote
        ]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
            return found[0]
        time.sleep(0.02)


def test_a_rest_request_is_an_http_server_span(traced) -> None:  # noqa: ANN001
    server, spans = traced
    # when a caller's traced request is served
    trace_id, parent = traceparent()
    response = infer(server, "digits", digits_request(np.zeros((1, 64), np.float32)), headers={"traceparent": parent})
    assert response.status == 200, response.body
    # then its span is named and described as OpenTelemetry's HTTP server conventions say
    span = root(spans, trace_id)
    assert span.name == "POST /v2/models/{model_name}/infer" and span.kind is SpanKind.SERVER
    assert format(span.parent.span_id, "016x") == CALLER_SPAN
    attributes = span.attributes
    assert attributes["http.request.method"] == "POST" and attributes["http.route"] == "/v2/models/{model_name}/infer"
    assert attributes["url.path"] == "/v2/models/digits/infer" and attributes["url.scheme"] == "http"
    assert attributes["server.address"] == "127.0.0.1" and attributes["server.port"] == server.port
    assert attributes["http.response.status_code"] == 200 and span.status.status_code is StatusCode.UNSET
    # and a pinned version's route is the versioned template
    trace_id, parent = traceparent()
    body = orjson.dumps(digits_request(np.zeros((1, 64), np.float32)))
    assert call(server, "POST", "/v2/models/digits/versions/1/infer", body, {"traceparent": parent}).status == 200
    pinned = root(spans, trace_id)
    assert pinned.name == "POST /v2/models/{model_name}/versions/{model_version}/infer"


def test_a_rest_5xx_is_an_error_and_a_4xx_is_not(traced) -> None:  # noqa: ANN001
    server, spans = traced
    # given a request the model cannot take (400) and one whose 1 microsecond timeout passes (504, or 503)
    bad_id, bad_parent = traceparent()
    bad = infer(server, "digits", digits_request(np.zeros((1, 3), np.float32)), headers={"traceparent": bad_parent})
    assert bad.status == 400, bad.body
    late_id, late_parent = traceparent()
    body = digits_request(np.zeros((1, 64), np.float32), parameters={"timeout": 1})
    late = infer(server, "digits", body, headers={"traceparent": late_parent})
    assert late.status in (503, 504), late.body
    # then the caller's error leaves the server span's status unset; the server's is ERROR, with error.type
    refused = root(spans, bad_id)
    assert refused.attributes["http.response.status_code"] == 400 and "error.type" not in refused.attributes
    assert refused.status.status_code is StatusCode.UNSET
    failed = root(spans, late_id)
    assert failed.attributes["http.response.status_code"] == late.status
    assert failed.attributes["error.type"] == str(late.status) and failed.status.status_code is StatusCode.ERROR


def test_a_websocket_message_is_the_child_of_its_handshakes_traceparent(traced, digits_samples) -> None:  # noqa: ANN001
    server, spans = traced
    x, _ = digits_samples
    trace_id, parent = traceparent()

    async def go() -> dict:
        # when a connection opened inside a caller's trace sends a message
        async with keyed(server, additional_headers={"traceparent": parent}) as ws:
            await ws.send(json_message("a", x[:1]))
            return await asyncio.wait_for(recv_json(ws), DEADLINE_S)

    answer = asyncio.run(go())
    assert "error" not in answer, answer
    # then the message's span is in the caller's trace, under its span, and says it is a WebSocket message: no
    # HTTP method or route it never had
    span = root(spans, trace_id)
    assert span.name == "WS /ws/v2/models/{model_name}/infer" and format(span.parent.span_id, "016x") == CALLER_SPAN
    assert span.attributes["network.protocol.name"] == "websocket" and span.attributes["url.scheme"] == "ws"
    assert span.attributes["url.path"] == "/ws/v2/models/digits/infer" and span.attributes["ferry.status"] == 200
    assert "http.request.method" not in span.attributes and "http.route" not in span.attributes


def test_a_grpc_call_is_an_rpc_server_span_with_its_code(grpc_port, traced, digits_samples) -> None:  # noqa: ANN001
    server, spans = traced
    x, _ = digits_samples
    client = grpcclient.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
    auth = {"authorization": f"Bearer {server.key}"}
    try:
        # when a traced call is served, one is refused for its input, and one's deadline passes
        ok_id, ok_parent = traceparent()
        client.infer("digits", [digits_input(x[:1])], headers={**auth, "traceparent": ok_parent})
        bad_id, bad_parent = traceparent()
        with pytest.raises(InferenceServerException):
            client.infer("digits", [digits_input(np.zeros((1, 3)))], headers={**auth, "traceparent": bad_parent})
        late_id, late_parent = traceparent()
        with pytest.raises(InferenceServerException):
            client.infer("digits", [digits_input(x[:1])], timeout=1, headers={**auth, "traceparent": late_parent})
    finally:
        client.close()
    # then each is a span named {rpc.service}/{rpc.method} with the RPC conventions' attributes, no HTTP status
    ok = root(spans, ok_id)
    assert ok.name == "inference.GRPCInferenceService/ModelInfer" and ok.kind is SpanKind.SERVER
    assert ok.attributes["rpc.system"] == "grpc" and ok.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert ok.attributes["rpc.method"] == "ModelInfer" and ok.attributes["rpc.grpc.status_code"] == 0
    assert "http.response.status_code" not in ok.attributes and ok.status.status_code is StatusCode.UNSET
    # and INVALID_ARGUMENT is the caller's error (unset), while DEADLINE_EXCEEDED (or UNAVAILABLE) is an ERROR
    bad = root(spans, bad_id)
    assert bad.attributes["rpc.grpc.status_code"] == 3 and bad.status.status_code is StatusCode.UNSET
    late = root(spans, late_id)
    assert late.attributes["rpc.grpc.status_code"] in (4, 14) and late.status.status_code is StatusCode.ERROR
    assert late.attributes["error.type"] in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
