"""System checks of the settings that protect logins (run at every management command's start, `serve`'s
included; `manage.py check` lists them)."""

from __future__ import annotations

from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register


@register(Tags.security)
def cookies_follow_https(app_configs: object = None, **kwargs: object) -> list[CheckMessage]:
    """FERRY_PROXY_SSL_HEADER or FERRY_HSTS_SECONDS say the site is served over https: its session and CSRF
    cookies must be Secure, or a browser sends them over plain http too (config/settings.py makes them so by
    default; FERRY_SECURE_COOKIES=false turns that off)."""
    https = settings.SECURE_PROXY_SSL_HEADER or settings.SECURE_HSTS_SECONDS
    if https and not (settings.SESSION_COOKIE_SECURE and settings.CSRF_COOKIE_SECURE):
        return [
            Warning(
                "the site is served over https (FERRY_PROXY_SSL_HEADER or FERRY_HSTS_SECONDS) but its session and"
                " CSRF cookies are not Secure: a browser would send them over plain http too",
                hint="leave FERRY_SECURE_COOKIES unset (it follows https) or set it to true",
                id="ferry.W001",
            )
        ]
    return []
