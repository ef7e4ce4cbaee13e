"""The console under its Content-Security-Policy (config.csp) in a real browser: its scripts run, its live figures
are fetched, the fleet page's WebSocket connects, and Chromium reports no violation of the policy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_console_browser import browser_page, log_in

pytestmark = pytest.mark.browser

USERNAME = "csp-operator"
PASSWORD = "a-long-test-password"


@pytest.fixture
def superuser_page(digits_server, django_user_model) -> Iterator:  # noqa: ANN001
    yield from browser_page(
        digits_server,
        lambda: django_user_model.objects.create_user(USERNAME, password=PASSWORD, is_staff=True, is_superuser=True),
    )


def test_the_console_works_under_its_policy(superuser_page) -> None:  # noqa: ANN001
    page = superuser_page
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
