"""Tenancy and approval rules the audit of the control plane found open, each pinned by the case that broke it:
a model taking a pipeline's name, public pipelines naming private models, delete-and-re-create (or rename)
around the approval policy, retiring without an audit entry, `shared_with` telling slugs apart before the
role check, other tenants reading rollouts, and an upload read before its owner's role check.

People (tests.test_api): Alice admin, Bob engineer, Charlie viewer of Acme; Dave in no tenant. Eve is an
engineer of Other, which owns `their-*`. Acme requires an approval for every change of a stable version
(the default policy)."""

from __future__ import annotations

import threading
import time

import pytest
from django.contrib.auth.models import User
from django.db import connection, transaction
from rest_framework.parsers import MultiPartParser

from rollout import transitions
from serving.actions import RegistrationError, register_version
from serving.models import NAME_LOCK_SPACE, Model, ModelVersion, Pipeline, State, lock_name
from serving.pipelines import PipelineRegistrationError, register_pipeline
from serving.publish import build_snapshot
from tenants.models import AuditEntry, Membership, Role, Tenant
from tests.conftest import DIGITS_IO, register
from tests.test_api import assert_json_error, client_for, form, people, upload  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def other(people) -> dict:  # noqa: ANN001, F811
    """Tenant Other with Eve, its engineer, and Olga, its admin; its public model `their-public` and its
    public pipeline `their-pipe` over it."""
    tenant = Tenant.objects.create(name="Other", slug="other")
    users = {}
    for name, role in (("eve", Role.ENGINEER), ("olga", Role.ADMIN)):
        users[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=users[name], tenant=tenant, role=role)
    return {"tenant": tenant, **users}


@pytest.fixture
def their_pipe(other, model_files) -> Pipeline:  # noqa: ANN001
    register(model_files.digits, "their-public", owner=other["tenant"], visibility="public")
    register_pipeline(
        name="their-pipe", spec={"model": "their-public", "name": "s"}, tenant=other["tenant"], visibility="public"
    )
    return Pipeline.objects.get(name="their-pipe")


# -- a model cannot take a pipeline's name ------------------------------------------------------------------


def test_a_model_cannot_take_a_pipelines_name_and_is_told_nothing(people, their_pipe, model_files) -> None:  # noqa: ANN001, F811
    bob = client_for(people["bob"])
    register(model_files.digits, "their-model", owner=their_pipe.tenant, visibility="private")
    taken = assert_json_error(bob.post("/api/models/", {"name": "their-model"}, format="json"), 409)["error"]
    # creating, renaming onto it and uploading to it: the 409 of any name not available, nothing more
    created = assert_json_error(bob.post("/api/models/", {"name": "their-pipe"}, format="json"), 409)["error"]
    assert created.replace("their-pipe", "X") == taken.replace("their-model", "X")
    assert bob.post("/api/models/", {"name": "mine"}, format="json").status_code == 201
    renamed = assert_json_error(bob.patch("/api/models/mine/", {"name": "their-pipe"}, format="json"), 409)["error"]
    assert renamed == created
    uploaded = assert_json_error(upload(bob, "their-pipe", form(model_files.digits)), 409)["error"]
    assert uploaded == created
    with pytest.raises(RegistrationError) as refused:
        with model_files.digits.open("rb") as f:
            register_version(model_name="their-pipe", artifact_file=f, fmt="torchscript", validate="none", **DIGITS_IO)
    assert refused.value.status == 409
    # and the pipeline is still served
    assert not Model.objects.filter(name="their-pipe").exists()
    assert "their-pipe" in build_snapshot().pipelines


def _holds_lock_then(create, name: str, racer) -> object:  # noqa: ANN001
    """Take the name lock in one transaction and, once `racer` (another thread) is either finished or
    waiting for a lock, create the other kind of thing of that name and commit; returns what `racer` did."""
    holding, go, outcome = threading.Event(), threading.Event(), {}

    def first() -> None:
        try:
            with transaction.atomic():
                lock_name(name)
                holding.set()
                go.wait(60)
                create()
        finally:
            connection.close()

    def second() -> None:
        try:
            outcome["result"] = racer()
        except Exception as exc:  # noqa: BLE001 - the test reads what it was
            outcome["result"] = exc
        finally:
            connection.close()

    a = threading.Thread(target=first)
    a.start()
    assert holding.wait(60)
    b = threading.Thread(target=second)
    b.start()
    deadline = time.monotonic() + 60
    with connection.cursor() as cursor:  # the racer is waiting on a lock, or done without one
        while b.is_alive() and time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND classid = %s"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                [NAME_LOCK_SPACE],
            )
            if cursor.fetchone()[0]:
                break
            time.sleep(0.01)
    go.set()
    a.join(60)
    b.join(60)
    return outcome["result"]


def test_a_pipeline_and_a_model_taking_one_name_at_once_cannot_both_have_it(people, model_files) -> None:  # noqa: ANN001, F811
    acme = Tenant.objects.get(slug="acme")
    register(model_files.digits, "step", owner=acme, visibility="private")

    def model_meanwhile() -> None:
        Model.objects.create(name="contested", tenant=acme)

    def pipeline() -> object:
        return register_pipeline(name="contested", spec={"model": "step", "name": "s"}, tenant=acme)

    refused = _holds_lock_then(model_meanwhile, "contested", pipeline)
    assert isinstance(refused, PipelineRegistrationError) and refused.status == 409, refused
    assert not Pipeline.objects.filter(name="contested").exists()

    def pipeline_meanwhile() -> None:
        Pipeline.objects.create(name="contested-2", tenant=acme)

    def model() -> object:
        with model_files.digits.open("rb") as f:
            return register_version(
                model_name="contested-2", artifact_file=f, fmt="torchscript", validate="none", tenant=acme, **DIGITS_IO
            )

    refused = _holds_lock_then(pipeline_meanwhile, "contested-2", model)
    assert isinstance(refused, RegistrationError) and refused.status == 409, refused
    assert not Model.objects.filter(name="contested-2").exists()


# -- public pipelines name no model the reader may not see ---------------------------------------------------


def test_a_public_pipelines_fallback_must_be_public(people, other, model_files) -> None:  # noqa: ANN001, F811
    register(model_files.digits, "their-public", owner=other["tenant"], visibility="public")
    register(model_files.digits, "their-private-fallback", owner=other["tenant"], visibility="private")
    olga = client_for(other["olga"])
    body = {"name": "p", "spec": {"model": "their-public", "name": "s"}, "visibility": "public"}
    refused = olga.post("/api/pipelines/", {**body, "fallback": "their-private-fallback"}, format="json")
    refused = assert_json_error(refused, 422)
    assert "their-private-fallback" not in refused["error"] and "public" in refused["error"]
    assert olga.post("/api/pipelines/", {**body, "fallback": "their-public"}, format="json").status_code == 201
    # a private pipeline may fall back to its tenant's private model: only its tenant sees it
    private = {**body, "name": "q", "visibility": "private", "fallback": "their-private-fallback"}
    assert olga.post("/api/pipelines/", private, format="json").status_code == 201


def test_models_made_private_since_are_unsaid_in_the_api_and_console(people, other, model_files) -> None:  # noqa: ANN001, F811
    # given a public pipeline of Other with an unnamed step (named after its model), a named one and a
    # fallback, all public when registered
    for name in ("their-first", "their-second", "their-fallback"):
        register(model_files.digits, name, owner=other["tenant"], visibility="public")
    spec = {
        "sequence": [
            {"model": "their-first"},
            {"model": "their-second", "name": "second", "inputs": {"input": "request.input"}},
            {"model": "their-public-too", "name": "third", "inputs": {"input": "request.input"}},
        ]
    }
    register(model_files.digits, "their-public-too", owner=other["tenant"], visibility="public")
    register_pipeline(
        name="their-pipe", spec=spec, tenant=other["tenant"], visibility="public", fallback="their-fallback"
    )
    # when Other makes three of the models private
    Model.objects.filter(name__in=["their-first", "their-second", "their-fallback"]).update(visibility="private")
    secrets = (b"their-first", b"their-second", b"their-fallback")
    # then Acme's people read the pipeline without their names, in the API
    bob = client_for(people["bob"])
    for path in ("/api/pipelines/", "/api/pipelines/their-pipe/"):
        response = bob.get(path)
        assert response.status_code == 200 and b"their-pipe" in response.content
        assert not any(secret in response.content for secret in secrets), response.content
    doc = bob.get("/api/pipelines/their-pipe/").json()
    assert doc["fallback"] is None and doc["fallback_hidden"] is True
    steps = doc["versions"][0]["spec"]["sequence"]
    assert [s["model"] for s in steps] == [None, None, "their-public-too"]
    assert [s.get("name") for s in steps] == [None, "second", "third"]
    # and on the console's list, page and live figures
    for path in ("/console/pipelines/", "/console/pipelines/their-pipe/", "/console/pipelines/their-pipe/live/"):
        response = bob.get(path)
        assert response.status_code == 200
        assert not any(secret in response.content for secret in secrets), (path, response.content)
    page = bob.get("/console/pipelines/their-pipe/").content.decode()
    assert "hidden model" in page and 'data-step="third"' in page and "their-public-too" in page
    # while Other's own people still read every name
    olga = client_for(other["olga"]).get("/api/pipelines/their-pipe/").json()
    assert olga["fallback"] == "their-fallback" and olga["versions"][0]["spec"] == spec


# -- approval: deleting and re-creating a model, renaming onto its name --------------------------------------


def _serve_digits(client, model_files) -> None:  # noqa: ANN001
    response = upload(client, "digits", form(model_files.digits))
    assert response.status_code == 201 and response.json()["state"] == State.READY, response.content


def test_a_deleted_models_name_registered_again_waits_for_an_approval(people, model_files) -> None:  # noqa: ANN001, F811
    bob, alice = client_for(people["bob"]), client_for(people["alice"])
    # given digits of Acme, its first version stable (a new name has no callers yet)
    _serve_digits(bob, model_files)
    assert Model.objects.get(name="digits").stable_version == 1
    # when an engineer retires it, deletes the model and registers the name again
    assert bob.post("/api/models/digits/versions/1/retire/").status_code == 200
    assert bob.delete("/api/models/digits/").status_code == 204
    deleted = AuditEntry.objects.get(action="model.delete")
    assert (deleted.actor_name, deleted.target, deleted.tenant.slug) == ("bob", "model digits", "acme")
    assert deleted.before["versions"] == [1]
    _serve_digits(bob, model_files)
    # then the new version is ready but serves nobody until an approver accepts its promotion
    assert Model.objects.get(name="digits").stable_version is None
    filed = bob.post("/api/models/digits/versions/1/promote/")
    assert filed.status_code == 202, filed.content
    accepted = alice.post(f"/api/promotion-requests/{filed.json()['id']}/approve/")
    assert accepted.status_code == 200, accepted.content
    assert Model.objects.get(name="digits").stable_version == 1


def test_a_served_model_may_not_be_renamed_onto_a_name_its_tenant_gave_up(people, model_files) -> None:  # noqa: ANN001, F811
    bob = client_for(people["bob"])
    _serve_digits(bob, model_files)
    # given digits renamed away (audited), and a new model with a version of its own, stable at once
    assert bob.patch("/api/models/digits/", {"name": "digits-old"}, format="json").status_code == 200
    entry = AuditEntry.objects.get(action="model.rename")
    served = Model.objects.get(name="digits-old")
    assert (entry.target, entry.after) == ("model digits", {"name": "digits-old"})
    assert entry.before == {"name": "digits", "model": served.pk}
    # (a model may take its own name back)
    assert bob.patch("/api/models/digits-old/", {"name": "digits"}, format="json").status_code == 200
    assert bob.patch("/api/models/digits/", {"name": "digits-old"}, format="json").status_code == 200
    response = upload(bob, "fresh", form(model_files.digits))
    assert response.json()["state"] == State.READY and Model.objects.get(name="fresh").stable_version == 1
    # when it is renamed onto the name digits' callers call / then it is refused: nobody approved it for them
    body = assert_json_error(bob.patch("/api/models/fresh/", {"name": "digits"}, format="json"), 409)
    assert "approval" in body["error"]
    # a model registered under that name waits for an approval, as after a delete
    _serve_digits(bob, model_files)
    assert Model.objects.get(name="digits").stable_version is None
    # and where engineers may promote, the rule does not apply
    assert bob.patch("/api/models/digits-old/", {"name": "digits-older"}, format="json").status_code == 200
    Tenant.objects.filter(slug="acme").update(promotion_policy="engineers")
    assert bob.patch("/api/models/fresh/", {"name": "digits-old"}, format="json").status_code == 200


# -- retiring a version is a routing change, audited ---------------------------------------------------------


def test_retiring_the_stable_version_is_audited_with_the_routing_it_changed(people, model_files) -> None:  # noqa: ANN001, F811
    bob = client_for(people["bob"])
    _serve_digits(bob, model_files)
    assert bob.post("/api/models/digits/versions/1/retire/").status_code == 200
    entry = AuditEntry.objects.get(action="version.retire")
    assert (entry.actor_name, entry.target, entry.tenant.slug) == ("bob", "model digits version 1", "acme")
    assert (entry.before["state"], entry.before["stable_version"]) == ("ready", 1)
    assert (entry.after["state"], entry.after["stable_version"]) == ("retired", None)


# -- shared_with: no slug is looked up for a caller who may not share ------------------------------------------


def test_an_engineer_cannot_tell_tenant_slugs_apart_by_sharing(people, other, model_files) -> None:  # noqa: ANN001, F811
    register(model_files.digits, "digits", owner=Tenant.objects.get(slug="acme"), visibility="private")
    bob, alice = client_for(people["bob"]), client_for(people["alice"])
    answers = [bob.patch("/api/models/digits/", {"shared_with": [slug]}, format="json") for slug in ("other", "nope")]
    assert [a.status_code for a in answers] == [403, 403]
    assert answers[0].json() == answers[1].json()
    # sharing is the admin's, who is told of a slug that names no tenant
    missing = assert_json_error(alice.patch("/api/models/digits/", {"shared_with": ["nope"]}, format="json"), 400)
    assert "shared_with" in missing["fields"]
    shared = alice.patch("/api/models/digits/", {"visibility": "shared", "shared_with": ["other"]}, format="json")
    assert shared.status_code == 200 and shared.json()["shared_with"] == ["other"]
    # an engineer may send the sharing as it is (a PUT of what GET answered)
    assert (
        bob.patch("/api/models/digits/", {"shared_with": ["other"], "description": "x"}, format="json").status_code
        == 200
    )


def test_pipeline_roles_are_checked_before_the_body_is_validated(people, their_pipe) -> None:  # noqa: ANN001, F811
    bob = client_for(people["bob"])
    malformed = {"spec": "not a graph", "visibility": "public"}
    # making one public needs the admin role: refused before the malformed spec is looked at
    assert_json_error(bob.post("/api/pipelines/", {"name": "mine", **malformed}, format="json"), 403)
    # another tenant's public pipeline: seen, not changed
    assert_json_error(bob.put("/api/pipelines/their-pipe/", malformed, format="json"), 403)
    assert_json_error(bob.put("/api/pipelines/their-pipe/", {"spec": "x"}, format="json"), 403)


# -- rollouts are the owning tenant's --------------------------------------------------------------------------


def test_another_tenant_sees_no_rollout_of_a_public_model(people, other, model_files) -> None:  # noqa: ANN001, F811
    acme = Tenant.objects.get(slug="acme")
    register(model_files.digits, "canaried", owner=acme, visibility="public")
    register(model_files.digits, "canaried", owner=acme, visibility="public")
    rollout = transitions.start(
        model=Model.objects.get(name="canaried"),
        candidate=2,
        actor=people["bob"],
        steps=[50, 100],
        shadow_seconds=0,
        bake_seconds=0,
    )
    eve, charlie = client_for(other["eve"]), client_for(people["charlie"])
    # the tenant's own viewer reads it
    assert charlie.get(f"/api/rollouts/{rollout.pk}/").json()["started_by"] == "bob"
    # another tenant that sees the model: as if there were none
    assert eve.get("/api/models/canaried/").status_code == 200
    assert eve.get("/api/rollouts/").json()["results"] == []
    for path in (f"/api/rollouts/{rollout.pk}/", f"/api/rollouts/{rollout.pk}/report/"):
        assert_json_error(eve.get(path), 404)
    assert_json_error(eve.post(f"/api/rollouts/{rollout.pk}/roll-back/"), 404)
    page = eve.get("/console/models/canaried/")
    assert page.status_code == 200 and b"Started by" not in page.content and b"bob" not in page.content
    assert eve.post(f"/console/rollouts/{rollout.pk}/roll-back/").status_code == 404
    assert "Started by bob" in client_for(people["charlie"]).get("/console/models/canaried/").content.decode()


# -- an upload's owner and role before its body ------------------------------------------------------------------


@pytest.mark.parametrize(("who", "status"), [("eve", 409), ("charlie", 403)])
def test_an_upload_is_refused_before_its_body_is_read(people, other, model_files, monkeypatch, who, status) -> None:  # noqa: ANN001, F811
    register(model_files.digits, "digits", owner=Tenant.objects.get(slug="acme"), visibility="public")
    # Charlie, Acme's viewer, is an engineer of Other: past the "engineer somewhere" check
    Membership.objects.create(user=people["charlie"], tenant=other["tenant"], role=Role.ENGINEER)
    client = client_for(other["eve"] if who == "eve" else people["charlie"])
    parsed = []
    real = MultiPartParser.parse

    def parse(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        parsed.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MultiPartParser, "parse", parse)
    # a form the validation would refuse (no artifact): the owner's answer comes first, the body unread
    assert_json_error(upload(client, "digits", form(None)), status)
    assert parsed == []
    assert ModelVersion.objects.filter(model__name="digits").count() == 1
