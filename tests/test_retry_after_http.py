"""Every refusal a client may retry says when: a shed 503 (admission, and the front door's gate), a quota
429 and a body-budget 503 each carry Retry-After, on one live server. And the tenant's plan budget
(`Quota.latency_budget_ms`) is the deadline admission holds a request to, end to end.

A shed is made certain without racing the machine: the served version's latency profile is set to say
one batch takes 300 ms, so admission refuses it under a plan budget of 200 ms whatever the load (time spent
waiting only shortens what is left), and admits it under the version's own 1 s (`default_timeout_ms`; the
suite's platform budget is 60 s, tests/xdist_workers.py).
"""

from __future__ import annotations

import socket

import numpy as np
import orjson
import pytest

from serving.dataplane.http.frontdoor import GATE
from serving.policies.batching import LatencyProfile
from tests.conftest import tenant
from tests.test_front_door import TIMEOUT, head, read_response
from tests.test_inference_http import assert_error, digits_request, grew, infer, metrics, sample, wait_until

ZERO = digits_request(np.zeros((1, 64), np.float32))


def set_quota(**limits: object) -> None:
    """The test tenant's quota, saved: the save republishes the routing snapshot on commit."""
    quota = tenant().quota
    for name, value in limits.items():
        setattr(quota, name, value)
    quota.save()


def retry_after(resp) -> int:  # noqa: ANN001
    assert "retry-after" in resp.headers, (resp.status, resp.headers, resp.body)
    value = int(resp.headers["retry-after"])
    assert value >= 1, resp.headers
    return value


def wait_for_plan(server, budget_ms: int | None) -> None:  # noqa: ANN001
    """Until the server's routing snapshot carries the test tenant's plan budget."""
    hub = server.plane().gateway.hub
    tid = tenant().pk
    wait_until(lambda: hub.current.tenants[tid].latency_budget_ms == budget_ms, "the plan published", deadline_s=30)


@pytest.fixture
def quiet(settings) -> None:  # noqa: ANN001
    # The refusals here are driven one by one: a busy test machine must not shed the requests meant to pass.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000


def test_every_503_and_429_carries_retry_after(quiet, digits_server, settings) -> None:  # noqa: ANN001
    server = digits_server
    hosted = server.plane().node.hosted["digits:1"]
    measured = hosted.profile
    before = metrics(server)
    try:
        # given a profile that says a batch of digits takes 300 ms, and the tenant's plan budget of 200 ms
        hosted.profile = LatencyProfile({1: 0.3, 16: 0.3})
        set_quota(latency_budget_ms=200)
        wait_for_plan(server, 200)
        # when it asks without a deadline / then admission sheds it: 503 with Retry-After
        shed = infer(server, "digits", ZERO)
        assert_error(shed, 503, "exceeds the request's deadline")
        retry_after(shed)
        # and a longer client deadline does not buy it more than its plan's 200 ms
        shed = infer(server, "digits", {**ZERO, "parameters": {"timeout": 30_000_000}})
        assert_error(shed, 503, "deadline")
        retry_after(shed)
        # when the plan's budget is cleared / then the version's 1 s admits it
        set_quota(latency_budget_ms=None)
        wait_for_plan(server, None)
        assert infer(server, "digits", ZERO).status == 200
    finally:
        hosted.profile = measured
    after = metrics(server)
    assert grew(before, after, "ferry_shed_total", model="digits", version="1", reason="deadline", tier="1") == 2

    # the front door's gate, refusing as when the event loop runs late: 503 with Retry-After
    try:
        GATE.drop = 1.0
        GATE.draw = lambda: 0.0
        gated = infer(server, "digits", ZERO)
        assert_error(gated, 503, "server saturated")
        retry_after(gated)
    finally:
        GATE.reset()

    # the tenant's quota: its requests per second spent, 429 with Retry-After
    set_quota(requests_per_second=1, burst=1)
    try:
        answers = [infer(server, "digits", ZERO) for _ in range(3)]  # a bucket of one: at most two within 1 s
        refused = [a for a in answers if a.status == 429]
        assert refused, [a.status for a in answers]
        for resp in refused:
            assert_error(resp, 429, "requests per second")
            retry_after(resp)
    finally:
        set_quota(requests_per_second=1000, burst=2000)

    # the process's budget of request-body bytes held: 503 with Retry-After
    settings.FERRY_MAX_INFLIGHT_BODY_BYTES = 256 * 1024
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 60
    good = orjson.dumps(ZERO)
    body = good[:-1] + b" " * (200 * 1024) + b"}"
    held = 150 * 1024

    def gauge() -> float:
        return sample(metrics(server), "ferry_frontdoor_inflight_body_bytes") or 0.0

    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as first:
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        first.sendall(head("POST", "/v2/models/digits/infer", {**headers, "Authorization": f"Bearer {server.key}"}))
        first.sendall(body[:held])
        wait_until(lambda: gauge() >= held, "the server holding the first body", deadline_s=15)
        over = infer(server, "digits", body)
        assert_error(over, 503, "bytes of request bodies")
        retry_after(over)
        wait_until(lambda: gauge() <= held, "the refused body released", deadline_s=15)
        first.sendall(body[held:])
        assert read_response(first).status == 200
