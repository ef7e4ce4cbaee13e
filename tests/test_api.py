"""Tests for the DRF control-plane API (/api/...) on PostgreSQL.

People: Alice is a tenant admin (membership role), Bob an engineer, Charlie a viewer; Dave belongs to
no tenant. Writes need the engineer role in the tenant that owns the model (Acme); reads need a login.
Every error is JSON with an "error" key.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from serving.models import Model, ModelVersion, State
from tenants.models import Membership, Role, Tenant
from tests.conftest import DIGITS_IO, register
from tests.test_admin_audit import change_model

pytestmark = pytest.mark.django_db

UPLOAD = "/api/models/{name}/versions/"


@pytest.fixture
def people(db) -> dict[str, User]:  # noqa: ANN001
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    users = {}
    roles = [("alice", Role.ADMIN), ("bob", Role.ENGINEER), ("charlie", Role.VIEWER), ("dave", None)]
    for name, role in roles:
        user = User.objects.create_user(name, f"{name}@example.org")  # no password: force_login needs none
        if role:
            Membership.objects.create(user=user, tenant=tenant, role=role)
        users[name] = user
    return users


def client_for(user: User | None) -> APIClient:
    client = APIClient()
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def alice(people) -> APIClient:
    return client_for(people["alice"])


@pytest.fixture
def bob(people) -> APIClient:
    return client_for(people["bob"])


@pytest.fixture
def charlie(people) -> APIClient:
    return client_for(people["charlie"])


@pytest.fixture
def dave(people) -> APIClient:
    return client_for(people["dave"])


def form(path: Path | None, **overrides: object) -> dict:
    data: dict = {
        "format": "torchscript",
        "inputs": json.dumps(DIGITS_IO["inputs"]),
        "outputs": json.dumps(DIGITS_IO["outputs"]),
        "max_batch_size": 2,
    }
    if path is not None:
        data["artifact"] = io.BytesIO(path.read_bytes())
        data["artifact"].name = path.name
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not None}


def upload(client: APIClient, name: str, data: dict):  # noqa: ANN201
    return client.post(UPLOAD.format(name=name), data, format="multipart")


def assert_json_error(response, status: int) -> dict:  # noqa: ANN001
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert isinstance(body.get("error"), str) and body["error"]
    return body


# --- upload -----------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("who", ["bob", "alice"])
def test_engineer_and_operator_upload_a_version_that_becomes_ready(request, model_files, who: str) -> None:
    # given an engineer (or a tenant admin, who ranks above)
    client = request.getfixturevalue(who)
    # when they upload the digits artifact as a new model's first version
    response = upload(
        client, "digits", form(model_files.digits, description="handwritten digits", preferred_batch_sizes="[2]")
    )
    # then it is created and, validated eagerly on commit, already READY
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["model"] == "digits" and body["version"] == 1
    assert body["state"] == State.READY, body["failure_reason"]
    assert body["max_batch_size"] == 2 and body["preferred_batch_sizes"] == [2]
    assert set(body["latency_profile"]) == {"1", "2"}
    assert body["memory_bytes"] > 0
    assert Model.objects.get(name="digits").description == "handwritten digits"


@pytest.mark.django_db(transaction=True)
def test_upload_of_a_broken_model_is_created_but_failed(bob, model_files) -> None:
    # when an engineer uploads a model whose output dtype contradicts its signature
    response = upload(bob, "wrong", form(model_files.wrong_dtype))
    # then the version exists (201) and says why it FAILED
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["state"] == State.FAILED
    assert "int64" in body["failure_reason"]


@pytest.mark.parametrize("who", ["charlie", "dave"])
def test_viewer_and_outsider_cannot_upload(request, model_files, who: str) -> None:
    # given a viewer, or a user with no role anywhere
    client = request.getfixturevalue(who)
    # when they upload
    response = upload(client, "digits", form(model_files.digits))
    # then they are refused and nothing is registered
    body = assert_json_error(response, 403)
    assert "engineer" in body["error"]
    assert not Model.objects.exists()


def test_anonymous_cannot_upload_or_read(model_files) -> None:
    anonymous = APIClient()
    assert_json_error(upload(anonymous, "digits", form(model_files.digits)), 403)
    assert_json_error(anonymous.get("/api/models/"), 403)
    assert not Model.objects.exists()


def test_staff_without_membership_can_upload(people, model_files) -> None:
    # given a staff user with no tenant membership
    staff = User.objects.create_user("root", "root@example.org", is_staff=True)
    # when they upload / then it is accepted (validation waits for the test transaction's commit)
    response = upload(client_for(staff), "digits", form(model_files.digits))
    assert response.status_code == 201, response.content
    assert response.json()["state"] == State.REGISTERED


# --- bad uploads: 4xx JSON, never 500 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "status", "field", "message"),
    [
        ({"inputs": '[{"name": "input"'}, 400, "inputs", "not valid JSON"),
        ({"inputs": '{"name": "input", "datatype": "FP32", "shape": [64]}'}, 400, "inputs", "must be a JSON list"),
        ({"outputs": "42"}, 400, "outputs", "must be a JSON list"),
        ({"inputs": '[{"name": "input", "datatype": "FP99", "shape": [64]}]'}, 400, None, "unsupported datatype"),
        ({"inputs": "[]"}, 400, None, "non-empty list"),
        ({"format": "onnx"}, 400, "format", "not a valid choice"),
        ({"format": None}, 400, "format", "required"),
        ({"sha256": "xyz"}, 400, "sha256", ""),
        ({"sha256": "0" * 64}, 400, None, "sha256 mismatch"),
        ({"max_batch_size": 0}, 400, "max_batch_size", ""),
        ({"max_batch_size": "lots"}, 400, "max_batch_size", ""),
        ({"max_batch_size": 4, "preferred_batch_sizes": "[8]"}, 400, None, "preferred batch size 8 is outside"),
        ({"preferred_batch_sizes": "[2"}, 400, "preferred_batch_sizes", "not valid JSON"),
        ({"default_timeout_ms": 0}, 400, "default_timeout_ms", ""),
        ({"task": "translation"}, 400, "task", "not a valid choice"),
    ],
)
def test_bad_upload_fields_are_json_400s(
    bob, model_files, overrides: dict, status: int, field: str | None, message: str
) -> None:
    # when an engineer uploads with one bad field
    response = upload(bob, "digits", form(model_files.digits, **overrides))
    # then it is a JSON 4xx naming the problem, and nothing is registered
    body = assert_json_error(response, status)
    assert message in body["error"]
    if field:
        assert field in body["fields"]
    assert not ModelVersion.objects.exists()


def test_missing_artifact_is_a_json_400(bob) -> None:
    body = assert_json_error(upload(bob, "digits", form(None)), 400)
    assert "artifact" in body["fields"]


def test_not_a_zip_is_a_json_422(bob, model_files) -> None:
    body = assert_json_error(upload(bob, "digits", form(model_files.not_a_zip)), 422)
    assert "not a zip" in body["error"]
    assert not Model.objects.exists()


def test_bad_model_name_in_the_url_is_a_json_404(bob, model_files) -> None:
    # the URL accepts exactly the names the schema's pattern allows; anything else is no endpoint at all
    body = assert_json_error(upload(bob, "-dash-first", form(model_files.digits)), 404)
    assert "/api/models/-dash-first/versions/" in body["error"]
    assert not Model.objects.exists()


def test_upload_over_the_limit_is_a_json_413(bob, model_files, settings) -> None:
    # given a limit below the artifact's size (but within the form allowance)
    settings.FERRY_MAX_ARTIFACT_BYTES = 1000
    # when it is uploaded / then the store refuses it while hashing
    body = assert_json_error(upload(bob, "digits", form(model_files.digits)), 413)
    assert "1000 byte limit" in body["error"]
    assert not Model.objects.exists()


def test_upload_far_over_the_limit_is_refused_from_its_length(bob, model_files, settings) -> None:
    # given a tiny limit and a request body far past it plus the form allowance
    settings.FERRY_MAX_ARTIFACT_BYTES = 1
    data = form(model_files.digits, format="onnx")  # also invalid, but never looked at
    data["artifact"] = io.BytesIO(b"\0" * (200 * 1024))
    data["artifact"].name = "huge.pt"
    # then it is refused as too large before the form is even parsed
    body = assert_json_error(upload(bob, "digits", data), 413)
    assert "1 byte limit" in body["error"]
    assert "fields" not in body
    assert not Model.objects.exists()


def test_upload_that_is_not_multipart_is_a_json_415(bob) -> None:
    # an artifact travels only as a multipart file part, which is all the schema documents
    response = bob.post(UPLOAD.format(name="digits"), {"format": "torchscript"}, format="json")
    body = assert_json_error(response, 415)
    assert "multipart/form-data" in body["error"]


# --- reading the registry -----------------------------------------------------------------------------------


@pytest.fixture
def registry(people, model_files) -> None:
    """digits v1, v2 (ready) and small v1 (ready), registered synchronously: public models of Acme."""
    acme = Tenant.objects.get(slug="acme")
    register(model_files.digits, "digits", max_batch_size=2, owner=acme)
    register(model_files.digits, "digits", max_batch_size=2, owner=acme)
    register(model_files.digits_export, "small", fmt="torch_export", max_batch_size=2, owner=acme)


@pytest.mark.parametrize("who", ["charlie", "dave", "bob"])
def test_any_logged_in_user_lists_and_retrieves(request, registry, who: str) -> None:
    client = request.getfixturevalue(who)
    # when the models are listed
    response = client.get("/api/models/")
    # then both come back, by name, with their versions
    assert response.status_code == 200
    body = response.json()
    assert body["count"] == 2
    assert [m["name"] for m in body["results"]] == ["digits", "small"]
    assert [v["version"] for v in body["results"][0]["versions"]] == [1, 2]
    # and one model can be retrieved by name
    model = client.get("/api/models/digits/").json()
    assert model["name"] == "digits" and model["fallback"] is None
    # and its versions listed and retrieved
    versions = client.get("/api/models/digits/versions/").json()
    assert [v["version"] for v in versions["results"]] == [1, 2]
    v2 = client.get("/api/models/digits/versions/2/").json()
    assert v2["model"] == "digits" and v2["state"] == State.READY and v2["format"] == "torchscript"
    assert len(v2["artifact_sha256"]) == 64


def test_unknown_model_and_version_are_json_404s(charlie, registry) -> None:
    assert_json_error(charlie.get("/api/models/nope/"), 404)
    body = assert_json_error(charlie.get("/api/models/nope/versions/"), 404)
    assert "unknown model 'nope'" in body["error"]
    assert_json_error(charlie.get("/api/models/digits/versions/99/"), 404)
    assert_json_error(charlie.get("/api/models/nope/versions/1/"), 404)


# --- changing the registry ----------------------------------------------------------------------


def test_engineer_sets_and_clears_a_fallback(bob, registry) -> None:
    # when an engineer makes small the fallback of digits
    response = bob.patch("/api/models/digits/", {"fallback": "small"}, format="json")
    # then it is stored and shown by name
    assert response.status_code == 200, response.content
    assert response.json()["fallback"] == "small"
    assert Model.objects.get(name="digits").fallback.name == "small"
    # and it can be cleared again
    response = bob.patch("/api/models/digits/", {"fallback": None}, format="json")
    assert response.status_code == 200 and response.json()["fallback"] is None
    assert Model.objects.get(name="digits").fallback is None


def test_a_model_cannot_be_its_own_fallback(bob, registry) -> None:
    body = assert_json_error(bob.patch("/api/models/digits/", {"fallback": "digits"}, format="json"), 400)
    assert "own fallback" in body["error"]
    assert Model.objects.get(name="digits").fallback is None


def test_unknown_fallback_is_a_json_400(bob, registry) -> None:
    body = assert_json_error(bob.patch("/api/models/digits/", {"fallback": "ghost"}, format="json"), 400)
    assert "fallback" in body["fields"]


def test_viewer_cannot_change_a_model(charlie, registry) -> None:
    assert_json_error(charlie.patch("/api/models/digits/", {"fallback": "small"}, format="json"), 403)
    assert Model.objects.get(name="digits").fallback is None


def test_engineer_retires_a_version(bob, registry) -> None:
    # when an engineer retires digits v2 (v1, ready first, is the stable version)
    response = bob.post("/api/models/digits/versions/2/retire/")
    # then it is retired and v1 is untouched
    assert response.status_code == 200, response.content
    assert response.json()["state"] == State.RETIRED
    states = dict(ModelVersion.objects.filter(model__name="digits").values_list("version", "state"))
    assert states == {1: State.READY, 2: State.RETIRED}


@pytest.mark.parametrize("who", ["charlie", "dave"])
def test_viewer_and_outsider_cannot_retire(request, registry, who: str) -> None:
    client = request.getfixturevalue(who)
    assert_json_error(client.post("/api/models/digits/versions/1/retire/"), 403)
    assert ModelVersion.objects.get(model__name="digits", version=1).state == State.READY


def test_retire_unknown_version_is_a_json_404(bob, registry) -> None:
    assert_json_error(bob.post("/api/models/digits/versions/7/retire/"), 404)


def test_a_model_with_live_versions_cannot_be_deleted(bob, registry) -> None:
    # when an engineer deletes a model whose versions are live
    body = assert_json_error(bob.delete("/api/models/small/"), 409)
    assert "retire" in body["error"]
    # then once its versions are retired it can be
    assert bob.post("/api/models/small/versions/1/retire/").status_code == 200
    assert bob.delete("/api/models/small/").status_code == 204
    assert not Model.objects.filter(name="small").exists()


@pytest.mark.django_db(transaction=True)
def test_second_upload_becomes_the_next_version(bob, model_files) -> None:
    first = upload(bob, "digits", form(model_files.digits))
    second = upload(bob, "digits", form(model_files.digits_export, format="torch_export"))
    assert (first.status_code, second.status_code) == (201, 201)
    assert (first.json()["version"], second.json()["version"]) == (1, 2)
    assert second.json()["state"] == State.READY, second.json()["failure_reason"]
    assert [v["version"] for v in bob.get("/api/models/digits/").json()["versions"]] == [1, 2]


# --- schema --------------------------------------------------------------------------------


def test_openapi_schema_describes_the_versions_endpoint(charlie) -> None:
    response = charlie.get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    schema = json.loads(response.content)
    assert schema["openapi"].startswith("3.")
    paths = schema["paths"]
    assert "/api/models/{model_name}/versions/" in paths
    upload_op = paths["/api/models/{model_name}/versions/"]["post"]
    assert "multipart/form-data" in upload_op["requestBody"]["content"]
    assert "/api/models/{model_name}/versions/{version}/retire/" in paths


def test_viewer_gets_403_before_the_body_is_validated(charlie, registry) -> None:
    # given a viewer / when sending an invalid change / then the role check answers, not validation
    response = charlie.patch("/api/models/digits/", {"fallback": "no-such-model"}, format="json")
    assert_json_error(response, 403)
    response = charlie.post("/api/models/digits/versions/", {}, format="multipart")
    assert_json_error(response, 403)


# --- the API answers what its schema documents --------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("limit=71027838781877370880", "limit"),  # once a relabelled server error (a database overflow)
        ("offset=99999999999999999999", "offset"),
        ("limit=0", "limit"),
        ("limit=-5", "limit"),
        ("limit=1001", "limit"),
        ("limit=abc", "limit"),
        ("limit=1.5", "limit"),
        ("limit=", "limit"),
        ("limit=%D9%A5", "limit"),  # an Arabic-Indic five: int() takes it, the schema's integer does not
        ("offset=-1", "offset"),
        ("offset=null", "offset"),
        ("limit=1&limit=2", "limit"),
    ],
)
@pytest.mark.parametrize("path", ["/api/models/", "/api/models/digits/versions/"])
def test_bad_pagination_is_a_json_400_naming_the_parameter(
    charlie, registry, path: str, query: str, field: str
) -> None:
    body = assert_json_error(charlie.get(f"{path}?{query}"), 400)
    assert field in body["fields"]


def test_pagination_within_bounds(charlie, registry) -> None:
    # when a page of one is asked for at each end of the documented bounds
    first = charlie.get("/api/models/?limit=1&offset=0").json()
    second = charlie.get("/api/models/?limit=1000&offset=1").json()
    beyond = charlie.get("/api/models/?offset=2147483647").json()
    # then each is the slice asked for
    assert [m["name"] for m in first["results"]] == ["digits"] and first["count"] == 2
    assert "limit=1" in first["next"]
    assert [m["name"] for m in second["results"]] == ["small"] and second["next"] is None
    assert beyond["results"] == []


@pytest.mark.parametrize(
    "path",
    [
        "/api/models/-dash/",
        "/api/models/%C2%84/",
        "/api/models/digits/versions/0/",
        "/api/models/digits/versions/x/",
        "/api/nope/",
        "/api/models/digits/nope/",
    ],
)
def test_unknown_api_paths_are_json_404s(charlie, registry, path: str) -> None:
    assert_json_error(charlie.get(path), 404)


def test_huge_version_number_is_a_json_404(charlie, registry) -> None:
    assert_json_error(charlie.get("/api/models/digits/versions/99999999999999999999/"), 404)


def test_creating_a_model_whose_name_is_taken_is_a_json_409(bob, registry) -> None:
    body = assert_json_error(bob.post("/api/models/", {"name": "digits"}, format="json"), 409)
    assert "digits" in body["error"]
    # and renaming a model onto another's name is the same conflict
    assert_json_error(bob.patch("/api/models/small/", {"name": "digits"}, format="json"), 409)
    assert Model.objects.filter(name="small").exists()


def test_engineer_creates_and_renames_a_model(bob, registry) -> None:
    response = bob.post("/api/models/", {"name": "empty", "description": "nothing yet"}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["versions"] == []
    response = bob.patch("/api/models/empty/", {"name": "still-empty"}, format="json")
    assert response.status_code == 200, response.content
    assert bob.get("/api/models/still-empty/").status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"description": 5}, "description"),  # a number is not text, though DRF would turn it into "5"
        ({"description": "nul\x00byte"}, "description"),
        ({"name": " digits2"}, "name"),  # not trimmed into a valid name
        ({"name": "digits2\n"}, "name"),
        ({"name": 7}, "name"),
        ({"fallback": 7}, "fallback"),
        ({"fallback": "nul\x00"}, "fallback"),
        ({"task": True}, "task"),
    ],
)
def test_model_fields_of_the_wrong_type_or_shape_are_json_400s(bob, registry, body: dict, field: str) -> None:
    response = bob.patch("/api/models/digits/", body, format="json")
    assert field in assert_json_error(response, 400)["fields"]
    model = Model.objects.get(name="digits")
    assert (model.description, model.fallback) == ("", None)


def test_model_changes_take_json_only(bob, registry) -> None:
    response = bob.patch("/api/models/digits/", {"description": "x"}, format="multipart")
    assert_json_error(response, 415)


# --- unexpected exceptions --------------------------------------------------------------------------------


def test_an_unexpected_exception_is_a_logged_and_counted_json_500(charlie, registry, monkeypatch, caplog) -> None:
    from serving.api.views import ModelViewSet
    from serving.dataplane.metrics.metrics import INTERNAL_ERRORS

    # given a view with a bug
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the view")

    monkeypatch.setattr(ModelViewSet, "list", broken)
    before = INTERNAL_ERRORS.labels("api")._value.get()
    # when it is called
    response = charlie.get("/api/models/")
    # then it is a JSON 500 (not relabelled as unavailable), logged with its traceback, and counted
    body = assert_json_error(response, 500)
    assert "internal error" in body["error"] and "a bug in the view" not in body["error"]
    assert INTERNAL_ERRORS.labels("api")._value.get() == before + 1
    logged = [r for r in caplog.records if r.exc_info and r.exc_info[1].args == ("a bug in the view",)]
    assert logged and logged[0].levelname == "ERROR"


# --- batching settings: the API's PATCH, the model's clean() and the admin --------------------------------

VERSION = "/api/models/digits/versions/1/"
BATCHING = ["max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes", "max_queue_size", "default_timeout_ms"]


def batching_of(name: str = "digits", version: int = 1) -> dict:
    row = ModelVersion.objects.get(model__name=name, version=version)
    return {f: getattr(row, f) for f in BATCHING}


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"preferred_batch_sizes": [4]}, "preferred_batch_sizes", "preferred batch size 4 is outside"),  # max is 2
        ({"max_batch_size": 1}, "preferred_batch_sizes", "outside"),  # v1 prefers 2 (set below)
        ({"max_batch_size": 8, "preferred_batch_sizes": [16]}, "preferred_batch_sizes", "outside"),
        ({"preferred_batch_sizes": "[2]"}, "preferred_batch_sizes", ""),
        ({"preferred_batch_sizes": [1.5]}, "preferred_batch_sizes", ""),
        ({"preferred_batch_sizes": [True]}, "preferred_batch_sizes", ""),
        ({"preferred_batch_sizes": None}, "preferred_batch_sizes", ""),
        ({"max_batch_size": 0}, "max_batch_size", ""),
        ({"max_batch_size": "8"}, "max_batch_size", ""),
        ({"max_batch_size": 5000}, "max_batch_size", ""),
        ({"max_queue_delay_ms": -1}, "max_queue_delay_ms", ""),
        ({"max_queue_delay_ms": "5"}, "max_queue_delay_ms", ""),
        ({"max_queue_size": 0}, "max_queue_size", ""),
        ({"default_timeout_ms": 0}, "default_timeout_ms", ""),
        ({"state": "ready"}, "state", "not a batching setting"),
    ],
)
def test_bad_batching_patch_is_a_json_400_and_changes_nothing(
    bob, registry, body: dict, field: str, message: str
) -> None:
    ModelVersion.objects.filter(model__name="digits", version=1).update(preferred_batch_sizes=[2])
    before = batching_of()
    response = bob.patch(VERSION, body, format="json")
    error = assert_json_error(response, 400)
    assert field in error["fields"] and message in error["error"]
    assert batching_of() == before


def test_engineer_patches_batching_and_the_data_plane_gets_it(
    bob, registry, django_capture_on_commit_callbacks
) -> None:
    from serving.dataplane.gateway.snapshot import hub

    # when an engineer changes digits v1's batching
    change = {
        "max_batch_size": 8,
        "preferred_batch_sizes": [4, 8],
        "max_queue_delay_ms": 1.5,
        "max_queue_size": 64,
        "default_timeout_ms": 250,
    }
    with django_capture_on_commit_callbacks(execute=True):
        response = bob.patch(VERSION, change, format="json")
    # then the row holds it, the answer shows it, and the routing snapshot was republished with it
    assert response.status_code == 200, response.content
    assert {k: response.json()[k] for k in change} == change
    assert batching_of() == change
    assert batching_of(version=2)["max_batch_size"] == 2
    entry = hub.current.models["digits"].versions[1]
    assert entry.batching.max_batch_size == 8 and entry.batching.preferred_batch_sizes == (4, 8)
    assert entry.default_timeout_ms == 250
    # and a partial change leaves the other settings alone
    response = bob.patch(VERSION, {"max_queue_size": 32}, format="json")
    assert response.status_code == 200, response.content
    assert batching_of() == {**change, "max_queue_size": 32}


@pytest.mark.parametrize("who", ["charlie", "dave"])
def test_viewer_cannot_patch_batching(request, registry, who: str) -> None:
    before = batching_of()
    assert_json_error(request.getfixturevalue(who).patch(VERSION, {"max_batch_size": 8}, format="json"), 403)
    assert batching_of() == before


def test_batching_patch_of_an_unknown_version_is_a_json_404(bob, registry) -> None:
    assert_json_error(bob.patch("/api/models/digits/versions/9/", {"max_batch_size": 8}, format="json"), 404)


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"preferred_batch_sizes": [4]}, "preferred_batch_sizes"),  # max_batch_size is 2
        ({"preferred_batch_sizes": "[1]"}, "preferred_batch_sizes"),
        ({"preferred_batch_sizes": [1, "2"]}, "preferred_batch_sizes"),
        ({"preferred_batch_sizes": [True]}, "preferred_batch_sizes"),
        ({"preferred_batch_sizes": {"1": 1}}, "preferred_batch_sizes"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_queue_delay_ms": -0.5}, "max_queue_delay_ms"),
        ({"max_queue_size": 0}, "max_queue_size"),
    ],
)
def test_model_version_clean_refuses_invalid_batching(registry, values: dict, field: str) -> None:
    from django.core.exceptions import ValidationError

    row = ModelVersion.objects.get(model__name="digits", version=1)
    for name, value in values.items():
        setattr(row, name, value)
    with pytest.raises(ValidationError) as caught:
        row.full_clean()
    assert field in caught.value.message_dict


def admin_post(client, model: Model, **version_fields: object):  # noqa: ANN001, ANN201
    """POST the admin change form of `model` with its first version's inline row changed."""
    first = model.versions.order_by("version").first()
    return change_model(client, model, {first.version: version_fields} if first is not None else None)


@pytest.fixture
def admin_client_(registry) -> APIClient:  # noqa: ARG001
    root = User.objects.create_superuser("root", "root@example.org", "unused")
    client = APIClient()
    client.force_login(root)
    return client


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"preferred_batch_sizes": "[4]"}, "preferred batch size 4 is outside"),
        ({"max_batch_size": "8", "preferred_batch_sizes": "[16]"}, "preferred batch size 16 is outside"),
        ({"preferred_batch_sizes": '"four"'}, "list of integers"),
        ({"preferred_batch_sizes": "[2.5]"}, "list of integers"),
        ({"max_queue_size": "0"}, ""),
    ],
)
def test_admin_refuses_invalid_batching_and_changes_nothing(admin_client_, change: dict, message: str) -> None:
    model = Model.objects.get(name="digits")
    before = batching_of()
    response = admin_post(admin_client_, model, **change)
    # the form comes back (200, not the redirect of a save) with the reason on it
    assert response.status_code == 200
    assert "errornote" in response.content.decode()
    assert message in response.content.decode()
    assert batching_of() == before


def test_admin_saves_valid_batching(admin_client_) -> None:
    model = Model.objects.get(name="digits")
    response = admin_post(admin_client_, model, max_batch_size="8", preferred_batch_sizes="[4, 8]", max_queue_size="64")
    assert response.status_code == 302, response.content.decode()[-3000:]
    assert batching_of()["max_batch_size"] == 8
    assert batching_of()["preferred_batch_sizes"] == [4, 8]
    assert batching_of()["max_queue_size"] == 64


def test_a_path_with_a_newline_is_a_json_404(bob) -> None:
    assert_json_error(bob.post("/api/models/a%0Ab/versions/", {}, format="multipart"), 404)


def test_model_create_through_the_api_counts_against_the_tenants_max_models(bob) -> None:
    from tenants.models import Quota

    # given tenant acme may hold one model
    Quota.objects.filter(tenant__slug="acme").update(max_models=1)
    # when its engineer creates one / then it is acme's
    first = bob.post("/api/models/", {"name": "first", "tenant": "acme"}, format="json")
    assert first.status_code == 201, first.content
    assert Model.objects.get(name="first").tenant.slug == "acme"
    # when a second / then 429 naming the quota, with no Retry-After (waiting does not help), and no model
    second = bob.post("/api/models/", {"name": "second", "tenant": "acme"}, format="json")
    assert second.status_code == 429, second.content
    assert "max_models" in second.json()["error"] and "Retry-After" not in second.headers
    assert not Model.objects.filter(name="second").exists()
