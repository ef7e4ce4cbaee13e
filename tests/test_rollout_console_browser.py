"""The rollout panel in a real browser: an approver approves a rollout that awaits approval and the page shows
it promoted; a viewer sees the same rollout with no buttons."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth.models import User

from rollout import transitions
from rollout.models import RolloutState
from serving.models import Model
from tenants.models import Membership, Role
from tests.conftest import LiveServer, register, tenant
from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in

pytestmark = pytest.mark.browser
PASSWORD = "a-long-test-password"


@pytest.fixture
def awaiting(transactional_db, model_files) -> Iterator[LiveServer]:  # noqa: ANN001
    """A live server with `digits` v1 stable and a rollout of v2 through its only step, awaiting approval."""
    register(model_files.digits, "digits", max_batch_size=8)
    register(model_files.digits, "digits", max_batch_size=8)
    users = {}
    for name, role in [("eng", Role.ENGINEER), ("approver", Role.APPROVER), ("viewer", Role.VIEWER)]:
        users[name] = User.objects.create_user(name, password=PASSWORD)
        Membership.objects.create(user=users[name], tenant=tenant(), role=role)
    model = Model.objects.get(name="digits")
    rollout = transitions.start(model=model, candidate=2, actor=users["eng"], steps=[100], shadow_seconds=0)
    rollout = transitions.advance(rollout=rollout, actor=users["eng"])
    assert rollout.state == RolloutState.AWAITING_APPROVAL
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def browser(awaiting):  # noqa: ANN001, ANN201
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is missing at {CHROMIUM}: install Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:

            def new_page(username: str):  # noqa: ANN202
                context = chromium.new_context(base_url=awaiting.url)
                context.set_default_timeout(WAIT_MS)
                page = context.new_page()
                page.goto("/login/?next=/console/models/digits/")
                log_in(page, username, PASSWORD)
                return page

            yield new_page
        finally:
            chromium.close()


def test_an_approver_approves_and_a_viewer_sees_no_buttons(browser) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # given a viewer on the model page: the rollout, its state and steps, and no buttons
    viewer = browser("viewer")
    panel = viewer.locator("article.rollout")
    expect(panel.locator(".rollout-state")).to_have_text("Awaiting Approval")
    expect(panel).to_contain_text("version 1 → 2")
    expect(panel.get_by_role("button")).to_have_count(0)
    # when an approver opens the same page, sees Approve, Reject and Roll back (not yet Promote), and approves
    approver = browser("approver")
    panel = approver.locator("article.rollout")
    expect(panel.get_by_role("button", name="Approve")).to_be_visible()
    expect(panel.get_by_role("button", name="Reject")).to_be_visible()
    expect(panel.get_by_role("button", name="Promote")).to_have_count(0)
    panel.get_by_role("button", name="Approve").click()
    # then the page shows it promoted by that approval, with nothing left to press
    expect(panel.locator(".rollout-state")).to_have_text("Promoted")
    expect(panel).to_contain_text("approved by approver")
    expect(panel.get_by_role("button")).to_have_count(0)
    # (the ORM from another thread: Playwright's sync API runs an event loop in this one)
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(stable_version).result() == 2


def stable_version() -> int | None:
    from django.db import connection

    try:
        return Model.objects.get(name="digits").stable_version
    finally:
        connection.close()
