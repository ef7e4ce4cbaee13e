"""The response cache through the real server (embedded mode): a repeat of an identical request to a version
that opted in is answered without a batch, counted in /metrics, and still takes its tenant's quota."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from django.utils import timezone

from serving.models import ModelVersion
from tests.conftest import LiveServer, register
from tests.test_inference_http import call, digits_request, grew, metrics
from tests.test_quota_http import set_quota

INFER = "/v2/models/digits/infer"


@pytest.fixture
def server(transactional_db, model_files, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    # Not a saturation test: a busy machine must not shed these requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    register(model_files.digits, "digits", max_batch_size=16, max_queue_delay_ms=2)
    ModelVersion.objects.filter(model__name="digits").update(response_cache=True)
    live = LiveServer().start()
    try:
        yield live
    finally:
        live.stop()


def test_a_repeat_is_answered_from_the_cache_without_a_batch_and_still_counts_against_the_quota(server) -> None:  # noqa: ANN001
    rows = np.random.default_rng(7).random((2, 64), dtype=np.float32)
    before = metrics(server)
    # given one answer computed
    first = call(server, "POST", INFER, digits_request(rows))
    assert first.status == 200, first.body
    middle = metrics(server)
    assert grew(before, middle, "ferry_response_cache_lookups_total", model="digits", result="miss") == 1
    assert grew(before, middle, "ferry_batch_size_count", model="digits") == 1
    # when the same request comes again
    second = call(server, "POST", INFER, digits_request(rows))
    after = metrics(server)
    # then it has the same outputs, from the cache: a hit, and no batch ran for it
    assert second.status == 200, second.body
    assert second.json()["outputs"] == first.json()["outputs"]
    assert grew(middle, after, "ferry_response_cache_lookups_total", model="digits", result="hit_local") == 1
    assert grew(middle, after, "ferry_batch_size_count", model="digits") == 0
    assert grew(middle, after, "ferry_requests_total", model="digits", status="200") == 1
    # and another input, or other outputs asked for, is a miss that runs
    other = call(server, "POST", INFER, digits_request(rows[:1]))
    asked = call(server, "POST", INFER, digits_request(rows, outputs=[{"name": "scores"}]))
    assert other.status == asked.status == 200
    last = metrics(server)
    assert grew(after, last, "ferry_response_cache_lookups_total", model="digits", result="miss") == 2
    assert grew(after, last, "ferry_batch_size_count", model="digits") == 2
    # and when the tenant's quota is spent, a request that would be a hit is refused like any other
    set_quota(requests_per_second=1, burst=1)
    server.refresh()
    statuses = [call(server, "POST", INFER, digits_request(rows)).status for _ in range(3)]
    assert 429 in statuses
    assert grew(last, metrics(server), "ferry_batch_size_count", model="digits") == 0


def test_a_version_that_did_not_opt_in_is_never_cached(server) -> None:  # noqa: ANN001
    # updated_at moves, as the PATCH moves it: the registry's fingerprint changes and the snapshot is rebuilt
    ModelVersion.objects.filter(model__name="digits").update(response_cache=False, updated_at=timezone.now())
    server.refresh()
    rows = np.ones((1, 64), np.float32)
    before = metrics(server)
    for _ in range(2):
        assert call(server, "POST", INFER, digits_request(rows)).status == 200
    after = metrics(server)
    assert grew(before, after, "ferry_batch_size_count", model="digits") == 2
    assert grew(before, after, "ferry_response_cache_lookups_total", model="digits", result="miss") == 0
