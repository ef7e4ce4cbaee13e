"""The console's usage page in a real browser: the demo tenant's chart, table and CSV link."""

from __future__ import annotations

import asyncio
import http.client
import re
from collections.abc import Iterator

import orjson
import pytest

from tests.conftest import mint_key, tenant
from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in

pytestmark = pytest.mark.browser

PASSWORD = "a-long-test-password"


def served(server, token: str, count: int) -> int:  # noqa: ANN001
    """Send single-row inferences with `token` until `count` are served; returns the answers that reached a
    tenant (the front door may refuse some before authentication on a busy machine)."""
    body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [3.0] * 64}]})
    ok = metered = 0
    for _ in range(500):
        if ok >= count:
            return metered
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request(
                "POST",
                "/v2/models/digits/infer",
                body=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
            )
            response = conn.getresponse()
            text = response.read()
        finally:
            conn.close()
        if response.status == 503 and b"of inference" in text:
            continue
        metered += 1
        ok += response.status == 200
    raise AssertionError(f"only {ok} of {count} served")


@pytest.fixture
def demo_page(digits_server, django_user_model) -> Iterator:  # noqa: ANN001
    from playwright.sync_api import sync_playwright

    from tenants.models import Membership, Role

    # given the demo tenant with a viewer, another tenant with usage of its own, and traffic from both
    demo = tenant("demo")
    user = django_user_model.objects.create_user("demo-viewer", password=PASSWORD)
    Membership.objects.create(user=user, tenant=demo, role=Role.VIEWER)
    tenant("globex")
    demo_requests = served(digits_server, mint_key("demo", ("infer",)), 12)
    served(digits_server, mint_key("globex", ("infer",)), 3)
    plane = digits_server.plane()
    asyncio.run_coroutine_threadsafe(plane.flush_usage(), plane.loop).result(timeout=60)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=digits_server.url)
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()
            page.demo_requests = demo_requests
            yield page
            context.close()
        finally:
            browser.close()


def test_usage_page_draws_the_demo_tenants_chart(demo_page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    page = demo_page
    # when the demo viewer logs in and follows the navigation's Usage link
    page.goto("/console/models/")
    log_in(page, "demo-viewer", PASSWORD)
    page.get_by_role("link", name="Usage").click()
    expect(page).to_have_url(re.compile(r"/console/usage/$"))
    # then the page is the demo tenant's, and no other tenant is offered
    expect(page.locator("h2.usage-tenant")).to_have_text(
        re.compile(rf"^Demo: {page.demo_requests} requests, \d+ errors$")
    )
    expect(page.locator('select[name="tenant"] option')).to_have_count(1)
    # and the inline SVG chart has a bar per minute of the hour, one of them with height, and a p99 line
    chart = page.locator("svg.usage-chart")
    expect(chart).to_be_visible()
    assert chart.locator("rect.requests").count() == 60
    heights = chart.locator("rect.requests").evaluate_all("rs => rs.map(r => parseFloat(r.getAttribute('height')))")
    assert sum(1 for h in heights if h > 0) >= 1
    expect(chart.locator("polyline.p99")).to_have_count(1)
    # and the table lists digits v1 with what the tenant sent
    rows = page.locator('table.usage tr[data-key="digits:1"]')
    assert sum(int(t) for t in rows.locator("td.requests").all_inner_texts()) == page.demo_requests
    # and the CSV link downloads the same range as CSV
    link = page.get_by_role("link", name="Download CSV")
    href = link.get_attribute("href")
    assert href.startswith("/api/usage/?tenant=demo&") and "format=csv" in href
    response = page.request.get(href)
    assert response.status == 200 and response.headers["content-type"].startswith("text/csv")
    lines = response.text().strip().splitlines()
    assert lines[0].startswith("tenant,model,version,start,requests")
    assert all(line.startswith("demo,digits,1,") for line in lines[1:]) and len(lines) >= 2


def test_usage_page_of_another_tenant_is_404(demo_page) -> None:  # noqa: ANN001
    page = demo_page
    page.goto("/console/models/")
    log_in(page, "demo-viewer", PASSWORD)
    assert page.goto("/console/usage/?tenant=globex").status == 404
    assert page.goto("/console/usage/?tenant=no-such").status == 404
