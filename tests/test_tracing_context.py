"""Traces that tell the truth, without a server (the SDK's in-memory exporter): a caller's long tracestate never
fails its request; the node's span (a `runnode`'s, the node host's) records what it answered; a caller's
sampled flag is not obeyed unless trusted; the service name and the exporter's protocol are the standard
variables'. The protocols' server spans against a live server: tests/test_tracing_protocols.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from serving.dataplane import tracing
from serving.dataplane.errors import ServingError, Unavailable
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_process import Facts, NodeProcess
from serving.dataplane.transport.host_link import HostTransport
from serving.dataplane.transport.stream_codec import StreamRequest, decode_request, encode_request
from tests.test_admission import Clock, StandIn, entry, rows
from tests.test_node_host import _host, _link

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = f"00-{TRACE_ID}-b7ad6b7169203331-01"  # sampled
UNSAMPLED = f"00-{TRACE_ID}-b7ad6b7169203331-00"
# W3C's most: 32 members; these make 32 x 40 characters, far past the 512 a tracestate may be cut to.
LONG_STATE = ",".join(f"vendor{i:02d}=" + "v" * 31 for i in range(32))


@pytest.fixture
def spans():  # noqa: ANN201
    exporter = InMemorySpanExporter()
    tracing.configure({}, exporter=exporter)
    yield exporter
    tracing.shutdown()


def request(trace: dict[str, str] | None) -> StreamRequest:
    return StreamRequest(1, b"reply", time.time() + 60, None, 1, 1, rows(1), None, trace)


# -- a long tracestate (audit item 2) ----------------------------------------------------------------


def test_a_callers_long_tracestate_is_cut_by_whole_members_and_the_request_still_travels(spans) -> None:  # noqa: ANN001
    # given a caller's request with a valid tracestate of 32 members, 1,311 characters
    assert len(LONG_STATE) > 1000
    context = tracing.from_headers({b"traceparent": PARENT.encode(), b"tracestate": LONG_STATE.encode()})
    span = tracing.start_request("POST /v2/models/{model_name}/infer", context)
    # when the gateway sends it on to a node
    with tracing.active(span):
        carried = tracing.carrier()
    assert carried is not None
    # then the context still goes (traceparent whole), its tracestate the first members that fit in 512
    assert carried["traceparent"].split("-")[1] == TRACE_ID
    state = carried["tracestate"]
    assert len(state) <= 512 and LONG_STATE.startswith(state + ",")
    assert len(state.split(",")) == 12  # 12 x 40 + 11 commas = 491; a 13th would make 532
    # and the node reads the entry: no malformed request, no 500
    assert decode_request(encode_request(request(carried))).trace == carried


def test_cutting_drops_members_over_128_characters_first_then_from_the_end() -> None:
    long_one = "big=" + "x" * 200
    state = ",".join(["a=1", long_one, *(f"k{i:02d}=" + "v" * 40 for i in range(12))])
    cut = tracing.fit_tracestate(state)
    assert long_one not in cut and cut.startswith("a=1,k00=") and len(cut) <= 512
    assert tracing.fit_tracestate("a=1,b=2") == "a=1,b=2"  # under the bound: as it came
    assert tracing.fit_tracestate("big=" + "x" * 600) == ""  # nothing fits: the carrier then has no tracestate


def test_the_node_leaves_out_an_overlong_tracestate_rather_than_refusing_the_request() -> None:
    # given an entry from a gateway that did not cut its caller's tracestate
    entry_ = request({"traceparent": PARENT, "tracestate": LONG_STATE})
    # when a node reads it / then the request is served with its traceparent, the tracestate left out
    assert decode_request(encode_request(entry_)).trace == {"traceparent": PARENT}


# -- the node's span records its answer (items 4, 10) ------------------------------------------------


async def _answered(process: NodeProcess, carried: dict[str, str]) -> list[bytes]:
    sent: list[bytes] = []
    process._reply = lambda reply_to, rid, payload: sent.append(payload)  # type: ignore[method-assign]
    await process._answer("t:1", encode_request(request(carried)))
    return sent


@pytest.mark.parametrize(
    ("failure", "status", "error"),
    [
        (Unavailable("shed: the queue would not finish in time"), 503, True),
        (ServingError("the model refused this input", status=422), 422, False),
        (RuntimeError("a bug"), 500, True),
    ],
)
async def test_the_nodes_span_records_its_answer(spans, failure: Exception, status: int, error: bool) -> None:  # noqa: ANN001
    # given a node process whose node fails a request of a traced gateway span
    node = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    process = NodeProcess(node, "redis://127.0.0.1:1/0", Facts("unit", "cpu", "cpu", 0, 1 << 30, 1 << 30))

    async def fails(*args: object, **kwargs: object) -> dict:
        raise failure

    node.infer = fails  # type: ignore[method-assign]
    gateway = tracing.start_request("POST /v2/models/{model_name}/infer")
    with tracing.active(gateway):
        carried = tracing.carrier()
    assert carried is not None
    try:
        # when the node answers it
        assert len(await _answered(process, carried)) == 1
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    # then its span says what it answered: a 5xx is ERROR, a 4xx (the caller's) leaves the status unset
    (span,) = [s for s in spans.get_finished_spans() if s.name == "ferry.node"]
    assert span.attributes["ferry.status"] == status
    assert span.status.status_code is (StatusCode.ERROR if error else StatusCode.UNSET)
    assert ("error.type" in span.attributes) is error
    # and each entry has one outcome: a refusal is counted as one, an unexpected failure as an error
    assert process.counts["refused" if isinstance(failure, ServingError) else "errors"] == 1
    assert sum(process.counts[o] for o in ("served", "expired", "refused", "errors")) == 1


@pytest.mark.parametrize("failure", [ValueError("a bug"), RuntimeError("CUDA error: an illegal memory access")])
async def test_a_failed_batch_is_recorded_as_an_error(spans, failure: Exception) -> None:  # noqa: ANN001
    # given a node whose version's batch fails on the device (a bug: 500; the device's error: 503)
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]

    class Failing(StandIn):
        def run(self, requests):  # noqa: ANN001, ANN202
            raise failure

    hosted = node.host(entry("t"), Failing(), {1: 0.001, 8: 0.001}, start=False)
    requests = [tracing.start_request("POST /v2/models/{model_name}/infer") for _ in range(2)]

    async def one(span):  # noqa: ANN001, ANN202
        with tracing.active(span):
            return await node.infer("t:1", rows(4), 4, clock.now + 100, 1)

    tasks = [asyncio.ensure_future(one(s)) for s in requests]
    await asyncio.sleep(0)
    try:
        # when the batch of both runs and fails
        assert await hosted.batcher.process_one_batch()
        answers = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    assert all(isinstance(a, ServingError) and a.status >= 500 for a in answers), answers
    # then the trace holds the batch, ERROR with the failure's type, linked to both requests, and no device span
    done = spans.get_finished_spans()
    (batch,) = [s for s in done if s.name == "ferry.batch"]
    assert batch.status.status_code is StatusCode.ERROR and batch.attributes["error.type"] == type(failure).__name__
    assert batch.attributes["ferry.batch.requests"] == 2
    assert sorted(link.context.span_id for link in batch.links) == sorted(
        r.get_span_context().span_id for r in requests
    )
    assert not [s for s in done if s.name == "ferry.device"]
    # and each request's span is an ERROR too
    roots = [s for s in done if s.name.startswith("POST ")]
    assert len(roots) == 2 and all(s.status.status_code is StatusCode.ERROR for s in roots)


def test_the_node_hosts_part_of_a_request_is_under_the_web_processes_span(spans, tmp_path: Path) -> None:  # noqa: ANN001
    async def go() -> tracing.Span:
        host, path = await _host(tmp_path)
        link = await _link(path)
        host.node.host(entry("t", max_batch=1), StandIn(), {1: 0.001})  # run at once
        transport = HostTransport(link)
        web = tracing.start_request("POST /v2/models/{model_name}/infer")
        try:
            # when a traced request of a web process is served by the node host (serve --workers N)
            with tracing.active(web):
                loop = asyncio.get_running_loop()
                assert (await transport.infer(entry("t"), rows(1), 1, loop.time() + 10, 1))["scores"].shape == (1, 2)
        finally:
            await link.close()
            await host.close()
        return web

    web = asyncio.run(go())
    done = spans.get_finished_spans()
    # then the host's part is a ferry.node span under the web process's request, with its queue and batch
    (node,) = [s for s in done if s.name == "ferry.node"]
    assert node.kind is SpanKind.CONSUMER and node.parent.span_id == web.get_span_context().span_id
    assert node.attributes["ferry.version"] == "t:1" and node.attributes["ferry.status"] == 200
    by_parent = {s.name: s.parent.span_id for s in done if s.parent is not None}
    assert by_parent["ferry.queue"] == by_parent["ferry.batch"] == node.context.span_id


# -- sampling, the service's name, the exporter (items 14, 15, 16) ---------------------------------------------


def test_a_callers_sampled_flag_does_not_force_a_trace_unless_callers_are_trusted() -> None:
    ratio_zero = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    sampled = tracing.from_headers({b"traceparent": PARENT.encode()})
    unsampled = tracing.from_headers({b"traceparent": UNSAMPLED.encode()})
    try:
        # given a ratio of 0: when a caller sends a sampled traceparent / then its request is not traced
        tracing.configure(ratio_zero, exporter=InMemorySpanExporter())
        span = tracing.start_request("POST /v2/models/{model_name}/infer", sampled)
        assert not span.is_recording()
        assert span.get_span_context().trace_id == int(TRACE_ID, 16)  # still the caller's trace
        # while a node follows its gateway's decision (the same remote parent, for a CONSUMER span)
        assert tracing.start_request("ferry.node", sampled, kind=tracing.CONSUMER).is_recording()
        # and with a ratio of 1 a caller's unsampled flag does not hide its request either
        tracing.configure({**ratio_zero, "OTEL_TRACES_SAMPLER_ARG": "1"}, exporter=InMemorySpanExporter())
        assert tracing.start_request("POST /v2/models/{model_name}/infer", unsampled).is_recording()
        # unless the callers are trusted (a proxy in front samples for the platform)
        tracing.configure({**ratio_zero, "FERRY_TRACES_TRUST_CALLERS": "true"}, exporter=InMemorySpanExporter())
        assert tracing.start_request("POST /v2/models/{model_name}/infer", sampled).is_recording()
    finally:
        tracing.shutdown()


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({}, "ferry-web"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,service.name=serving%20eu"}, "serving eu"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes", "OTEL_SERVICE_NAME": "named"}, "named"),
    ],
)
def test_the_service_name_is_the_standard_variables_before_the_default(env: dict, name: str) -> None:
    exporter = InMemorySpanExporter()
    tracing.configure(env, exporter=exporter, service="ferry-web")
    try:
        tracing.start_request("x").end()
        (span,) = exporter.get_finished_spans()
    finally:
        tracing.shutdown()
    assert span.resource.attributes["service.name"] == name
    if "deployment.environment" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert span.resource.attributes["deployment.environment"] == "prod"


def test_an_otlp_protocol_that_is_not_installed_fails_at_start() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    try:
        for protocol in ("grpc", "http/json"):
            with pytest.raises(ValueError, match="http/protobuf"):
                tracing.configure({**endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
        assert tracing.ENABLED is False
        assert tracing.configure({**endpoint, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
    finally:
        tracing.shutdown()
