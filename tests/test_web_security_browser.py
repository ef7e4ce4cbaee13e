"""The console under its Content-Security-Policy (config.csp) in a real browser: its scripts run, its live figures
are fetched, the fleet page's WebSocket connects, and Chromium reports no violation of the policy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in

pytestmark = pytest.mark.browser

USERNAME = "csp-operator"
PASSWORD = "a-long-test-password"


@pytest.fixture
def browser_page(digits_server, django_user_model) -> Iterator:  # noqa: ANN001
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is missing at {CHROMIUM}: install Debian's chromium package")
    from playwright.sync_api import sync_playwright  # after the Chromium check, as tests.test_console_browser does

    # The ORM is called before Playwright starts: its sync API runs an event loop in this thread.
    django_user_model.objects.create_user(USERNAME, password=PASSWORD, is_staff=True, is_superuser=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=digits_server.url)
            context.set_default_timeout(WAIT_MS)
            yield context.new_page()
            context.close()
        finally:
            browser.close()


def test_the_console_works_under_its_policy(browser_page) -> None:  # noqa: ANN001
    page = browser_page
    violations: list[str] = []
    page.on("console", lambda message: violations.append(message.text) if "Security Policy" in message.text else None)
    # given a login under the policy
    login = page.goto("/login/")
    assert "script-src 'self'" in login.headers["content-security-policy"]
    log_in(page, USERNAME, PASSWORD)
    page.wait_for_url("**/console/models/")
    # when the models page runs its script (static/ferry/models.js): it fetches the live figures
    with page.expect_response(lambda r: r.url.endswith("/console/live/") and r.status == 200):
        pass
    # and the fleet page's script opens its WebSocket, which the policy allows (connect-src)
    page.goto("/console/fleet/")
    page.wait_for_selector('#fleet-live[data-state="live"]')
    # and the planner's script runs
    page.goto("/console/planner/")
    page.wait_for_load_state("load")
    # then the browser reported no violation of the policy
    assert violations == []
    # while an inline script is refused: what HTML from the server could bring cannot run
    page.evaluate(
        """() => { const s = document.createElement("script"); s.textContent = "window.ran = true";
                   document.body.appendChild(s); }"""
    )
    assert page.evaluate("() => window.ran === undefined")
