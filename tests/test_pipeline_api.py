"""Registering pipelines through /api/pipelines/: the derived signature, refusals naming step and tensor,
tenancy (Alice admin, Bob engineer, Charlie viewer of Acme; Dave in no tenant), the audit entry, and the
pipeline as the routing snapshot carries it, through Redis' encoding too."""

from __future__ import annotations

import pytest

from serving.dataplane.gateway import snapshot_redis
from serving.publish import build_snapshot
from tenants.models import AuditEntry, Tenant
from tests.conftest import TOKENS_IO, register
from tests.test_api import assert_json_error, client_for, people  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)

SWITCH = {
    "sequence": [
        {"model": "pa-small", "name": "small"},
        {
            "switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": 0.9},
            "then": {"model": "pa-big", "name": "big"},
        },
    ]
}


@pytest.fixture
def models(people, model_files):  # noqa: ANN001, ANN201, F811
    acme = Tenant.objects.get(slug="acme")
    register(model_files.digits, "pa-small", owner=acme, visibility="private", max_batch_size=16)
    register(model_files.digits, "pa-big", owner=acme, visibility="private", max_batch_size=8)
    register(model_files.tokens, "pa-tokens", io=TOKENS_IO, owner=acme, visibility="private")
    other = Tenant.objects.create(name="Other", slug="other")
    register(model_files.digits, "their-secret", owner=other, visibility="private")
    return people


def test_engineer_registers_a_pipeline_with_its_signature_derived(models) -> None:  # noqa: ANN001
    bob = client_for(models["bob"])
    resp = bob.post("/api/pipelines/", {"name": "cascade", "spec": SWITCH}, format="json")
    assert resp.status_code == 201, resp.content
    body = resp.json()
    assert body["tenant"] == "acme" and body["latest"] == 1 and body["visibility"] == "private"
    (version,) = body["versions"]
    assert version["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [64]}]
    assert version["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [10]}]
    entry = AuditEntry.objects.get(action="pipeline.register")
    assert entry.actor_name == "bob" and entry.target == "pipeline cascade" and entry.after["version"] == 1

    # A PUT is the next version; the snapshot serves the latest, re-checked, with the steps' batch limit.
    resp = bob.put("/api/pipelines/cascade/", {"spec": {"model": "pa-big"}}, format="json")
    assert resp.status_code == 200, resp.content
    assert resp.json()["latest"] == 2
    snapshot = build_snapshot()
    pipeline = snapshot.pipelines["cascade"]
    assert pipeline.latest == 2 and set(pipeline.versions) == {1, 2}
    assert pipeline.versions[1].max_rows == 8 and not pipeline.versions[1].broken
    assert snapshot_redis.decode(snapshot_redis.encode(snapshot)).pipelines == snapshot.pipelines


def test_steps_that_do_not_connect_are_refused_with_step_and_tensor(models) -> None:  # noqa: ANN001
    bob = client_for(models["bob"])
    spec = {"sequence": [{"model": "pa-small"}, {"model": "pa-tokens", "inputs": {"tokens": "scores"}}]}
    body = assert_json_error(bob.post("/api/pipelines/", {"name": "bad", "spec": spec}, format="json"), 422)
    assert "step 'pa-tokens', tensor 'tokens'" in body["error"]
    assert "INT64" in body["error"] and "FP32 [10]" in body["error"]
    assert not AuditEntry.objects.filter(action="pipeline.register").exists()


def test_another_tenants_private_model_reads_as_an_unknown_one(models) -> None:  # noqa: ANN001
    bob = client_for(models["bob"])
    secret = bob.post("/api/pipelines/", {"name": "p1", "spec": {"model": "their-secret"}}, format="json")
    missing = bob.post("/api/pipelines/", {"name": "p1", "spec": {"model": "nobody-has-it"}}, format="json")
    a, b = assert_json_error(secret, 422)["error"], assert_json_error(missing, 422)["error"]
    assert a.replace("their-secret", "X") == b.replace("nobody-has-it", "X")
    assert "Other" not in a and "other" not in a.replace("another", "")


def test_roles_names_and_visibility(models) -> None:  # noqa: ANN001
    bob, charlie, dave = (client_for(models[n]) for n in ("bob", "charlie", "dave"))
    assert_json_error(charlie.post("/api/pipelines/", {"name": "c", "spec": SWITCH}, format="json"), 403)
    # A model's name is not a pipeline's to take.
    assert_json_error(bob.post("/api/pipelines/", {"name": "pa-big", "spec": SWITCH}, format="json"), 409)
    # Public needs the admin role.
    public = {"name": "c", "spec": SWITCH, "visibility": "public"}
    assert_json_error(bob.post("/api/pipelines/", public, format="json"), 403)
    # Its steps run as each caller: a public pipeline over private models would fail every other tenant.
    refused = assert_json_error(client_for(models["alice"]).post("/api/pipelines/", public, format="json"), 422)
    assert refused["error"] == "step 'small': a public pipeline's steps must be public models"
    assert bob.post("/api/pipelines/", {"name": "c", "spec": SWITCH}, format="json").status_code == 201
    # Private: the viewer of its tenant sees it, an outsider does not.
    assert charlie.get("/api/pipelines/c/").status_code == 200
    assert_json_error(dave.get("/api/pipelines/c/"), 404)
    assert dave.get("/api/pipelines/").json()["results"] == []
    assert_json_error(charlie.delete("/api/pipelines/c/"), 403)
    assert bob.delete("/api/pipelines/c/").status_code == 204
    assert AuditEntry.objects.filter(action="pipeline.delete", target="pipeline c").exists()
