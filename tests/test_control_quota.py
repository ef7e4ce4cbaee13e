"""/v2 control calls count against the tenant's quota: metadata, config, ready and the repository index take a
request as inference does, and repository load/unload also a token of their own, slower bucket: past either,
429 with Retry-After and the RateLimit headers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from serving.policies.quota import CONTROL, ControlBuckets
from tests.conftest import LiveServer, register
from tests.test_inference_http import assert_error, call
from tests.test_quota_http import RATE_HEADERS, SMALL, set_quota


@pytest.fixture
def served(transactional_db, model_files, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    # no shedding on a busy test machine; one load or unload a minute per tenant
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    settings.FERRY_CONTROL_LOADS_PER_MINUTE = 1
    settings.FERRY_CONTROL_LOAD_BURST = 1
    register(model_files.digits, "digits", **SMALL)
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def assert_429(resp, *fragments: str) -> None:  # noqa: ANN001
    assert_error(resp, 429, *fragments)
    assert int(resp.headers["retry-after"]) >= 1
    for name in RATE_HEADERS:
        assert resp.headers[name].isdigit(), (name, resp.headers)


def test_metadata_and_the_repository_index_take_requests_of_the_quota(served) -> None:  # noqa: ANN001
    # given a tenant with 4 requests left this month
    set_quota(monthly_requests=4)
    served.refresh()
    # when it asks for metadata, config, readiness and the index: each answered, with the RateLimit headers
    for method, path in (
        ("GET", "/v2/models/digits"),
        ("GET", "/v2/models/digits/config"),
        ("GET", "/v2/models/digits/ready"),
        ("POST", "/v2/repository/index"),
    ):
        resp = call(served, method, path, {} if method == "POST" else None)
        assert resp.status == 200, (path, resp.status, resp.body)
        assert all(name in resp.headers for name in RATE_HEADERS), (path, resp.headers)
    # then the next of any of them is over the quota
    assert_429(call(served, "GET", "/v2/models/digits"), "monthly")
    assert_429(call(served, "POST", "/v2/repository/index", {}), "monthly")
    # and the anonymous probes stay outside it
    assert call(served, "GET", "/v2/health/ready", auth=None).status == 200


def test_load_and_unload_have_their_own_lower_rate(served) -> None:  # noqa: ANN001
    # given one load or unload a minute (the fixture), and plenty of requests
    resp = call(served, "POST", "/v2/repository/models/digits/load", {})
    assert resp.status == 200, resp.body
    assert all(name in resp.headers for name in RATE_HEADERS)
    # when the tenant loads or unloads again within the minute / then 429, naming the load/unload quota
    assert_429(call(served, "POST", "/v2/repository/models/digits/unload", {}), "loads and unloads")
    assert_429(call(served, "POST", "/v2/repository/models/digits/load", {}), "loads and unloads")
    # and the rest of the quota is untouched: metadata is still answered
    assert call(served, "GET", "/v2/models/digits").status == 200


def test_the_control_bucket_refills_at_its_rate_on_the_injected_clock() -> None:
    now = itertools.count(step=0)  # a clock that stands still unless moved
    t = [0.0]
    buckets = ControlBuckets(rate=1 / 60, burst=2, clock=lambda: t[0] + next(now))
    assert buckets.admit(7).admitted and buckets.admit(7).admitted
    refused = buckets.admit(7)
    assert not refused.admitted and refused.reason == CONTROL
    assert refused.retry_after == pytest.approx(60.0)
    assert buckets.admit(8).admitted  # per tenant
    t[0] = 60.0
    assert buckets.admit(7).admitted
    assert not buckets.admit(7).admitted
    buckets.refund(7)  # a call the request quota refused after its token was taken
    assert buckets.admit(7).admitted
