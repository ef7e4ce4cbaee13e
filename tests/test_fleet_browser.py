"""The fleet page in a real browser over real processes: a web process (`manage.py serve`, no embedded node)
and two `manage.py runnode` processes on the test PostgreSQL and Redis. Both nodes show with their packing
bars; a request for a version that does not fit beside the loaded one forces an LRU eviction on a node, and the
eviction appears on the page, pushed over the WebSocket, without a reload."""

from __future__ import annotations

import http.client
import re
from collections.abc import Iterator

import numpy as np
import orjson
import pytest

from serving.models import ModelVersion
from tests.conftest import mint_key, register
from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in
from tests.test_inference_http import digits_request
from tests.test_streams_processes import (
    REDIS_URL,
    Proc,
    ready_on,
    redis_db,
    start,
    start_web,
    stop_all,
    wait_for,
    web_ready,
)

pytestmark = pytest.mark.browser
__all__ = ["redis_db"]  # the fixture, used by name

PASSWORD = "a-long-test-password"


def start_small_node(name: str, tmp_path, budget: int) -> Proc:  # noqa: ANN001
    return start(
        name,
        ["runnode", "--name", name, "--accelerator", "a10g", "--memory", str(budget), "--labels", f"zone={name}"],
        tmp_path,
        REDIS_URL,
    )


@pytest.fixture
def fleet(transactional_db, redis_db, model_files, tmp_path, django_user_model) -> Iterator[tuple[Proc, str]]:  # noqa: ANN001
    """The web process, and two nodes whose budgets hold one version of digits but not two."""
    from tenants.models import Membership, Role
    from tests.conftest import tenant

    register(model_files.digits, "digits", max_batch_size=4, max_queue_delay_ms=2)
    # infer_v2 gives version 2 a 60 s deadline to load on a node; its default_timeout_ms caps any client's.
    register(model_files.digits, "digits", max_batch_size=4, max_queue_delay_ms=2, default_timeout_ms=60_000)
    footprint = ModelVersion.objects.get(model__name="digits", version=1).memory_bytes
    assert footprint > 0
    user = django_user_model.objects.create_user("fleet-viewer", password=PASSWORD)
    Membership.objects.create(user=user, tenant=tenant(), role=Role.VIEWER)
    key = mint_key()
    budget = footprint * 3 // 2
    procs = [
        start_web(tmp_path, REDIS_URL),
        start_small_node("node-a", tmp_path, budget),
        start_small_node("node-b", tmp_path, budget),
    ]
    try:
        web = procs[0]
        wait_for(
            "both nodes serving digits:1",
            lambda: ready_on(redis_db, "node-a", "digits:1") and ready_on(redis_db, "node-b", "digits:1"),
            procs,
        )
        wait_for("the web process ready", lambda: web_ready(web), procs)
        yield web, key
    finally:
        stop_all(procs, tail=4000)


def infer_v2(web: Proc, key: str) -> int:
    body = digits_request(np.zeros((1, 64), np.float32), parameters={"timeout": 60_000_000})
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=90)
    try:
        conn.request(
            "POST",
            "/v2/models/digits/versions/2/infer",
            body=orjson.dumps(body),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_the_fleet_page_shows_both_nodes_and_an_eviction_live(fleet) -> None:  # noqa: ANN001
    from playwright.sync_api import expect, sync_playwright

    web, key = fleet
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=f"http://127.0.0.1:{web.port}")
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()
            # given a viewer on the fleet page, reached from the navigation
            page.goto("/console/models/")
            log_in(page, "fleet-viewer", PASSWORD)
            page.get_by_role("link", name="Fleet").click()
            expect(page.locator("#fleet-live")).to_have_attribute("data-state", "live")
            # then both nodes are live, each with digits:1 hot in its packing bar
            for name in ("node-a", "node-b"):
                row = page.locator(f'tr.node[data-node="{name}"]')
                expect(row).to_have_attribute("data-state", "live")
                expect(row.locator('svg.packing-bar rect.segment.hot[data-key="digits:1"]')).to_have_count(1)
                expect(row.locator("td.busy")).to_have_text(re.compile(r"^\d+%$"))
            for name in ("node-a", "node-b"):  # each node's load of it is among the events (a reload would add one)
                expect(
                    page.locator(f'tr.event[data-kind="load"][data-key="digits:1"][data-node="{name}"]').first
                ).to_be_visible()
            page.evaluate("window.ferryNotReloaded = true")
            expect(page.locator('tr.event[data-kind="evict"]')).to_have_count(0)

            # when a request for digits:2, which fits no node beside digits:1, loads it on one
            assert infer_v2(web, key) == 200

            # then the eviction of digits:1 and the load of digits:2 appear, pushed: the page was not reloaded
            expect(page.locator('tr.event[data-kind="evict"][data-key="digits:1"]')).to_have_count(1)
            expect(page.locator('tr.event[data-kind="load"][data-key="digits:2"]')).to_have_count(1)
            evicted_on = page.locator('tr.event[data-kind="evict"]').get_attribute("data-node")
            row = page.locator(f'tr.node[data-node="{evicted_on}"]')
            expect(row.locator('rect.segment.hot[data-key="digits:2"]')).to_have_count(1)
            expect(row.locator('rect.segment.hot[data-key="digits:1"]')).to_have_count(0)
            # and the versions table says where each is: digits:2 hot on that node, digits:1 on the other only
            version_two = page.locator('tr.version[data-key="digits:2"]')
            expect(version_two).to_have_attribute("data-state", "READY")
            expect(version_two.locator("td").nth(2)).to_have_text(evicted_on)
            other = "node-b" if evicted_on == "node-a" else "node-a"
            expect(page.locator('tr.version[data-key="digits:1"]').locator("td").nth(2)).to_have_text(other)
            assert page.evaluate("window.ferryNotReloaded") is True
            assert int(page.locator("#fleet-live").get_attribute("data-updates")) >= 1
            context.close()
        finally:
            browser.close()
