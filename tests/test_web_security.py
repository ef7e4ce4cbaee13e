"""The web-security audit's findings, each answered (the proxies' client address, the API's throttles, the secret
key, the console's Content-Security-Policy, the demo account, the files' modes, cookies and TLS, passwords,
sessions, hosts)."""

from __future__ import annotations

import asyncio
import base64
import http.client
from collections.abc import Iterator

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.server import ServerState

from serving.dataplane.http import frontdoor
from tests.conftest import LiveServer

RIGHT = "the-right-password-17"
WRONG = "not-the-password"
INGRESS = "127.0.0.0/8"  # the test's own connections stand for the ingress controller's


@pytest.fixture
def users(transactional_db, settings) -> dict[str, User]:  # noqa: ANN001
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # every attempt hashes once
    return {
        name: User.objects.create_user(name, f"{name}@example.org", RIGHT, is_staff=True) for name in ("alice", "bob")
    }


def request(
    server: LiveServer, path: str, username: str | None = None, password: str = "", forwarded_for: str | None = None
) -> tuple[int, dict[str, str], bytes]:
    headers = {}
    if username is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def behind_ingress(users, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    """A live server whose every connection comes from its trusted proxy, as behind a Kubernetes ingress."""
    settings.FERRY_TRUSTED_PROXIES = [INGRESS]
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


# --- 1. Behind the ingress, a lockout is the attacker's address's, not everyone's ---


def test_wrong_passwords_from_one_client_behind_the_proxy_do_not_lock_out_another(behind_ingress) -> None:  # noqa: ANN001
    # given an attacker behind the ingress who sends the limit of wrong passwords for alice, each request naming
    # a different address of its own (the ingress appends the address it saw: the attacker's)
    for i in range(django_settings.AXES_FAILURE_LIMIT + 1):
        status, _, _ = request(behind_ingress, "/api/models/", "alice", WRONG, f"10.9.9.{i}, 203.0.113.66")
        assert status in (403, 429)
    # when alice, behind the same ingress, logs in from her own address
    status, _, body = request(behind_ingress, "/api/models/", "alice", RIGHT, "198.51.100.7")
    # then she is served: the lockout is the attacker's address's (the old code keyed it on the ingress's)
    assert status == 200, body
    # and the attacker's address is the one locked out, whatever it writes before the ingress's entry
    status, headers, body = request(behind_ingress, "/api/models/", "alice", RIGHT, "192.0.2.1, 203.0.113.66")
    assert status == 429, body
    assert int(headers["retry-after"]) >= 1


def test_forwarded_addresses_from_an_untrusted_peer_are_ignored(users, settings) -> None:  # noqa: ANN001
    # given a server whose trusted proxy is elsewhere: this test's connections are clients, not the proxy
    settings.FERRY_TRUSTED_PROXIES = ["10.0.0.0/8"]
    server = LiveServer().start()
    try:
        # when a client sends the limit of wrong passwords, each with an X-Forwarded-For of its choosing
        for i in range(django_settings.AXES_FAILURE_LIMIT):
            request(server, "/api/models/", "bob", WRONG, f"192.0.2.{i}")
        # then it is locked out all the same: the header was not believed
        status, _, body = request(server, "/api/models/", "bob", RIGHT, "198.51.100.8")
        assert status == 429, body
    finally:
        server.stop()


def test_the_inference_lane_stays_behind_the_proxy_headers(settings) -> None:  # noqa: ANN001
    # given a server configured to trust a proxy: uvicorn wraps the application in its proxy headers' middleware
    from config.asgi import application

    settings.FERRY_TRUSTED_PROXIES = [INGRESS]
    config = frontdoor.uvicorn_config(application, "127.0.0.1", 0, loop="asyncio")
    config.load()
    assert type(config.loaded_app) is ProxyHeadersMiddleware
    assert config.proxy_headers and config.forwarded_allow_ips == [INGRESS]
    # then the front door still answers inference POSTs on its lane, with the application's handler
    loop = asyncio.new_event_loop()
    try:
        protocol = frontdoor.FrontDoorProtocol(config, ServerState(), {}, loop)
        assert protocol.infer is application.ferry_infer
    finally:
        loop.close()
    # and with no proxy trusted, none is wrapped in: the TCP peer is the client
    settings.FERRY_TRUSTED_PROXIES = []
    plain = frontdoor.uvicorn_config(application, "127.0.0.1", 0, loop="asyncio")
    plain.load()
    assert plain.loaded_app is application and not plain.proxy_headers
