"""Names the Open Inference Protocol's paths use under /v2/models/ (`stats`: GET /v2/models/stats lists every
model's statistics) cannot name a new model or pipeline: either would be unreadable at its own path."""

from __future__ import annotations

import pytest

from serving.errors import RegistrationError
from serving.models import RESERVED_NAMES, Model, Pipeline
from serving.pipelines import PipelineRegistrationError, register_pipeline
from tenants.models import Tenant
from tests.conftest import register
from tests.test_api import assert_json_error, client_for, people  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)


def test_stats_is_reserved() -> None:
    assert "stats" in RESERVED_NAMES


def test_the_api_refuses_a_model_named_stats(people) -> None:  # noqa: ANN001, F811
    bob = client_for(people["bob"])
    refused = assert_json_error(bob.post("/api/models/", {"name": "stats"}, format="json"), 400)
    assert "reserved" in str(refused)
    assert not Model.objects.filter(name="stats").exists()


def test_an_upload_cannot_create_a_model_named_stats(people, model_files) -> None:  # noqa: ANN001, F811
    with pytest.raises(RegistrationError, match="reserved"):
        register(model_files.digits, "stats", owner=Tenant.objects.get(slug="acme"))
    assert not Model.objects.filter(name="stats").exists()


def test_a_pipeline_cannot_be_named_stats(people, model_files) -> None:  # noqa: ANN001, F811
    acme = Tenant.objects.get(slug="acme")
    register(model_files.digits, "rn-small", owner=acme, visibility="private")
    with pytest.raises(PipelineRegistrationError, match="reserved") as refused:
        register_pipeline(name="stats", spec={"model": "rn-small"}, tenant=acme)
    assert refused.value.status == 400
    assert not Pipeline.objects.exists()
