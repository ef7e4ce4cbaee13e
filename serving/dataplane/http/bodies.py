"""Request bodies: the bounds every body meets and the process's budget of body bytes held.

`metered`, an ASGI wrapper that counts every body against a process-wide budget of body bytes held
(FERRY_MAX_INFLIGHT_BODY_BYTES, 503 past it) and can bound one body. Django's door
(`serving.django_door.bounded`, which reads sessions and users) wraps it for every non-/v2 route; the
front door's lane, the inference consumer, the inference socket and gRPC charge the same budget with
`charge` and `discharge`. `LIMITS` holds the settings the inference path reads per request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from django.conf import settings
from django.core.signals import setting_changed
from prometheus_client import Counter, Gauge

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

REFUSED = Counter("ferry_frontdoor_refusals", "Requests the front door answered itself, by reason", ["reason"])
_TOO_LARGE = REFUSED.labels("too_large")
_BUDGET = REFUSED.labels("inflight_budget")

DISCONNECT = {"type": "http.disconnect"}


def json_head(status: int, body: bytes, retry_after: int | None = None) -> dict:
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


async def send_json(send: Send, status: int, message: str, retry_after: int | None = None) -> None:
    """Answer {"error": message} and close the connection (a refused body is not read to its end)."""
    body = orjson.dumps({"error": message})
    await send(json_head(status, body, retry_after))
    await send({"type": "http.response.body", "body": body})


# -- settings read per request ------------------------------------------------------------------


class Limits:
    """The settings the inference path reads on every request, copied out of Django's lazy settings
    (each of whose attribute reads is a Python-level call); reloaded when a setting changes."""

    def __init__(self) -> None:
        self.load()

    def load(self, **_: object) -> None:
        self.inflight_budget: int = settings.FERRY_MAX_INFLIGHT_BODY_BYTES
        self.max_infer_body: int = settings.FERRY_MAX_INFER_BODY_BYTES
        self.max_loop_lag_ms: float = settings.FERRY_MAX_LOOP_LAG_MS
        self.max_frontend_wait_ms: float = settings.FERRY_MAX_FRONTEND_WAIT_MS
        self.body_timeout: float = settings.FERRY_BODY_TIMEOUT_S


LIMITS = Limits()
setting_changed.connect(LIMITS.load)  # tests change settings; a server's stay as started


# -- body bounds and the in-flight budget (ASGI) ---------------------------------------------------

_inflight = 0  # body bytes held by requests in progress, process-wide (one event loop touches it)
Gauge("ferry_frontdoor_inflight_body_bytes", "Request body bytes held by requests in progress").set_function(
    lambda: _inflight
)


def charge(nbytes: int) -> bool:
    """Count `nbytes` more of request body held; False (and nothing counted) past the budget."""
    global _inflight
    if _inflight + nbytes > LIMITS.inflight_budget:
        _BUDGET.inc()
        return False
    _inflight += nbytes
    return True


def discharge(nbytes: int) -> None:
    global _inflight
    _inflight -= nbytes


async def metered(
    app: App,
    scope: Scope,
    receive: Receive,
    send: Send,
    limit: int | None = None,
    limit_error: str = "",
    charge_cap: int | None = None,
) -> None:
    """Run `app` with its body counted against FERRY_MAX_INFLIGHT_BODY_BYTES until it finishes.

    Each request is charged the bytes it received, or at most `charge_cap` (what its app keeps in
    memory). A chunk that takes the body past `limit` (413) or the process past its budget (503 +
    Retry-After) is not passed on: the answer is sent unless the app began one, and the app's
    receive() says http.disconnect from then on.
    """
    global _inflight
    held = 0
    charged = 0
    refused = False
    started = False

    async def counted_receive() -> dict:
        global _inflight
        nonlocal held, charged, refused, started
        if refused:
            return DISCONNECT
        message = await receive()
        body = message.get("body")
        if body:
            held += len(body)
            charge = held if charge_cap is None or held < charge_cap else charge_cap
            _inflight += charge - charged
            charged = charge
            if limit is not None and held > limit:
                refused = True
                _TOO_LARGE.inc()
                if not started:
                    started = True
                    await send_json(send, 413, limit_error)
                return DISCONNECT
            if _inflight > settings.FERRY_MAX_INFLIGHT_BODY_BYTES:
                refused = True
                _BUDGET.inc()
                if not started:
                    started = True
                    await send_over_budget(send)
                return DISCONNECT
        return message

    async def tracked_send(message: dict) -> None:
        nonlocal started
        if refused:
            return
        started = True
        await send(message)

    try:
        await app(scope, counted_receive, tracked_send)
    finally:
        _inflight -= charged


async def send_over_budget(send: Send) -> None:
    budget = settings.FERRY_MAX_INFLIGHT_BODY_BYTES
    await send_json(send, 503, f"server holds {budget} bytes of request bodies; retry shortly", retry_after=1)


def held() -> int:
    """Body bytes held by requests in progress in this process."""
    return _inflight
