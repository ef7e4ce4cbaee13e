"""Cookies and TLS (issue 17, finding 5): FERRY_SECURE_COOKIES, FERRY_HSTS_SECONDS and FERRY_PROXY_SSL_HEADER,
off in embedded mode and on in platform/k8s, make Django's cookies Secure, send HSTS on https, and trust the
proxy's X-Forwarded-Proto; `manage.py check --deploy` stops warning about them once they are on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client

ROOT = Path(__file__).resolve().parent.parent
SECURE_ENV = {
    "FERRY_SECURE_COOKIES": "true",
    "FERRY_HSTS_SECONDS": "31536000",
    "FERRY_HSTS_INCLUDE_SUBDOMAINS": "true",
    "FERRY_PROXY_SSL_HEADER": "X-Forwarded-Proto",
}
# check --deploy's warnings these settings answer: HSTS (W004), the session and CSRF cookies (W012, W016)
ANSWERED = ("security.W004", "security.W012", "security.W016")


def django_in(tmp_path: Path, code: list[str], **env: str) -> subprocess.CompletedProcess:
    """`python <code>` in a fresh interpreter on this project's settings, with `env` over a clean FERRY_ slate."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "DJANGO_"))}
    environment = {
        **base,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "FERRY_DATA_DIR": str(tmp_path),
        "SECRET_KEY": "x" * 60,
        **env,
    }
    return subprocess.run(
        [sys.executable, *code], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )


def test_the_environment_sets_them_and_they_are_off_by_default(tmp_path: Path) -> None:
    script = (
        "import django; django.setup(); from django.conf import settings as s; print("
        "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_HSTS_SECONDS, s.SECURE_HSTS_INCLUDE_SUBDOMAINS,"
        " s.SECURE_PROXY_SSL_HEADER)"
    )
    off = django_in(tmp_path, ["-c", script])
    on = django_in(tmp_path, ["-c", script], **SECURE_ENV)
    assert off.stdout.split("\n")[-2] == "False False 0 False None", off.stderr
    assert on.stdout.split("\n")[-2] == "True True 31536000 True ('HTTP_X_FORWARDED_PROTO', 'https')", on.stderr


def test_check_deploy_is_happier_with_them_on(tmp_path: Path) -> None:
    off = django_in(tmp_path, ["manage.py", "check", "--deploy"])
    on = django_in(tmp_path, ["manage.py", "check", "--deploy"], **SECURE_ENV)
    for warning in ANSWERED:
        assert warning in off.stderr + off.stdout, warning
        assert warning not in on.stderr + on.stdout, (warning, on.stderr)


@pytest.fixture
def secure(settings, transactional_db) -> User:  # noqa: ANN001
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = True
    settings.SECURE_HSTS_SECONDS = 31536000
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    return User.objects.create_user("carol", "carol@example.org", "carols-password")


def test_cookies_are_secure_and_https_gets_hsts(secure: User) -> None:
    client = Client()
    page = client.get("/login/", secure=True)
    assert page.status_code == 200
    assert page["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
    assert page.cookies["csrftoken"]["secure"] is True
    resp = client.post("/login/", {"username": "carol", "password": "carols-password"}, secure=True)
    assert resp.status_code == 302
    assert resp.cookies["sessionid"]["secure"] is True


def test_hsts_only_over_https_as_the_proxy_says(secure: User) -> None:
    # plain http: no HSTS (a browser ignores it there, and it must not be sent)
    assert "Strict-Transport-Security" not in Client().get("/login/")
    # http from the proxy that says the client came over https: HSTS, the request is secure
    assert "Strict-Transport-Security" in Client().get("/login/", headers={"X-Forwarded-Proto": "https"})
