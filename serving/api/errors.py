"""DRF errors as {"error": "...", "fields": {...}} with the status DRF chose; the database out of reach is
a 503 with Retry-After (an outage, not a bug: the data plane keeps serving from its snapshot); anything
else unexpected is a bug: a logged, counted 500. `server_error` answers the same for Django's own views."""

import logging
import sys

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import Counter
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import exception_handler, set_rollback

from serving.dataplane.metrics.metrics import INTERNAL_ERRORS

log = logging.getLogger(__name__)

DB_UNAVAILABLE = Counter(
    "ferry_database_unavailable", "Control-plane requests answered 503 because PostgreSQL could not be reached"
)
RETRY_AFTER_S = 5
UNREACHABLE = (OperationalError, InterfaceError)


def database_unavailable(request: HttpRequest | None, exc: BaseException) -> JsonResponse:
    where = f"{request.method} {request.path}" if request is not None else "?"
    log.warning("database unavailable answering %s: %s", where, str(exc).strip().splitlines()[0] if str(exc) else exc)
    DB_UNAVAILABLE.inc()
    response = JsonResponse(
        {"error": "the database is unavailable; retry shortly (inference keeps serving)"}, status=503
    )
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response


def _flatten(detail: object) -> str:
    if isinstance(detail, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in detail.items())
    if isinstance(detail, list):
        return " ".join(_flatten(v) for v in detail)
    return str(detail)


def _parsing_json(exc: BaseException) -> bool:
    """Whether `exc` was raised while DRF's JSON parser read the body (its frame is on the traceback)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is JSONParser.parse.__code__:
            return True
        tb = tb.tb_next
    return False


def json_exception_handler(exc: Exception, context: dict) -> Response:
    response = exception_handler(exc, context)
    if response is None and isinstance(exc, UNREACHABLE):
        set_rollback()
        return database_unavailable(context.get("request"), exc)  # type: ignore[return-value]
    if response is None and isinstance(exc, RecursionError) and _parsing_json(exc):
        # A body nested thousands deep: json's decoder gives up past the interpreter's recursion limit, and DRF's
        # parser turns only ValueError into its 400. Any other RecursionError is a bug, answered as one below.
        return Response({"error": "JSON parse error - the body is nested too deeply"}, status=400)
    if response is None:
        request = context.get("request")
        where = f"{request.method} {request.path}" if request is not None else "?"
        log.error("unexpected exception answering %s", where, exc_info=exc)
        INTERNAL_ERRORS.labels("api").inc()
        set_rollback()
        return Response({"error": "internal error; the server logged it"}, status=500)
    detail = response.data
    if isinstance(detail, dict) and set(detail) == {"detail"}:
        response.data = {"error": _flatten(detail["detail"])}
    else:
        response.data = {"error": _flatten(detail)}
        if isinstance(detail, dict):
            response.data["fields"] = detail
    return response


@csrf_exempt  # there is nothing here to protect; a CSRF refusal would be an HTML 403 instead of this 404
def not_found(request: HttpRequest, *args: object, **kwargs: object) -> JsonResponse:
    """Any /api/ path no endpoint matches (a name or version outside its pattern included)."""
    return JsonResponse({"error": f"no such endpoint: {request.path}"}, status=404)


def server_error(request: HttpRequest) -> JsonResponse:
    """Django's handler500 (any view or middleware outside DRF), called while the exception is handled."""
    exc = sys.exc_info()[1]
    if isinstance(exc, UNREACHABLE):
        return database_unavailable(request, exc)
    INTERNAL_ERRORS.labels("django").inc()  # Django logged it (django.request)
    return JsonResponse({"error": "internal error; the server logged it"}, status=500)
