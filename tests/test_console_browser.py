"""The console in a real browser: Playwright driving Debian's Chromium (never `playwright install`)."""

from __future__ import annotations

import http.client
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
USERNAME = "console-op"
PASSWORD = "a-long-test-password"
WAIT_MS = 30_000  # deadline for polls in the page; a failure, never a timing assertion


def browser_page(server, make_user: Callable[[], object]) -> Iterator:  # noqa: ANN001
    """A Chromium page on `server`'s site, once `make_user()` has made the account the test logs in with."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium is missing at {CHROMIUM}: install Debian's chromium package (scripts/setup.sh test does it)"
        )
    from playwright.sync_api import sync_playwright  # after the check above, so a missing browser says so

    # The ORM is called before Playwright starts: its sync API runs an event loop in this thread.
    make_user()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(base_url=server.url)
            context.set_default_timeout(WAIT_MS)
            yield context.new_page()
            context.close()
        finally:
            browser.close()


@pytest.fixture
def page(digits_server, django_user_model) -> Iterator:  # noqa: ANN001
    yield from browser_page(
        digits_server, lambda: django_user_model.objects.create_user(USERNAME, password=PASSWORD, is_staff=True)
    )


@pytest.fixture
def quiet_model(digits_server, model_files) -> str:  # noqa: ANN001
    """A copy of digits under a name no other test sends to: its live figures start at zero."""
    from tests.conftest import register

    register(model_files.digits, "digits-quiet", max_batch_size=16)
    digits_server.refresh()
    return "digits-quiet"


def log_in(page, username: str, password: str) -> None:  # noqa: ANN001
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Log in").click()


def send_inferences(server, model: str, count: int) -> None:  # noqa: ANN001
    body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [3.0] * 64}]})
    for _ in range(count):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request(
                "POST",
                f"/v2/models/{model}/infer",
                body=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"},
            )
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
        finally:
            conn.close()


def test_login_models_page_and_live_rate(quiet_model, page, digits_server) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # given an anonymous visitor / when opening the console / then the login page, remembering where to go
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/login/\?next=/console/models/$"))
    expect(page.get_by_role("heading", name="Log in")).to_be_visible()

    # when logging in through the form / then the models page
    log_in(page, USERNAME, PASSWORD)
    expect(page).to_have_url(re.compile(r"/console/models/$"))
    expect(page.get_by_role("heading", name="Models")).to_be_visible()
    expect(page.locator("header")).to_contain_text(USERNAME)

    # and every model is listed, validated ("ready") and loaded on this node
    for name in ("digits", "digits-export", "tokens", quiet_model):
        row = page.locator(f'tr[data-key="{name}:1"]')
        expect(row.locator("td.model strong")).to_have_text(name)
        expect(row.locator(".state")).to_have_text("ready")
        expect(row.locator(".loaded")).to_have_text("loaded")
        # with its measured latency profile (batch 1 and the largest) and footprint
        expect(row.locator(".profile")).to_have_text(re.compile(r"^b1 [\d.]+ ms · b\d+ [\d.]+ ms · \d+ MB$"))
    # and a model nothing has been sent to shows no traffic yet
    quiet_rate = page.locator(f'tr[data-key="{quiet_model}:1"] .rate')
    expect(quiet_rate).to_have_text(re.compile(r"^0(\.0)?$"))  # rendered 0.0; the page's refresh writes 0
    expect(page.locator(f'tr[data-key="{quiet_model}:1"] .p50')).to_have_text("—")

    # when inferences are served by digits and by the quiet model
    send_inferences(digits_server, "digits", 30)
    send_inferences(digits_server, quiet_model, 30)

    # then the live request rates, refreshed in place without a reload, rise above zero
    for name in ("digits", quiet_model):
        page.wait_for_function(
            """(key) => {
                const cell = document.querySelector(`tr[data-key="${key}"] .rate`);
                return cell !== null && parseFloat(cell.textContent) > 0;
            }""",
            arg=f"{name}:1",
            timeout=WAIT_MS,
        )
        assert float(page.locator(f'tr[data-key="{name}:1"] .rate').inner_text()) > 0
    expect(page.locator(f'tr[data-key="{quiet_model}:1"] .p50')).not_to_have_text("—")


def test_wrong_password_shows_the_error(page) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # given the login page / when the password is wrong / then the form says so and no session starts
    page.goto("/login/")
    log_in(page, USERNAME, "not-the-password")
    expect(page.get_by_role("alert")).to_have_text("Your username and password didn't match.")
    expect(page).to_have_url(re.compile(r"/login/"))

    # and the console stays closed
    page.goto("/console/models/")
    expect(page).to_have_url(re.compile(r"/login/\?next=/console/models/$"))

    # when the right password follows / then the console opens
    log_in(page, USERNAME, PASSWORD)
    expect(page).to_have_url(re.compile(r"/console/models/$"))
