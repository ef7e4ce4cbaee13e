"""Defects a review found in the serving core, each shown over HTTP against a live Ferry.

Bad input must be a 4xx found by validation; a genuine bug a 500 that is logged and counted;
shedding visible in /metrics; registry edits unable to wedge or break serving.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import numpy as np
import orjson
import pytest
from django.utils import timezone

from serving.dataplane.http.frontdoor import GATE
from serving.models import ModelVersion
from tests.conftest import register
from tests.test_inference_http import (
    HELD,
    _hold_one,
    assert_error,
    call,
    digits_request,
    grew,
    in_background,
    infer,
    joined,
    metrics,
    scores,
    wait_until,
)


@pytest.mark.parametrize("suffix", ["", "/ready", "/config", "/infer"])
def test_version_segments_that_only_look_like_digits_are_404(digits_server, suffix: str) -> None:  # noqa: ANN001
    # given version segments that str.isdigit() accepts but are no version number
    for version in ("²", "١", "1²"):
        method = "POST" if suffix == "/infer" else "GET"
        body = digits_request(np.zeros((1, 64), np.float32)) if method == "POST" else None
        # when addressed / then 404 naming the version, never a 5xx
        resp = call(digits_server, method, f"/v2/models/digits/versions/{quote(version)}{suffix}", body)
        assert_error(resp, 404, "version")


def test_an_unexpected_exception_is_a_counted_500(digits_server, digits_samples, monkeypatch) -> None:  # noqa: ANN001
    x, _ = digits_samples
    plane = digits_server.plane()
    before = metrics(digits_server)

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    # given a gateway with a bug
    monkeypatch.setattr(plane.gateway, "infer", broken)
    # when inference is asked / then 500 with a JSON error, not a relabelled 503
    resp = infer(digits_server, "digits", digits_request(x[:1]))
    assert_error(resp, 500, "internal error")
    assert "retry-after" not in resp.headers
    # and it is counted: as an internal error, and among the model's answers
    after = metrics(digits_server)
    assert grew(before, after, "ferry_internal_errors_total", component="inference") == 1
    assert grew(before, after, "ferry_requests_total", model="digits", version="1", status="500") == 1


def test_a_fallback_too_small_for_the_request_is_skipped_not_crashed(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, _ = digits_samples
    # given `big` saturated by one waiting request, whose fallback takes at most 2 rows
    small = register(model_files.digits, "small", max_batch_size=2)
    big = register(model_files.digits, "big", **HELD)
    big.model.fallback = small.model
    big.model.save()
    server = request.getfixturevalue("live_server")
    first, box = _hold_one(server, "big", digits_request(x[:1]))
    before = metrics(server)
    # when a 4-row request for `big` arrives / then 503 for big's full queue (the fallback cannot take 4 rows)
    resp = infer(server, "big", digits_request(x[1:5]))
    assert_error(resp, 503, "max_queue_size")
    assert int(resp.headers["retry-after"]) >= 1
    # and a 1-row request is served by the fallback, which says so in the body and a header
    served = infer(server, "big", digits_request(x[1:2]))
    assert served.status == 200 and served.json()["parameters"] == {"fallback_from": "big:1"}
    assert served.headers["x-ferry-fallback-from"] == "big:1"
    after = metrics(server)
    assert grew(before, after, "ferry_shed_total", model="big", version="1", reason="queue_full", tier="1") == 1
    assert grew(before, after, "ferry_internal_errors_total", component="inference") == 0
    assert joined(first, box).status == 200


@contextlib.contextmanager
def late_loop(plane, limit_ms: float):  # noqa: ANN001, ANN201
    """The plane's event loop held a quarter of a second at a time, again and again, until the block ends; it
    yields once the loop runs more than `limit_ms` late."""
    stop = threading.Event()

    def hog() -> None:
        time.sleep(0.25)
        if not stop.is_set():
            plane.loop.call_later(0.01, hog)

    plane.loop.call_soon_threadsafe(hog)
    try:
        wait_until(lambda: plane.loop_lag * 1000 > limit_ms, "the loop lag to rise")
        yield
    finally:
        stop.set()


def test_a_backed_up_event_loop_sheds_and_counts_it(digits_server, digits_samples, settings, monkeypatch) -> None:  # noqa: ANN001
    x, _ = digits_samples
    settings.FERRY_MAX_LOOP_LAG_MS = 150
    plane = digits_server.plane()
    counted: list[str] = []  # what the transport counts as asked for and refused (the fleet autoscaler's demand)
    monkeypatch.setattr(plane.gateway.transport, "count_refused", counted.append)
    before = metrics(digits_server)
    # given an event loop that keeps running a quarter of a second late
    with late_loop(plane, settings.FERRY_MAX_LOOP_LAG_MS):
        # when inference arrives / then it is refused at once with Retry-After, saying why: the loop is late,
        # or (when it came during a hold, and waited through it before it was read) its own wait
        resp = infer(digits_server, "digits", digits_request(x[:1]))
        message = assert_error(resp, 503, "saturated")
        assert "ms late" in message or "before it was read" in message, message
        assert resp.headers["retry-after"] == "1"
        # and health still answers
        assert call(digits_server, "GET", "/v2/health/live").status == 200
    # and the refusal is counted among the model's answers, as shed by the front end, and as asked for
    after = metrics(digits_server)
    assert grew(before, after, "ferry_requests_total", model="digits", version="1", status="503") >= 1
    assert grew(before, after, "ferry_shed_total", model="digits", version="1", reason="frontend", tier="0") >= 1
    assert "digits:1" in counted, counted
    # and once the loop keeps up again, the front door stops refusing and inference is served
    wait_until(
        lambda: plane.loop_lag * 1000 < settings.FERRY_MAX_LOOP_LAG_MS and GATE.drop == 0,
        "the loop lag and the front door's refusals to fall",
    )
    assert infer(digits_server, "digits", digits_request(x[:1])).status == 200


def test_a_request_its_handler_refuses_for_a_late_loop_is_counted_as_asked_for(  # noqa: ANN001
    digits_server, digits_samples, settings, monkeypatch
) -> None:
    x, _ = digits_samples
    # given a front door that refuses nothing for its own wait (so the handler's check on the loop decides) and
    # a loop that runs late
    settings.FERRY_MAX_LOOP_LAG_MS = 150
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    plane = digits_server.plane()
    counted: list[str] = []
    monkeypatch.setattr(plane.gateway.transport, "count_refused", counted.append)
    with late_loop(plane, settings.FERRY_MAX_LOOP_LAG_MS):
        # when inference arrives, then the handler refuses it for the loop's lag
        message = assert_error(infer(digits_server, "digits", digits_request(x[:1])), 503, "saturated")
    # and the fleet's autoscaler is told it was asked for (in distributed mode, the version's refusal counter):
    # a refusal for the front end's sake is demand all the same (until 2026-12-05 it went uncounted, and
    # tests/test_gateway_admission_processes.py found 15 of 4,254 requests missing from what was asked)
    assert "ms late" in message, message
    assert counted == ["digits:1"], counted
    wait_until(lambda: plane.loop_lag * 1000 < settings.FERRY_MAX_LOOP_LAG_MS and GATE.drop == 0, "the loop to keep up")


def test_a_request_whose_client_left_is_dropped_before_it_runs(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, _ = digits_samples
    # given a model with a 2 s batching window and one request waiting in it
    register(model_files.digits, "held", **{**HELD, "max_queue_size": 4})
    server = request.getfixturevalue("live_server")
    plane = server.plane()
    before = metrics(server)
    body = orjson.dumps(digits_request(x[:1]))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(
        b"POST /v2/models/held/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {server.key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_until(lambda: plane.node.queue_depth("held:1") == 1, "the request to queue")
    # when its client disconnects before the window closes
    sock.close()
    wait_until(
        lambda: grew(before, metrics(server), "ferry_requests_total", model="held", version="1", status="499") == 1,
        "the disconnect to be noticed",
    )
    # then when the window closes the request is dropped unrun: counted as abandoned, no batch computed
    wait_until(lambda: plane.node.queue_depth("held:1") == 0, "the queue to empty")
    after = metrics(server)
    assert grew(before, after, "ferry_abandoned_total", model="held", version="1") == 1
    assert grew(before, after, "ferry_batch_size_count", model="held", version="1") == 0


def test_variable_dims_above_their_declared_maximum_are_400(  # noqa: ANN001
    transactional_db, model_files, request
) -> None:
    # given a tokens model whose variable dimension is declared at most 16 long
    io = {
        "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [-1], "max_shape": [16]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [2]}],
    }
    register(model_files.tokens, "tokens16", io=io)
    server = request.getfixturevalue("live_server")

    def ask(length: int):  # noqa: ANN202
        return infer(
            server,
            "tokens16",
            {"inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, length], "data": [1] * length}]},
        )

    # when a request of 16 tokens comes / then it is served; of 17 / then 400 naming the maximum
    assert ask(16).status == 200
    assert_error(ask(17), 400, "maximum 16")


def test_shrinking_max_batch_size_answers_queued_work_instead_of_wedging(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, y = digits_samples
    # given a 6-row and a 1-row request waiting in a model's 2 s window (max_batch_size 8)
    version = register(model_files.digits, "held", **{**HELD, "max_queue_size": 4})
    server = request.getfixturevalue("live_server")
    plane = server.plane()
    big, big_box = in_background(lambda: infer(server, "held", digits_request(x[:6])))
    wait_until(lambda: plane.node.queue_depth("held:1") == 1, "the 6-row request to queue")
    small, small_box = in_background(lambda: infer(server, "held", digits_request(x[6:7])))
    wait_until(lambda: plane.node.queue_depth("held:1") == 2, "the 1-row request to queue")
    # when the registry shrinks max_batch_size to 4 and the server picks it up
    ModelVersion.objects.filter(pk=version.pk).update(
        max_batch_size=4, preferred_batch_sizes=[], updated_at=timezone.now()
    )
    server.refresh()
    # then the 6-row request is answered 503 with the reason at once, and the 1-row one is served
    assert_error(joined(big, big_box), 503, "max_batch_size changed to 4")
    assert int(scores(joined(small, small_box)).argmax()) == y[6]


def test_one_bad_registry_row_does_not_stop_the_others_serving(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, _ = digits_samples
    # given two models served
    register(model_files.digits, "good")
    bad = register(model_files.digits, "bad")
    server = request.getfixturevalue("live_server")
    # when one row's batching settings are made invalid behind the API's back
    ModelVersion.objects.filter(pk=bad.pk).update(preferred_batch_sizes=[999], updated_at=timezone.now())
    server.refresh()
    # then the other model still serves, and the bad one is listed unservable with the reason
    assert infer(server, "good", digits_request(x[:1])).status == 200
    index = {r["name"]: r for r in call(server, "POST", "/v2/repository/index", b"").json()}
    assert index["bad"]["state"] == "FAILED" and "unservable registry row" in index["bad"]["reason"]
    assert index["good"]["state"] == "READY"
    assert_error(infer(server, "bad", digits_request(x[:1])), 503, "bad")


def test_repository_index_validates_its_body(digits_server) -> None:  # noqa: ANN001
    # given bodies the index cannot take / when posted / then 400 with the reason
    for body, fragment in [
        (b"{nope", "malformed"),
        (b"[1]", "object"),
        (b'{"ready": "yes"}', "ready"),
        (b'{"color": 1}', "unknown field"),
    ]:
        assert_error(call(digits_server, "POST", "/v2/repository/index", body), 400, fragment)
    # and {"ready": true} lists only ready versions, an empty body or {} all of them
    call(digits_server, "POST", "/v2/repository/models/tokens/unload", b"")
    ready = call(digits_server, "POST", "/v2/repository/index", b'{"ready": true}').json()
    everything = call(digits_server, "POST", "/v2/repository/index", b"{}").json()
    assert {r["name"] for r in ready} == {"digits", "digits-export"}
    assert {r["name"] for r in everything} == {"digits", "digits-export", "tokens"}
    # and load/unload bodies are checked the same way
    assert_error(call(digits_server, "POST", "/v2/repository/models/tokens/load", b"[]"), 400, "object")


def test_queue_full_answers_are_counted_as_shed_by_reason_and_tier(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, _ = digits_samples
    register(model_files.digits, "held", **HELD)
    server = request.getfixturevalue("live_server")
    first, box = _hold_one(server, "held", digits_request(x[:1]))
    before = metrics(server)
    # when three more requests arrive at a full queue, at priorities 1 and 3
    with ThreadPoolExecutor(3) as pool:
        answers = list(
            pool.map(lambda p: infer(server, "held", digits_request(x[:1], parameters={"priority": p})), [1, 1, 3])
        )
    assert [a.status for a in answers] == [503, 503, 503]
    # then /metrics says why and at which tier
    after = metrics(server)
    assert grew(before, after, "ferry_shed_total", model="held", version="1", reason="queue_full", tier="1") == 2
    assert grew(before, after, "ferry_shed_total", model="held", version="1", reason="queue_full", tier="3") == 1
    assert joined(first, box).status == 200
