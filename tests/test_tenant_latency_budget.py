"""A tenant's plan may lower the platform's latency budget (`Quota.latency_budget_ms`): asked for and approved
like any limit, bounded, carried in the routing snapshot's TenantEntry, and applied by the gateway as the least
of the platform's, the version's and the plan's budget. A plan never raises it.
"""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from serving.dataplane.errors import DeadlineExceeded, ServingError
from serving.dataplane.gateway import snapshot_redis
from serving.dataplane.gateway.snapshot import RoutingSnapshot, TenantEntry
from serving.dataplane.metrics import metrics
from serving.publish import build_snapshot
from tenants.models import Quota, QuotaRequest, Role, Tenant
from tests.test_admission import Clock
from tests.test_latency_budget import Recording, body, gateway, snapshot
from tests.test_tenant_workflows import person

TENANT, OTHER = 7, 8


def with_plans(snap: RoutingSnapshot, **budgets: int | None) -> RoutingSnapshot:
    """`snap` with tenants TENANT and OTHER, whose plans' budgets are `budgets["tenant"]`, `budgets["other"]`."""
    plan = TenantEntry("t", 1000, 2000, 512, 10**8, 1)
    return dataclasses.replace(
        snap,
        tenants={
            TENANT: dataclasses.replace(plan, slug="t", latency_budget_ms=budgets.get("tenant")),
            OTHER: dataclasses.replace(plan, slug="o", latency_budget_ms=budgets.get("other")),
        },
    )


async def left(snap: RoutingSnapshot, viewer: int | None, timeout_us: int | None = None) -> float:
    clock, transport = Clock(), Recording()
    reply = await gateway(snap, transport, clock).infer("m", None, body(timeout_us), None, viewer)
    assert reply.status == 200
    return transport.deadlines[0] - clock.now


# -- the gateway applies the least budget --------------------------------------------------------------


async def test_a_plans_lower_budget_is_the_deadline_of_its_requests_only() -> None:
    # given a 300 ms platform budget and a tenant whose plan says 100 ms
    snap = with_plans(snapshot(300), tenant=100)
    # then its requests without a deadline get 100 ms, and a longer client deadline is cut to it
    assert await left(snap, TENANT) == pytest.approx(0.100)
    assert await left(snap, TENANT, timeout_us=250_000) == pytest.approx(0.100)
    # and a shorter client deadline is kept
    assert await left(snap, TENANT, timeout_us=40_000) == pytest.approx(0.040)
    # and another tenant, and the data plane's own calls, keep the platform's 300 ms
    assert await left(snap, OTHER) == pytest.approx(0.300)
    assert await left(snap, None) == pytest.approx(0.300)


async def test_a_plan_never_raises_the_budget() -> None:
    # given a plan of 5 s over the platform's 300 ms / then its requests get 300 ms
    assert await left(with_plans(snapshot(300), tenant=5000), TENANT) == pytest.approx(0.300)
    assert await left(with_plans(snapshot(300), tenant=5000), TENANT, timeout_us=2_000_000) == pytest.approx(0.300)


async def test_a_versions_lower_default_wins_over_the_plan() -> None:
    # given plan 150 ms, platform 300 ms, the version's default_timeout_ms 80 / then 80 ms
    assert await left(with_plans(snapshot(300, default_timeout_ms=80), tenant=150), TENANT) == pytest.approx(0.080)
    # and with the version at 1 s, the plan's 150 ms
    assert await left(with_plans(snapshot(300), tenant=150), TENANT) == pytest.approx(0.150)


def test_the_snapshot_in_redis_keeps_the_plans_budget() -> None:
    snap = with_plans(snapshot(300), tenant=120)
    decoded = snapshot_redis.decode(snapshot_redis.encode(snap))
    assert decoded.tenants[TENANT].latency_budget_ms == 120 and decoded.tenants[OTHER].latency_budget_ms is None
    # and a snapshot published before the field existed decodes with no plan budget
    doc = orjson.loads(snapshot_redis.encode(snap))
    for tenant in doc["tenants"].values():
        del tenant["latency_budget_ms"]
    assert snapshot_redis.decode(orjson.dumps(doc)).tenants[TENANT].latency_budget_ms is None


# -- the plan, asked for, approved and published ---------------------------------------------------------


@pytest.fixture
def acme(db) -> Tenant:  # noqa: ANN001
    return Tenant.objects.create(slug="acme", name="Acme")


@pytest.fixture
def alice(acme: Tenant) -> APIClient:
    return person("alice", acme, Role.ADMIN)


@pytest.fixture
def root(db) -> APIClient:  # noqa: ANN001
    return person("root", is_staff=True)


def ask(client: APIClient, changes: dict) -> object:
    return client.post("/api/tenants/acme/quota-requests/", {"changes": changes, "justification": "x"}, format="json")


def approve(client: APIClient, request_id: int) -> object:
    return client.post(f"/api/tenants/acme/quota-requests/{request_id}/approve/", {}, format="json")


@pytest.mark.django_db
def test_an_approved_plan_budget_is_published_and_can_be_cleared(
    alice: APIClient, root: APIClient, acme: Tenant
) -> None:
    # given no plan budget: the tenant reads null, and the snapshot carries none
    assert alice.get("/api/tenants/acme/quota/").json()["latency_budget_ms"] is None
    assert build_snapshot().tenants[acme.pk].latency_budget_ms is None
    # when its admin asks for 150 ms and staff approve
    filed = ask(alice, {"latency_budget_ms": 150})
    assert filed.status_code == 201, filed.content
    assert (
        root.post(f"/api/tenants/acme/quota-requests/{filed.json()['id']}/approve/", {}, format="json").status_code
        == 200
    )
    # then the quota and the routing snapshot hold it
    assert alice.get("/api/tenants/acme/quota/").json()["latency_budget_ms"] == 150
    snap = build_snapshot()
    assert snap.tenants[acme.pk].latency_budget_ms == 150
    # when a later request clears it (null) and is approved / then the platform's budget applies again
    cleared = ask(alice, {"latency_budget_ms": None})
    assert cleared.status_code == 201, cleared.content
    assert (
        root.post(f"/api/tenants/acme/quota-requests/{cleared.json()['id']}/approve/", {}, format="json").status_code
        == 200
    )
    assert Quota.objects.get(tenant=acme).latency_budget_ms is None
    assert build_snapshot().tenants[acme.pk].latency_budget_ms is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    "value", [0, -1, -300, 600_001, 2**31, 10**30, "100", "", 1.5, 100.0, True, [100], {"ms": 100}]
)
def test_bad_plan_budgets_are_400(alice: APIClient, value: object) -> None:
    response = ask(alice, {"latency_budget_ms": value})
    assert response.status_code == 400, (value, response.content)
    assert "latency_budget_ms" in response.content.decode(), response.content
    assert not QuotaRequest.objects.exists()


@pytest.mark.django_db
def test_only_the_plan_budget_may_be_null(alice: APIClient) -> None:
    response = ask(alice, {"burst": None})
    assert response.status_code == 400, response.content
    assert not QuotaRequest.objects.exists()


@pytest.mark.django_db
def test_the_set_quota_command_sets_bounds_and_clears_the_plan_budget(acme: Tenant) -> None:
    call_command("set_quota", "acme", "latency_budget_ms=200")
    assert Quota.objects.get(tenant=acme).latency_budget_ms == 200
    for bad in ("latency_budget_ms=0", "latency_budget_ms=9999999", "latency_budget_ms=soon", "burst=none"):
        with pytest.raises(CommandError):
            call_command("set_quota", "acme", bad)
    assert Quota.objects.get(tenant=acme).latency_budget_ms == 200
    call_command("set_quota", "acme", "latency_budget_ms=none")
    assert Quota.objects.get(tenant=acme).latency_budget_ms is None


def test_a_pipelines_budget_and_the_config_endpoints_take_the_plans_budget_too() -> None:
    # a pipeline's call has no version of its own: the platform's budget, lowered by the caller's plan
    snap = with_plans(snapshot(300, default_timeout_ms=200), tenant=120, other=5000)
    assert snap.tenant_budget_ms(TENANT) == 120 and snap.tenant_budget_ms(OTHER) == 300
    assert snap.tenant_budget_ms(None) == 300
    # and a version's budget for the caller (what /config and gRPC's ModelConfig report) is the least of all
    version = snap.models["m"].versions[1]
    assert snap.budget_ms(version, TENANT) == 120 and snap.budget_ms(version, OTHER) == 200


class Late:
    """A transport whose every request passes its deadline in the node (504)."""

    async def infer(self, entry, inputs, rows, deadline, priority, **_):  # noqa: ANN001, ANN003, ANN201
        raise DeadlineExceeded("deadline passed while queued")


async def test_a_504_is_answered_and_counted_by_model_and_version() -> None:
    # 504 means the server's estimate was wrong: each one counts in ferry_requests_total{model,version,status}
    counted = metrics.REQUESTS.labels("m", "1", "504")
    before = counted.value
    reply_status = None
    try:
        await gateway(with_plans(snapshot(300)), Late(), Clock()).infer("m", None, body(), None, TENANT)
    except ServingError as exc:
        reply_status = exc.status
    assert reply_status == 504
    assert counted.value == before + 1
