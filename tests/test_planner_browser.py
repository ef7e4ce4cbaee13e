"""The capacity lab in a real browser: the five scenario cards of the seed, a slider dragged, a simulation check
drawn over the analytic curve, and screenshots of it into docs/img/. Plus the page's answers without a browser
(validation, JSON)."""

from __future__ import annotations

import json
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
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "img"  # the lab's screenshots, for docs/console.md


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


def _login(page) -> None:  # noqa: ANN001
    page.goto("/console/planner/")
    page.get_by_label("Username").fill(USERNAME)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()


def _nodes(page) -> set[str]:  # noqa: ANN001
    return set(page.eval_on_selector_all(".lab-diagram [data-node]", "els => els.map(e => e.dataset.node)"))


def _meter(page, key: str) -> tuple[str, float]:  # noqa: ANN001
    """A meter's state and value as the page shows them."""
    el = page.locator(f'[data-meter="{key}"]')
    value = el.get_attribute("data-value")
    return el.get_attribute("data-state"), float(value)


def _answered(page) -> None:  # noqa: ANN001
    """Wait until the page has the answer to its newest inputs (the script marks the results busy until then)."""
    from playwright.sync_api import expect

    expect(page.locator("#results")).to_have_attribute("data-busy", "0")


def _card(page, key: str) -> None:  # noqa: ANN001
    """Click a scenario card and wait until the results are those of its inputs (its rate on the plot)."""
    from playwright.sync_api import expect

    card = page.locator(f'.card[data-card="{key}"]')
    rate = float(json.loads(card.get_attribute("data-inputs"))["rate"])
    card.click()
    expect(card).to_have_attribute("aria-pressed", "true")
    _answered(page)
    expect(page.locator(".lab-plot")).to_have_attribute("data-rate", f"{rate:g}")


@pytest.mark.browser
def test_the_lab_walks_the_five_cards_drags_a_slider_and_checks_by_simulation(page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # given an operator logged in, on the lab, on a laptop-sized screen
    page.set_viewport_size({"width": 1440, "height": 900})
    SHOTS.mkdir(parents=True, exist_ok=True)
    _login(page)
    expect(page.get_by_role("heading", name="Capacity planner")).to_be_visible()
    page.evaluate("window.__notReloaded = true")

    # when the first card is chosen with the keyboard: a single CPU endpoint, nothing else in the path
    page.locator('.card[data-card="single"]').focus()
    page.keyboard.press("Enter")
    expect(page.locator('.card[data-card="single"]')).to_have_attribute("aria-pressed", "true")
    _answered(page)
    expect(page.locator(".lab-plot")).to_have_attribute("data-rate", "45")
    assert _nodes(page) == {"clients", "gateway", "replicas"}
    assert _meter(page, "accelerator-efficiency")[0] == "off"
    single_capacity = _meter(page, "serving-capacity")
    assert single_capacity[0] in {"warn", "over"}  # one server at the edge of what it serves
    assert _meter(page, "p99-latency-budget")[0] == "over"
    capacity_1 = float(page.locator("#capacity").inner_text())

    # then dynamic batching: the batcher joins the path, capacity grows, the window takes part of p99
    _card(page, "batching")
    assert _nodes(page) == {"clients", "gateway", "batcher", "replicas"}
    assert float(page.locator("#capacity").inner_text()) > capacity_1
    assert page.locator('.lab-budget rect[data-part="window_ms"]').count() == 1

    # then GPU-backed autoscaling replicas: a GPU pool, replicas and their metrics; the accelerator is busy
    # enough and the fleet is sized to its target
    _card(page, "gpu")
    assert {"gpu", "metrics", "replicas", "batcher"} <= _nodes(page)
    assert "split" not in _nodes(page)
    expect(page.locator('[data-node="replicas"]')).to_contain_text("Server replicas x")
    assert _meter(page, "accelerator-efficiency")[0] == "ok"
    assert _meter(page, "serving-capacity")[0] == "ok"
    assert _meter(page, "replica-fleet-pressure")[0] == "ok"
    packing_gpu = _meter(page, "multi-model-packing")[1]

    # then a registry with a canary rollout: registry, traffic split and shadow traffic; two versions a device
    _card(page, "canary")
    assert {"registry", "split", "shadow"} <= _nodes(page)
    assert _meter(page, "multi-model-packing")[1] > packing_gpu
    page.locator(".lab-shape").screenshot(path=str(SHOTS / "lab-diagram-canary.png"))

    # then multi-model packing at high throughput: packing is the bottleneck
    _card(page, "packing")
    expect(page.locator("#bottleneck")).to_have_text("multi-model packing")
    assert _meter(page, "multi-model-packing")[0] == "over"
    expect(page.locator('[data-node="replicas"]')).to_contain_text("16 models packed")
    page.screenshot(path=str(SHOTS / "lab-packing.png"), full_page=True)

    # (on a smaller laptop screen the cards, the inputs and the first meters fit the first screenful)
    page.set_viewport_size({"width": 1366, "height": 768})
    _card(page, "gpu")
    page.screenshot(path=str(SHOTS / "lab-laptop.png"))
    page.set_viewport_size({"width": 1440, "height": 900})

    # when the operator drags the request-rate slider to the left
    slider = page.locator("#slider-rate")
    box = slider.bounding_box()
    before = page.locator(".lab-plot").get_attribute("data-rate")
    page.mouse.move(box["x"] + box["width"] * 0.75, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.45, box["y"] + box["height"] / 2, steps=8)
    page.mouse.up()
    _answered(page)
    # then the plot moves its marked point to the new rate, the box shows it, and the page did not reload
    expect(page.locator(".lab-plot")).not_to_have_attribute("data-rate", before)
    rate = page.locator("#in-rate").input_value()
    expect(page.locator(".lab-plot")).to_have_attribute("data-rate", f"{float(rate):g}")
    expect(page.locator('.card[data-card="gpu"]')).to_have_attribute("aria-pressed", "false")
    assert page.evaluate("window.__notReloaded") is True

    # when the operator asks for the simulation on these inputs
    page.get_by_role("button", name="Check by simulation").click()
    # then the simulated points lie over the analytic curve, with their table, still without a reload
    expect(page.locator("#lab-sim")).to_be_visible()
    assert page.locator(".lab-plot .sim-point").count() >= 2
    assert int(page.locator(".lab-plot").get_attribute("data-simulated")) == page.locator(".sim-row").count()
    assert page.evaluate("window.__notReloaded") is True
    expect(page.locator("#lab-status")).to_contain_text("Simulated")
    page.screenshot(path=str(SHOTS / "lab-simulated.png"), full_page=True)

    # and a change of input after it clears the points: they were for the inputs checked
    page.locator("#in-models").fill("3")
    _answered(page)
    expect(page.locator(".lab-plot")).to_have_attribute("data-simulated", "0")
    assert page.evaluate("window.__notReloaded") is True

    # when the operator fills the inputs from the fleet: this server's own node, a CPU, and no traffic yet
    page.get_by_role("button", name="From my fleet").click()
    expect(page.locator("#lab-status")).to_contain_text("Filled from the fleet")
    _answered(page)
    # then the nodes give the replicas and the device, and the page says where each input came from
    expect(page.locator("#lab-sources")).to_contain_text("live node")
    expect(page.locator("#lab-sources")).to_contain_text("kept as they were")
    nodes = int(page.locator("#lab-status").inner_text().split("fleet: ")[1].split(" ")[0])
    assert nodes >= 1
    expect(page.locator("#in-replicas")).to_have_value(str(nodes))
    assert page.evaluate("window.__notReloaded") is True
