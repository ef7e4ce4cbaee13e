"""DRF errors as {"error": "...", "fields": {...}} with the status DRF chose; anything unexpected is a bug:
a logged, counted 500."""

import logging

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from rest_framework.response import Response
from rest_framework.views import exception_handler, set_rollback

from serving.dataplane.metrics import INTERNAL_ERRORS

log = logging.getLogger(__name__)


def _flatten(detail: object) -> str:
    if isinstance(detail, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in detail.items())
    if isinstance(detail, list):
        return " ".join(_flatten(v) for v in detail)
    return str(detail)


def json_exception_handler(exc: Exception, context: dict) -> Response:
    response = exception_handler(exc, context)
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
