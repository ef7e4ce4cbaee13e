"""The console's pipeline pages: the list, the graph drawn with a box per step, the live figures' JSON, and
nothing of a private pipeline for someone outside its tenant."""

from __future__ import annotations

import pytest

from serving.pipelines import register_pipeline
from tenants.models import Tenant
from tests.test_api import client_for, people  # noqa: F401 - the fixture
from tests.test_pipeline_api import SWITCH, models  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db(transaction=True)


def test_pipeline_page_draws_each_step_and_serves_its_live_figures(models) -> None:  # noqa: ANN001, F811
    acme = Tenant.objects.get(slug="acme")
    register_pipeline(name="cascade", spec=SWITCH, tenant=acme, fallback="pa-big")
    charlie, dave = client_for(models["charlie"]), client_for(models["dave"])

    listing = charlie.get("/console/pipelines/")
    assert listing.status_code == 200 and b"cascade" in listing.content

    page = charlie.get("/console/pipelines/cascade/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'data-step="small"' in html and 'data-step="big"' in html
    assert "max_softmax(scores) &lt; 0.9" in html and "else: kept" in html
    live = charlie.get("/console/pipelines/cascade/live/")
    assert live.status_code == 200 and set(live.json()) == {"calls", "fallbacks", "steps"}

    for path in ("/console/pipelines/cascade/", "/console/pipelines/cascade/live/"):
        assert dave.get(path).status_code == 404
    assert b"cascade" not in dave.get("/console/pipelines/").content
