"""Open Inference Protocol over a WebSocket: /ws/v2/models/{name}[/versions/{v}]/infer (docs/websocket.md).

One connection carries many requests to one model. Each message is one OIP inference request with an `id`:
a text frame holds its JSON; a binary frame holds the binary tensor extension's body behind a 4-byte
big-endian length of its JSON header (the HTTP header Inference-Header-Content-Length, carried in the
frame). Answers come back by `id`, in the order they finish. Each message goes through the very handler a
REST POST takes (`InferenceRequest.answer`): key, shedding, quota, routing, admission, deadline, metrics and
usage are REST's, not a copy of them.

The key comes in the `Sec-WebSocket-Protocol` header (`ferry.v2, ferry.key.<key>`; the server answers
`ferry.v2`, never the key) or in the first message (`{"authorization": "Bearer <key>"}`), never in the URL:
a query string is refused. There is no Origin check: the key is never ambient (no cookie or session reaches
this consumer), so a page elsewhere can use it only if it already holds the key.

Bounds per connection (config/settings.py, "WebSocket inference"): messages and bytes in flight, with the
socket left unread while at either (the ASGI server then stops reading it: a fast sender is slowed by TCP,
not buffered); the bytes held, also charged to the process's budget of body bytes shared with HTTP: a
request's until its answer is computed, then its answer's until the socket has taken it; each message's size
(FERRY_MAX_INFER_BODY_BYTES, a binary frame's 4-byte length aside: a larger one closes the connection 1009);
the first message's size, where it carries the key (frontdoor.FIRST_MESSAGE_BYTES, refused unread), and its
wait (KEY_WAIT_S); each send's wait for the socket to take it (FERRY_BODY_TIMEOUT_S: past it the connection is
dropped); the idle time. A refusal of the connection closes it with 4000 + the HTTP status after a JSON error
frame; a refusal of one message answers that message and keeps the connection.

A connection is to a model or a pipeline (`serving.dataplane.gateway.pipeline`): REST's handler serves both at
the same path, so a pipeline's messages are admitted, charged to the quota and given their deadline as its REST
calls are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from channels.consumer import AsyncConsumer
from django.conf import settings
from prometheus_client import Counter, Gauge

from serving.dataplane import plane as dataplane
from serving.dataplane.errors import ServingError
from serving.dataplane.gateway.auth import authenticate
from serving.dataplane.gateway.pipeline import runner_for as pipeline_runner
from serving.dataplane.http import frontdoor, protocol
from serving.dataplane.http.consumers import InferenceRequest

log = logging.getLogger(__name__)

PATH = re.compile(r"/ws(/v2/models/[^/]+(?:/versions/[^/]+)?/infer)/?")
SUBPROTOCOL = "ferry.v2"  # what the server accepts, and the only subprotocol it ever answers with
KEY_SUBPROTOCOL = "ferry.key."  # + the key: how a client that can set no other header sends it
LENGTH = struct.Struct(">I")  # a binary frame's JSON header length, before the header
CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's reason fits in 125 bytes with its code
JSON_HEADERS = [(b"content-type", b"application/json")]
TOO_BIG = 1009  # RFC 6455's close code for a message too big to process, as the WebSocket layer closes with
# How long a connection without a key in its handshake may take to send the key's message: as long as an idle
# HTTP connection may take to send its next request (uvicorn's timeout_keep_alive, which `uvicorn_config`
# leaves at 5 s). Such a socket holds a slot of FERRY_MAX_CONCURRENCY before anything says whose it is.
KEY_WAIT_S = 5.0
CARRIED = (b"traceparent", b"tracestate", b"host")  # the handshake's headers each message's request carries


@dataclass(slots=True)
class Stats:
    """This process's WebSocket inference, for its gauges and the tests (one event loop touches it)."""

    connections: int = 0
    in_flight: int = 0  # messages taken and not yet answered, all connections
    held_bytes: int = 0  # of those, the bytes held: a request's until it is answered, then its answer's until sent
    peak_in_flight: int = 0  # the most of one connection at once (tests reset it)
    peak_held_bytes: int = 0
    read_stalls: int = 0  # times a connection stopped reading at its bound


STATS = Stats()
Gauge("ferry_ws_connections", "Open WebSocket inference connections").set_function(lambda: STATS.connections)
Gauge("ferry_ws_inflight_messages", "WebSocket inference messages taken and not yet answered").set_function(
    lambda: STATS.in_flight
)
Gauge(
    "ferry_ws_inflight_bytes",
    "Bytes held for WebSocket inference messages: requests not yet answered, answers not yet sent",
).set_function(lambda: STATS.held_bytes)
# A Counter (ferry_ws_read_stalls_total), not a gauge of STATS' count: rate() reads it, and under several web
# processes each process's count is summed into the family's total, even once that process is gone.
READ_STALLS = Counter(
    "ferry_ws_read_stalls", "Times a WebSocket inference connection stopped reading at its in-flight bound"
)
MESSAGES = Counter("ferry_ws_messages", "WebSocket inference messages taken, by frame", ["frame"])
TEXT_MESSAGES, BINARY_MESSAGES = MESSAGES.labels("text"), MESSAGES.labels("binary")  # bound once, not per message
CLOSES = Counter("ferry_ws_closes", "WebSocket inference connections closed by the server, by close code", ["code"])


class BadMessage(ServingError):
    """A message that is no request this endpoint can take (400, or `status`); `id` when it had one."""

    def __init__(self, message: str, rid: object = None, status: int = 400) -> None:
        super().__init__(message, status=status)
        self.rid = rid


@dataclass(slots=True, frozen=True)
class Bounds:
    max_in_flight: int
    max_in_flight_bytes: int
    max_message: int
    idle_s: float
    auth_s: float  # for the first message, when the key is to come in it (KEY_WAIT_S)
    send_s: float  # for the socket to take one frame: a client that stops reading is dropped past it

    @classmethod
    def from_settings(cls) -> Bounds:
        return cls(
            settings.FERRY_WS_MAX_IN_FLIGHT,
            settings.FERRY_WS_MAX_IN_FLIGHT_BYTES,
            settings.FERRY_MAX_INFER_BODY_BYTES,
            float(settings.FERRY_WS_IDLE_S),
            KEY_WAIT_S,
            float(settings.FERRY_BODY_TIMEOUT_S),  # a stalled download frees its slot as a stalled upload does
        )


def parse_message(message: bytes, binary: bool) -> tuple[str, bytes, int | None]:
    """(id, the request's body as REST takes it, its JSON header length or None) of one message: a text
    frame's bytes (`binary` False) or a binary frame's."""
    if not binary:
        body = message
        header: bytes | memoryview = body
        length = None
    else:
        if len(message) < LENGTH.size:
            raise BadMessage(f"a binary message starts with its JSON header's length ({LENGTH.size} bytes)")
        (length,) = LENGTH.unpack_from(message)
        body = message[LENGTH.size :]
        if length > len(body):
            raise BadMessage(f"JSON header length {length} is outside the message's {len(body)} bytes")
        header = memoryview(body)[:length]
    try:
        request = protocol.load_header(header)  # as REST reads it: tritonclient's NaN and Infinity included
    except protocol.ProtocolError as exc:
        raise BadMessage(str(exc)) from None
    rid = request.get("id") if isinstance(request, dict) else None
    if not isinstance(rid, str) or not rid:
        raise BadMessage("each message is an inference request with an 'id' (a non-empty string)", rid)
    return rid, body, length


def error_frame(rid: object, status: int, message: str, retry_after: float | None = None) -> str:
    """An error answer: OIP's {"error": ...} with the request's id and the HTTP-equivalent status."""
    answer: dict = {"id": rid if isinstance(rid, str) else None, "status": status, "error": message}
    if retry_after is not None:
        answer["retry_after"] = retry_after
    return orjson.dumps(answer).decode()


class InferenceSocket(AsyncConsumer):
    """The WebSocket inference consumer. Like `consumers.InferenceConsumer`, it runs its own receive loop
    instead of Channels' dispatch: no channel on the channel layer (nothing is ever sent to a connection
    from elsewhere), and a loop that can stop reading while the connection is at its bound."""

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        self.scope = scope
        self.channel_layer = None
        self.base_send = send
        self.bounds = Bounds.from_settings()
        self.closed = False  # the connection is gone, or closing: queued requests of it are dropped (499)
        self.aborted = False  # dropped by this server (a send waited past its deadline)
        self.tasks: set[asyncio.Task] = set()
        self.ids: set[str] = set()
        self.held = 0  # bytes held for this connection's messages in flight: requests, then answers until sent
        self.room = asyncio.Event()  # set when a request of this connection finishes
        self.last = time.monotonic()  # the last message taken
        self.timer: asyncio.TimerHandle | None = None
        self.closing: asyncio.Task | None = None
        client = scope.get("client")
        self.client = client[0] if client else None
        if (await receive())["type"] != "websocket.connect":
            return
        headers = dict(reversed(scope.get("headers", [])))
        self.routing_key = headers.get(b"x-ferry-routing-key")
        # The handshake's trace context (and Host, for the span's server.address): each message's span is the
        # child of the caller's span that opened the connection, not a trace of its own.
        self.carried = {name: headers[name] for name in CARRIED if name in headers}
        refused = self._handshake()
        if refused is not None:
            await self._deny(*refused)
            return
        if self.authorization is None and (bound := scope.get("ferry.bound_first_message")) is not None:
            bound()  # the key's message is refused unread past FIRST_MESSAGE_BYTES (the front door's protocol)
        await send({"type": "websocket.accept", "subprotocol": SUBPROTOCOL if self.offered else None})
        STATS.connections += 1
        try:
            self._arm(self.bounds.auth_s if self.authorization is None else self.bounds.idle_s)
            if self.authorization is None and not await self._first_message(receive):
                return
            await self._serve(receive)
        finally:
            self.closed = True
            if self.timer is not None:
                self.timer.cancel()
            # Requests still running finish within their deadline (queued ones are dropped as their client's
            # gone): their bytes are discharged and their usage recorded as for a REST client that left.
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            STATS.connections -= 1

    # -- the handshake ------------------------------------------------------------------------------

    def _handshake(self) -> tuple[int, str] | None:
        """Set up the connection from its request; (status, message) when it is refused."""
        scope = self.scope
        match = PATH.fullmatch(scope["path"])
        if match is None:
            return 404, "no such endpoint; WebSocket inference is /ws/v2/models/{name}[/versions/{v}]/infer"
        self.infer_path = match.group(1)
        self.model = self.infer_path.split("/")[3]
        if scope.get("query_string"):
            return 400, (
                "this endpoint takes no query string: send the API key in the first message or the"
                " Sec-WebSocket-Protocol header, never in the URL"
            )
        offered = scope.get("subprotocols") or []
        keys = [p[len(KEY_SUBPROTOCOL) :] for p in offered if p.startswith(KEY_SUBPROTOCOL)]
        self.offered = SUBPROTOCOL in offered
        if keys and not self.offered:
            return 400, f"a key in Sec-WebSocket-Protocol comes with the subprotocol '{SUBPROTOCOL}'"
        if len(keys) > 1:
            return 400, "one key per connection"
        self.authorization = b"Bearer " + keys[0].encode("latin-1") if keys else None
        if self.authorization is None:
            return None
        try:
            self._authorize()
        except ServingError as exc:
            return exc.status, exc.message
        return None

    def _authorize(self) -> None:
        """The connection's key may infer, and its tenant may see the model or pipeline: the checks every
        message repeats (a key revoked later is refused at its next message), here to refuse a connection
        early. One the tenant may not see is refused as an unknown model."""
        plane = dataplane.current()
        if plane is None:
            raise ServingError("the data plane is starting", status=503, retry_after=1)
        gateway = plane.gateway
        caller = authenticate(self.authorization, gateway.snapshot, plane.pepper, time.time())
        caller.require("infer")
        if pipeline_runner(gateway).find(self.model, caller.tenant_id) is None:
            gateway.model(self.model, caller.tenant_id)

    async def _deny(self, status: int, message: str) -> None:
        """Refuse the handshake: an HTTP answer with the JSON error where the server can send one (the ASGI
        "websocket.http.response" extension), else the plain 403 every ASGI server answers a close with."""
        CLOSES.labels(str(4000 + status)).inc()
        if "websocket.http.response" not in self.scope.get("extensions", {}):
            await self.base_send({"type": "websocket.close", "code": 4000 + status})
            return
        body = orjson.dumps({"error": message})
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await self.base_send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await self.base_send({"type": "websocket.http.response.body", "body": body})

    async def _first_message(self, receive: Callable[[], Awaitable[dict]]) -> bool:
        """Take the key from the first message; False (the connection closed) when it is not one."""
        message = await receive()
        if message["type"] != "websocket.receive":
            return False
        text = message.get("text")
        try:
            first = orjson.loads(text) if text is not None and len(text) <= frontdoor.FIRST_MESSAGE_BYTES else None
        except orjson.JSONDecodeError:
            first = None
        value = first.get("authorization") if isinstance(first, dict) and len(first) == 1 else None
        if not isinstance(value, str):
            await self._close(
                400, 'without a key in Sec-WebSocket-Protocol, the first message is {"authorization": "Bearer …"}'
            )
            return False
        self.authorization = value.encode("latin-1", "replace")
        try:
            self._authorize()
        except ServingError as exc:
            await self._close(exc.status, exc.message)
            return False
        self.last = time.monotonic()
        return True

    # -- the requests -------------------------------------------------------------------------------

    async def _serve(self, receive: Callable[[], Awaitable[dict]]) -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                return
            if kind != "websocket.receive" or self.closed:
                continue
            self.last = time.monotonic()
            text = message.get("text")
            try:
                if text is not None:
                    TEXT_MESSAGES.inc()
                    await self._take(text.encode(), False)
                else:
                    BINARY_MESSAGES.inc()
                    await self._take(message.get("bytes") or b"", True)
            except OSError:  # the client went, or was dropped, while a refusal was on its way
                self.closed = True
                return

    async def _take(self, message: bytes, binary: bool) -> None:
        """Start one request, after waiting for room on this connection: until there is, this coroutine
        holds the receive loop, so the socket is not read (the server's read buffer is one message)."""
        bounds = self.bounds
        size = len(message)
        if size - (LENGTH.size if binary else 0) > bounds.max_message:
            await self._too_big(message, binary)
            return
        try:
            rid, body, length = parse_message(message, binary)
            if rid in self.ids:
                raise BadMessage(f"id {rid!r} is already in flight on this connection", rid, 409)
        except BadMessage as exc:
            await self._send_text(error_frame(exc.rid, exc.status, exc.message))
            return
        if self.tasks and (len(self.tasks) >= bounds.max_in_flight or self.held + size > bounds.max_in_flight_bytes):
            STATS.read_stalls += 1
            READ_STALLS.inc()
            while self.tasks and (
                len(self.tasks) >= bounds.max_in_flight or self.held + size > bounds.max_in_flight_bytes
            ):
                self.room.clear()
                await self.room.wait()
            if self.closed:
                return
        if not frontdoor.charge(size):  # the process's budget of body bytes held, shared with HTTP
            await self._send_text(error_frame(rid, 503, "server holds its budget of bytes of requests", 1))
            return
        self.ids.add(rid)
        self.held += size
        STATS.in_flight += 1
        STATS.held_bytes += size
        STATS.peak_in_flight = max(STATS.peak_in_flight, len(self.tasks) + 1)
        STATS.peak_held_bytes = max(STATS.peak_held_bytes, self.held)
        task = asyncio.get_running_loop().create_task(self._run(rid, body, length, size, time.monotonic()))
        self.tasks.add(task)

    async def _run(self, rid: str, body: bytes, length: int | None, size: int, taken: float) -> None:
        """Answer one request through REST's handler. It is in flight until its answer is written; it holds
        bytes (on this connection and in the process's budget) until then: its request's until its answer is
        computed, then its answer's, which a client slow to read keeps in this process as long."""
        held = size
        try:
            headers = {**self.carried, b"authorization": self.authorization}
            if length is not None:
                headers[b"inference-header-content-length"] = str(length).encode()
            if self.routing_key is not None:
                headers[b"x-ferry-routing-key"] = self.routing_key
            request = InferenceRequest(
                "POST", self.infer_path, headers, time.monotonic() - taken, self._gone, self.client, websocket=True
            )
            answer = await request.answer(body, infer=True)
            del body
            if answer is None or self.closed:
                return  # the connection went away while it ran
            status, answer_headers, _, payload = answer
            del answer
            if status == 200:
                split = _header_length(answer_headers)
                frame: str | bytes = payload.decode() if split is None else LENGTH.pack(split) + payload
                out = len(payload) + (0 if split is None else LENGTH.size)
                del payload  # the frame alone is held from here
                if not self._hold(held, out):  # the process's budget has no room for the answer until it is sent
                    held = 0
                    await self._send_text(error_frame(rid, 503, "server holds its budget of bytes of messages", 1))
                    return
                held = out
                await (self._send_text(frame) if isinstance(frame, str) else self._send_bytes(frame))
                return
            self._release(held)  # an error's frame is a few bytes
            held = 0
            message = orjson.loads(payload).get("error", "")
            retry = next((float(v) for k, v in answer_headers if k == b"retry-after"), None)
            await self._send_text(error_frame(rid, status, message, retry))
            if status in (401, 403):  # the key was revoked, expired or lost its scope since the connection began
                await self._close(status, message)
        except OSError:  # uvicorn's ClientDisconnected: the client went while its answer was on its way
            self.closed = True
        except Exception:  # a bug here, not in the request (its handler answers those): logged, answered 500
            log.exception("answering WebSocket message %r on %s", rid, self.infer_path)
            with contextlib.suppress(OSError):
                await self._send_text(error_frame(rid, 500, "internal error; the server logged it"))
        finally:
            if held:
                self._release(held)
            self.tasks.discard(asyncio.current_task())  # type: ignore[arg-type]
            self.ids.discard(rid)
            STATS.in_flight -= 1
            self.last = time.monotonic()
            self.room.set()

    def _release(self, size: int) -> None:
        """Give back a message's bytes: this connection's and the process's budget."""
        self.held -= size
        STATS.held_bytes -= size
        frontdoor.discharge(size)
        self.room.set()

    def _hold(self, held: int, out: int) -> bool:
        """Hold `out` bytes of an answer in place of the `held` of its request, on this connection and in the
        process's budget; False, all of them given back, where the budget has no room for the more it needs."""
        if out <= held:
            self._release(held - out)
            return True
        if not frontdoor.charge(out - held):
            self._release(held)
            return False
        self.held += out - held
        STATS.held_bytes += out - held
        STATS.peak_held_bytes = max(STATS.peak_held_bytes, self.held)
        return True

    def _gone(self) -> bool:
        return self.closed

    # -- sending and closing ------------------------------------------------------------------------

    async def _send_text(self, text: str) -> None:
        await self._send({"type": "websocket.send", "text": text})

    async def _send_bytes(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def _send(self, message: dict) -> None:
        """Send one message, waiting at most `send_s` for the socket to take it (the server's send waits while
        the socket's write buffer is over its high-water mark, that is while the client reads nothing): past
        that the connection is dropped, and ConnectionAbortedError raised, an OSError as a client's going is."""
        if self.aborted:
            raise ConnectionAbortedError("the connection was dropped")
        try:
            async with asyncio.timeout(self.bounds.send_s):
                await self.base_send(message)
        except TimeoutError:
            self._abort()
            raise ConnectionAbortedError(f"the client took no data for {self.bounds.send_s:g} s") from None

    def _abort(self) -> None:
        """Drop the connection without a closing handshake (its close frame would wait behind the answers the
        client does not read): the receive loop then sees it go, and the sends waiting on it fail at once."""
        if self.aborted:
            return
        self.aborted = self.closed = True
        CLOSES.labels("1006").inc()
        abort = self.scope.get("ferry.abort")
        if abort is not None:  # the front door's protocol (frontdoor.FrontDoorWebSocket); another server keeps it
            abort()

    async def _too_big(self, message: bytes, binary: bool) -> None:
        """Refuse a message over the connection's bound as the WebSocket layer refuses a larger one unread:
        close 1009. This one was read (within the layer's bound, which is the process's bound and a binary
        frame's length; or past a bound lowered since the connection opened), so its error frame says its
        `id` where the message has a readable one, for a client to tell which request was refused."""
        try:
            rid: object = parse_message(message, binary)[0]
        except BadMessage as exc:
            rid = exc.rid
        del message
        said = f"message exceeds {self.bounds.max_message} bytes"
        await self._close(413, said, rid=rid, code=TOO_BIG)

    async def _close(self, status: int, message: str, rid: object = None, code: int | None = None) -> None:
        """Close the connection with `code` (else 4000 + `status`), after a JSON error frame that says why,
        with the id `rid` of the message refused, where one was."""
        if self.closed:
            return
        self.closed = True
        code = 4000 + status if code is None else code
        CLOSES.labels(str(code)).inc()
        try:
            await self._send_text(error_frame(rid, status, message))
            reason = message.encode()[:CLOSE_REASON_BYTES].decode("utf-8", "ignore")
            await self._send({"type": "websocket.close", "code": code, "reason": reason})
        except OSError:  # noqa: S110  # the client went first, or took nothing and was dropped
            pass

    def _arm(self, delay: float) -> None:
        self.timer = asyncio.get_running_loop().call_later(delay, self._check_idle)

    def _check_idle(self) -> None:
        """The idle timer: close a connection that has had nothing in flight and sent nothing for its idle
        time (or, before its key, for KEY_WAIT_S). One timer per connection, re-armed here, not per
        message. A message in flight ends within its deadline and `send_s` (its answer's send is bounded), so
        a connection re-arms it only while it has work, never for a client that stopped reading."""
        if self.closed:
            return
        limit = self.bounds.idle_s if self.authorization is not None else self.bounds.auth_s
        left = self.last + limit - time.monotonic()
        if self.tasks or left > 0:
            self._arm(max(left, 0.05) if not self.tasks else limit)
            return
        what = "sent nothing" if self.authorization is not None else "sent no key"
        self.closing = asyncio.get_running_loop().create_task(self._close(408, f"idle: {what} for {limit:g} s"))


def _header_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"inference-header-content-length":
            return int(value)
    return None
