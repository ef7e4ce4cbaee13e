"""A model's fallback that the caller may not see (another tenant's private model) is not named: the API answers
`fallback: null` with `fallback_hidden: true`, the console says "hidden"; its owner still sees the name."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from serving.models import Model, Visibility
from tenants.models import Membership, Role, Tenant
from tests.conftest import register

SECRET = "acme-secret-fallback"


@pytest.fixture
def registry(db, model_files) -> dict[str, User]:  # noqa: ANN001
    """acme owns a public model `front` whose fallback is its private `acme-secret-fallback`, and a public `open`
    whose fallback is the public `front`; globex's engineer sees both public models, not the private one."""
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    secret = Model.objects.create(name=SECRET, tenant=acme, visibility=Visibility.PRIVATE)
    # a version, so that the console's models page lists it
    front = register(model_files.digits, "front", owner=acme, visibility=Visibility.PUBLIC).model
    front.fallback = secret
    front.save(update_fields=["fallback"])
    Model.objects.create(name="open", tenant=acme, visibility=Visibility.PUBLIC, fallback=front)
    people = {}
    for name, tenant in (("owner", acme), ("outsider", globex)):
        people[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=people[name], tenant=tenant, role=Role.ENGINEER)
    return people


def api(user: User) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def test_the_api_hides_a_fallback_the_caller_may_not_see(registry) -> None:  # noqa: ANN001
    client = api(registry["outsider"])
    listed = {m["name"]: m for m in client.get("/api/models/").json()["results"]}
    assert SECRET not in listed
    assert listed["front"]["fallback"] is None and listed["front"]["fallback_hidden"] is True
    # a fallback the caller sees is named as before
    assert listed["open"]["fallback"] == "front" and listed["open"]["fallback_hidden"] is False
    detail = client.get("/api/models/front/")
    assert detail.status_code == 200
    assert detail.json()["fallback"] is None and detail.json()["fallback_hidden"] is True
    assert SECRET.encode() not in client.get("/api/models/").content + detail.content


def test_the_owner_still_sees_its_fallback(registry) -> None:  # noqa: ANN001
    client = api(registry["owner"])
    detail = client.get("/api/models/front/").json()
    assert detail["fallback"] == SECRET and detail["fallback_hidden"] is False
    listed = {m["name"]: m for m in client.get("/api/models/").json()["results"]}
    assert listed["front"]["fallback"] == SECRET


def test_the_console_hides_it_too(registry, client) -> None:  # noqa: ANN001
    client.force_login(registry["outsider"])
    for page in ("/console/models/", "/console/models/front/"):
        resp = client.get(page)
        assert resp.status_code == 200, page
        assert SECRET.encode() not in resp.content, page
        assert b'fallback <em class="hidden-fallback">hidden</em>' in resp.content, page
    client.force_login(registry["owner"])
    for page in ("/console/models/", "/console/models/front/"):
        assert f"fallback {SECRET}".encode() in client.get(page).content, page
