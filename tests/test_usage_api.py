"""GET /api/usage/: who sees which tenant's usage, validation, granularity, CSV; and usage end to end,
from inference through the live server to the API."""

from __future__ import annotations

import asyncio
import base64
import csv
import http.client
import io
import json
from datetime import UTC, datetime, timedelta

import orjson
import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from tenants.models import Membership, Role, Tenant
from usage.ingest import ingest
from usage.recorder import UsageRecorder

URL = "/api/usage/"


def minute_of(at: datetime) -> int:
    return int(at.timestamp() // 60)


def put_usage(
    tenant: Tenant,
    at: datetime,
    *answers: tuple[int, int, float, float],
    model: str = "digits",
    version: int = 1,
    batch: str | None = None,
) -> None:
    rec = UsageRecorder(lambda: at.timestamp())
    for status, items, compute, latency in answers:
        rec.record(tenant.pk, model, version, status, items, compute, latency)
    ingest(batch or f"{tenant.slug}-{model}-{version}-{at.isoformat()}", rec.drain().rows())


@pytest.fixture
def world(db) -> dict:  # noqa: ANN001
    """Acme (owner alice, member bob) and Globex (owner charlie) with usage; staff sees everything."""
    acme = Tenant.objects.create(name="Acme", slug="acme")
    globex = Tenant.objects.create(name="Globex", slug="globex")
    users = {
        "alice": User.objects.create_user("alice"),
        "bob": User.objects.create_user("bob"),
        "charlie": User.objects.create_user("charlie"),
        "staff": User.objects.create_user("staff", is_staff=True),
    }
    Membership.objects.create(user=users["alice"], tenant=acme, role=Role.ADMIN)
    Membership.objects.create(user=users["bob"], tenant=acme, role=Role.VIEWER)
    Membership.objects.create(user=users["charlie"], tenant=globex, role=Role.ADMIN)
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    put_usage(acme, now - timedelta(minutes=5), (200, 4, 0.004, 0.010), (200, 1, 0.001, 0.020), (503, 0, 0.0, 0.1))
    put_usage(acme, now - timedelta(minutes=4), (200, 2, 0.002, 0.030), (400, 0, 0.0, 0.001))
    put_usage(acme, now - timedelta(minutes=4), (200, 3, 0.003, 0.030), model="digits", version=2)
    put_usage(globex, now - timedelta(minutes=5), (200, 9, 0.009, 0.040))
    return {"acme": acme, "globex": globex, "users": users, "now": now}


def client_for(user: User) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def tenants_in(response) -> set[str]:  # noqa: ANN001
    return {row["tenant"] for row in response.json()["results"]}


def test_a_member_sees_only_its_tenants_usage(world) -> None:  # noqa: ANN001
    for name in ("alice", "bob"):
        # given a member of Acme / when asking for usage without a tenant / then only Acme's rows
        response = client_for(world["users"][name]).get(URL)
        assert response.status_code == 200, response.content
        assert tenants_in(response) == {"acme"}
        # and naming Acme gives the same
        assert tenants_in(client_for(world["users"][name]).get(URL, {"tenant": "acme"})) == {"acme"}


def test_an_outsider_gets_404_for_another_tenant_like_a_missing_one(world) -> None:  # noqa: ANN001
    charlie = client_for(world["users"]["charlie"])
    other = charlie.get(URL, {"tenant": "acme"})
    missing = charlie.get(URL, {"tenant": "no-such-tenant"})
    assert other.status_code == missing.status_code == 404
    assert other.json() == {"error": "unknown tenant 'acme'"}
    assert tenants_in(charlie.get(URL)) == {"globex"}


def test_staff_see_every_tenant_and_may_pick_one(world) -> None:  # noqa: ANN001
    staff = client_for(world["users"]["staff"])
    assert tenants_in(staff.get(URL)) == {"acme", "globex"}
    assert tenants_in(staff.get(URL, {"tenant": "globex"})) == {"globex"}


def test_anonymous_is_refused(world) -> None:  # noqa: ANN001
    response = APIClient().get(URL)
    assert response.status_code == 403 and "error" in response.json()


def test_minute_rows_carry_counts_and_percentiles(world) -> None:  # noqa: ANN001
    response = client_for(world["users"]["alice"]).get(URL, {"model": "digits", "version": 1})
    rows = response.json()["results"]
    assert [r["start"] for r in rows] == sorted(r["start"] for r in rows) and len(rows) == 2
    first = rows[0]
    assert (first["requests"], first["errors_4xx"], first["errors_5xx"], first["items"]) == (3, 0, 1, 5)
    assert first["compute_seconds"] == pytest.approx(0.005)
    assert first["p50_ms"] == pytest.approx(20, rel=0.05) and first["p99_ms"] == pytest.approx(100, rel=0.05)


def test_hour_granularity_sums_minutes_and_merges_sketches(world) -> None:  # noqa: ANN001
    now = world["now"]
    response = client_for(world["users"]["alice"]).get(
        URL,
        {
            "granularity": "hour",
            "version": "1",
            "from": (now - timedelta(hours=3)).isoformat(),
            "to": (now + timedelta(hours=1)).isoformat(),
        },
    )
    rows = response.json()["results"]
    # the two minutes may straddle an hour boundary: sum whatever hours they fell in
    assert sum(r["requests"] for r in rows) == 5
    assert sum(r["errors_4xx"] for r in rows) == 1 and sum(r["errors_5xx"] for r in rows) == 1
    assert all(datetime.fromisoformat(r["start"].replace("Z", "+00:00")).minute == 0 for r in rows)
    if len(rows) == 1:
        assert rows[0]["p99_ms"] == pytest.approx(100, rel=0.05)


def test_csv_by_format_parameter_and_by_accept_header(world) -> None:  # noqa: ANN001
    alice = client_for(world["users"]["alice"])
    for response in (alice.get(URL, {"format": "csv"}), alice.get(URL, HTTP_ACCEPT="text/csv")):
        assert response.status_code == 200
        assert response["Content-Type"].startswith("text/csv")
        assert "attachment" in response["Content-Disposition"]
        rows = list(csv.DictReader(io.StringIO(response.content.decode())))
        assert len(rows) == 3 and {r["tenant"] for r in rows} == {"acme"}
        assert sum(int(r["requests"]) for r in rows) == 6
    # and OPTIONS (DRF's metadata) is JSON even when CSV was asked for
    options = alice.options(URL + "?format=csv")
    assert options.status_code == 200 and options["Content-Type"].startswith("application/json")
    # and an error stays JSON even when CSV was asked for
    bad = alice.get(URL, {"format": "csv", "granularity": "week"})
    assert bad.status_code == 400 and bad["Content-Type"].startswith("application/json")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"granularity": "week"}, "granularity"),
        ({"from": "yesterday"}, "from"),
        ({"to": "2025-13-40T00:00:00Z"}, "to"),
        ({"to": ""}, "to"),
        ({"version": ""}, "version"),
        ({"from": "2025-01-02T00:00:00Z", "to": "2025-01-01T00:00:00Z"}, "from"),
        ({"from": "2025-01-01T00:00:00Z", "to": "2025-01-03T00:00:00Z"}, "to"),  # 2 days of minutes
        ({"granularity": "day", "from": "2025-01-01T00:00:00Z", "to": "2025-06-01T00:00:00Z"}, "to"),
        ({"version": "0"}, "version"),
        ({"model": "../etc"}, "model"),
        ({"tenant": "not a slug"}, "tenant"),
        ({"limit": "0"}, "limit"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(world, params, field) -> None:  # noqa: ANN001
    response = client_for(world["users"]["alice"]).get(URL, params)
    assert response.status_code == 400, response.content
    assert field in response.json()["fields"]


def test_a_retried_batch_does_not_change_what_the_api_reports(world) -> None:  # noqa: ANN001
    alice = client_for(world["users"]["alice"])
    before = alice.get(URL).json()["results"]
    put_usage(
        world["acme"],
        world["now"] - timedelta(minutes=5),
        (200, 100, 1.0, 1.0),
        batch=f"acme-digits-1-{(world['now'] - timedelta(minutes=5)).isoformat()}",
    )
    assert alice.get(URL).json()["results"] == before


# -- end to end -------------------------------------------------------------------------------------------


def infer_until(server, body: bytes, status: int, times: int) -> dict[int, int]:  # noqa: ANN001
    """Send `body` to digits until `times` answers had `status`; the answers metered, by status. On a busy
    machine the front door may refuse some before authentication: those name no tenant and are not metered."""
    metered: dict[int, int] = {}
    for _ in range(500):
        if metered.get(status, 0) >= times:
            return metered
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request(
                "POST",
                "/v2/models/digits/infer",
                body=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"},
            )
            response = conn.getresponse()
            text = response.read()
        finally:
            conn.close()
        if response.status == 503 and b"of inference" in text:
            continue  # the front door's gate (serving.dataplane.http.frontdoor): before any tenant is known
        assert response.status in (status, 503), text
        metered[response.status] = metered.get(response.status, 0) + 1
    raise AssertionError(f"no {times} answers of {status} in 500 tries: {metered}")


def get(server, path: str, user: str, password: str, accept: str = "application/json"):  # noqa: ANN001, ANN201
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        conn.request("GET", path, headers={"Authorization": f"Basic {auth}", "Accept": accept})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type"), response.read()
    finally:
        conn.close()


def test_inference_usage_reaches_the_api_in_json_and_csv(digits_server, settings) -> None:  # noqa: ANN001
    from tests.conftest import tenant

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # given a member of the key's tenant
    user = User.objects.create_user("viewer", password="viewer-password")
    Membership.objects.create(user=user, tenant=tenant(), role=Role.VIEWER)
    # when the key's tenant sends 5 requests of 3 rows and 2 malformed ones to digits
    three_rows = orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 64], "data": [1.0] * 192}]}
    )
    bad = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 63], "data": [1.0] * 63}]})
    sent = infer_until(digits_server, three_rows, 200, 5)
    for status, count in infer_until(digits_server, bad, 400, 2).items():
        sent[status] = sent.get(status, 0) + count
    # and the process's usage is flushed (as its background flusher does every few seconds)
    plane = digits_server.plane()
    asyncio.run_coroutine_threadsafe(plane.flush_usage(), plane.loop).result(timeout=60)
    # then the API reports them for the tenant, model and version
    status, ctype, body = get(digits_server, f"{URL}?tenant=test&model=digits", "viewer", "viewer-password")
    assert status == 200 and ctype.startswith("application/json"), body
    rows = json.loads(body)["results"]
    assert sum(r["requests"] for r in rows) == sum(sent.values())
    assert sum(r["errors_4xx"] for r in rows) == 2 and sum(r["errors_5xx"] for r in rows) == sent.get(503, 0)
    assert sum(r["items"] for r in rows) == 15
    assert sum(r["compute_seconds"] for r in rows) > 0
    assert all(r["version"] == 1 and r["p99_ms"] > 0 for r in rows)
    # and the same as CSV
    status, ctype, body = get(
        digits_server, f"{URL}?tenant=test&model=digits", "viewer", "viewer-password", accept="text/csv"
    )
    assert status == 200 and ctype.startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(body.decode())))
    assert sum(int(r["requests"]) for r in table) == sum(sent.values()) and sum(int(r["items"]) for r in table) == 15
