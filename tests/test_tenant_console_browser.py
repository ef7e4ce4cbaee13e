"""Tenant self-service in a real browser (Playwright driving Debian's Chromium): a key shown once, a quota
increase requested by a tenant admin and approved by staff, and another tenant's model page as a 404."""

from __future__ import annotations

import http.client
import re
from collections.abc import Callable, Iterator

import pytest

from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in

pytestmark = pytest.mark.browser
PASSWORD = "a-long-test-password"


@pytest.fixture
def server(transactional_db) -> Iterator:  # noqa: ANN001
    # conftest's LiveServer under another name: pytest-django reserves `live_server` for its own helper.
    from tests.conftest import LiveServer

    running = LiveServer().start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def people(server, django_user_model, settings) -> dict:  # noqa: ANN001
    """ada: admin of acme; olga: admin of bravo; sam: platform staff. acme owns the private model `secret`."""
    from serving.models import Model
    from tenants.models import Membership, Role, Tenant

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    acme = Tenant.objects.create(slug="acme", name="Acme")
    bravo = Tenant.objects.create(slug="bravo", name="Bravo")
    users = {
        "ada": django_user_model.objects.create_user("ada", password=PASSWORD),
        "olga": django_user_model.objects.create_user("olga", password=PASSWORD),
        "sam": django_user_model.objects.create_user("sam", password=PASSWORD, is_staff=True),
    }
    Membership.objects.create(user=users["ada"], tenant=acme, role=Role.ADMIN)
    Membership.objects.create(user=users["olga"], tenant=bravo, role=Role.ADMIN)
    Model.objects.create(name="secret", tenant=acme, visibility="private")
    return users


@pytest.fixture
def open_as(server, people) -> Iterator[Callable]:  # noqa: ANN001
    """open_as(username) -> a logged-in page in its own browser context (its own cookies)."""
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is missing at {CHROMIUM}: install Debian's chromium package")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)

        def open_as(username: str):  # noqa: ANN202
            context = browser.new_context(base_url=server.url)
            context.set_default_timeout(WAIT_MS)
            page = context.new_page()
            page.goto("/login/")
            log_in(page, username, PASSWORD)
            page.wait_for_url(re.compile(r"/console/models/$"))
            return page

        try:
            yield open_as
        finally:
            browser.close()


def test_a_new_key_is_shown_once(server, open_as) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    page = open_as("ada")
    # given the tenant admin on the API keys page, reached from the tenants list
    page.get_by_role("link", name="Tenants").click()
    page.locator('tr[data-tenant="acme"]').get_by_role("link", name="API keys").click()
    expect(page.get_by_role("heading", name="API keys of Acme")).to_be_visible()
    # when creating a key with both scopes
    page.get_by_label("Name").fill("billing-app")
    page.get_by_label("manage").check()
    page.get_by_role("button", name="Create key").click()
    # then its token is shown, and the table lists the key by prefix only
    token = page.locator("#new-token").inner_text().strip()
    assert re.fullmatch(r"fy_[A-Za-z0-9]{10}_[\w-]{43}", token), token
    row = page.locator(f'tr[data-prefix="{token[3:13]}"]')
    expect(row).to_contain_text("billing-app")
    expect(row).to_contain_text("infer, manage")
    # and the token works on /v2
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v2/repository/index", body=b"", headers={"Authorization": f"Bearer {token}"})
    assert conn.getresponse().status == 200
    conn.close()
    # when the page is reloaded / then the token is gone for good
    page.reload()
    expect(page.locator("#new-token")).to_have_count(0)
    expect(row).to_be_visible()
    assert token not in page.content()
    # and revoking the key from the page marks it revoked
    row.get_by_role("button", name="Revoke").click()
    expect(page.locator(f'tr[data-prefix="{token[3:13]}"] .key-state')).to_have_text("revoked")


def test_a_quota_increase_requested_and_approved(open_as) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    ada, sam = open_as("ada"), open_as("sam")
    # given the tenant admin on the quota page
    ada.goto("/console/tenants/acme/quota/")
    limit = ada.locator('tr[data-limit="requests_per_second"] .value')
    expect(limit).to_have_text("1000")
    # when she asks for 5000 requests per second, with a justification
    ada.get_by_label("requests_per_second").fill("5000")
    ada.get_by_label("Justification").fill("launch week traffic")
    ada.get_by_role("button", name="Request").click()
    # then the request is listed, pending, and the limit unchanged
    expect(ada.locator(".request-state")).to_have_text("pending")
    expect(limit).to_have_text("1000")
    # when staff approve it from the pending requests, with a note
    sam.get_by_role("link", name="Quota requests").click()
    pending = sam.locator("tr[data-request]")
    expect(pending).to_contain_text("Acme")
    expect(pending).to_contain_text("requests_per_second: 1000 → 5000")
    pending.get_by_label("Note").fill("ok for the launch")
    pending.get_by_role("button", name="Approve").click()
    expect(sam.get_by_text("Nothing pending.")).to_be_visible()
    # then the tenant admin sees the new limit in force and the request approved, with the note
    ada.reload()
    expect(limit).to_have_text("5000")
    expect(ada.locator(".request-state")).to_have_text("approved")
    expect(ada.locator("tr[data-request]")).to_contain_text("ok for the launch")
    # and the audit log shows both steps
    ada.get_by_role("link", name="Audit log").click()
    expect(ada.locator('tr[data-action="quota.approve"]')).to_contain_text("sam")
    expect(ada.locator('tr[data-action="quota.request"]')).to_contain_text("ada")


def test_an_outsider_gets_404_for_another_tenants_model_page(open_as) -> None:  # noqa: ANN001
    from playwright.sync_api import expect

    # given the owner's admin / then the model page opens
    ada = open_as("ada")
    assert ada.goto("/console/models/secret/").status == 200
    expect(ada.get_by_role("heading", name="secret")).to_be_visible()
    # given an admin of another tenant / when opening the page / then 404, exactly as for a missing model
    olga = open_as("olga")
    hidden = olga.goto("/console/models/secret/")
    hidden_body = olga.content()
    missing = olga.goto("/console/models/no-such-model/")
    assert hidden.status == missing.status == 404
    assert hidden_body == olga.content()
    # and the models list does not mention it
    olga.goto("/console/models/")
    assert "secret" not in olga.content()
