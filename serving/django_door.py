"""Django's door: every non-/v2 body is bounded before Django reads (and spools) it.

Bodies go under FERRY_MAX_FORM_BODY_BYTES. The exception is an upload, `POST /api/models/<name>/versions/`,
by an engineer who may upload to that name by the view's own rule (`serving.api.views.upload_target`: a
model of a tenant where the caller is an engineer, or a new name), both checked here before any body byte
is read: it may carry the artifact limit. An engineer's upload to any other name (another tenant's model,
private, public or a platform one, a pipeline's, a name the router does not take) gets the form bound like
anyone else's, with one answer for all: its 413 tells nothing of which it is. Past its bound a body is
answered 413 and not passed on. Then the front door's `metered` counts it against the process's budget
of body bytes held. This side reads sessions, users and models, so it lives with the control plane, not
in `serving.dataplane`.
"""

from __future__ import annotations

import base64
import io
import logging
import re
from dataclasses import dataclass
from importlib import import_module

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import (
    BACKEND_SESSION_KEY,
    HASH_SESSION_KEY,
    SESSION_KEY,
    authenticate,
    get_user_model,
    load_backend,
)
from django.core.exceptions import ValidationError
from django.core.handlers.asgi import ASGIRequest
from django.db import InterfaceError, OperationalError
from django.http.cookie import parse_cookie
from django.utils.crypto import constant_time_compare
from rest_framework.exceptions import APIException

from serving.api.views import (
    FORM_OVERHEAD,  # the view's own allowance for the form around a file
    upload_target,
)
from serving.dataplane.http import frontdoor
from serving.dataplane.http.frontdoor import App, Receive, Scope, Send, metered, send_json
from serving.models import MODEL_NAME_PATTERN
from tenants.lockout import STATUS as LOCKED_OUT
from tenants.lockout import LockedOut, cool_off_seconds, scope_verdict
from tenants.models import Role, has_role

log = logging.getLogger(__name__)

UPLOAD_ROUTE = re.compile(r"/api/models/(?P<name>[^/]+)/versions/")  # ModelVersionViewSet's create
# The names its URL takes: another is the router's 404, refused here in the words of any other refusal
_MODEL_NAME = re.compile(MODEL_NAME_PATTERN)
_TOO_LARGE = frontdoor.REFUSED.labels("too_large")
_BUDGET = frontdoor.REFUSED.labels("inflight_budget")
_BODY_HEADERS = (b"content-type", b"content-length", b"transfer-encoding")


async def bounded(app: App, scope: Scope, receive: Receive, send: Send) -> None:
    """Django's door: bound the body before Django reads (and spools) it; then `metered`.

    An upload (POST /api/models/<name>/versions/) is the one request whose credentials are checked
    here, before its body is read: an engineer's to a name the view lets it upload to may carry the
    artifact limit and gets FERRY_UPLOAD_READ_TIMEOUT_S to arrive; anyone else's, and an engineer's to
    any other name, gets the form bound like any other body, with the same words whatever the name. Those
    answers tell a right HTTP Basic password from a wrong one, so the check is a login attempt that
    django-axes counts, and a locked-out login gets its 429 here, whatever the password.
    """
    limit = settings.FERRY_MAX_FORM_BODY_BYTES
    declared = _content_length(scope["headers"])
    error = f"request body exceeds {limit} bytes"
    upload = UPLOAD_ROUTE.fullmatch(scope["path"]) if scope["method"] == "POST" else None
    if upload is not None:
        artifact_limit = settings.FERRY_MAX_ARTIFACT_BYTES + FORM_OVERHEAD
        artifact_error = f"artifact exceeds the {settings.FERRY_MAX_ARTIFACT_BYTES} byte limit"
        if declared is not None and declared > artifact_limit:
            _TOO_LARGE.inc()
            return await send_json(send, 413, artifact_error)
        try:
            uploader = await _uploader(scope, upload["name"])
        except (OperationalError, InterfaceError) as exc:  # PostgreSQL out of reach: an outage, not a bug
            log.warning(
                "checking upload credentials failed: the database is unavailable (%s)",
                str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__,
            )
            return await send_json(send, 503, "cannot check credentials now; retry shortly", retry_after=1)
        if uploader.locked_out is not None:
            return await send_json(send, LOCKED_OUT, LockedOut.default_detail, retry_after=uploader.locked_out)
        if uploader.may_upload:
            limit, error = artifact_limit, artifact_error
            extend = scope.get("ferry.extend_read_deadline")
            if extend is not None:
                extend(scope, settings.FERRY_UPLOAD_READ_TIMEOUT_S)
        else:
            # One answer for every refusal: a foreign model's name must not read differently from a pipeline's.
            error += (
                "; a larger artifact upload needs an engineer's session or HTTP Basic credentials,"
                " and a model name that engineer may upload to"
            )
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


@dataclass(frozen=True, slots=True)
class Uploader:
    may_upload: bool  # an engineer who may upload to the name in the path: the artifact limit
    locked_out: int | None = None  # seconds of django-axes' cool-off left: the login is locked out


async def _uploader(scope: Scope, model_name: str) -> Uploader:
    cookie = authorization = None
    for name, value in scope["headers"]:
        if name == b"cookie":
            cookie = value if cookie is None else cookie + b"; " + value
        elif name == b"authorization":
            authorization = value
    if cookie is None and authorization is None:
        return Uploader(may_upload=False)
    return await sync_to_async(_engineer_credentials)(scope, model_name, cookie, authorization)


def _engineer_credentials(scope: Scope, model_name: str, cookie: bytes | None, authorization: bytes | None) -> Uploader:
    """Whether the request's credentials are an engineer's who may upload to `model_name`. The credentials in
    DRF's order: an active session user if there is one, else HTTP Basic; the name by the view's rule
    (`upload_target`). Nothing is written but django-axes' record of a wrong password."""
    user = None
    if cookie is not None:
        key = parse_cookie(cookie.decode("latin-1")).get(settings.SESSION_COOKIE_NAME)
        if key:
            user = _session_user(key)
    if user is None and authorization is not None:
        # The request axes records the attempt from (address, path): without the body's headers, so that
        # reading its form (axes keeps the POST data of a failed login) finds nothing to parse.
        bodiless = [(name, value) for name, value in scope["headers"] if name not in _BODY_HEADERS]
        request = ASGIRequest({**scope, "headers": bodiless}, io.BytesIO())
        user = _basic_user(request, authorization)
        scope_verdict(scope, authorization, user)
        if getattr(request, "axes_locked_out", False):
            return Uploader(may_upload=False, locked_out=cool_off_seconds(request) or 1)
    if user is None or not has_role(user, Role.ENGINEER) or not _MODEL_NAME.fullmatch(model_name):
        return Uploader(may_upload=False)
    try:
        upload_target(user, model_name)
    except APIException:  # the view would refuse it (409, 403) once the body was read: not the artifact limit
        return Uploader(may_upload=False)
    return Uploader(may_upload=True)


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


def _basic_user(request: ASGIRequest, authorization: bytes):  # noqa: ANN202

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
    # A login attempt like any other, through django-axes' backend: the answer here (413 before the body,
    # or the longer read deadline) tells a right password from a wrong one, so a wrong one is counted and a
    # locked-out login is refused. DRF's authentication of the same request reuses this verdict
    # (tenants.lockout.DOOR_VERDICT) instead of counting the attempt twice.
    user = authenticate(request, **{get_user_model().USERNAME_FIELD: userid, "password": password})
    return user if user is not None and user.is_active else None
