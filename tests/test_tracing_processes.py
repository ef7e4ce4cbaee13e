"""One trace across processes: a web process (FERRY_EMBEDDED_NODE=false) and a `runnode` process, and `serve
--workers 2`'s web processes and node host, exporting over OTLP/HTTP to a real receiver in this test process
(tests/otlp_receiver.py); the node's part of the request is under the gateway's span because the context travels
with the request (the stream entry, the node host's frame)."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from tests import otlp_receiver
from tests.conftest import free_port, mint_key, register
from tests.test_inference_http import digits_request
from tests.test_node_host_processes import get, post, start_serve
from tests.test_streams_processes import (  # noqa: F401
    REDIS_URL,
    Proc,
    ready_on,
    redis_db,
    start,
    start_web,
    stop_all,
    wait_for,
    web_ready,
)
from tests.test_tracing_http import CALLER_SPAN, ROOT, TRACE_ID, TRACEPARENT, tree

SPANS_WAIT_S = 60  # a bound on waiting for two processes' exporters, not a timing assertion


@pytest.fixture
def traced_cluster(
    transactional_db,
    redis_db,  # noqa: F811 (a fixture)
    model_files,
    tmp_path,  # noqa: ANN001
) -> Iterator[tuple[Proc, str, otlp_receiver.Receiver]]:
    receiver = otlp_receiver.start()
    register(model_files.digits, "digits", max_batch_size=8, max_queue_delay_ms=2)
    key = mint_key()
    otel = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    procs = [
        start_web(tmp_path, REDIS_URL, **otel),
        start("node-t", ["runnode", "--name", "node-t", "--memory", "8GiB"], tmp_path, REDIS_URL, **otel),
    ]
    try:
        web = procs[0]
        wait_for("the node ready with digits:1", lambda: ready_on(redis_db, "node-t", "digits:1"), procs)
        wait_for("the web process ready", lambda: web_ready(web), procs)
        yield web, key, receiver
    finally:
        stop_all(procs)
        receiver.close()


def send_traced(port: int, key: str) -> None:
    """An inference request inside the caller's trace (TRACEPARENT), answered 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            "POST",
            "/v2/models/digits/infer",
            body=orjson.dumps(digits_request(np.zeros((1, 64), np.float32))),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}", "traceparent": TRACEPARENT},
        )
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
    finally:
        conn.close()


def test_one_trace_crosses_the_gateway_and_the_node(traced_cluster) -> None:  # noqa: ANN001
    web, key, receiver = traced_cluster
    # when a client sends a request inside its own trace
    send_traced(web.port, key)
    expected = {ROOT, "ferry.auth", "ferry.route", "ferry.node", "ferry.admission", "ferry.queue"}
    expected |= {"ferry.batch", "ferry.device", "ferry.reply"}
    deadline = time.monotonic() + SPANS_WAIT_S
    spans = receiver.take(TRACE_ID)
    while not expected <= {s.name for s in spans} and time.monotonic() < deadline:
        time.sleep(0.1)
        spans = receiver.take(TRACE_ID)
    # then one trace holds both processes' spans: the gateway's under the caller's span, the node's under the
    # gateway's request span
    (root,) = [s for s in spans if s.name == ROOT]
    (node,) = [s for s in spans if s.name == "ferry.node"]
    assert root.parent_id == CALLER_SPAN and root.service == "ferry-web"
    assert node.parent_id == root.span_id and node.service == "ferry-node" and node.kind == 5  # SPAN_KIND_CONSUMER
    assert node.attributes["ferry.version"] == "digits:1"
    shape = tree(spans)
    assert shape[ROOT] == ["ferry.auth", "ferry.node", "ferry.reply", "ferry.route"]
    assert shape["ferry.node"] == ["ferry.admission", "ferry.batch", "ferry.queue", "ferry.reply"]
    assert shape["ferry.batch"] == ["ferry.device"]
    services = {s.name: s.service for s in spans}
    assert all(services[n] == "ferry-node" for n in ("ferry.admission", "ferry.queue", "ferry.batch", "ferry.device"))


def test_with_several_web_processes_the_node_hosts_part_is_in_the_trace(
    transactional_db,  # noqa: ANN001
    model_files,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
) -> None:
    # given `serve --workers 2` (embedded mode: the node host runs the batches), exporting to one receiver
    receiver = otlp_receiver.start()
    register(model_files.digits, "digits", max_batch_size=8, max_queue_delay_ms=2)
    key = mint_key()
    port = free_port()
    otel = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    serve = start_serve(tmp_path, port, **otel)
    try:
        wait_for("serve ready", lambda: get(port, "/v2/health/ready") == 200, [serve])
        wait_for("digits answered", lambda: post(port, key)[0] == 200, [serve])
        # when a client sends a request inside its own trace
        send_traced(port, key)
        expected = {ROOT, "ferry.node", "ferry.admission", "ferry.queue", "ferry.batch", "ferry.device"}
        deadline = time.monotonic() + SPANS_WAIT_S
        spans = receiver.take(TRACE_ID)
        while not expected <= {s.name for s in spans} and time.monotonic() < deadline:
            time.sleep(0.1)
            spans = receiver.take(TRACE_ID)
    finally:
        stop_all([serve])
        receiver.close()
    # then the node host's part (queue, batch, device) is in the caller's trace, under the web process's span, and
    # named as a node's
    (root,) = [s for s in spans if s.name == ROOT]
    (node,) = [s for s in spans if s.name == "ferry.node"]
    assert root.parent_id == CALLER_SPAN and root.service == "ferry-web"
    assert node.parent_id == root.span_id and node.service == "ferry-node" and node.kind == 5  # SPAN_KIND_CONSUMER
    shape = tree(spans)
    assert {"ferry.admission", "ferry.queue", "ferry.batch"} <= set(shape["ferry.node"])
    assert shape["ferry.batch"] == ["ferry.device"]
