"""The registry API's placement settings of a version: PATCH /api/models/{name}/versions/{v}/placement/."""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User

from serving.models import ModelVersion
from tenants.models import AuditEntry, Membership, Role, Tenant
from tests.conftest import register
from tests.test_api import alice, assert_json_error, bob, charlie, client_for, dave, people  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db

URL = "/api/models/digits/versions/1/placement/"


@pytest.fixture
def digits(people, model_files) -> ModelVersion:  # noqa: ANN001, F811
    return register(model_files.digits, "digits", max_batch_size=2, owner=Tenant.objects.get(slug="acme"))


def test_an_engineer_sets_constraints_and_flags_and_the_change_is_audited(bob, digits) -> None:  # noqa: ANN001, F811
    # given a version a node had found unschedulable
    ModelVersion.objects.filter(pk=digits.pk).update(unschedulable_reason="unschedulable (accelerator): …")
    # when an engineer of the owning tenant changes its placement settings
    body = {"min_memory_bytes": 1 << 34, "accelerators": ["h100", "a100", "h100"], "pinned": True, "min_replicas": 2}
    response = bob.patch(URL, body, format="json")
    # then they are stored (accelerators as a sorted set), shown, and the verdict is cleared to be judged again
    assert response.status_code == 200, response.content
    data = response.json()
    assert (data["min_memory_bytes"], data["accelerators"], data["pinned"], data["min_replicas"]) == (
        1 << 34,
        ["a100", "h100"],
        True,
        2,
    )
    assert data["unschedulable_reason"] == "" and data["placement_measurements"] == {}
    stored = ModelVersion.objects.get(pk=digits.pk)
    assert (stored.accelerators, stored.pinned, stored.unschedulable_reason) == (["a100", "h100"], True, "")
    # and the audit log holds the change, before and after
    entry = AuditEntry.objects.get(action="version.placement")
    assert entry.before["pinned"] is False and entry.after["pinned"] is True
    assert entry.after["accelerators"] == ["a100", "h100"] and entry.tenant.slug == "acme"


def test_a_subset_changes_only_itself_and_no_change_is_not_audited(bob, digits) -> None:  # noqa: ANN001, F811
    assert bob.patch(URL, {"pinned": True}, format="json").status_code == 200
    assert bob.patch(URL, {"pinned": True}, format="json").status_code == 200
    stored = ModelVersion.objects.get(pk=digits.pk)
    assert stored.pinned and stored.min_replicas == 0 and stored.accelerators == []
    assert AuditEntry.objects.filter(action="version.placement").count() == 1


@pytest.mark.parametrize(
    "body",
    [
        {"pinned": "true"},
        {"pinned": 1},
        {"min_replicas": -1},
        {"min_replicas": 2.0},
        {"min_memory_bytes": "16GiB"},
        {"accelerators": "h100"},
        {"accelerators": ["H100"]},
        {"accelerators": [""]},
        {"max_batch_size": 4},
    ],
)
def test_malformed_or_unknown_settings_are_400(bob, digits, body) -> None:  # noqa: ANN001, F811
    assert_json_error(bob.patch(URL, body, format="json"), 400)
    assert not ModelVersion.objects.get(pk=digits.pk).pinned


def test_a_viewer_is_refused_and_an_outsider_sees_nothing(charlie, dave, people, model_files) -> None:  # noqa: ANN001, F811
    # given a private model of Acme, and an engineer of another tenant
    register(model_files.digits, "digits", owner=Tenant.objects.get(slug="acme"), visibility="private")
    other = Tenant.objects.create(name="Other", slug="other")
    erin = User.objects.create_user("erin", "erin@example.org")
    Membership.objects.create(user=erin, tenant=other, role=Role.ENGINEER)
    body = {"pinned": True}
    # then Acme's viewer sees the version and may not change it (403)
    assert_json_error(charlie.patch(URL, body, format="json"), 403)
    # the other tenant's engineer is answered as for a model that does not exist (404), malformed body or not
    hidden = assert_json_error(client_for(erin).patch(URL, body, format="json"), 404)
    missing = assert_json_error(client_for(erin).patch(URL.replace("digits", "nothing"), body, format="json"), 404)
    assert hidden["error"].replace("digits", "X") == missing["error"].replace("nothing", "X")
    assert_json_error(client_for(erin).patch(URL, {"pinned": "x"}, format="json"), 404)
    # and someone who is an engineer nowhere is refused before anything is looked up, the same for any model
    assert assert_json_error(dave.patch(URL, body, format="json"), 403) == assert_json_error(
        dave.patch(URL.replace("digits", "nothing"), body, format="json"), 403
    )
    assert not ModelVersion.objects.get(model__name="digits").pinned


def test_the_schema_documents_the_placement_patch(bob) -> None:  # noqa: ANN001, F811
    schema = bob.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    operation = schema["paths"]["/api/models/{model_name}/versions/{version}/placement/"]["patch"]
    assert set(operation["responses"]) == {"200", "400", "403", "404", "413", "415"}
    body = schema["components"]["schemas"]["PatchedPlacementUpdate"]
    assert body["additionalProperties"] is False
    assert set(body["properties"]) == {"min_memory_bytes", "accelerators", "pinned", "min_replicas"}


def test_the_console_marks_unschedulable_and_pinned_versions(bob, digits) -> None:  # noqa: ANN001, F811
    ModelVersion.objects.filter(pk=digits.pk).update(
        unschedulable_reason="unschedulable (memory): too big", pinned=True
    )
    for url in ("/console/models/", "/console/models/digits/"):
        page = bob.get(url).content.decode()
        assert 'title="unschedulable (memory): too big">unschedulable</small>' in page
        assert '<small class="pinned">pinned</small>' in page
