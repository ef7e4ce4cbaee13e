"""The capacity planner in a real browser: the analytic answer as the operator types, then a simulation
check with its plot. Plus the page's answers without a browser (validation, JSON)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sim.planner import WhatIf, answer
from tenants.models import Membership
from tests.conftest import tenant

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
USERNAME = "planner-op"
PASSWORD = "a-long-test-password"
WAIT_MS = 60_000  # deadline for what the page shows; a failure, never a timing assertion


def test_the_bottleneck_is_named():
    assert answer(WhatIf(rate=200)).bottleneck == "accelerator efficiency"
    assert answer(WhatIf(rate=50_000, replicas=2)).bottleneck == "serving capacity"
    assert answer(WhatIf(rate=4_500)).bottleneck == "fleet pressure"
    assert answer(WhatIf(latency_ms=200, p99_ms=300)).bottleneck == "p99 budget"
    assert answer(WhatIf(device="cpu", latency_ms=20, rate=50, replicas=2)).bottleneck == "none"


def test_the_page_answers_json_and_refuses_nonsense(client, django_user_model):  # noqa: ANN001
    user = django_user_model.objects.create_user(USERNAME, password=PASSWORD)
    client.force_login(user)
    ok = client.get(
        "/console/planner/",
        {"rate": "50000", "replicas": "2", "device": "accelerator", "batching": "on", "format": "json"},
    )
    assert ok.status_code == 200
    assert ok.json()["bottleneck"] == "serving capacity"
    assert ok.json()["p99_ms"] is None  # unbounded past capacity
    bad = client.get("/console/planner/", {"rate": "lots", "format": "json"})
    assert bad.status_code == 400
    assert "must be a number" in bad.json()["error"]
    assert client.get("/console/planner/", {"replicas": "0", "device": "cpu"}).status_code == 400
    # a fleet too large to simulate in a request is refused with the reason, the analytic answer kept
    big = client.post("/console/planner/", {"replicas": "1000", "models": "200", "device": "accelerator"})
    assert big.status_code == 400
    assert b"too large to simulate here" in big.content
    assert b"Bottleneck:" in big.content


def test_anonymous_visitors_are_sent_to_log_in(client):  # noqa: ANN001
    resp = client.get("/console/planner/")
    assert resp.status_code == 302
    assert "/login/" in resp["Location"]


@pytest.fixture
def planner_server(transactional_db) -> Iterator:  # noqa: ANN001
    """A real server (uvicorn in a thread, as tests.conftest's); the planner needs no models."""
    from tests.conftest import LiveServer

    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def page(planner_server, django_user_model) -> Iterator:  # noqa: ANN001
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is missing at {CHROMIUM}: install Debian's chromium package")
    from playwright.sync_api import sync_playwright

    # The simulation check needs the engineer role in some tenant (tests/test_planner_bounds.py).
    operator = django_user_model.objects.create_user(USERNAME, password=PASSWORD)
    Membership.objects.create(user=operator, tenant=tenant(), role="engineer")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=planner_server.url)
            context.set_default_timeout(WAIT_MS)
            yield context.new_page()
            context.close()
        finally:
            browser.close()


@pytest.mark.browser
def test_planner_answers_a_what_if_and_plots_its_simulation(page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # given an operator logged in, on the planner
    page.goto("/console/planner/")
    page.get_by_label("Username").fill(USERNAME)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Capacity planner")).to_be_visible()
    expect(page.locator("#bottleneck")).to_have_text("none")
    # when the rate goes past what four replicas serve / then the answer changes without a submit
    page.get_by_label("Request rate (req/s)").fill("50000")
    expect(page.locator("#bottleneck")).to_have_text("serving capacity")
    expect(page.locator("#p99")).to_have_text("unbounded")
    # when the rate comes back and the operator asks for the simulation
    page.get_by_label("Request rate (req/s)").fill("3000")
    page.get_by_label("Models hosted per device").fill("4")
    expect(page.locator("#bottleneck")).not_to_have_text("serving capacity")
    page.get_by_role("button", name="Check by simulation").click()
    # then the page shows the simulated figures and the plot, and keeps the what-if
    expect(page.get_by_role("heading", name="Simulated")).to_be_visible()
    plot = page.get_by_alt_text("simulated latency and load over time")
    expect(plot).to_be_visible()
    assert page.evaluate("document.querySelector('#simulation img').naturalWidth") > 100
    expect(page.get_by_label("Models hosted per device")).to_have_value("4")
