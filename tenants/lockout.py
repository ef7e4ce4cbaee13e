"""What a locked-out login gets: 429 with Retry-After, as a page on the console and the admin (django-axes'
AXES_LOCKOUT_CALLABLE, config/settings.py), as JSON on the API (HTTP Basic callers are programs).

The API's is raised by `LockoutAwareBasicAuthentication`, not by axes' middleware: DRF hands
`authenticate()` its own Request, so the flag axes sets there (`axes_locked_out`) never reaches the
HttpRequest the middleware looks at, and DRF would answer the lockout as one more wrong password.

An upload's HTTP Basic credentials are checked before its body is read (serving.django_door), as a login
attempt axes counts; the door leaves its verdict in the ASGI scope (`scope_verdict`), and DRF's
authentication of the same request reuses it rather than counting the same wrong password twice.

A failure during a lockout starts the cool-off again (axes' AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT,
left at its default), and this answer follows such a failure, so the whole cool-off is the wait.
"""

from __future__ import annotations

import math

from axes.helpers import get_cool_off
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from drf_spectacular.authentication import BasicScheme
from rest_framework.authentication import BasicAuthentication
from rest_framework.exceptions import AuthenticationFailed, Throttled

from tenants.throttles import FailedLogins

STATUS = 429
DOOR_VERDICT = "ferry.basic_verdict"  # scope key: (the Authorization header the door checked, its user or None)


def locked_out(request: HttpRequest, *_context: object) -> HttpResponse:
    # axes passes (request, response, credentials) from its sync middleware and (request, credentials) from its
    # async one; neither is needed here.
    seconds = cool_off_seconds(request)
    minutes = math.ceil(seconds / 60) if seconds else None
    response = render(request, "registration/locked_out.html", {"minutes": minutes}, status=STATUS)
    if seconds:
        response["Retry-After"] = str(seconds)
    return response


def cool_off_seconds(request: object) -> int | None:
    cool_off = get_cool_off(request)  # type: ignore[arg-type]
    return max(1, math.ceil(cool_off.total_seconds())) if cool_off else None


def scope_verdict(scope: dict, authorization: bytes, user: object) -> None:
    """Leave the door's verdict on `authorization` (the user, or None for a wrong password) for DRF."""
    scope[DOOR_VERDICT] = (authorization.strip(), user)


def _door_verdict(request: object) -> tuple[bool, object]:
    """(whether the door checked this request's very Authorization header, the user it found or None)."""
    django_request = getattr(request, "_request", request)  # DRF's Request wraps Django's
    scope = getattr(django_request, "scope", None)
    verdict = scope.get(DOOR_VERDICT) if isinstance(scope, dict) else None
    if verdict is None:
        return False, None
    authorization, user = verdict
    header = django_request.META.get("HTTP_AUTHORIZATION", "")  # type: ignore[attr-defined]
    return header.strip().encode("latin-1") == authorization, user


class LockedOut(Throttled):
    """429; DRF sets Retry-After from `wait`, and serving.api.errors writes {"error": ...}."""

    default_detail = "too many failed logins for this username from this address"


class LockoutAwareBasicAuthentication(BasicAuthentication):
    """DRF's HTTP Basic authentication, answering 429 instead of 403 once axes has locked the login out, and
    429 without checking the password once the client's address has sent too many wrong ones
    (tenants.throttles.FailedLogins: each check costs a password hash)."""

    def authenticate_credentials(self, userid: str, password: str, request: object = None) -> tuple:
        failures = FailedLogins()
        checked, user = _door_verdict(request)
        if checked:  # counted once already, by the door
            if user is None:
                failures.record(request)
                raise AuthenticationFailed("Invalid username/password.")
            return user, None
        refused = failures.refused(request)
        if refused is not None:
            raise refused
        try:
            return super().authenticate_credentials(userid, password, request)
        except AuthenticationFailed:
            failures.record(request)
            if request is not None and getattr(request, "axes_locked_out", False):
                raise LockedOut(wait=cool_off_seconds(request)) from None
            raise


class LockoutAwareBasicScheme(BasicScheme):
    """The API schema's basicAuth for the class above (drf-spectacular matches authenticators by exact class)."""

    target_class = "tenants.lockout.LockoutAwareBasicAuthentication"
