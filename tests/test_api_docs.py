"""The API's pages for people: /api/ lists the resources, /api/docs/ (Swagger UI) and /api/redoc/ read the
schema, and every asset they load comes from this server's static files, never a CDN."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import expect, sync_playwright

from tests.conftest import LiveServer

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
WAIT_MS = 30_000  # deadline for the page to render; a failure, never a timing assertion
RESOURCES = {"models", "tenants", "rollouts", "promotion-requests", "audit", "usage", "fleet"}
PAGES = ("/api/docs/", "/api/redoc/")


class _References(HTMLParser):
    """Every src= and href= of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def references(html: str) -> list[str]:
    parser = _References()
    parser.feed(html)
    return parser.urls


def test_the_index_lists_each_resource_and_the_docs(client, django_user_model) -> None:  # noqa: ANN001
    # given an anonymous visitor / when asking /api/ / then the resources, the schema and both pages
    response = client.get("/api/")
    assert response.status_code == 200
    index = response.json()
    assert {r["name"] for r in index["resources"]} == RESOURCES
    assert urlsplit(index["schema"]).path == "/api/schema/"
    assert urlsplit(index["docs"]).path == "/api/docs/"
    assert urlsplit(index["redoc"]).path == "/api/redoc/"
    # and each resource is there for a staff user (anonymous ones are refused, as before)
    client.force_login(django_user_model.objects.create_user("api-staff", is_staff=True))
    for resource in index["resources"]:
        path = urlsplit(resource["url"]).path
        assert client.get(path).status_code == 200, path
    assert client.get(urlsplit(index["schema"]).path).status_code == 200


def test_the_index_needs_no_credentials_and_ignores_wrong_ones(client, db) -> None:  # noqa: ANN001
    # given wrong Basic credentials / when asking the index / then it still answers: it names paths only
    response = client.get("/api/", HTTP_AUTHORIZATION="Basic bm9ib2R5Ondyb25n")
    assert response.status_code == 200
    # while a resource behind it still refuses them
    assert client.get("/api/models/", HTTP_AUTHORIZATION="Basic bm9ib2R5Ondyb25n").status_code in (401, 403)


@pytest.mark.parametrize("page_path", PAGES)
def test_the_docs_pages_load_only_local_assets(client, page_path: str) -> None:  # noqa: ANN001
    # given the page / when served / then HTML whose every script, stylesheet and icon is on this server,
    # the UIs' files under /static/
    response = client.get(page_path)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assert "http://" not in html and "https://" not in html  # no CDN, no web fonts
    assets = references(html)
    assert any(url.startswith("/static/drf_spectacular_sidecar/") for url in assets), assets
    for url in assets:
        assert url.startswith("/") and not url.startswith("//"), url
        assert url.startswith(("/static/", page_path + "?")), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        assert b"".join(asset.streaming_content if asset.streaming else [asset.content]), url
    # and the browser is told to load from nowhere else (Redoc's bundle would fetch its logo from a CDN)
    policy = response["Content-Security-Policy"]
    assert "default-src 'self'" in policy and "img-src 'self' data:" in policy


@dataclass
class Browsing:
    page: object  # playwright's Page
    server: LiveServer
    requested: list[str] = field(default_factory=list)  # every URL the page asked for
    failed: dict[str, str] = field(default_factory=dict)  # URL -> why the browser did not load it

    def only_this_server(self) -> bool:
        """Everything the page loaded came from this server; whatever it tried elsewhere, the browser's
        Content-Security-Policy stopped (a network failure would not do: the test machine may be offline)."""
        here = (self.server.url + "/", "blob:" + self.server.url + "/")
        elsewhere = [url for url in self.requested if not url.startswith(here)]
        return bool(self.requested) and all(self.failed.get(url) == "csp" for url in elsewhere)


@pytest.fixture
def browsing(transactional_db) -> Iterator[Browsing]:  # noqa: ANN001
    if not CHROMIUM.exists():
        pytest.fail(f"Chromium is missing at {CHROMIUM}: install Debian's chromium package")
    server = LiveServer().start()
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                context = browser.new_context(base_url=server.url)
                context.set_default_timeout(WAIT_MS)
                browsing = Browsing(context.new_page(), server)
                browsing.page.on("request", lambda request: browsing.requested.append(request.url))
                browsing.page.on(
                    "requestfailed", lambda request: browsing.failed.update({request.url: request.failure})
                )
                yield browsing
                context.close()
            finally:
                browser.close()
    finally:
        server.stop()


@pytest.mark.browser
def test_swagger_ui_renders_the_operations_from_this_server_only(browsing: Browsing) -> None:
    # given a browser / when opening /api/docs/ / then Swagger UI shows the schema's operations
    browsing.page.goto("/api/docs/")
    expect(browsing.page.locator(".opblock").first).to_be_visible()
    expect(browsing.page.locator(".opblock-summary-path", has_text="/api/models/").first).to_be_visible()
    # and everything it loaded came from this server
    assert browsing.only_this_server(), (browsing.requested, browsing.failed)


@pytest.mark.browser
def test_redoc_renders_the_schema_from_this_server_only(browsing: Browsing) -> None:
    # given a browser / when opening /api/redoc/ / then Redoc shows the API's title and its operations
    browsing.page.goto("/api/redoc/")
    expect(browsing.page.locator("h1", has_text="Ferry control-plane API")).to_be_visible()
    expect(browsing.page.locator("[data-section-id^='tag/']").first).to_be_attached()
    assert browsing.only_this_server(), (browsing.requested, browsing.failed)
