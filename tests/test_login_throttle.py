"""Logins are throttled (issue 17, finding 5; django-axes): FERRY_LOGIN_FAILURE_LIMIT wrong passwords for one
username from one address lock that pair out for FERRY_LOGIN_COOLOFF_MINUTES, on the console's /login/ (a
429 page) and on the API's HTTP Basic authentication (429 JSON with Retry-After, through the real ASGI
server); the right password is refused until the cool-off ends; another user, or the same user from
another address, is unaffected."""

from __future__ import annotations

import base64
import http.client
from collections.abc import Iterator
from datetime import timedelta

import orjson
import pytest
from asgiref.sync import sync_to_async
from axes.models import AccessAttempt
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.db import connections
from django.test import AsyncClient, Client
from django.utils import timezone

from tests.conftest import LiveServer

RIGHT = "the-right-password-17"
WRONG = "not-the-password"


@pytest.fixture
def users(transactional_db, settings) -> dict[str, User]:  # noqa: ANN001
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # every attempt hashes once
    return {
        name: User.objects.create_user(name, f"{name}@example.org", RIGHT, is_staff=True) for name in ("alice", "bob")
    }


def limit() -> int:
    return django_settings.AXES_FAILURE_LIMIT


def cool_off_seconds() -> int:
    return django_settings.FERRY_LOGIN_COOLOFF_MINUTES * 60


def end_cool_off() -> None:
    """The cool-off passes: the recorded failures are moved back past it (as time would)."""
    AccessAttempt.objects.update(attempt_time=timezone.now() - timedelta(seconds=cool_off_seconds() + 1))


def console_login(username: str, password: str, address: str = "127.0.0.1"):  # noqa: ANN201
    client = Client(REMOTE_ADDR=address)
    return client, client.post("/login/", {"username": username, "password": password})


def test_settings_drive_axes() -> None:
    assert django_settings.AXES_FAILURE_LIMIT == django_settings.FERRY_LOGIN_FAILURE_LIMIT
    assert django_settings.AXES_LOCKOUT_PARAMETERS == [["username", "ip_address"]]
    assert "axes.backends.AxesStandaloneBackend" == django_settings.AUTHENTICATION_BACKENDS[0]


def test_console_login_locks_out_after_the_limit(users) -> None:  # noqa: ANN001
    # given wrong passwords for alice: the form says so until the limit
    for _ in range(limit() - 1):
        _, resp = console_login("alice", WRONG)
        assert resp.status_code == 200 and b"didn't match" in resp.content
    # when the limit is reached: a readable 429 page, with the wait
    _, resp = console_login("alice", WRONG)
    assert resp.status_code == 429
    assert b"Too many failed logins" in resp.content and resp["Content-Type"].startswith("text/html")
    assert resp["Retry-After"] == str(cool_off_seconds())
    # then the right password is refused too, and no session is made
    client, resp = console_login("alice", RIGHT)
    assert resp.status_code == 429 and "_auth_user_id" not in client.session
    # while bob, and alice from another address, log in
    client, resp = console_login("bob", RIGHT)
    assert resp.status_code == 302 and client.session["_auth_user_id"] == str(users["bob"].pk)
    client, resp = console_login("alice", RIGHT, address="10.20.30.40")
    assert resp.status_code == 302 and client.session["_auth_user_id"] == str(users["alice"].pk)
    # and once the cool-off has passed, alice logs in from the first address again
    end_cool_off()
    client, resp = console_login("alice", RIGHT)
    assert resp.status_code == 302 and client.session["_auth_user_id"] == str(users["alice"].pk)


async def test_console_lockout_through_the_async_middleware_chain(users) -> None:  # noqa: ANN001
    # the web process serves Django over ASGI, where axes' middleware takes its async branch (which hands the
    # lockout callable other arguments than the sync one)
    client = AsyncClient(REMOTE_ADDR="127.0.0.1")
    for _ in range(limit() - 1):
        assert (await client.post("/login/", {"username": "alice", "password": WRONG})).status_code == 200
    resp = await client.post("/login/", {"username": "alice", "password": WRONG})
    assert resp.status_code == 429 and b"Too many failed logins" in resp.content
    resp = await client.post("/login/", {"username": "alice", "password": RIGHT})
    assert resp.status_code == 429 and resp["Retry-After"] == str(cool_off_seconds())
    assert (await AsyncClient().post("/login/", {"username": "bob", "password": RIGHT})).status_code == 302
    await sync_to_async(connections.close_all)()  # the views' thread holds a connection of its own: close it


def test_a_success_resets_the_count(users) -> None:  # noqa: ANN001
    for _ in range(limit() - 1):
        assert console_login("alice", WRONG)[1].status_code == 200
    assert console_login("alice", RIGHT)[1].status_code == 302
    for _ in range(limit() - 1):
        assert console_login("alice", WRONG)[1].status_code == 200  # counted from zero again: not locked yet
    assert console_login("alice", RIGHT)[1].status_code == 302


@pytest.fixture
def server(users) -> Iterator[LiveServer]:  # noqa: ANN001
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def basic(server: LiveServer, username: str, password: str) -> tuple[int, dict[str, str], bytes]:
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", "/api/models/", headers={"Authorization": f"Basic {token}"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_api_basic_auth_locks_out_after_the_limit(server: LiveServer) -> None:
    # given the right password works
    assert basic(server, "alice", RIGHT)[0] == 200
    # when wrong ones are sent: refused (403, as DRF answers a failed Basic login after Session) until the
    # limit, then 429 JSON with Retry-After
    for _ in range(limit() - 1):
        assert basic(server, "alice", WRONG)[0] == 403
    status, headers, body = basic(server, "alice", WRONG)
    assert status == 429, body
    assert headers["content-type"].startswith("application/json")
    assert "too many failed logins" in orjson.loads(body)["error"]
    assert headers["retry-after"] == str(cool_off_seconds())
    # then the right password is refused as well
    status, headers, body = basic(server, "alice", RIGHT)
    assert status == 429 and int(headers["retry-after"]) >= 1
    # while bob is served
    assert basic(server, "bob", RIGHT)[0] == 200
    # and after the cool-off alice is served again
    end_cool_off()
    assert basic(server, "alice", RIGHT)[0] == 200
