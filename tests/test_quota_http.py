"""Quotas end to end: 429 with Retry-After and RateLimit headers on /v2 inference (in-process, through the
real Redis, and with Redis down), a quota change in force without a restart, and the registry's count
and accelerator-memory quotas."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import numpy as np
import pytest
import redis
from django.utils import timezone

from serving.dataplane.gateway.quota_redis import keys_of
from tests.conftest import DIGITS_IO, LiveServer, free_port, register, tenant
from tests.test_inference_http import assert_error, call, digits_request, grew, infer, metrics, sample

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
ZERO = digits_request(np.zeros((1, 64), np.float32))
SMALL = {"max_batch_size": 4, "max_queue_delay_ms": 1}
RATE_HEADERS = ("ratelimit-limit", "ratelimit-remaining", "ratelimit-reset")


def set_quota(slug: str = "test", **limits: object) -> None:
    """Change a tenant's quota the way the console does: save(), which republishes the snapshot on commit."""
    quota = tenant(slug).quota
    for name, value in limits.items():
        setattr(quota, name, value)
    quota.save()


@pytest.fixture
def quiet(settings) -> None:  # noqa: ANN001
    # These tests are about quotas, not saturation: a busy test machine must not shed their requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000


@pytest.fixture
def served(transactional_db, model_files, quiet) -> Iterator[LiveServer]:  # noqa: ANN001
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
    assert resp.headers["ratelimit-remaining"] == "0"


def test_monthly_budget_answers_429_and_a_raised_quota_is_in_force_without_restart(served) -> None:  # noqa: ANN001
    # given the test tenant may send 2 requests this month
    set_quota(monthly_requests=2)
    before = metrics(served)
    # when it sends 2: both served, with the bucket's RateLimit headers
    for _ in range(2):
        resp = infer(served, "digits", ZERO)
        assert resp.status == 200, resp.body
        assert all(name in resp.headers for name in RATE_HEADERS) and "retry-after" not in resp.headers
    # then the third is 429, naming the monthly budget, with the month's numbers in the headers
    resp = infer(served, "digits", ZERO)
    assert_429(resp, "monthly")
    assert resp.headers["ratelimit-limit"] == "2"
    assert int(resp.headers["retry-after"]) <= 31 * 86400
    after = metrics(served)
    assert grew(before, after, "ferry_requests_total", model="digits", version="1", status="429") == 1
    assert grew(before, after, "ferry_quota_refusals_total", tenant="test", reason="monthly") == 1
    # and the refusal is in the tenant's usage, as a 4xx answer of digits:1
    from serving.dataplane import plane as dataplane

    cells = dict(dataplane.current().gateway.usage._cells)
    assert sum(c.errors_4xx for (t, m, v, _), c in cells.items() if (t, m, v) == (tenant().pk, "digits", 1)) == 1
    # when staff raise the quota (saved: republished on commit) / then the next request is served
    set_quota(monthly_requests=100)
    assert infer(served, "digits", ZERO).status == 200
    # when another process lowers it (no signal here: an update() as a worker's would be seen by the
    # periodic refresh, whose fingerprint covers quotas) / then it holds from the next refresh
    from tenants.models import Quota

    Quota.objects.filter(tenant=tenant()).update(monthly_requests=1, updated_at=timezone.now())
    served.refresh()
    assert_429(infer(served, "digits", ZERO), "monthly")


def test_rate_limit_answers_429_and_other_tenants_are_not_charged(served) -> None:  # noqa: ANN001
    from tests.conftest import mint_key

    # given the test tenant: a bucket of 3 at 1/s; another tenant with the default quota
    set_quota(requests_per_second=1, burst=3)
    other = mint_key("other", scopes=("infer",))
    started = time.monotonic()
    answers = [infer(served, "digits", ZERO) for _ in range(8)]
    elapsed = time.monotonic() - started
    admitted = [r for r in answers if r.status == 200]
    refused = [r for r in answers if r.status != 200]
    # then no more pass than the bucket and its refill allow, the rest are 429 for rate
    assert len(admitted) <= 3 + int(elapsed) + 1
    assert refused
    for resp in refused:
        assert_429(resp, "requests per second")
        assert resp.headers["ratelimit-limit"] == "3"
    # while another tenant's requests pass
    assert infer(served, "digits", ZERO, auth=other).status == 200


def test_in_flight_limit_of_zero_refuses_and_names_it(served) -> None:  # noqa: ANN001
    set_quota(max_in_flight=0)
    resp = infer(served, "digits", ZERO)
    assert_429(resp, "in flight")
    assert resp.headers["ratelimit-limit"] == "0"
    # an in-flight limit is not a rate: the other endpoints of the model stay open
    assert call(served, "GET", "/v2/models/digits").status == 200


@pytest.fixture
def redis_quota(settings) -> Iterator[str]:  # noqa: ANN001
    settings.FERRY_QUOTA_REDIS_URL = REDIS_URL
    yield REDIS_URL


def test_quotas_through_redis(transactional_db, model_files, quiet, redis_quota) -> None:  # noqa: ANN001
    # given a server whose quotas live in Redis, and a tenant with a bucket of 2
    register(model_files.digits, "digits", **SMALL)
    tid = tenant().pk
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*keys_of(tid))
    set_quota(requests_per_second=1, burst=2)
    server = LiveServer().start()
    try:
        answers = [infer(server, "digits", ZERO) for _ in range(5)]
        admitted = sum(r.status == 200 for r in answers)
        for resp in answers:
            if resp.status != 200:
                assert_429(resp, "requests per second")
        # then Redis counted exactly the admitted requests this month
        assert int(client.hget(keys_of(tid)[0], "used")) == admitted
        assert admitted < 5
        # and every in-flight lease was released once answered (removed by a background task)
        deadline = time.monotonic() + 10
        while client.zcard(keys_of(tid)[1]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.zcard(keys_of(tid)[1]) == 0
    finally:
        server.stop()
        client.delete(*keys_of(tid))
        client.close()


def test_redis_down_falls_back_in_process_and_never_500s(transactional_db, model_files, quiet, settings) -> None:  # noqa: ANN001,E501
    # given quotas pointed at a Redis that does not listen, two gateways expected
    settings.FERRY_QUOTA_REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    settings.FERRY_QUOTA_GATEWAYS = 2
    register(model_files.digits, "digits", **SMALL)
    set_quota(requests_per_second=1, burst=4)
    server = LiveServer().start()
    try:
        fell_back = sample(metrics(server), "ferry_quota_fallback_total") or 0.0
        started = time.monotonic()
        answers = [infer(server, "digits", ZERO) for _ in range(6)]
        elapsed = time.monotonic() - started
        # then every answer is 200 or 429, never a 500
        assert {r.status for r in answers} <= {200, 429}, [r.body for r in answers]
        # and this gateway allowed its half: a bucket of 2 refilling at 0.5/s
        assert sum(r.status == 200 for r in answers) <= 2 + int(elapsed * 0.5) + 1
        assert (sample(metrics(server), "ferry_quota_fallback_total") or 0.0) - fell_back == 6
    finally:
        server.stop()


# -- the registry's quotas ------------------------------------------------------------------------------


def _register(path, name: str, tenant_id: int | None):  # noqa: ANN001, ANN202
    from serving.actions import register_version

    with path.open("rb") as f:
        return register_version(
            model_name=name,
            artifact_file=f,
            fmt="torchscript",
            inputs=DIGITS_IO["inputs"],
            outputs=DIGITS_IO["outputs"],
            validate="none",
            tenant_id=tenant_id,
        )


def test_max_models_and_max_versions_at_registration(db, model_files) -> None:  # noqa: ANN001
    from serving.actions import RegistrationError
    from serving.models import Model, ModelVersion, State

    owner = tenant("owner")
    set_quota("owner", max_models=1, max_versions=2)
    first = _register(model_files.digits, "a", owner.pk)
    assert first.model.tenant_id == owner.pk
    # when a second model is registered for the tenant / then 429 naming max_models, and nothing is left
    with pytest.raises(RegistrationError) as full:
        _register(model_files.digits, "b", owner.pk)
    assert full.value.status == 429 and "max_models" in full.value.message
    assert not Model.objects.filter(name="b").exists()
    # a platform model (no tenant) has no quota
    _register(model_files.digits, "platform-b", None)
    # when versions fill max_versions / then the next is refused, until one is retired
    _register(model_files.digits, "a", owner.pk)
    with pytest.raises(RegistrationError) as full:
        _register(model_files.digits, "a", owner.pk)
    assert full.value.status == 429 and "max_versions" in full.value.message
    assert ModelVersion.objects.filter(model__name="a").count() == 2
    first.retire()
    assert _register(model_files.digits, "a", owner.pk).version == 3
    assert ModelVersion.objects.filter(model__name="a").exclude(state=State.RETIRED).count() == 2


@pytest.mark.django_db(transaction=True)
def test_upload_over_max_versions_is_a_json_429_without_retry_after(model_files) -> None:  # noqa: ANN001
    import io
    import json

    from django.contrib.auth.models import User
    from rest_framework.test import APIClient

    from tenants.models import Membership, Role

    acme = tenant("acme")
    bob = User.objects.create_user("bob", "bob@example.org")
    Membership.objects.create(user=bob, tenant=acme, role=Role.ENGINEER)
    _register(model_files.digits, "mine", acme.pk)
    set_quota("acme", max_versions=1)
    client = APIClient()
    client.force_login(bob)
    artifact = io.BytesIO(model_files.digits.read_bytes())
    artifact.name = "digits.pt"
    resp = client.post(
        "/api/models/mine/versions/",
        {
            "format": "torchscript",
            "inputs": json.dumps(DIGITS_IO["inputs"]),
            "outputs": json.dumps(DIGITS_IO["outputs"]),
            "artifact": artifact,
        },
        format="multipart",
    )
    assert resp.status_code == 429, resp.content
    assert "max_versions" in resp.json()["error"]
    assert "Retry-After" not in resp


def test_accelerator_memory_quota_leaves_a_version_unloaded_and_refuses_a_load(db, model_files) -> None:  # noqa: ANN001
    from serving.actions import RegistrationError, set_loaded
    from serving.models import ModelVersion, State
    from serving.validation import validate

    owner = tenant("owner")
    set_quota("owner", max_accelerator_bytes=1)
    # when a private model's version is validated and its footprint exceeds the quota
    version = validate(_register(model_files.digits, "big", owner.pk))
    # then it is ready but not loaded, saying why
    assert version.state == State.READY and version.memory_bytes > 1
    assert not version.loaded and "max_accelerator_bytes" in version.failure_reason
    # and loading it is refused with 429
    with pytest.raises(RegistrationError) as full:
        set_loaded(model_name="big", loaded=True)
    assert full.value.status == 429 and "max_accelerator_bytes" in full.value.message
    # when the quota is raised / then it loads, and the reason is gone
    set_quota("owner", max_accelerator_bytes=version.memory_bytes)
    set_loaded(model_name="big", loaded=True)
    version = ModelVersion.objects.get(pk=version.pk)
    assert version.loaded and version.failure_reason == ""
    # a second private model that does not fit beside it is left unloaded
    second = validate(_register(model_files.digits, "big2", owner.pk))
    assert not second.loaded


def test_repository_load_over_accelerator_quota_is_429(transactional_db, model_files, quiet) -> None:  # noqa: ANN001
    from serving.validation import validate

    owner = tenant()
    set_quota(max_accelerator_bytes=1)
    validate(_register(model_files.digits, "big", owner.pk))
    server = LiveServer().start()
    try:
        resp = call(server, "POST", "/v2/repository/models/big/load", b"")
        assert_error(resp, 429, "max_accelerator_bytes")
        assert "retry-after" not in resp.headers
    finally:
        server.stop()


# -- the tenant's priority tier -------------------------------------------------------------------------


class RecordingTransport:
    """Answers zeros and records the priority each request was queued at."""

    def __init__(self) -> None:
        self.priorities: list[int] = []

    async def infer(self, entry, inputs, rows, deadline, priority, *, nbytes=0, gone=None, **_):  # noqa: ANN001, ANN003, ANN201
        import numpy as np

        self.priorities.append(priority)
        return {spec.name: np.zeros((rows, *spec.shape), np.float32) for spec in entry.outputs}


def test_the_gateway_queues_at_the_tenant_tier_or_lower(db, model_files) -> None:  # noqa: ANN001
    import asyncio

    import orjson

    from serving.dataplane.gateway.gateway import Gateway
    from serving.dataplane.gateway.snapshot import SnapshotHub
    from serving.publish import build_snapshot

    register(model_files.digits, "digits")
    hub = SnapshotHub()
    hub.set(build_snapshot())
    transport = RecordingTransport()
    gateway = Gateway(hub, transport)

    def body(priority: int) -> bytes:
        return orjson.dumps(
            {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}],
                "parameters": {"priority": priority},
            }
        )

    # a tier-2 tenant: no priority asks for its tier; asking for 1 gets 2; asking for 3 gets 3
    for asked in (0, 1, 3):
        assert asyncio.run(gateway.infer("digits", None, body(asked), None, None, tier=2)).status == 200
    assert transport.priorities == [2, 2, 3]
