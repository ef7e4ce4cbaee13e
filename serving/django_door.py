"""Django's door: every non-/v2 body is bounded before Django reads (and spools) it.

Bodies go under FERRY_MAX_FORM_BODY_BYTES, except an upload to `POST /api/models/<name>/versions/`
by an engineer, authenticated here before any body byte is read, which may carry the artifact
limit. Past its bound a body is answered 413 and not passed on. Then the front door's `metered`
counts it against the process's budget of body bytes held. This side reads sessions and users,
so it lives with the control plane, not in `serving.dataplane`.
"""

from __future__ import annotations

import base64
import logging
import re
from importlib import import_module

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model, load_backend
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import ValidationError
from django.db import InterfaceError, OperationalError
from django.http.cookie import parse_cookie
from django.utils.crypto import constant_time_compare

from serving.api.views import FORM_OVERHEAD  # the view's own allowance for the form around a file
from serving.dataplane.http import frontdoor
from serving.dataplane.http.frontdoor import App, Receive, Scope, Send, metered, send_json
from tenants.models import Role, has_role

log = logging.getLogger(__name__)

UPLOAD_ROUTE = re.compile(r"/api/models/[^/]+/versions/")  # ModelVersionViewSet's create
_TOO_LARGE = frontdoor.REFUSED.labels("too_large")
_BUDGET = frontdoor.REFUSED.labels("inflight_budget")


async def bounded(app: App, scope: Scope, receive: Receive, send: Send) -> None:
    """Django's door: bound the body before Django reads (and spools) it; then `metered`.

    An upload (POST /api/models/<name>/versions/) is the one request whose credentials are checked
    here, before its body is read: an engineer's may carry the artifact limit and gets
    FERRY_UPLOAD_READ_TIMEOUT_S to arrive; anyone else's gets the form bound like any other body.
    """
    limit = settings.FERRY_MAX_FORM_BODY_BYTES
    declared = _content_length(scope["headers"])
    error = f"request body exceeds {limit} bytes"
    if scope["method"] == "POST" and UPLOAD_ROUTE.fullmatch(scope["path"]):
        artifact_limit = settings.FERRY_MAX_ARTIFACT_BYTES + FORM_OVERHEAD
        artifact_error = f"artifact exceeds the {settings.FERRY_MAX_ARTIFACT_BYTES} byte limit"
        if declared is not None and declared > artifact_limit:
            _TOO_LARGE.inc()
            return await send_json(send, 413, artifact_error)
        try:
            engineer = await _is_engineer(scope["headers"])
        except (OperationalError, InterfaceError) as exc:  # PostgreSQL out of reach: an outage, not a bug
            log.warning(
                "checking upload credentials failed: the database is unavailable (%s)",
                str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return await send_json(send, 503, "cannot check credentials now; retry shortly", retry_after=1)
        if engineer:
            limit, error = artifact_limit, artifact_error
            extend = scope.get("ferry.extend_read_deadline")
            if extend is not None:
                extend(scope, settings.FERRY_UPLOAD_READ_TIMEOUT_S)
        else:
            error += "; a larger artifact upload needs an engineer's session or HTTP Basic credentials"
    if declared is not None:
        if declared > limit:
            _TOO_LARGE.inc()
            return await send_json(send, 413, error)
        spooled = min(declared, settings.FILE_UPLOAD_MAX_MEMORY_SIZE)
        if frontdoor.held() + spooled > settings.FERRY_MAX_INFLIGHT_BODY_BYTES:
            _BUDGET.inc()
            return await frontdoor.send_over_budget(send)
    # Django keeps a body in memory up to FILE_UPLOAD_MAX_MEMORY_SIZE and spools the rest to disk.
    await metered(app, scope, receive, send, limit, error, settings.FILE_UPLOAD_MAX_MEMORY_SIZE)


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the streaming count still bounds it
    return None


# -- who is asking (before any body byte is read) ---------------------------------------------------


async def _is_engineer(headers: list[tuple[bytes, bytes]]) -> bool:
    cookie = authorization = None
    for name, value in headers:
        if name == b"cookie":
            cookie = value if cookie is None else cookie + b"; " + value
        elif name == b"authorization":
            authorization = value
    if cookie is None and authorization is None:
        return False
    return await sync_to_async(_engineer_credentials)(cookie, authorization)


def _engineer_credentials(cookie: bytes | None, authorization: bytes | None) -> bool:
    """Whether the request's credentials are an engineer's, in DRF's order: an active session user if
    there is one, else HTTP Basic. Nothing is written (Django's own handling of the request does that)."""
    user = None
    if cookie is not None:
        key = parse_cookie(cookie.decode("latin-1")).get(settings.SESSION_COOKIE_NAME)
        if key:
            user = _session_user(key)
    if user is None and authorization is not None:
        user = _basic_user(authorization)
    return user is not None and has_role(user, Role.ENGINEER)


def _session_user(key: str):  # noqa: ANN202

    session = import_module(settings.SESSION_ENGINE).SessionStore(key)
    try:
        user_id = get_user_model()._meta.pk.to_python(session[SESSION_KEY])
        backend_path = session[BACKEND_SESSION_KEY]
    except (KeyError, ValidationError):
        return None
    if backend_path not in settings.AUTHENTICATION_BACKENDS:
        return None
    user = load_backend(backend_path).get_user(user_id)
    if user is None or not user.is_active:
        return None
    # As django.contrib.auth.get_user verifies it, against the current SECRET_KEY only: a session
    # signed under SECRET_KEY_FALLBACKS gets the form bound here until Django re-keys it.
    session_hash = session.get(HASH_SESSION_KEY)
    if not session_hash or not constant_time_compare(session_hash, user.get_session_auth_hash()):
        return None
    return user


def _basic_user(authorization: bytes):  # noqa: ANN202

    scheme, _, encoded = authorization.strip().partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        raw = base64.b64decode(encoded.strip())
    except ValueError:
        return None
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError:
        decoded = raw.decode("latin-1")
    userid, sep, password = decoded.partition(":")
    if not sep:
        return None
    # The password check alone, past django-axes' backend: this look decides only how large a body may
    # come, and is no login attempt of its own. DRF's authentication of the same request, which axes counts
    # and locks out, still decides whether it is let in (axes' backend also refuses a call without a request).
    user = ModelBackend().authenticate(None, **{get_user_model().USERNAME_FIELD: userid, "password": password})
    return user if user is not None and user.is_active else None
