"""Changes made in Django's /admin/ are audited as the API's are (tenants.admin_audit), and a rename or delete
there keeps the API's rules: the name lock and a pipeline's name, the approval a re-used name's callers are
owed (serving.validation.name_released), live versions before a delete, the owner never changed, a running
rollout never deleted. Each case posts the admin's own forms as a logged-in superuser."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from autoscaling.models import ScalingPolicy
from rollout.models import Rollout
from serving.models import Artifact, Model, ModelVersion, Pipeline, State
from serving.validation import name_released
from tenants.actions import create_key
from tenants.models import ApiKey, AuditEntry, Tenant
from usage.models import UsageMinute

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme(db) -> Tenant:  # noqa: ANN001 - "approval required", the default policy
    return Tenant.objects.create(slug="acme", name="Acme")


@pytest.fixture
def root(db) -> Client:  # noqa: ANN001
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.org", "unused"))
    return client


def served(name: str, tenant: Tenant, *states: str) -> Model:
    """A model of `tenant` with a version per state (registry rows only), the first ready one stable."""
    artifact, _ = Artifact.objects.get_or_create(sha256="0" * 64, defaults={"size_bytes": 1})
    model = Model.objects.create(name=name, tenant=tenant)
    for number, state in enumerate(states, start=1):
        ModelVersion.objects.create(
            model=model, version=number, artifact=artifact, format="torchscript", inputs=[], outputs=[], state=state
        )
    if State.READY in states:
        Model.objects.filter(pk=model.pk).update(stable_version=states.index(State.READY) + 1)
        model.refresh_from_db()
    return model


def model_form(model: Model, versions: dict | None = None, **changes: object) -> dict:
    """The admin's change form of `model` (a new one: its add form) as it shows it, with `changes` to the
    model's fields and `versions` ({version number: {field: value}}) to its versions' rows."""
    saved = model.pk is not None
    rows = list(model.versions.order_by("version")) if saved else []
    data: dict = {
        "name": model.name,
        "description": model.description,
        "task": model.task,
        "fallback": model.fallback_id or "",
        "visibility": model.visibility,
        "shared_with": [t.pk for t in model.shared_with.all()] if saved else [],
        "versions-TOTAL_FORMS": str(len(rows)),
        "versions-INITIAL_FORMS": str(len(rows)),
        "versions-MIN_NUM_FORMS": "0",
        "versions-MAX_NUM_FORMS": "1000",
        "_save": "Save",
        **changes,
    }
    for i, row in enumerate(rows):
        fields = {
            "id": row.pk,
            "model": model.pk,
            "loaded": "on" if row.loaded else "",
            "max_batch_size": row.max_batch_size,
            "max_queue_delay_ms": row.max_queue_delay_ms,
            "preferred_batch_sizes": json.dumps(row.preferred_batch_sizes),
            "max_queue_size": row.max_queue_size,
            "default_timeout_ms": row.default_timeout_ms,
            **(versions or {}).get(row.version, {}),
        }
        data.update({f"versions-{i}-{k}": v for k, v in fields.items() if v != ""})
    return data


def change_model(client: Client, model: Model, versions: dict | None = None, **changes: object):  # noqa: ANN201
    return client.post(f"/admin/serving/model/{model.pk}/change/", model_form(model, versions, **changes))


def bulk_delete(client: Client, changelist: str, objects: list):  # noqa: ANN201
    return client.post(
        changelist, {"action": "delete_selected", "_selected_action": [o.pk for o in objects], "post": "yes"}
    )


def only_entry(**filters: object) -> AuditEntry:
    entries = list(AuditEntry.objects.filter(**filters))
    assert len(entries) == 1, [(e.action, e.target, e.before, e.after) for e in AuditEntry.objects.all()]
    return entries[0]


# --- models: renames, other fields, versions ----------------------------------------------------------------


def test_a_rename_is_audited_as_the_apis_and_releases_the_name(root: Client, acme: Tenant) -> None:
    model = served("digits", acme, State.READY)
    # when staff rename the model and change its description in the admin
    response = change_model(root, model, name="digits-old", description="the old digits")
    assert response.status_code == 302, response.content.decode()[-3000:]
    # then the rename is the API's entry, naming who, the old name and the model
    entry = only_entry(action="model.rename")
    assert (entry.actor_name, entry.target, entry.tenant) == ("root", "model digits", acme)
    assert (entry.before, entry.after) == ({"name": "digits", "model": model.pk}, {"name": "digits-old"})
    # and the other field changed is model.change, with before and after
    change = only_entry(action="model.change")
    assert (change.actor_name, change.target, change.tenant) == ("root", "model digits-old", acme)
    assert (change.before, change.after) == ({"description": ""}, {"description": "the old digits"})
    # so a model registered later under the old name waits for an approval, as after the API's rename
    assert name_released(acme.pk, "digits")


def test_a_served_model_may_not_take_a_name_its_tenant_gave_up(root: Client, acme: Tenant) -> None:
    # given digits renamed away in the admin, and another served model of Acme (which requires approval)
    assert change_model(root, served("digits", acme, State.READY), name="digits-old").status_code == 302
    fresh = served("fresh", acme, State.READY)
    # when staff rename it onto the name digits' callers call / then the form refuses, naming the rule
    response = change_model(root, fresh, name="digits")
    assert response.status_code == 200 and "errornote" in response.content.decode()
    assert "requires an approval" in response.content.decode()
    assert Model.objects.get(pk=fresh.pk).name == "fresh"
    assert not AuditEntry.objects.filter(action="model.rename", target="model fresh").exists()
    # while the model that gave the name up may take it back
    assert change_model(root, Model.objects.get(name="digits-old"), name="digits").status_code == 302


def test_a_model_may_not_take_a_pipelines_name(root: Client, acme: Tenant) -> None:
    Pipeline.objects.create(name="their-pipe", tenant=acme)
    model = served("mine", acme)
    response = change_model(root, model, name="their-pipe")
    assert response.status_code == 200 and "is not available" in response.content.decode()
    assert Model.objects.get(pk=model.pk).name == "mine"


def test_the_owner_and_the_routing_are_not_changed_here(root: Client, acme: Tenant) -> None:
    other = Tenant.objects.create(slug="other", name="Other")
    model = served("digits", acme, State.READY, State.READY)
    # when the form is posted naming another tenant and a shadow version
    response = change_model(root, model, tenant=other.pk, shadow_version="2", shadow_fraction="0.5")
    assert response.status_code == 302, response.content.decode()[-3000:]
    # then the model is still Acme's, mirroring nothing (those change through the API, checked and audited)
    model.refresh_from_db()
    assert (model.tenant, model.shadow_version, model.shadow_fraction) == (acme, None, 0.0)
    assert not AuditEntry.objects.exists()


def test_a_versions_settings_changed_here_are_audited(root: Client, acme: Tenant) -> None:
    model = served("digits", acme, State.READY)
    response = change_model(root, model, versions={1: {"loaded": "", "max_batch_size": "8"}})
    assert response.status_code == 302, response.content.decode()[-3000:]
    entry = only_entry(action="version.change")
    assert (entry.actor_name, entry.target, entry.tenant) == ("root", "model digits version 1", acme)
    assert entry.before == {"loaded": True, "max_batch_size": 32}
    assert entry.after == {"loaded": False, "max_batch_size": 8}


def test_a_version_is_not_deleted_from_the_models_form(root: Client, acme: Tenant) -> None:
    # a deleted version would leave the routing naming it; retiring is the way out
    model = served("digits", acme, State.READY)
    response = change_model(root, model, versions={1: {"DELETE": "on"}})
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert model.versions.filter(version=1).exists()


def test_a_model_created_here_is_audited(root: Client, acme: Tenant) -> None:
    data = {**model_form(Model(name="new", tenant=acme)), "tenant": acme.pk}
    response = root.post("/admin/serving/model/add/", data)
    assert response.status_code == 302, response.content.decode()[-3000:]
    entry = only_entry(action="model.create")
    assert (entry.actor_name, entry.target, entry.tenant) == ("root", "model new", acme)
    assert entry.after["name"] == "new" and entry.after["tenant"] == acme.pk


# --- models: deletes, one and in bulk -----------------------------------------------------------------------


def test_a_model_with_a_live_version_is_not_deleted_here(root: Client, acme: Tenant) -> None:
    model = served("digits", acme, State.RETIRED, State.READY)
    for response in (
        root.post(f"/admin/serving/model/{model.pk}/delete/", {"post": "yes"}),
        bulk_delete(root, "/admin/serving/model/", [model]),
    ):
        # the confirmation page comes back naming the version to retire, and nothing is deleted
        assert response.status_code == 200
        assert "digits version 2" in response.content.decode()
    assert Model.objects.filter(pk=model.pk).exists()
    assert not AuditEntry.objects.exists()


def test_a_deleted_model_is_audited_as_the_apis_and_releases_its_name(root: Client, acme: Tenant) -> None:
    model = served("digits", acme, State.RETIRED)
    response = root.post(f"/admin/serving/model/{model.pk}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert not Model.objects.filter(pk=model.pk).exists()
    entry = only_entry(action="model.delete")
    assert (entry.actor_name, entry.target, entry.tenant) == ("root", "model digits", acme)
    assert entry.before["model"] == model.pk and entry.before["versions"] == [1]
    assert name_released(acme.pk, "digits")


def test_models_deleted_in_bulk_are_each_audited(root: Client, acme: Tenant) -> None:
    models = [served("a", acme, State.RETIRED), served("b", acme)]
    response = bulk_delete(root, "/admin/serving/model/", models)
    assert response.status_code == 302
    assert not Model.objects.exists()
    entries = AuditEntry.objects.filter(action="model.delete").order_by("target")
    assert [(e.actor_name, e.target, e.before["model"]) for e in entries] == [
        ("root", "model a", models[0].pk),
        ("root", "model b", models[1].pk),
    ]
    assert name_released(acme.pk, "a") and name_released(acme.pk, "b")


def test_an_artifact_deleted_here_is_audited(root: Client) -> None:
    artifact = Artifact.objects.create(sha256="a" * 64, size_bytes=10)
    assert bulk_delete(root, "/admin/serving/artifact/", [artifact]).status_code == 302
    entry = only_entry(action="artifact.delete")
    assert (entry.actor_name, entry.target) == ("root", f"artifact {'a' * 64}")
    assert entry.before["size_bytes"] == 10


# --- tenants and keys ---------------------------------------------------------------------------------------


def tenant_form(tenant: Tenant, **changes: object) -> dict:
    return {
        "name": tenant.name,
        "slug": tenant.slug,
        "promotion_policy": tenant.promotion_policy,
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
        **changes,
    }


def test_a_tenant_created_changed_and_deleted_here_is_audited(root: Client) -> None:
    # created
    response = root.post("/admin/tenants/tenant/add/", tenant_form(Tenant(name="Beta", slug="beta")))
    assert response.status_code == 302, response.content.decode()[-3000:]
    beta = Tenant.objects.get(slug="beta")
    created = only_entry(action="tenant.create")
    assert (created.actor_name, created.target, created.tenant) == ("root", "tenant beta", beta)
    assert created.after["name"] == "Beta" and created.after["share_response_cache"] is False
    # changed: the cache sharing setting, which has no action of its own
    response = root.post(f"/admin/tenants/tenant/{beta.pk}/change/", tenant_form(beta, share_response_cache="on"))
    assert response.status_code == 302, response.content.decode()[-3000:]
    changed = only_entry(action="tenant.change")
    assert (changed.before, changed.after) == ({"share_response_cache": False}, {"share_response_cache": True})
    # deleted, in bulk
    assert bulk_delete(root, "/admin/tenants/tenant/", [beta]).status_code == 302
    deleted = only_entry(action="tenant.delete")
    assert (deleted.actor_name, deleted.target, deleted.before["slug"]) == ("root", "tenant beta", "beta")


def test_a_setting_with_its_own_action_is_not_logged_twice(root: Client, acme: Tenant) -> None:
    response = root.post(f"/admin/tenants/tenant/{acme.pk}/change/", tenant_form(acme, allow_self_approval="on"))
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert list(AuditEntry.objects.values_list("action", flat=True)) == ["tenant.self_approval"]


def test_a_key_deleted_here_is_audited_without_its_digest(root: Client, acme: Tenant) -> None:
    one, _ = create_key(tenant=acme, name="one", scopes=["infer"])
    two, _ = create_key(tenant=acme, name="two", scopes=["infer"])
    assert root.post(f"/admin/tenants/apikey/{one.pk}/delete/", {"post": "yes"}).status_code == 302
    assert bulk_delete(root, "/admin/tenants/apikey/", [two]).status_code == 302
    assert not ApiKey.objects.exists()
    entries = AuditEntry.objects.filter(action="key.delete").order_by("pk")
    assert [(e.actor_name, e.target, e.tenant) for e in entries] == [
        ("root", f"key fy_{one.prefix}", acme),
        ("root", f"key fy_{two.prefix}", acme),
    ]
    assert entries[0].before == {
        "name": "one",
        "prefix": one.prefix,
        "scopes": ["infer"],
        "expires_at": None,
        "revoked_at": None,
    }
    assert not any(one.digest in json.dumps(e.before) for e in entries)


# --- rollouts, scaling policies, usage ----------------------------------------------------------------------


def rollout(model: Model, state: str) -> Rollout:
    return Rollout.objects.create(
        model=model, baseline=1, candidate=2, state=state, step=0, phase_started_at=timezone.now()
    )


def test_a_running_rollout_is_not_deleted_here_and_a_finished_one_is_audited(root: Client, acme: Tenant) -> None:
    model = served("digits", acme, State.READY, State.READY)
    done = rollout(model, "promoted")
    running = rollout(model, "canary")
    # a running one: refused, on its delete page and in bulk
    assert root.post(f"/admin/rollout/rollout/{running.pk}/delete/", {"post": "yes"}).status_code == 403
    assert bulk_delete(root, "/admin/rollout/rollout/", [running, done]).status_code == 403
    assert Rollout.objects.count() == 2
    assert not AuditEntry.objects.exists()
    # a finished one: deleted, with rollout.transitions' words for it
    assert root.post(f"/admin/rollout/rollout/{done.pk}/delete/", {"post": "yes"}).status_code == 302
    entry = only_entry(action="rollout.delete")
    assert (entry.actor_name, entry.target, entry.tenant) == (
        "root",
        f"rollout #{done.pk} of model digits version 2",
        acme,
    )
    assert entry.before["state"] == "promoted" and entry.before["baseline"] == 1


def policy_form(version: ModelVersion, **changes: object) -> dict:
    return {
        "version": version.pk,
        "enabled": "on",
        "max_replicas": "4",
        "target_utilisation": "0.7",
        "warm_pool": "0",
        "cool_down_seconds": "300",
        "idle_to_zero_seconds": "",
        "accelerator": "",
        "_save": "Save",
        **changes,
    }


def test_a_scaling_policy_created_changed_and_deleted_here_is_audited(root: Client, acme: Tenant) -> None:
    version = served("digits", acme, State.READY).versions.get()
    response = root.post("/admin/autoscaling/scalingpolicy/add/", policy_form(version))
    assert response.status_code == 302, response.content.decode()[-3000:]
    policy = ScalingPolicy.objects.get()
    created = only_entry(action="scaling.create")
    assert (created.actor_name, created.target, created.tenant) == ("root", "model digits version 1", acme)
    assert created.after["max_replicas"] == 4 and created.after["version"] == version.pk
    response = root.post(
        f"/admin/autoscaling/scalingpolicy/{policy.pk}/change/", policy_form(version, max_replicas="9")
    )
    assert response.status_code == 302, response.content.decode()[-3000:]
    changed = only_entry(action="scaling.change")
    assert (changed.before, changed.after) == ({"max_replicas": 4}, {"max_replicas": 9})
    assert bulk_delete(root, "/admin/autoscaling/scalingpolicy/", [policy]).status_code == 302
    deleted = only_entry(action="scaling.delete")
    assert deleted.target == "model digits version 1" and deleted.before["max_replicas"] == 9


def test_usage_deleted_here_is_audited(root: Client, acme: Tenant) -> None:
    minute = timezone.now().replace(second=0, microsecond=0)
    row = UsageMinute.objects.create(tenant=acme, model_name="digits", version=1, minute=minute, requests=40)
    assert bulk_delete(root, "/admin/usage/usageminute/", [row]).status_code == 302
    entry = only_entry(action="usage.delete")
    assert (entry.actor_name, entry.tenant, entry.before["requests"]) == ("root", acme, 40)
    assert entry.target.startswith("usage of model digits version 1 at ")
