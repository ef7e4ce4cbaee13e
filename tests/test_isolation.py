"""Isolation: nobody reads or changes what is not theirs, on the console, the DRF API and /v2.

One world, walked as a matrix of people x endpoints. Tenant `acme` owns every resource: models (private,
shared with tenant `partner`, public) and the platform's own model, an API key, its quota, a quota request,
its members and audit entries. Its people: `admin`, `engineer`, `viewer`. Outside it: `partner` (admin of
the tenant the shared model is shared with), `outsider` (admin of tenant `bravo`) and `staff` (platform
staff, in no tenant).

The expectations read: 2xx/302 the owner's success, 403 a role too low (or seeing without owning), 404 for
anything the caller may not see, answered exactly as a missing object would be.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.contrib.auth.models import User
from django.test import Client
from rest_framework.test import APIClient

from serving.models import Artifact, Model, ModelVersion, State, Visibility
from tenants.actions import create_key
from tenants.governance import request_quota
from tenants.models import AuditEntry, Membership, Role, Tenant

PEOPLE = ("admin", "engineer", "viewer", "partner", "outsider", "staff")


@dataclass
class World:
    users: dict[str, User]
    key_prefix: str
    request_id: int


@pytest.fixture
def world(db) -> World:  # noqa: ANN001
    acme = Tenant.objects.create(slug="acme", name="Acme")
    partner = Tenant.objects.create(slug="partner", name="Partner")
    bravo = Tenant.objects.create(slug="bravo", name="Bravo")
    users = {}
    for name, tenant, role in [
        ("admin", acme, Role.ADMIN),
        ("engineer", acme, Role.ENGINEER),
        ("viewer", acme, Role.VIEWER),
        ("partner", partner, Role.ADMIN),
        ("outsider", bravo, Role.ADMIN),
        ("staff", None, None),
    ]:
        users[name] = User.objects.create_user(name, is_staff=name == "staff")
        if tenant is not None:
            Membership.objects.create(user=users[name], tenant=tenant, role=role)
    # Registry rows only: who may see and change them does not depend on a loadable artifact.
    artifact = Artifact.objects.create(sha256="0" * 64, size_bytes=1)
    for name, owner, visibility in [
        ("private", acme, Visibility.PRIVATE),
        ("shared", acme, Visibility.SHARED),
        ("public", acme, Visibility.PUBLIC),
        ("platform", None, Visibility.PRIVATE),
    ]:
        model = Model.objects.create(name=name, tenant=owner, visibility=visibility)
        ModelVersion.objects.create(
            model=model, version=1, artifact=artifact, format="torchscript", inputs=[], outputs=[], state=State.READY
        )
    Model.objects.get(name="shared").shared_with.add(partner)
    key, _ = create_key(tenant=acme, name="acme-app", scopes=["infer"], created_by=users["admin"])
    filed = request_quota(tenant=acme, changes={"max_models": 60}, justification="growth", actor=users["admin"])
    return World(users, key.prefix, filed.pk)


def expect(row: str) -> dict[str, int]:
    """'200 200 200 404 404 200' -> the status for each of PEOPLE, in order."""
    codes = [int(c) for c in row.split()]
    assert len(codes) == len(PEOPLE)
    return dict(zip(PEOPLE, codes, strict=True))


# (method, path, body, expected per person: admin engineer viewer partner outsider staff)
CONSOLE = [
    ("GET", "/console/models/private/", None, "200 200 200 404 404 200"),
    ("GET", "/console/models/shared/", None, "200 200 200 200 404 200"),
    ("GET", "/console/models/public/", None, "200 200 200 200 200 200"),
    ("GET", "/console/models/platform/", None, "200 200 200 200 200 200"),
    ("POST", "/console/models/private/", {"visibility": "public"}, "302 403 403 404 404 302"),
    ("POST", "/console/models/shared/", {"visibility": "public"}, "302 403 403 403 404 302"),
    ("POST", "/console/models/public/", {"visibility": "private"}, "302 403 403 403 403 302"),
    ("POST", "/console/models/platform/", {"visibility": "public"}, "403 403 403 403 403 302"),
    ("GET", "/console/tenants/acme/", None, "200 200 200 404 404 200"),
    ("POST", "/console/tenants/acme/", {"username": "viewer", "role": "engineer"}, "302 403 403 404 404 302"),
    ("GET", "/console/tenants/acme/keys/", None, "200 403 403 404 404 200"),
    ("POST", "/console/tenants/acme/keys/", {"name": "new", "scopes": ["infer"]}, "302 403 403 404 404 302"),
    ("POST", "/console/tenants/acme/keys/", {"action": "revoke", "prefix": "{key}"}, "302 403 403 404 404 302"),
    ("GET", "/console/tenants/acme/quota/", None, "200 200 200 404 404 200"),
    ("POST", "/console/tenants/acme/quota/", {"max_models": "70", "justification": "more"}, "302 403 403 404 404 302"),
    ("GET", "/console/quota-requests/", None, "403 403 403 403 403 200"),
    ("POST", "/console/quota-requests/", {"id": "{request}", "decision": "approve"}, "403 403 403 403 403 302"),
    ("GET", "/console/audit/", None, "200 403 403 200 200 200"),  # what each sees: test_audit_log_is_scoped
]

API = [
    ("GET", "/api/models/private/", None, "200 200 200 404 404 200"),
    ("GET", "/api/models/shared/", None, "200 200 200 200 404 200"),
    ("GET", "/api/models/public/", None, "200 200 200 200 200 200"),
    ("GET", "/api/models/private/versions/", None, "200 200 200 404 404 200"),
    ("GET", "/api/models/private/versions/1/", None, "200 200 200 404 404 200"),
    ("PATCH", "/api/models/private/", {"description": "x"}, "200 200 403 404 404 200"),
    ("PATCH", "/api/models/shared/", {"description": "x"}, "200 200 403 403 404 200"),
    ("PATCH", "/api/models/public/", {"description": "x"}, "200 200 403 403 403 200"),
    ("PATCH", "/api/models/platform/", {"description": "x"}, "403 403 403 403 403 200"),
    ("PATCH", "/api/models/private/", {"visibility": "public"}, "200 403 403 404 404 200"),
    ("PATCH", "/api/models/public/", {"shared_with": ["bravo"]}, "200 403 403 403 403 200"),
    ("POST", "/api/models/private/versions/1/retire/", None, "200 200 403 404 404 200"),
    ("PATCH", "/api/models/private/versions/1/", {"max_queue_delay_ms": 3}, "200 200 403 404 404 200"),
    ("DELETE", "/api/models/public/", None, "409 409 403 403 403 409"),  # seen, but only acme's may try
    ("POST", "/api/models/", {"name": "new", "tenant": "acme"}, "201 201 403 400 400 201"),
    ("GET", "/api/tenants/acme/", None, "200 200 200 404 404 200"),
    ("GET", "/api/tenants/acme/members/", None, "200 200 200 404 404 200"),
    ("PATCH", "/api/tenants/acme/members/viewer/", {"role": "engineer"}, "200 403 403 404 404 200"),
    ("POST", "/api/tenants/acme/members/", {"username": "partner", "role": "viewer"}, "201 403 403 404 404 201"),
    ("DELETE", "/api/tenants/acme/members/engineer/", None, "204 403 403 404 404 204"),
    ("GET", "/api/tenants/acme/keys/", None, "200 403 403 404 404 200"),
    ("GET", "/api/tenants/acme/keys/{key}/", None, "200 403 403 404 404 200"),
    ("POST", "/api/tenants/acme/keys/", {"name": "new", "scopes": ["infer"]}, "201 403 403 404 404 201"),
    ("POST", "/api/tenants/acme/keys/{key}/revoke/", None, "200 403 403 404 404 200"),
    ("GET", "/api/tenants/acme/quota/", None, "200 200 200 404 404 200"),
    ("GET", "/api/tenants/acme/quota-requests/", None, "200 200 200 404 404 200"),
    ("GET", "/api/tenants/acme/quota-requests/{request}/", None, "200 200 200 404 404 200"),
    (
        "POST",
        "/api/tenants/acme/quota-requests/",
        {"changes": {"burst": 4000}, "justification": "peak"},
        "201 403 403 404 404 201",
    ),
    ("POST", "/api/tenants/acme/quota-requests/{request}/approve/", {}, "403 403 403 404 404 200"),
    ("POST", "/api/tenants/acme/quota-requests/{request}/reject/", {"note": "no"}, "403 403 403 404 404 200"),
    ("GET", "/api/audit/", None, "200 403 403 200 200 200"),  # what each sees: test_audit_log_is_scoped
]


def _fill(world: World, value: object) -> object:
    if isinstance(value, str):
        return value.replace("{key}", world.key_prefix).replace("{request}", str(world.request_id))
    if isinstance(value, dict):
        return {k: _fill(world, v) for k, v in value.items()}
    return value


def _cases(table: list) -> list:
    return [
        pytest.param(method, path, body, who, status, id=f"{method} {path} as {who}")
        for method, path, body, row in table
        for who, status in expect(row).items()
    ]


@pytest.mark.parametrize(("method", "path", "body", "who", "status"), _cases(CONSOLE))
def test_console(world: World, method: str, path: str, body: dict | None, who: str, status: int) -> None:
    # given a logged-in person / when they open or act on a console page / then the table's answer
    client = Client()
    client.force_login(world.users[who])
    path = _fill(world, path)
    response = client.get(path) if method == "GET" else client.post(path, _fill(world, body))
    assert response.status_code == status, response.content[:500]


@pytest.mark.parametrize(("method", "path", "body", "who", "status"), _cases(API))
def test_api(world: World, method: str, path: str, body: dict | None, who: str, status: int) -> None:
    # given a logged-in person / when they call the API / then the table's answer, as JSON
    client = APIClient()
    client.force_login(world.users[who])
    response = client.generic(
        method, _fill(world, path), data=_json(_fill(world, body)), content_type="application/json"
    )
    assert response.status_code == status, response.content[:500]
    if status >= 400:
        assert isinstance(response.json()["error"], str)


def _json(body: object) -> str:
    import json

    return "" if body is None else json.dumps(body)


@pytest.mark.parametrize(
    "path", ["/console/models/{}/", "/api/models/{}/", "/api/models/{}/versions/", "/api/models/{}/versions/1/"]
)
def test_a_model_the_caller_may_not_see_answers_like_a_missing_one(world: World, path: str) -> None:
    client = Client()
    client.force_login(world.users["outsider"])
    hidden, missing = client.get(path.format("private")), client.get(path.format("no-such"))
    assert hidden.status_code == missing.status_code == 404
    assert hidden.content.replace(b"private", b"no-such") == missing.content


def test_a_tenant_the_caller_is_not_in_answers_like_a_missing_one(world: World) -> None:
    client = APIClient()
    client.force_login(world.users["outsider"])
    for path in ("/api/tenants/{}/", "/api/tenants/{}/keys/", "/api/tenants/{}/quota/"):
        hidden, missing = client.get(path.format("acme")), client.get(path.format("nope"))
        assert hidden.status_code == missing.status_code == 404
        assert hidden.json()["error"].replace("acme", "nope") == missing.json()["error"]


def test_lists_show_only_what_the_caller_may_see(world: World) -> None:
    sees = {
        "viewer": {"private", "shared", "public", "platform"},
        "partner": {"shared", "public", "platform"},
        "outsider": {"public", "platform"},
        "staff": {"private", "shared", "public", "platform"},
    }
    for who, names in sees.items():
        client = APIClient()
        client.force_login(world.users[who])
        assert {m["name"] for m in client.get("/api/models/").json()["results"]} == names, who
        page = Client()
        page.force_login(world.users[who])
        html = page.get("/console/models/").content.decode()
        shown = {name for name in ("private", "shared", "public", "platform") if f'data-key="{name}:1"' in html}
        assert shown == names, who
        assert set(page.get("/console/live/").json()["versions"]) == {f"{n}:1" for n in names}, who
    # and the tenants list holds the caller's own tenants with its role
    client = APIClient()
    client.force_login(world.users["partner"])
    assert [(t["slug"], t["role"]) for t in client.get("/api/tenants/").json()["results"]] == [("partner", "admin")]


def test_shared_with_is_the_owners_business(world: World) -> None:
    # given the model acme shares with partner / when partner reads it / then it does not learn who else
    client = APIClient()
    client.force_login(world.users["partner"])
    assert client.get("/api/models/shared/").json()["shared_with"] == []
    client.force_login(world.users["viewer"])
    assert client.get("/api/models/shared/").json()["shared_with"] == ["partner"]


def test_audit_log_is_scoped(world: World) -> None:
    # given entries of acme (key, quota request) and one of bravo
    AuditEntry.objects.create(
        actor_name="x", tenant=Tenant.objects.get(slug="bravo"), action="key.create", target="key fy_bravo"
    )
    entries = {who: [] for who in ("admin", "outsider", "staff")}
    for who in entries:
        client = APIClient()
        client.force_login(world.users[who])
        entries[who] = {(e["tenant"], e["action"]) for e in client.get("/api/audit/").json()["results"]}
    # then each admin sees its tenant's entries only; staff sees all
    assert entries["admin"] == {("acme", "key.create"), ("acme", "quota.request")}
    assert entries["outsider"] == {("bravo", "key.create")}
    assert entries["staff"] == entries["admin"] | entries["outsider"]
    # and the console page says the same
    page = Client()
    page.force_login(world.users["outsider"])
    html = page.get("/console/audit/").content.decode()
    assert "fy_bravo" in html and f"fy_{world.key_prefix}" not in html


def test_console_actions_need_the_csrf_token(world: World) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(world.users["admin"])
    response = client.post("/console/tenants/acme/keys/", {"name": "forged", "scopes": ["infer"]})
    assert response.status_code == 403
    assert not world.users["admin"].memberships.get().tenant.api_keys.filter(name="forged").exists()


# --- /v2 with API keys ------------------------------------------------------------------------------------

# (method, path, body, expected per key of: acme partner bravo). Load is used, not unload: on a loaded model
# it changes nothing, so the rows do not depend on each other's order.
V2_KEYS = ("acme", "partner", "bravo")
V2 = [
    ("GET", "/v2/models/private", None, "200 404 404"),
    ("GET", "/v2/models/shared", None, "200 200 404"),
    ("GET", "/v2/models/public", None, "200 200 200"),
    ("GET", "/v2/models/platform", None, "200 200 200"),
    ("GET", "/v2/models/private/config", None, "200 404 404"),
    ("POST", "/v2/models/private/infer", "ZERO", "200 404 404"),
    ("POST", "/v2/models/shared/infer", "ZERO", "200 200 404"),
    ("POST", "/v2/models/public/infer", "ZERO", "200 200 200"),
    ("POST", "/v2/repository/models/private/load", b"", "200 404 404"),
    ("POST", "/v2/repository/models/shared/load", b"", "200 403 404"),
    ("POST", "/v2/repository/models/public/load", b"", "200 403 403"),
    ("POST", "/v2/repository/models/platform/load", b"", "403 403 403"),
]


@pytest.fixture
def v2_world(transactional_db, model_files, settings):  # noqa: ANN001, ANN201
    from tests.conftest import LiveServer, mint_key, register, tenant

    # About who may call, not saturation: a busy test machine must not shed these requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    acme, partner = tenant("acme"), tenant("partner")
    small = {"max_batch_size": 4, "max_queue_delay_ms": 1}
    for name, owner, visibility in [
        ("private", acme, "private"),
        ("shared", acme, "shared"),
        ("public", acme, "public"),
        ("platform", None, "private"),
    ]:
        register(model_files.digits, name, owner=owner, visibility=visibility, **small)
    Model.objects.get(name="shared").shared_with.add(partner)
    tokens = {slug: mint_key(slug) for slug in V2_KEYS}
    server = LiveServer().start()
    try:
        yield server, tokens
    finally:
        server.stop()


def test_v2_with_api_keys(v2_world) -> None:  # noqa: ANN001
    import numpy as np

    from tests.test_inference_http import call, digits_request

    server, tokens = v2_world
    zero = digits_request(np.zeros((1, 64), np.float32))
    failures = []
    for method, path, body, row in V2:
        codes = dict(zip(V2_KEYS, (int(c) for c in row.split()), strict=True))
        for slug, status in codes.items():
            # given tenant `slug`'s key (infer + manage) / when it calls / then the table's answer
            resp = call(server, method, path, zero if body == "ZERO" else body, auth=tokens[slug])
            if resp.status != status:
                failures.append(f"{method} {path} with {slug}'s key: {resp.status} (expected {status}) {resp.body!r}")
            elif status >= 400:
                assert isinstance(resp.error, str) and resp.error
    assert not failures, "\n".join(failures)
    # and the repository index lists, for each key, exactly what the table lets it see
    sees = {
        "acme": {"private", "shared", "public", "platform"},
        "partner": {"shared", "public", "platform"},
        "bravo": {"public", "platform"},
    }
    for slug, names in sees.items():
        resp = call(server, "POST", "/v2/repository/index", b"", auth=tokens[slug])
        assert {r["name"] for r in resp.json()} == names, slug
