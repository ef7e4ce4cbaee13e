"""The registry's side of pipelines, after registration: what each snapshot checks again (a step's model
whose signature changed, a name another model took, a fallback that no longer fits), the tenant's quota,
settings a new version keeps, and bodies the API refuses as bad requests rather than failing on. Tenancy
as in test_pipeline_api (Alice admin, Bob engineer of Acme)."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps

from serving.models import PIPELINE_VERSIONS_SERVED, Model, ModelVersion, Pipeline, PipelineVersion
from serving.pipelines import register_pipeline
from serving.publish import build_snapshot
from serving.quota_counts import usage_against_quota
from tenants.models import Quota, Tenant
from tests.conftest import TOKENS_IO, register
from tests.test_api import assert_json_error, client_for, people  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def models(people, model_files):  # noqa: ANN001, ANN201, F811
    acme = Tenant.objects.get(slug="acme")
    register(model_files.digits, "pr-small", owner=acme, visibility="private", max_batch_size=16)
    register(model_files.digits, "pr-pub", owner=acme, visibility="public")
    register(model_files.digits, "pr-pub2", owner=acme, visibility="public")
    return people


def _acme() -> Tenant:
    return Tenant.objects.get(slug="acme")


def test_a_step_whose_model_now_takes_other_tensors_is_broken(models, model_files) -> None:  # noqa: ANN001
    register_pipeline(name="drift", spec={"model": "pr-small", "name": "small"}, tenant=_acme())
    assert not build_snapshot().pipelines["drift"].versions[1].broken
    # A version that reads tokens becomes the model's stable one: every call would be refused at the step.
    register(model_files.tokens, "pr-small", io=TOKENS_IO, owner=_acme(), visibility="private")
    Model.objects.filter(name="pr-small").update(stable_version=2)
    entry = build_snapshot().pipelines["drift"].versions[1]
    assert entry.broken == (
        "pipeline, tensor 'input': registered to take FP32 [64], its steps' models now take no such tensor:"
        " register a new version"
    )


def test_a_step_whose_model_now_gives_other_tensors_is_broken(models) -> None:  # noqa: ANN001
    register_pipeline(name="drift", spec={"model": "pr-small", "name": "small"}, tenant=_acme())
    # Only the outputs change: the step takes the request as before and answers another shape, which the
    # pipeline would have passed on as its own, silently.
    ModelVersion.objects.filter(model__name="pr-small").update(
        outputs=[{"name": "scores", "datatype": "FP32", "shape": [12]}]
    )
    entry = build_snapshot().pipelines["drift"].versions[1]
    assert entry.broken == (
        "pipeline, tensor 'scores': registered to give FP32 [10], its steps' models now give FP32 [12]:"
        " register a new version"
    )


def test_a_fallback_that_no_longer_fits_is_not_served(models) -> None:  # noqa: ANN001
    register_pipeline(name="fb", spec={"model": "pr-small", "name": "small"}, tenant=_acme(), fallback="pr-pub")
    assert build_snapshot().pipelines["fb"].fallback == "pr-pub"
    ModelVersion.objects.filter(model__name="pr-pub").update(
        inputs=[{"name": "input", "datatype": "FP32", "shape": [32]}]
    )
    pipeline = build_snapshot().pipelines["fb"]
    assert pipeline.fallback is None and not pipeline.versions[1].broken


def test_a_step_is_bound_to_its_model_not_to_whoever_takes_the_name(models, model_files) -> None:  # noqa: ANN001
    register_pipeline(name="bound", spec={"model": "pr-pub", "name": "s"}, tenant=_acme(), visibility="public")
    assert PipelineVersion.objects.get(pipeline__name="bound").step_models == {
        "pr-pub": Model.objects.get(name="pr-pub").pk
    }
    # Acme's model gives up the name (renamed here; deleted reads the same), and another tenant's public
    # model with the same signature takes it: the pipeline's callers' data must not go to it.
    Model.objects.filter(name="pr-pub").update(name="pr-pub-old")
    other = Tenant.objects.create(name="Other", slug="other")
    register(model_files.digits, "pr-pub", owner=other, visibility="public")
    entry = build_snapshot().pipelines["bound"].versions[1]
    assert entry.broken == (
        "step 'pr-pub': the model of this name is not the one this version was registered with: register a new version"
    )


def test_stored_versions_are_bound_by_the_migration(models) -> None:  # noqa: ANN001
    register_pipeline(name="old", spec={"model": "pr-pub", "name": "s"}, tenant=_acme())
    PipelineVersion.objects.update(step_models={}, spec={"sequence": [{"model": "pr-pub"}, {"model": "gone"}]})
    Pipeline.objects.update(visibility="shared")  # served as private: it has no tenants to share with
    migration = importlib.import_module("serving.migrations.0011_pipeline_step_models")
    migration.bind_and_unshare(apps, None)
    assert PipelineVersion.objects.get().step_models == {"gone": None, "pr-pub": Model.objects.get(name="pr-pub").pk}
    assert Pipeline.objects.get().visibility == "private"


def test_pipelines_count_toward_the_tenants_quota(models) -> None:  # noqa: ANN001
    bob = client_for(models["bob"])
    # Acme has 3 models with a live version each.
    Quota.objects.update_or_create(tenant=_acme(), defaults={"max_models": 4, "max_versions": 5})
    assert bob.post("/api/pipelines/", {"name": "a", "spec": {"model": "pr-small"}}, format="json").status_code == 201
    refused = assert_json_error(
        bob.post("/api/pipelines/", {"name": "b", "spec": {"model": "pr-small"}}, format="json"), 429
    )
    assert refused["error"].startswith("the tenant has 4 of its 4 models and pipelines (quota max_models)")
    assert bob.put("/api/pipelines/a/", {"spec": {"model": "pr-pub"}}, format="json").status_code == 200
    refused = assert_json_error(bob.put("/api/pipelines/a/", {"spec": {"model": "pr-small"}}, format="json"), 429)
    assert refused["error"].startswith("the tenant has 5 of its 5 live versions (quota max_versions)")
    assert not Pipeline.objects.filter(name="b").exists()
    assert PipelineVersion.objects.filter(pipeline__name="a").count() == 2
    usage = usage_against_quota(_acme().pk)
    assert usage["max_models"] == 4 and usage["max_versions"] == 5


def test_only_the_latest_versions_are_served_and_counted(models) -> None:  # noqa: ANN001
    acme = _acme()
    for _ in range(PIPELINE_VERSIONS_SERVED + 2):
        register_pipeline(name="many", spec={"model": "pr-small"}, tenant=acme)
    pipeline = build_snapshot().pipelines["many"]
    assert sorted(pipeline.versions) == list(range(3, PIPELINE_VERSIONS_SERVED + 3))
    assert pipeline.latest == PIPELINE_VERSIONS_SERVED + 2
    assert usage_against_quota(acme.pk)["max_versions"] == 3 + PIPELINE_VERSIONS_SERVED
    # Full: one more version only moves the window, so it still registers.
    Quota.objects.update_or_create(tenant=acme, defaults={"max_versions": 3 + PIPELINE_VERSIONS_SERVED})
    register_pipeline(name="many", spec={"model": "pr-small"}, tenant=acme)


def test_a_new_version_keeps_visibility_and_fallback_left_out(models) -> None:  # noqa: ANN001
    alice, bob = client_for(models["alice"]), client_for(models["bob"])
    body = {"name": "kept", "spec": {"model": "pr-pub"}, "visibility": "public", "fallback": "pr-pub2"}
    assert alice.post("/api/pipelines/", body, format="json").status_code == 201
    resp = alice.put("/api/pipelines/kept/", {"spec": {"model": "pr-pub2"}}, format="json")
    assert resp.status_code == 200, resp.content
    assert (resp.json()["visibility"], resp.json()["fallback"], resp.json()["latest"]) == ("public", "pr-pub2", 2)
    # A new version of a public pipeline is what every tenant runs: the admin role, as for making it public.
    assert_json_error(bob.put("/api/pipelines/kept/", {"spec": {"model": "pr-pub"}}, format="json"), 403)
    assert_json_error(bob.post("/api/pipelines/", {"name": "kept", "spec": {"model": "pr-pub"}}, format="json"), 403)
    # Said, they change: null removes the fallback.
    resp = alice.post("/api/pipelines/", {"name": "kept", "spec": {"model": "pr-pub"}, "fallback": None}, format="json")
    assert resp.status_code == 201, resp.content
    assert (resp.json()["visibility"], resp.json()["fallback"]) == ("public", None)


def test_shared_is_not_a_pipelines_visibility(models) -> None:  # noqa: ANN001
    alice = client_for(models["alice"])
    body = {"name": "sh", "spec": {"model": "pr-small"}, "visibility": "shared"}
    refused = assert_json_error(alice.post("/api/pipelines/", body, format="json"), 400)
    assert "visibility" in refused["fields"]
    with pytest.raises(Exception, match="a pipeline's visibility is private or public"):
        register_pipeline(name="sh", spec={"model": "pr-small"}, tenant=_acme(), visibility="shared")
    assert not Pipeline.objects.exists()


def test_bad_bodies_are_bad_requests_not_server_errors(models) -> None:  # noqa: ANN001
    alice = client_for(models["alice"])
    step = {"model": "pr-small", "name": "small"}
    switch = {"switch": {"tensor": "scores", "op": "<", "value": 10**400}, "then": {"model": "pr-pub"}}
    body = {"name": "huge", "spec": {"sequence": [step, switch]}}
    refused = assert_json_error(alice.post("/api/pipelines/", body, format="json"), 422)
    assert refused["error"] == "step 'sequence': the switch's 'value' must be a finite number"
    misspelled = {"name": "typo", "spec": {"model": "pr-small", "inputs": {"input": "smal.scores"}}}
    refused = assert_json_error(alice.post("/api/pipelines/", misspelled, format="json"), 422)
    assert "no step 'smal' has run before this step" in refused["error"]
    # Nested past the interpreter's recursion limit: json's decoder raises RecursionError, not ValueError.
    deep = '{"name": "deep", "spec": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for path in ("/api/pipelines/", "/api/models/"):
        refused = assert_json_error(alice.post(path, deep, content_type="application/json"), 400)
        assert refused["error"] == "JSON parse error - the body is nested too deeply"
    assert not Pipeline.objects.exists()
