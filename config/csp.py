"""The Content-Security-Policy of every HTML page Django answers (the console, the admin, the login page, DRF's
browsable API), unless the view set one of its own (the API docs' pages: serving.api.docs).

Scripts only from this server's files, never inline (the console's are static/ferry/*.js): HTML that reaches a
page from the server (the fleet page's WebSocket puts it into innerHTML; SVG figures are built as markup) cannot
run a script or an event handler, whatever it holds. Inline styles stay allowed: the console's figures and the
admin set style attributes, and a style cannot run code. Connections (fetch, the fleet WebSocket) to this origin
only; no plugins, no <base>, no framing, forms posted here only. Django 6 has this built in; Django 5.2 does not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from asgiref.sync import iscoroutinefunction
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponseBase
from django.utils.decorators import sync_and_async_middleware

HEADER = "Content-Security-Policy"
POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'{websocket}; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)


def policy(request: HttpRequest) -> str:
    """The policy for `request`'s page: its WebSocket origin named as well ('self' covers ws: and wss: only in
    browsers that follow CSP Level 3)."""
    try:
        host = request.get_host()
    except DisallowedHost:  # this answer is the 400 for that very host: no socket to allow
        return POLICY.format(websocket="")
    return POLICY.format(websocket=f" {'wss' if request.is_secure() else 'ws'}://{host}")


def _apply(request: HttpRequest, response: HttpResponseBase) -> None:
    if HEADER not in response and response.get("Content-Type", "").startswith("text/html"):
        response[HEADER] = policy(request)


@sync_and_async_middleware
def content_security_policy(
    get_response: Callable[[HttpRequest], HttpResponseBase | Awaitable[HttpResponseBase]],
) -> Callable:
    if iscoroutinefunction(get_response):

        async def middleware_async(request: HttpRequest) -> HttpResponseBase:
            response = await get_response(request)  # type: ignore[misc]
            _apply(request, response)
            return response

        return middleware_async

    def middleware(request: HttpRequest) -> HttpResponseBase:
        response = get_response(request)
        _apply(request, response)  # type: ignore[arg-type]
        return response  # type: ignore[return-value]

    return middleware
