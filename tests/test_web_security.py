"""The web-security audit's findings, each answered (the proxies' client address, the API's throttles, the secret
key, the console's Content-Security-Policy, the demo account, the files' modes, cookies and TLS, passwords,
sessions, hosts)."""

from __future__ import annotations

import asyncio
import base64
import http.client
import io
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from django.conf import settings as django_settings
from django.contrib.auth.hashers import MD5PasswordHasher
from django.contrib.auth.models import User
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
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
    from config.asgi import application  # builds the whole application when imported: only this test needs it

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


# --- 2. The API's HTTP Basic authentication cannot be used to spend the server's CPU ---


class CountingMD5(MD5PasswordHasher):
    """The test's password hasher, counting the hashes computed (each a PBKDF2 in production)."""

    hashes = 0

    def encode(self, password: str, salt: str) -> str:
        type(self).hashes += 1
        return super().encode(password, salt)


@pytest.fixture
def counted(transactional_db, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    settings.PASSWORD_HASHERS = ["tests.test_web_security.CountingMD5"]
    settings.FERRY_TRUSTED_PROXIES = [INGRESS]  # so that the test's requests can come from several addresses
    User.objects.create_user("carol", "carol@example.org", RIGHT)
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def test_an_address_spraying_usernames_is_refused_before_its_passwords_are_hashed(counted, settings) -> None:  # noqa: ANN001
    settings.FERRY_API_FAILED_LOGIN_RATE = "3/minute"
    attacker = "203.0.113.9"
    # given an address that sends wrong credentials, each for another username (django-axes counts per username
    # and address: none of them is locked out)
    for i in range(3):
        status, _, _ = request(counted, "/api/models/", f"user{i}", WRONG, attacker)
        assert status == 403
    hashed = CountingMD5.hashes
    # when it sends more, the right password of a real user included
    status, headers, body = request(counted, "/api/models/", "user3", WRONG, attacker)
    again = request(counted, "/api/models/", "carol", RIGHT, attacker)
    # then each is refused at once, 429 JSON with Retry-After, and no password is hashed for them
    assert status == 429, body
    assert headers["content-type"].startswith("application/json")
    assert "too many failed logins from this address" in orjson.loads(body)["error"]
    assert 1 <= int(headers["retry-after"]) <= 60
    assert again[0] == 429 and int(again[1]["retry-after"]) >= 1
    assert CountingMD5.hashes == hashed
    # while carol from her own address is served: the count is the address's
    assert request(counted, "/api/models/", "carol", RIGHT, "198.51.100.7")[0] == 200


def test_anonymous_requests_are_throttled_per_address_whatever_they_forward(settings, db) -> None:  # noqa: ANN001
    settings.FERRY_API_ANON_RATE = "2/minute"
    client = Client(REMOTE_ADDR="192.0.2.10")
    # given an anonymous client that used its rate on the API's open views
    assert client.get("/api/").status_code == 200
    assert client.get("/api/", headers={"X-Forwarded-For": "198.51.100.1"}).status_code == 200
    # when it asks again, naming another address as its own
    resp = client.get("/api/", headers={"X-Forwarded-For": "198.51.100.2"})
    # then it is throttled: 429 JSON with Retry-After, as the API's other errors
    assert resp.status_code == 429
    assert resp["Content-Type"].startswith("application/json")
    assert "throttled" in resp.json()["error"]
    assert 1 <= int(resp["Retry-After"]) <= 60
    # and another address is not
    assert Client(REMOTE_ADDR="192.0.2.11").get("/api/").status_code == 200


# --- 4. A shared deployment's web processes share one SECRET_KEY, and never an example's ---

ROOT = Path(__file__).resolve().parent.parent
SHARED_ENV = ("SECRET_KEY", "SECRET_KEY_FILE", "DATABASE_URL", "REDIS_URL", "ALLOWED_HOSTS")
K8S_PLACEHOLDER = "CHANGE-ME-to-50-random-characters"  # platform/k8s/base/secret.example.yaml's
COMPOSE_KEY = "compose-local-only-not-a-secret-change-me-for-anything-real"  # platform/compose.yaml's default
DEPLOYMENT_KEY = "a-deployment-s-own-random-key-" + "q8Zr4" * 6


def python_in(tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter on this project's settings, with `env` over a slate without any
    FERRY_ setting, key, database or Redis."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "DJANGO_")) and k not in SHARED_ENV}
    environment = {**base, "DJANGO_SETTINGS_MODULE": "config.settings", "FERRY_DATA_DIR": str(tmp_path), **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )


def test_a_web_process_on_a_shared_database_refuses_a_key_of_its_own(tmp_path: Path) -> None:
    database = {"DATABASE_URL": "postgres://ferry@db.example.internal:5432/ferry"}  # never connected to here
    # given a web process (config.asgi) pointed at a shared database with no SECRET_KEY
    alone = python_in(tmp_path / "a", "import config.asgi", **database)
    # then it refuses to start, saying why (the old code generated a key per pod: API keys failed on the others)
    assert alone.returncode != 0
    assert "SECRET_KEY is not set" in alone.stderr, alone.stderr[-2000:]
    # and with REDIS_URL alone just as well
    redis = python_in(tmp_path / "b", "import config.asgi", REDIS_URL="redis://redis.example.internal:6379/0")
    assert redis.returncode != 0 and "SECRET_KEY is not set" in redis.stderr
    # while with the key set it starts, and embedded mode (neither set) keeps its generated key
    keyed = python_in(tmp_path / "c", "import config.asgi", SECRET_KEY=DEPLOYMENT_KEY, **database)
    assert keyed.returncode == 0, keyed.stderr[-2000:]
    embedded = python_in(tmp_path / "d", "import config.asgi")
    assert embedded.returncode == 0, embedded.stderr[-2000:]
    assert (tmp_path / "d" / "secret_key").exists()


def test_ensure_demo_user_refuses_without_the_shared_key(settings, db) -> None:  # noqa: ANN001
    settings.SECRET_KEY_MISSING = "SECRET_KEY is not set, and ..."
    with pytest.raises(CommandError, match="SECRET_KEY is not set"):
        call_command("ensure_demo_user", stdout=io.StringIO())
    assert not User.objects.exists()


def test_an_example_key_is_refused_where_the_hosts_are_public(tmp_path: Path) -> None:
    setup = "import django; django.setup()"
    # given the Kubernetes example's placeholder with the ConfigMap's public host: refused, saying why
    k8s = python_in(tmp_path / "a", setup, SECRET_KEY=K8S_PLACEHOLDER, ALLOWED_HOSTS="ferry.example.com")
    assert k8s.returncode != 0 and "placeholder" in k8s.stderr, k8s.stderr[-2000:]
    # and compose's own public key too, once a host is public
    public = python_in(tmp_path / "b", setup, SECRET_KEY=COMPOSE_KEY, ALLOWED_HOSTS="ferry.example.com,localhost")
    assert public.returncode != 0 and "placeholder" in public.stderr
    # while compose on a laptop (loopback, and the service's name) starts on it
    laptop = python_in(tmp_path / "c", setup, SECRET_KEY=COMPOSE_KEY, ALLOWED_HOSTS="127.0.0.1,localhost,web")
    assert laptop.returncode == 0, laptop.stderr[-2000:]


# --- 3. The console's pages run this server's scripts only ---

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>", re.IGNORECASE)
EVENT_HANDLER = re.compile(r"<[^>]+\son[a-z]+\s*=", re.IGNORECASE)
CONSOLE_PAGES = (
    "/login/",
    "/console/models/",
    "/console/fleet/",
    "/console/pipelines/",
    "/console/tenants/",
    "/console/usage/",
    "/console/planner/",
    "/console/audit/",
    "/console/quota-requests/",
    "/admin/",
)


def directives(header: str) -> dict[str, list[str]]:
    return {name: values for name, *values in (part.split() for part in header.split(";") if part.strip())}


def test_html_pages_send_a_policy_that_runs_no_inline_script(db, django_user_model) -> None:  # noqa: ANN001
    staff = django_user_model.objects.create_user("csp-staff", password=RIGHT, is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    for path in CONSOLE_PAGES:
        page = client.get(path) if path != "/login/" else Client().get(path)
        assert page.status_code == 200, path
        # the policy: scripts from this server only, never inline; no plugins, no <base>, no framing
        policy = directives(page["Content-Security-Policy"])
        assert policy["script-src"] == ["'self'"], path
        assert policy["default-src"] == ["'self'"] and policy["object-src"] == ["'none'"], path
        assert policy["base-uri"] == ["'none'"] and policy["frame-ancestors"] == ["'none'"], path
        assert policy["connect-src"] == ["'self'", "ws://testserver"], path  # the fleet page's socket
        # and the page needs nothing it forbids: no inline script, no event handler attribute
        html = page.content.decode()
        assert not INLINE_SCRIPT.search(html), (path, INLINE_SCRIPT.search(html))
        assert not EVENT_HANDLER.search(html), (path, EVENT_HANDLER.search(html))
    # over https the socket's origin is wss
    secure = client.get("/console/fleet/", secure=True)
    assert "wss://testserver" in directives(secure["Content-Security-Policy"])["connect-src"]


def test_the_api_docs_keep_their_own_policy_and_json_gets_none(db) -> None:  # noqa: ANN001
    docs = Client().get("/api/docs/")
    assert "blob:" in directives(docs["Content-Security-Policy"])["worker-src"]  # serving.api.docs' own
    assert "Content-Security-Policy" not in Client().get("/api/")


# --- 5. The demo account's password is the machine's own, and no secret is printed ---


def test_the_demo_account_gets_a_random_password_in_a_private_file(monkeypatch, settings, tmp_path, db) -> None:  # noqa: ANN001
    settings.DATA_DIR = tmp_path
    monkeypatch.delenv("FERRY_ADMIN_PASSWORD", raising=False)
    monkeypatch.delenv("FERRY_ADMIN_USER", raising=False)
    # given no account / when the demo's set-up runs
    out = io.StringIO()
    call_command("ensure_demo_user", stdout=out)
    # then admin's password is not the one the README used to publish, but a random one in a file of mode 600
    admin = User.objects.get(username="admin")
    assert admin.is_superuser and not admin.check_password("ferry-admin")
    path = tmp_path / "demo-admin-password"
    password = path.read_text().strip()
    assert len(password) >= 20 and admin.check_password(password)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # and the output (kept in compose's and CI's logs) names the files, never the secrets
    token = (tmp_path / "demo-api-key").read_text().strip()
    printed = out.getvalue()
    assert str(path) in printed and str(tmp_path / "demo-api-key") in printed
    assert password not in printed and token not in printed


def test_an_account_with_the_old_published_password_gets_a_new_one(monkeypatch, settings, tmp_path, db) -> None:  # noqa: ANN001
    settings.DATA_DIR = tmp_path
    monkeypatch.delenv("FERRY_ADMIN_PASSWORD", raising=False)
    monkeypatch.delenv("FERRY_ADMIN_USER", raising=False)
    User.objects.create_superuser("admin", "admin@example.org", "ferry-admin")  # an earlier `make run`'s
    call_command("ensure_demo_user", stdout=io.StringIO())
    admin = User.objects.get(username="admin")
    assert not admin.check_password("ferry-admin")
    assert admin.check_password((tmp_path / "demo-admin-password").read_text().strip())
    # while a password of the operator's own choosing is kept
    admin.set_password("the-operators-own-password")
    admin.save()
    call_command("ensure_demo_user", stdout=io.StringIO())
    admin.refresh_from_db()
    assert admin.check_password("the-operators-own-password")


# --- 6. The data directory and its secrets are this user's only ---

MODES = """
import os, pathlib
os.umask(0o022)  # a usual umask: what is private is made so by the code, not by the caller's umask
import django
django.setup()
from django.conf import settings
from django.db import connection
with connection.cursor() as cursor:
    cursor.execute("CREATE TABLE IF NOT EXISTS t (x)")
    cursor.execute("INSERT INTO t VALUES (1)")
home = pathlib.Path(settings.DATA_DIR)
for path in (home, *sorted(home.glob("secret_key")), *sorted(home.glob("ferry.sqlite3*"))):
    print(path.name, oct(path.stat().st_mode & 0o777))
"""


def modes(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr[-2000:]
    return dict(line.split() for line in result.stdout.splitlines() if line.startswith(("data", "secret", "ferry")))


def test_a_new_data_directory_and_its_files_are_private(tmp_path: Path) -> None:
    # given embedded mode in a new data directory, under a umask that lets others read
    found = modes(python_in(tmp_path / "data", MODES))
    # then the directory is this user's only, and so are the key and the database with its WAL files (the
    # old code made them 755 and 644: other local users could read the sessions)
    assert found["data"] == "0o700"
    assert found["secret_key"] == "0o600"
    assert found["ferry.sqlite3"] == "0o600" and found["ferry.sqlite3-wal"] == "0o600"


def test_a_database_an_earlier_version_left_readable_is_narrowed(tmp_path: Path) -> None:
    home = tmp_path / "data"
    home.mkdir()
    (home / "ferry.sqlite3").touch(mode=0o644)
    (home / "ferry.sqlite3").chmod(0o644)
    found = modes(python_in(home, MODES))
    assert found["ferry.sqlite3"] == "0o600"


def test_processes_starting_together_agree_on_one_generated_key(tmp_path: Path) -> None:
    # given several processes of one machine starting at once in a new data directory (`serve --workers 4`)
    code = "import django; django.setup(); from django.conf import settings; print(settings.SECRET_KEY)"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "DJANGO_")) and k not in SHARED_ENV}
    env = {**base, "DJANGO_SETTINGS_MODULE": "config.settings", "FERRY_DATA_DIR": str(tmp_path / "data")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    keys = {proc.communicate(timeout=300)[0].strip().splitlines()[-1] for proc in procs}
    # then they all have the one key the directory holds, which is long and this user's only
    key_file = tmp_path / "data" / "secret_key"
    assert keys == {key_file.read_text().strip()} and len(keys.pop()) >= 50
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert [p.name for p in (tmp_path / "data").iterdir() if p.name.startswith(".secret_key")] == []


# --- 8. Cookies follow https; Django's https redirect spares the nodes' in-cluster fetches ---

COOKIES = (
    "import django; django.setup(); from django.conf import settings as s; "
    "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_PRELOAD)"
)


def test_cookies_are_secure_whenever_the_site_says_it_is_served_over_https(tmp_path: Path) -> None:
    def secure(name: str, **env: str) -> str:
        result = python_in(tmp_path / name, COOKIES, SECRET_KEY=DEPLOYMENT_KEY, **env)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout.splitlines()[-1]

    # given the proxy's https header alone, or HSTS alone: the cookies are Secure (the old code needed
    # FERRY_SECURE_COOKIES besides, and without it sent the session cookie over plain http)
    assert secure("proxy", FERRY_PROXY_SSL_HEADER="X-Forwarded-Proto") == "True True False"
    assert secure("hsts", FERRY_HSTS_SECONDS="31536000", FERRY_HSTS_PRELOAD="true") == "True True True"
    # and embedded mode (neither) keeps plain http's cookies
    assert secure("embedded") == "False False False"


def test_cookies_turned_off_beside_https_are_warned_about(tmp_path: Path) -> None:
    check = "import django; django.setup(); from django.core.management import call_command; call_command('check')"
    off = python_in(
        tmp_path / "a",
        check,
        SECRET_KEY=DEPLOYMENT_KEY,
        FERRY_PROXY_SSL_HEADER="X-Forwarded-Proto",
        FERRY_SECURE_COOKIES="false",
    )
    assert "ferry.W001" in off.stdout + off.stderr
    on = python_in(tmp_path / "b", check, SECRET_KEY=DEPLOYMENT_KEY, FERRY_PROXY_SSL_HEADER="X-Forwarded-Proto")
    assert on.returncode == 0 and "ferry.W001" not in on.stdout + on.stderr


def test_the_https_redirect_spares_internal_artifact_fetches(settings, db) -> None:  # noqa: ANN001
    settings.SECURE_SSL_REDIRECT = True
    # the console over plain http is sent to https
    console = Client().get("/login/")
    assert console.status_code == 301 and console["Location"].startswith("https://")
    # while a node's in-cluster fetch over http reaches the artifact endpoint (the old code redirected it too,
    # and a node does not follow a redirect to an https it cannot reach)
    fetch = Client().get("/internal/artifacts/" + "0" * 64)
    assert fetch.status_code != 301


# --- 7. Passwords set by people are long, uncommon, not numeric, not the username ---


@pytest.mark.parametrize(
    "password, why",
    [
        ("Tr0ub4dor&3", "too short"),  # 11 characters: the old minimum was 8
        ("password1234", "too common"),
        ("839201746652", "entirely numeric"),
        ("margaret.hamilton.1936", "too similar"),
    ],
)
def test_weak_passwords_are_refused(password: str, why: str) -> None:
    user = User(username="margaret.hamilton.1936", email="margaret@example.org")
    with pytest.raises(ValidationError, match=why):
        validate_password(password, user)


def test_a_long_uncommon_password_is_accepted() -> None:
    validate_password("correct horse battery staple", User(username="margaret"))


# --- 9. A console session lasts a working day, and other sites' links and forms do not carry it ---


def test_a_login_lasts_hours_and_its_cookie_stays_on_this_site(db, django_user_model) -> None:  # noqa: ANN001
    django_user_model.objects.create_user("session-op", password=RIGHT, is_staff=True)
    client = Client()
    client.get("/login/")
    resp = client.post("/login/", {"username": "session-op", "password": RIGHT})
    assert resp.status_code == 302
    cookie = resp.cookies[django_settings.SESSION_COOKIE_NAME]
    # 12 hours (the old code kept a superuser's session two weeks), sent by same-site requests only
    assert cookie["max-age"] == 12 * 3600
    assert cookie["samesite"] == "Strict"
    # while the CSRF cookie stays Lax, and the login works: the console answers the session
    assert client.cookies[django_settings.CSRF_COOKIE_NAME]["samesite"] == "Lax"
    assert client.get("/console/models/").status_code == 200


# --- 10. The test client's host is the tests' alone ---


def test_the_default_hosts_are_loopback_only(tmp_path: Path) -> None:
    code = "import django; django.setup(); from django.conf import settings; print(','.join(settings.ALLOWED_HOSTS))"
    result = python_in(tmp_path, code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines()[-1] == "127.0.0.1,localhost,[::1]"  # the old default added testserver
    # while the tests' own set-up adds it for Django's test client
    assert "testserver" in django_settings.ALLOWED_HOSTS
