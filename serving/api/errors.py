"""DRF errors as {"error": "...", "detail": {...}} with the status DRF chose; unexpected ones as 503."""

import logging

from rest_framework.response import Response
from rest_framework.views import exception_handler

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
        log.exception("unhandled API error", exc_info=exc)
        return Response({"error": "internal error; the server logged it"}, status=503)
    detail = response.data
    response.data = {"error": _flatten(detail)}
    if isinstance(detail, dict) and set(detail) != {"detail"}:
        response.data["fields"] = detail
    return response
