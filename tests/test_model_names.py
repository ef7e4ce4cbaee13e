"""A taken model name is refused without saying whose it is: another tenant's private model, its public model and
a platform model's (reserved) name get the same answer; the caller's own tenant's duplicate says what it is."""

from __future__ import annotations

import io
import json

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from serving.models import Model, Visibility
from tenants.models import Membership, Role, Tenant
from tests.conftest import DIGITS_IO

TAKEN = {"private": "acme-private-name", "public": "acme-public-name", "reserved": "platform-name"}


@pytest.fixture
def names(db) -> dict[str, APIClient]:  # noqa: ANN001
    acme = Tenant.objects.create(slug="acme", name="Acme")
    globex = Tenant.objects.create(slug="globex", name="Globex")
    Model.objects.create(name=TAKEN["private"], tenant=acme, visibility=Visibility.PRIVATE)
    Model.objects.create(name=TAKEN["public"], tenant=acme, visibility=Visibility.PUBLIC)
    Model.objects.create(name=TAKEN["reserved"], tenant=None)
    Model.objects.create(name="globex-own", tenant=globex, visibility=Visibility.PRIVATE)
    clients = {}
    for name, tenant in (("acme", acme), ("globex", globex)):
        user = User.objects.create_user(f"{name}-engineer", f"{name}@example.org")
        Membership.objects.create(user=user, tenant=tenant, role=Role.ENGINEER)
        clients[name] = APIClient()
        clients[name].force_login(user)
    return clients


def answer(response, name: str) -> tuple[int, str, str]:  # noqa: ANN001
    """Status, content type and body with the name asked for taken out: what may not differ between names."""
    return response.status_code, response["Content-Type"], response.content.decode().replace(name, "NAME")


def test_another_tenants_names_all_answer_alike(names) -> None:  # noqa: ANN001
    client = names["globex"]
    answers = {
        kind: answer(client.post("/api/models/", {"name": name}, format="json"), name) for kind, name in TAKEN.items()
    }
    assert answers["private"] == answers["public"] == answers["reserved"]
    status, _, body = answers["private"]
    assert status == 409
    assert "not available" in body and "exists" not in body
    # and renaming its own model onto them answers the same
    renames = {
        kind: answer(client.patch("/api/models/globex-own/", {"name": name}, format="json"), name)
        for kind, name in TAKEN.items()
    }
    assert set(renames.values()) == {answers["private"]}
    assert Model.objects.filter(name="globex-own").exists()


def test_an_upload_under_another_tenants_name_answers_alike(names, model_files) -> None:  # noqa: ANN001
    def upload(name: str):  # noqa: ANN202
        artifact = io.BytesIO(model_files.digits.read_bytes())
        artifact.name = model_files.digits.name
        data = {
            "format": "torchscript",
            "inputs": json.dumps(DIGITS_IO["inputs"]),
            "outputs": json.dumps(DIGITS_IO["outputs"]),
            "artifact": artifact,
        }
        return names["globex"].post(f"/api/models/{name}/versions/", data, format="multipart")

    answers = {kind: answer(upload(name), name) for kind, name in TAKEN.items()}
    assert answers["private"] == answers["public"] == answers["reserved"]
    assert answers["private"][0] == 409 and "not available" in answers["private"][2]
    assert Model.objects.get(name=TAKEN["public"]).versions.count() == 0


def test_the_owners_duplicate_says_it_exists(names) -> None:  # noqa: ANN001
    for name in (TAKEN["private"], TAKEN["public"]):
        response = names["acme"].post("/api/models/", {"name": name}, format="json")
        assert response.status_code == 409
        assert response.json()["error"] == f"a model named {name!r} exists already"
