"""Traces: when they are on, the sampler the standard variables name, the W3C context in and out, and one
request's spans through a node's queue and batch (the SDK's in-memory exporter; the whole tree over a real
OTLP receiver is in tests/test_tracing_http.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from serving.dataplane import tracing
from serving.dataplane.node.node import Node
from serving.dataplane.transport.stream_codec import (
    MalformedMessage,
    StreamRequest,
    decode_request,
    encode_request,
)
from tests.test_admission import Clock, StandIn, entry, rows

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def spans():  # noqa: ANN201
    exporter = InMemorySpanExporter()
    tracing.configure({}, exporter=exporter)
    yield exporter
    tracing.shutdown()


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ],
)
def test_traces_are_on_only_when_the_standard_variables_ask(env: dict, on: bool) -> None:
    assert tracing.wanted(env) is on


def test_off_there_is_no_tracer_and_nothing_travels() -> None:
    tracing.shutdown()
    assert tracing.configure({}) is False
    assert tracing.ENABLED is False
    assert tracing.carrier() is None
    assert tracing.child("x") is tracing.NOOP and tracing.active(None) is tracing.NOOP
    assert tracing.start_child("x") is None


def test_the_sampler_is_the_one_named_with_its_ratio() -> None:
    chosen = tracing.sampler({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"})
    assert isinstance(chosen, ParentBased) and "0.01" in chosen.get_description()
    assert isinstance(tracing.sampler({"OTEL_TRACES_SAMPLER": "traceidratio"}), TraceIdRatioBased)
    assert "AlwaysOn" in tracing.sampler({}).get_description()  # parentbased_always_on
    with pytest.raises(ValueError):
        tracing.sampler({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"})
    with pytest.raises(ValueError):
        tracing.sampler({"OTEL_TRACES_SAMPLER": "jaeger_remote"})


def test_an_incoming_traceparent_is_the_parent_and_a_bad_one_starts_a_new_trace(spans) -> None:  # noqa: ANN001
    context = tracing.from_headers({b"traceparent": PARENT.encode(), b"tracestate": b"k=v"})
    assert context is not None
    assert tracing.from_headers({b"traceparent": b"00-zz-yy-01"}) is None
    assert tracing.from_headers({}) is None
    assert tracing.from_metadata([("traceparent", PARENT), ("other", "x")]) is not None
    assert tracing.from_metadata([("authorization", "Bearer k")]) is None
    span = tracing.start_request("ferry.infer", context)
    with tracing.active(span):
        carrier = tracing.carrier()
    assert span.get_span_context().trace_id == int("0af7651916cd43dd8448eb211c80319c", 16)
    assert carrier is not None and carrier["traceparent"].split("-")[1] == "0af7651916cd43dd8448eb211c80319c"
    assert carrier["traceparent"].split("-")[2] == format(span.get_span_context().span_id, "016x")


def test_a_sampled_out_request_makes_no_children_and_sends_no_context() -> None:
    exporter = InMemorySpanExporter()
    tracing.configure({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}, exporter=exporter)
    try:
        span = tracing.start_request("ferry.infer")
        with tracing.active(span):
            assert tracing.child("ferry.route") is tracing.NOOP
            assert tracing.start_child("ferry.queue") is None
            assert tracing.carrier() is None
        assert exporter.get_finished_spans() == ()
    finally:
        tracing.shutdown()


def test_the_trace_context_travels_in_the_stream_entry_and_a_bad_one_is_malformed() -> None:
    def request(trace: object) -> StreamRequest:
        return StreamRequest(1, b"reply", 1e10, None, 1, 1, rows(1), None, trace)  # type: ignore[arg-type]

    carried = decode_request(encode_request(request({"traceparent": PARENT})))
    assert carried.trace == {"traceparent": PARENT}
    assert decode_request(encode_request(request(None))).trace is None
    for bad in ({"traceparent": 5}, ["traceparent", PARENT], {"a": "1", "b": "2", "c": "3"}):
        with pytest.raises(MalformedMessage):
            decode_request(encode_request(request(bad)))


async def test_a_batch_links_its_requests_and_is_the_child_of_the_first(spans) -> None:  # noqa: ANN001
    # given a node with a version and four traced requests of 2 rows: one full batch
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    hosted = node.host(entry("t"), StandIn(), {1: 0.001, 8: 0.001}, start=False)
    requests = [tracing.start_request("ferry.infer") for _ in range(4)]

    async def one(span):  # noqa: ANN001, ANN202
        with tracing.active(span):
            return await node.infer("t:1", rows(2), 2, clock.now + 100, 1)

    tasks = [asyncio.ensure_future(one(s)) for s in requests]
    await asyncio.sleep(0)
    try:
        # when the batch runs
        assert await hosted.batcher.process_one_batch()
        results = await asyncio.gather(*tasks)
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    assert all(r["scores"].shape == (2, 2) for r in results)
    done = spans.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in done:
        by_name.setdefault(s.name, []).append(s)
    ids = [r.get_span_context().span_id for r in requests]
    # then each request has its admission and its queue time, under its own span
    for name in ("ferry.admission", "ferry.queue"):
        assert sorted(s.parent.span_id for s in by_name[name]) == sorted(ids)
    # and one batch of 8 rows, 4 requests, links to all four, the child of the first, with the device under it
    (batch,) = by_name["ferry.batch"]
    assert batch.attributes["ferry.batch.rows"] == 8 and batch.attributes["ferry.batch.requests"] == 4
    assert sorted(link.context.span_id for link in batch.links) == sorted(ids)
    assert batch.parent.span_id == ids[0] and batch.context.trace_id == requests[0].get_span_context().trace_id
    (device,) = by_name["ferry.device"]
    assert device.parent.span_id == batch.context.span_id
    assert batch.start_time <= device.start_time <= device.end_time <= batch.end_time
    # and each queue span ends when the batch starts
    assert all(q.end_time == batch.start_time for q in by_name["ferry.queue"])


async def test_a_request_that_never_runs_still_ends_its_queue_span(spans) -> None:  # noqa: ANN001
    clock = Clock()
    node = Node(artifact_path=lambda sha: None, device="cpu", clock=clock)  # type: ignore[arg-type]
    node.host(entry("t"), StandIn(), {1: 0.001, 8: 0.001}, start=False)
    span = tracing.start_request("ferry.infer")
    try:
        with tracing.active(span):
            task = asyncio.ensure_future(node.infer("t:1", rows(1), 1, clock.now + 100, 1))
            await asyncio.sleep(0)
            task.cancel()  # its client left before its batch
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        node._device_pool.shutdown(wait=False)
        node._load_pool.shutdown(wait=False)
    (queued,) = [s for s in spans.get_finished_spans() if s.name == "ferry.queue"]
    assert queued.status.description == "not_run"
    assert np.isfinite(queued.end_time)
