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


def upload(server: LiveServer, username: str, password: str, declared: int) -> tuple[int, dict[str, str], bytes]:
    """An upload's head with HTTP Basic credentials and a declared body that never comes: the front door
    answers it (413, 429) before reading a byte, or waits for the body (then the read deadline ends it)."""
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", "/api/models/digits/versions/")
        for name, value in (
            ("Authorization", f"Basic {token}"),
            ("Content-Type", "multipart/form-data; boundary=x"),
            ("Content-Length", str(declared)),
        ):
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def test_upload_credentials_are_login_attempts(server: LiveServer, settings) -> None:  # noqa: ANN001
    # given a declared upload past the form bound: the door checks its credentials before any body byte, and a
    # wrong password's answer (413 at once) differs from a right one's (it waits for the body)
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    settings.FERRY_UPLOAD_READ_TIMEOUT_S = 1
    big = settings.FERRY_MAX_FORM_BODY_BYTES + 1
    # when wrong passwords are sent that way: each is refused unread, and counted as a failed login
    for attempt in range(limit() - 1):
        status, _, body = upload(server, "alice", WRONG, big)
        assert status == 413 and b"engineer" in body
        assert AccessAttempt.objects.get(username="alice").failures_since_start == attempt + 1
    status, headers, body = upload(server, "alice", WRONG, big)
    # then the limit locks the login out, as on the API: 429 JSON with Retry-After
    assert status == 429, body
    assert headers["content-type"].startswith("application/json")
    assert "too many failed logins" in orjson.loads(body)["error"]
    assert headers["retry-after"] == str(cool_off_seconds())
    # and the right password gets the same 429, so the door tells nothing of it during the lockout
    status, headers, _ = upload(server, "alice", RIGHT, big)
    assert status == 429 and int(headers["retry-after"]) >= 1
    # as the API does
    assert basic(server, "alice", RIGHT)[0] == 429


def test_an_upload_reaching_drf_counts_its_wrong_password_once(server: LiveServer) -> None:
    # given an upload small enough for the form bound, with a wrong password: the door checks it, and DRF's
    # authentication of the same request reuses that verdict
    token = base64.b64encode(f"alice:{WRONG}".encode()).decode()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(
            "POST",
            "/api/models/digits/versions/",
            body=b"a=b",
            headers={"Authorization": f"Basic {token}", "Content-Type": "application/x-www-form-urlencoded"},
        )
        resp = conn.getresponse()
        status = resp.status
        resp.read()
    finally:
        conn.close()
    # then it is refused as a failed login, counted once
    assert status == 403
    assert AccessAttempt.objects.get(username="alice").failures_since_start == 1
