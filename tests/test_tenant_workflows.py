"""Tenant workflows through the API: keys, members, quota requests and visibility, each leaving an audit
entry with who, what, before and after; and the rules each enforces."""

from __future__ import annotations

import re

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.test import APIClient

from serving.models import Model
from tenants.models import ApiKey, AuditEntry, Membership, Quota, QuotaRequest, Role, Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme(db) -> Tenant:  # noqa: ANN001
    return Tenant.objects.create(slug="acme", name="Acme")


def person(name: str, tenant: Tenant | None = None, role: str | None = None, **extra: object) -> APIClient:
    user = User.objects.create_user(name, **extra)
    if tenant is not None:
        Membership.objects.create(user=user, tenant=tenant, role=role)
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def alice(acme: Tenant) -> APIClient:
    return person("alice", acme, Role.ADMIN)


@pytest.fixture
def root(db) -> APIClient:  # noqa: ANN001
    return person("root", is_staff=True)


def only_entry(**filters: object) -> AuditEntry:
    entries = list(AuditEntry.objects.filter(**filters))
    assert len(entries) == 1, entries
    return entries[0]


def test_a_key_is_shown_once_and_its_creation_and_revocation_are_audited(alice: APIClient) -> None:
    # when the tenant admin creates a key
    created = alice.post("/api/tenants/acme/keys/", {"name": "app", "scopes": ["manage", "infer"]}, format="json")
    # then the response carries the token, once
    assert created.status_code == 201, created.content
    body = created.json()
    token, prefix = body["token"], body["prefix"]
    assert token.startswith(f"fy_{prefix}_") and body["scopes"] == ["infer", "manage"]
    # and no later read shows it
    for read in (alice.get("/api/tenants/acme/keys/"), alice.get(f"/api/tenants/acme/keys/{prefix}/")):
        assert read.status_code == 200 and token not in read.content.decode() and b'"token"' not in read.content
    # and the audit log has who created what, never the token or its digest
    entry = only_entry(action="key.create")
    key = ApiKey.objects.get(prefix=prefix)
    assert (entry.actor_name, entry.tenant.slug, entry.target) == ("alice", "acme", f"key fy_{prefix}")
    assert entry.before is None and entry.after["scopes"] == ["infer", "manage"] and entry.after["revoked_at"] is None
    assert token not in str(entry.after) and key.digest not in str(entry.after)
    # when it is revoked (twice: the second changes nothing)
    for _ in range(2):
        revoked = alice.post(f"/api/tenants/acme/keys/{prefix}/revoke/")
        assert revoked.status_code == 200 and revoked.json()["revoked_at"] and not revoked.json()["active"]
    # then one entry records the state before and after
    entry = only_entry(action="key.revoke")
    assert entry.before["revoked_at"] is None and entry.after["revoked_at"] is not None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "app", "scopes": []}, "scopes"),
        ({"name": "app", "scopes": ["root"]}, "scopes"),
        ({"name": "", "scopes": ["infer"]}, "name"),
        ({"name": "app", "scopes": ["infer"], "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
    ],
)
def test_bad_key_requests_are_400(alice: APIClient, body: dict, field: str) -> None:
    response = alice.post("/api/tenants/acme/keys/", body, format="json")
    assert response.status_code == 400 and field in response.json().get("fields", {}), response.content
    assert not ApiKey.objects.exists() and not AuditEntry.objects.exists()


def test_roles_are_added_changed_and_removed_with_audit(alice: APIClient, acme: Tenant) -> None:
    User.objects.create_user("bob")
    # when alice adds bob as a viewer, makes him an engineer, then removes him
    assert (
        alice.post("/api/tenants/acme/members/", {"username": "bob", "role": "viewer"}, format="json").status_code
        == 201
    )
    changed = alice.patch("/api/tenants/acme/members/bob/", {"role": "engineer"}, format="json")
    assert changed.status_code == 200 and changed.json() == {"username": "bob", "role": "engineer"}
    assert alice.delete("/api/tenants/acme/members/bob/").status_code == 204
    # then each step is in the audit log with the role before and after
    steps = [(e.action, e.before, e.after) for e in AuditEntry.objects.order_by("pk")]
    assert steps == [
        ("role.add", None, {"role": "viewer"}),
        ("role.change", {"role": "viewer"}, {"role": "engineer"}),
        ("role.remove", {"role": "engineer"}, None),
    ]
    assert all(e.target == "member bob" and e.actor_name == "alice" for e in AuditEntry.objects.all())
    # and unknown users and roles are 400s, an existing member 409
    assert (
        alice.post("/api/tenants/acme/members/", {"username": "ghost", "role": "viewer"}, format="json").status_code
        == 400
    )
    assert (
        alice.post("/api/tenants/acme/members/", {"username": "alice", "role": "viewer"}, format="json").status_code
        == 409
    )
    assert alice.patch("/api/tenants/acme/members/alice/", {"role": "owner"}, format="json").status_code == 400


def test_a_tenant_keeps_an_admin(alice: APIClient) -> None:
    # given alice, the only admin / when she demotes or removes herself / then 409, nothing changes
    assert alice.patch("/api/tenants/acme/members/alice/", {"role": "viewer"}, format="json").status_code == 409
    assert alice.delete("/api/tenants/acme/members/alice/").status_code == 409
    assert Membership.objects.get(user__username="alice").role == Role.ADMIN
    assert not AuditEntry.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_quota_request_approved_by_staff_becomes_the_quota(alice: APIClient, root: APIClient, acme: Tenant) -> None:
    before = Quota.objects.get(tenant=acme).limits()
    # when the tenant admin asks for more, with a justification
    filed = alice.post(
        "/api/tenants/acme/quota-requests/",
        {
            "changes": {"requests_per_second": 5000, "priority": 2},
            "justification": "launch week",
        },
        format="json",
    )
    assert filed.status_code == 201, filed.content
    request_id = filed.json()["id"]
    assert filed.json()["state"] == "pending"
    # then the tenant admin cannot decide it
    assert alice.post(f"/api/tenants/acme/quota-requests/{request_id}/approve/", {}, format="json").status_code == 403
    # when staff approve it
    approved = root.post(
        f"/api/tenants/acme/quota-requests/{request_id}/approve/", {"note": "ok for a week"}, format="json"
    )
    assert approved.status_code == 200, approved.content
    assert approved.json()["state"] == "approved" and approved.json()["decided_by"] == "root"
    # then the quota holds the new limits, and the tenant reads them
    quota = alice.get("/api/tenants/acme/quota/").json()
    assert quota["requests_per_second"] == 5000 and quota["priority"] == 2 and quota["burst"] == before["burst"]
    # and the audit log has the request and the approval, the quota before and after
    assert only_entry(action="quota.request").after == {"requests_per_second": 5000, "priority": 2}
    entry = only_entry(action="quota.approve")
    assert entry.actor_name == "root" and entry.before == before
    assert entry.after == {**before, "requests_per_second": 5000, "priority": 2, "note": "ok for a week"}
    # and a decided request cannot be decided again
    assert root.post(f"/api/tenants/acme/quota-requests/{request_id}/reject/", {}, format="json").status_code == 409


def test_a_rejected_request_leaves_the_quota(alice: APIClient, root: APIClient, acme: Tenant) -> None:
    before = Quota.objects.get(tenant=acme).limits()
    filed = alice.post(
        "/api/tenants/acme/quota-requests/", {"changes": {"max_models": 500}, "justification": "many"}, format="json"
    ).json()
    rejected = root.post(f"/api/tenants/acme/quota-requests/{filed['id']}/reject/", {"note": "too many"}, format="json")
    assert rejected.status_code == 200 and rejected.json()["decision_note"] == "too many"
    assert Quota.objects.get(tenant=acme).limits() == before
    entry = only_entry(action="quota.reject")
    assert entry.before == {"state": "pending"} and entry.after == {"state": "rejected", "note": "too many"}


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"colour": 3},
        {"priority": 4},
        {"priority": 0},
        {"max_models": 0},
        {"burst": "10"},
        {"burst": 1.5},
        {"burst": True},
        {"monthly_requests": 2**63},
    ],
)
def test_bad_quota_requests_are_400(alice: APIClient, changes: dict) -> None:
    response = alice.post(
        "/api/tenants/acme/quota-requests/", {"changes": changes, "justification": "x"}, format="json"
    )
    assert response.status_code == 400, response.content
    assert not QuotaRequest.objects.exists()


def test_a_quota_request_needs_a_justification(alice: APIClient) -> None:
    for justification in ("", "   "):
        response = alice.post(
            "/api/tenants/acme/quota-requests/",
            {"changes": {"burst": 9}, "justification": justification},
            format="json",
        )
        assert response.status_code == 400, response.content


def test_visibility_changes_need_the_admin_role_and_are_audited(alice: APIClient, acme: Tenant) -> None:
    partner = Tenant.objects.create(slug="partner", name="Partner")
    bob = person("bob", acme, Role.ENGINEER)
    # given an engineer's new model, private by default
    created = bob.post("/api/models/", {"name": "m"}, format="json")
    assert created.status_code == 201 and created.json()["tenant"] == "acme"
    assert created.json()["visibility"] == "private"
    # when the engineer tries to share it / then 403: visibility is the admin's
    assert bob.patch("/api/models/m/", {"visibility": "public"}, format="json").status_code == 403
    # when the admin shares it with partner
    shared = alice.patch("/api/models/m/", {"visibility": "shared", "shared_with": ["partner"]}, format="json")
    assert shared.status_code == 200 and shared.json()["shared_with"] == ["partner"]
    model = Model.objects.get(name="m")
    assert model.visibility == "shared" and list(model.shared_with.all()) == [partner]
    # then the audit log has the change with before and after
    entry = only_entry(action="model.visibility")
    assert entry.before == {"visibility": "private", "shared_with": []}
    assert entry.after == {"visibility": "shared", "shared_with": ["partner"]}
    # and the engineer may still edit what is theirs to edit, with no audit entry for it
    assert bob.patch("/api/models/m/", {"description": "d", "visibility": "shared"}, format="json").status_code == 200
    assert AuditEntry.objects.filter(action="model.visibility").count() == 1
    # and the tenant cannot be changed
    assert alice.patch("/api/models/m/", {"tenant": None}, format="json").status_code == 400


def test_a_new_model_belongs_to_the_named_or_only_tenant(acme: Tenant) -> None:
    other = Tenant.objects.create(slug="other", name="Other")
    solo = person("solo", acme, Role.ENGINEER)
    assert solo.post("/api/models/", {"name": "a"}, format="json").json()["tenant"] == "acme"
    # given someone in two tenants / then naming one is required
    both = person("both", acme, Role.ENGINEER)
    Membership.objects.create(user=User.objects.get(username="both"), tenant=other, role=Role.VIEWER)
    response = both.post("/api/models/", {"name": "b"}, format="json")
    assert response.status_code == 400 and "tenant" in response.json()["fields"]
    assert both.post("/api/models/", {"name": "b", "tenant": "acme"}, format="json").status_code == 201
    # and a tenant where they are only a viewer refuses
    assert both.post("/api/models/", {"name": "c", "tenant": "other"}, format="json").status_code == 403
    # and staff in no tenant register platform models
    staff = person("staff", is_staff=True)
    assert staff.post("/api/models/", {"name": "p"}, format="json").json()["tenant"] is None


# --- the same changes made in /admin/ are audited too -------------------------------------------------------


@pytest.fixture
def superuser_client(db) -> tuple[Client, User]:  # noqa: ANN001
    user = User.objects.create_superuser("root-admin", "root@example.org", "pw")
    client = Client()
    client.force_login(user)
    return client


def test_admin_revocation_is_audited(superuser_client, acme: Tenant) -> None:  # noqa: ANN001
    from tenants.actions import create_key

    key, _ = create_key(tenant=acme, name="app", scopes=["infer"])
    response = superuser_client.post(
        f"/admin/tenants/apikey/{key.pk}/change/",
        {
            "expires_at_0": "",
            "expires_at_1": "",
            "revoked_at_0": "2026-01-02",
            "revoked_at_1": "03:04:05",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    entry = only_entry(action="key.revoke")
    assert entry.actor_name == "root-admin" and entry.before["revoked_at"] is None
    assert entry.after["revoked_at"].startswith("2026-01-02")


def test_admin_role_change_is_audited(superuser_client, acme: Tenant) -> None:  # noqa: ANN001
    bob = User.objects.create_user("bob")
    membership = Membership.objects.create(user=bob, tenant=acme, role=Role.VIEWER)
    response = superuser_client.post(
        f"/admin/tenants/tenant/{acme.pk}/change/",
        {
            "name": "Acme",
            "slug": "acme",
            "promotion_policy": acme.promotion_policy,
            "memberships-TOTAL_FORMS": "1",
            "memberships-INITIAL_FORMS": "1",
            "memberships-MIN_NUM_FORMS": "0",
            "memberships-MAX_NUM_FORMS": "1000",
            "memberships-0-id": str(membership.pk),
            "memberships-0-tenant": str(acme.pk),
            "memberships-0-user": str(bob.pk),
            "memberships-0-role": "engineer",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    entry = only_entry(action="role.change")
    assert (entry.target, entry.before, entry.after) == ("member bob", {"role": "viewer"}, {"role": "engineer"})


def test_admin_visibility_change_is_audited(superuser_client, acme: Tenant) -> None:  # noqa: ANN001
    partner = Tenant.objects.create(slug="partner", name="Partner")
    model = Model.objects.create(name="m", tenant=acme)
    response = superuser_client.post(
        f"/admin/serving/model/{model.pk}/change/",
        {
            "name": "m",
            "tenant": str(acme.pk),
            "visibility": "shared",
            "shared_with": [str(partner.pk)],
            "description": "",
            "task": "classification",
            "fallback": "",
            "versions-TOTAL_FORMS": "0",
            "versions-INITIAL_FORMS": "0",
            "versions-MIN_NUM_FORMS": "0",
            "versions-MAX_NUM_FORMS": "1000",
        },
    )
    assert response.status_code == 302, response.content[:2000]
    entry = only_entry(action="model.visibility")
    assert entry.before == {"visibility": "private", "shared_with": []}
    assert entry.after == {"visibility": "shared", "shared_with": ["partner"]}


def test_the_quota_page_shows_use_against_each_limit(alice: APIClient, acme: Tenant) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from usage.models import UsageMinute

    # given acme has one model and 1,200 requests metered in one minute of the last hour
    Model.objects.create(name="acme-model", tenant=acme)
    minute = (timezone.now() - timedelta(minutes=5)).replace(second=0, microsecond=0)
    UsageMinute.objects.create(tenant=acme, model_name="acme-model", version=1, minute=minute, requests=1200)
    # when its admin opens the quota page / then each limit shows what is used of it
    page = alice.get(f"/console/tenants/{acme.slug}/quota/").content.decode()
    assert '<tr data-limit="monthly_requests"><td>monthly_requests</td><td class="value">' in page
    used = dict(re.findall(r'<tr data-limit="(\w+)">.*?<td class="used">([^<]*)</td>', page))
    assert used["monthly_requests"] == "1200" and used["requests_per_second"] == "20"
    assert used["max_models"] == "1" and used["burst"] == "—"


def test_a_quota_decision_must_be_approve_or_reject(alice: APIClient, root: APIClient, acme: Tenant) -> None:
    filed = alice.post(
        f"/api/tenants/{acme.slug}/quota-requests/",
        {"changes": {"burst": 5000}, "justification": "launch"},
        format="json",
    )
    assert filed.status_code == 201, filed.content
    pk = filed.json()["id"]
    response = root.post("/console/quota-requests/", {"id": str(pk), "note": "?"})
    assert response.status_code == 400 and b"approve or reject" in response.content
    assert QuotaRequest.objects.get(pk=pk).state == QuotaRequest.State.PENDING
