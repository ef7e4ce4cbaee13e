"""The shadow report page in a real browser, filled from live traffic of a rollout's shadow: charts drawn on
the server, the confusion heat table, the disagreement sample; an approver approves from it and sees the new
state, an engineer reads it without the approver's buttons, a viewer gets no link and is refused the page."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from serving.models import Model
from tests.conftest import tenant
from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in
from tests.test_shadow_http import mirror_and_flush, permuted_digits, shadow_server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.browser

PASSWORD = "a-long-test-password"


@pytest.fixture
def report_page(shadow_server, digits_samples, django_user_model) -> Iterator:  # noqa: ANN001, F811
    from playwright.sync_api import sync_playwright

    from rollout import gates, transitions
    from tenants.models import Membership, Role

    # given the test tenant's engineer, approver and viewer
    owner = tenant()
    users = {}
    for name, role in (
        ("shadow-engineer", Role.ENGINEER),
        ("shadow-approver", Role.APPROVER),
        ("shadow-viewer", Role.VIEWER),
    ):
        users[name] = django_user_model.objects.create_user(name, password=PASSWORD)
        Membership.objects.create(user=users[name], tenant=owner, role=role)
    # and the engineer's rollout of the permuted version, shadowing (its gates wait for more than this test
    # sends, so the evaluator leaves it be), with 40 live requests mirrored to it
    transitions.start(
        model=Model.objects.get(name="shadowed"),
        candidate=3,
        actor=users["shadow-engineer"],
        thresholds=gates.Thresholds(min_compared=1_000_000),
    )
    assert Model.objects.get(name="shadowed").shadow_version == 3
    shadow_server.refresh()
    mirror_and_flush(shadow_server, digits_samples[0][:40])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=shadow_server.url)
            context.set_default_timeout(WAIT_MS)
            yield context.new_page()
            context.close()
        finally:
            browser.close()


def open_report(page, username: str) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    page.goto("/console/models/shadowed/")
    log_in(page, username, PASSWORD)
    page.get_by_role("link", name="Shadow report").click()
    expect(page.locator("h2.shadow-summary")).to_contain_text("agreement over 40 rows")
    expect(page.locator("main")).not_to_contain_text("#}")  # no template markup shows


def assert_charts(page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # agreement over time: a point for the minute that compared the 40 rows
    expect(page.locator("svg.shadow-agreement")).to_be_visible()
    assert page.locator("svg.shadow-agreement circle.point").count() >= 1
    # the difference histogram has bars, some with height
    bars = page.locator("svg.shadow-differences rect.bar")
    heights = bars.evaluate_all("rs => rs.map(r => parseFloat(r.getAttribute('height')))")
    assert heights and any(h > 0 for h in heights)
    # both latency distributions are drawn
    assert page.locator("svg.shadow-latency rect.bar.baseline").count() >= 1
    assert page.locator("svg.shadow-latency rect.bar.candidate").count() >= 1
    # the confusion heat table: every one of the 40 rows off the diagonal (the outputs are rolled by a class)
    cells = page.locator("table.confusion td").all_inner_texts()
    assert sum(int(c) for c in cells) == 40
    assert sum(int(c) for c in page.locator("table.confusion td.diagonal").all_inner_texts()) == 0
    # and the disagreement sample lists rows with their classes
    expect(page.locator("table.disagreements td.summary").first).to_contain_text("class ")


def test_an_approver_sees_the_charts_approves_and_sees_the_new_state(report_page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    page = report_page
    open_report(page, "shadow-approver")
    assert_charts(page)
    rollout = page.locator("article.rollout")
    expect(rollout.locator(".rollout-state")).to_have_text("Shadowing")
    # when the approver approves from the report
    rollout.get_by_role("button", name="Approve").click()
    # then the report comes back showing the approval, and Approve is gone
    expect(page).to_have_url(re.compile(r"/console/models/shadowed/shadow/"))
    expect(page.locator("article.rollout")).to_contain_text("Approved by shadow-approver")
    assert page.locator("article.rollout").get_by_role("button", name="Approve").count() == 0
    assert_charts(page)


def test_an_engineer_reads_the_report_without_the_approvers_buttons(report_page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    open_report(report_page, "shadow-engineer")
    assert_charts(report_page)
    expect(report_page.locator("article.rollout .rollout-state")).to_have_text("Shadowing")
    assert report_page.locator("main button").filter(has_text=re.compile("^(Approve|Reject)$")).count() == 0


def test_a_viewer_has_no_link_to_the_report_and_is_refused_it(report_page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    page = report_page
    page.goto("/console/models/shadowed/")
    log_in(page, "shadow-viewer", PASSWORD)
    expect(page.locator("h1")).to_have_text("shadowed")  # the viewer sees the model
    assert page.get_by_role("link", name="Shadow report").count() == 0
    response = page.goto("/console/models/shadowed/shadow/")
    assert response is not None and response.status == 403
    assert page.locator("table.disagreements").count() == 0
