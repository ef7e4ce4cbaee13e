"""The front door: what every HTTP request passes before Django or the inference consumer sees it.

Two layers, both built for the hot path (no task per request; at most one timer per connection):

- `FrontDoorProtocol`, uvicorn's httptools protocol with a whole-request read deadline
  (FERRY_REQUEST_READ_TIMEOUT_S, from the request's first byte until its body is complete; a new
  connection that sends nothing gets the same time) answered 408 JSON, and uvicorn's concurrency
  limit answered as 503 JSON with Retry-After instead of text. It stamps `scope["ferry.first_byte"]`
  (time.monotonic() when the request's first byte reached this machine: `_ReceivedAt`) and puts a hook in
  `scope["ferry.extend_read_deadline"]`, which Django's door uses for an engineer's upload.
- the inference lane (`Lane`): a plain inference POST answered by the protocol with the app's
  handler, without ASGI (docs/decisions/0002-a-lean-request-path.md).

`FrontDoorWebSocket` is uvicorn's websockets-sansio protocol with a bound on a connection's first message
and a way to drop a connection at once, both for the inference socket (serving.dataplane.http.websocket).

The bounds on bodies and the process's budget of body bytes are `serving.dataplane.http.bodies`; the
shed controller is `serving.policies.shedding`.

`uvicorn_config` is the one place a server is configured: `manage.py serve` and the tests use it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

import httptools
import orjson
import uvicorn
from django.conf import settings
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame, Opcode
from websockets.server import ServerProtocol

# Bodies are their own module; its names are re-exported here for the callers that know them as the front
# door's (the consumer, the inference socket, gRPC and Django's door).
from serving.dataplane.http.bodies import (  # noqa: F401
    _TOO_LARGE,
    LIMITS,
    REFUSED,
    App,
    Receive,
    Scope,
    Send,
    charge,
    discharge,
    held,
    metered,
    send_json,
    send_over_budget,
)
from serving.policies.shedding import ShedGate

log = logging.getLogger(__name__)

# Linux's struct tcp_info: `tcpi_last_data_recv`, the milliseconds since the kernel received the connection's
# last data segment, is the u32 at byte 52 (8 one-byte fields, then 11 u32s).
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCP_INFO_LEN = 104
_LAST_DATA_RECV = struct.Struct("=I")
_LAST_DATA_RECV_AT = 52


class _ReceivedAt:
    """When the bytes being read now reached this machine, on time.monotonic()'s clock.

    A request's deadline counts from its first byte, but a process that is behind reads late: a new
    connection waits in the listen queue until the loop accepts it, and its request, or one on a keep-alive
    connection, waits in the socket's buffer until the loop reads it. No clock of this process sees that
    wait, and it is the one that grows under overload. The kernel does: it stamps each data segment it
    receives, and TCP_INFO says how long ago the last one came (in ms, to the kernel's tick: 4 ms at 250 Hz;
    about a microsecond to ask). So the wait counts against the request's deadline and the front end's bound
    on it (FERRY_MAX_FRONTEND_WAIT_MS), as its client sees it. Elsewhere (a Unix socket, another OS) the read
    time is the best there is."""

    __slots__ = ("sock",)

    def __init__(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.sock = None
        if _TCP_INFO is not None and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                if len(sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)) >= _LAST_DATA_RECV_AT + 4:
                    self.sock = sock
            except OSError:
                pass

    def __call__(self, now: float, limit: float) -> float:
        """`now`, less how long the kernel has held what is being read (at most `limit` seconds)."""
        sock = self.sock
        if sock is None:
            return now
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
        except OSError:  # the connection is going away
            return now
        return now - min(_LAST_DATA_RECV.unpack_from(info, _LAST_DATA_RECV_AT)[0] / 1000.0, limit)


_READ_TIMEOUT = REFUSED.labels("read_timeout")
_CONCURRENCY = REFUSED.labels("concurrency")
# Past the connection/task limit these are still served (Kubernetes restarts a pod whose liveness probe fails,
# and takes one out of its Service whose readiness does): each is answered from memory, at once.
PROBES = frozenset((b"/v2/health/live", b"/v2/health/ready"))


class FrontDoorGate(ShedGate):
    """The shed controller (serving.policies.shedding, steered by the data plane's lag ticker) with what
    the protocol needs to refuse inference itself, before an ASGI task, a consumer or a route lookup is
    spent on it: the answer's bytes, and `count`, which counts a refusal under its model."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Callable[[bytes], None] = lambda url: None
        self._rendered: tuple[str, bytes, bytes] = ("", b"", b"")

    def answer(self, keep_alive: bool, reason: str = "") -> bytes:
        """The 503 for a refused request, with or without `connection: close`: for the gate's own reason
        (rendered once per reason) or for `reason`, one request's (rendered for it)."""
        if reason:
            return self._render(reason)[0 if keep_alive else 1]
        rendered, keep, closing = self._rendered
        if rendered != self.reason or not keep:
            keep, closing = self._render(self.reason)
            self._rendered = (self.reason, keep, closing)
        return keep if keep_alive else closing

    @staticmethod
    def _render(reason: str) -> tuple[bytes, bytes]:
        body = orjson.dumps({"error": f"server saturated: {reason}"})
        head = (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
        )
        return head + b"\r\n" + body, head + b"connection: close\r\n\r\n" + body


GATE = FrontDoorGate()

# -- the protocol --------------------------------------------------------------------------------


async def over_capacity(scope: Scope, receive: Receive, send: Send) -> None:
    """What a request gets while the process holds its connection/task limit (uvicorn's limit_concurrency)."""
    _CONCURRENCY.inc()
    await send_json(send, 503, "server at its connection limit; retry shortly", retry_after=1)


class FrontDoorProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a read deadline per request and a JSON concurrency answer.

    The deadline: a request's head and body must arrive within FERRY_REQUEST_READ_TIMEOUT_S of its
    first byte (a new connection gets as long for its first byte). When it passes, the request is
    answered 408 if no response has begun, its app sees http.disconnect, and the connection is
    closed. A request costs a clock read and a few attribute stores: each connection has at most one
    loop timer, which on firing re-arms itself for the current request's deadline if that is later
    (so keep-alive traffic re-arms about once per deadline period, not once per request).
    """

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # uvicorn infers "access log on" from the access logger having handlers, which a test's log capture or
        # an embedding application may give it; access_log=False (uvicorn_config's) means off.
        self.access_log = self.access_log and config.access_log
        # uvicorn's own check would answer text/plain; on_headers_complete applies the same limit.
        self.max_concurrency, self.limit_concurrency = self.limit_concurrency, None
        self.read_timeout: float = settings.FERRY_REQUEST_READ_TIMEOUT_S
        self.read_deadline_s = self.read_timeout  # the current request's allowance, once extended
        self.read_deadline = 0.0  # time.monotonic() by which the current request must have arrived
        # A lane request's body must also keep coming: FERRY_BODY_TIMEOUT_S from its last bytes (the consumer's
        # per-chunk wait, for requests that go by ASGI). 0.0 while its body is not waited for.
        self.stall_deadline = 0.0
        self.reading = False  # the connection is new, or a request has begun and not all arrived
        self.read_timer: asyncio.TimerHandle | None = None
        self.read_timer_at = 0.0  # when read_timer fires, on time.monotonic()'s clock
        # The current request is refused in the protocol, with this reason for its answer ("": the shed gate's
        # own); None while it is not.
        self.shed: str | None = None
        self._extend = self.extend_read_deadline
        self.first_byte = 0.0  # time.monotonic() when the current request's first byte reached this machine
        self.received_at: _ReceivedAt | None = None  # once connected
        self.raw_headers: list[bytes] = []  # the current request's header names and values, alternating, as they came
        # The inference lane (see Lane): the application's handler for an inference request, when the app
        # names one (config.asgi does); any other app, or one wrapped by uvicorn, gets every request by ASGI. The
        # proxy headers' wrapper (FERRY_TRUSTED_PROXIES) keeps the lane: it rewrites only the scope's client and
        # scheme, which the lane's handler never reads (an inference request is its API key's, from any address).
        app = self.app.app if type(self.app) is ProxyHeadersMiddleware else self.app
        self.infer: Infer | None = getattr(app, "ferry_infer", None)
        self._is_closing = None  # the transport's is_closing, once connected
        # Keep-alive idling: one timer a connection, re-armed when it fires, instead of uvicorn's timer set at
        # every response and cancelled at every request's first bytes.
        self.idle_since = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._is_closing = transport.is_closing
        self.received_at = _ReceivedAt(transport)
        self.reading = True
        self.read_deadline = time.monotonic() + self.read_timeout
        self._arm(self.read_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        # Bodies the lane read for requests it never started give back their bytes (a started one does so
        # when its handler ends).
        for lane in (self.cycle, *(cycle for cycle, _ in self.pipeline)):
            if type(lane) is Lane and not lane.started:
                lane.release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's, less its keep-alive timer's cancellation (see on_response_complete).
        try:
            self.parser.feed_data(data)
            if self.reading and type(self.cycle) is Lane and self.cycle.more_body:  # the body is still coming
                self._await_body()
        except httptools.HttpParserError:
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()

    def on_response_complete(self) -> None:
        """uvicorn's: the next pipelined request starts, or the connection idles, closed after
        timeout_keep_alive seconds of it by the idle timer."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_since = time.monotonic()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_later(self.timeout_keep_alive, self._idle_expired)

    def _idle_expired(self) -> None:
        self.idle_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self.reading or self.pipeline or not (cycle is None or cycle.response_complete):
            return  # busy: the response that ends it arms the timer again
        left = self.timeout_keep_alive - (time.monotonic() - self.idle_since)
        if left > 0:
            self.idle_timer = self.loop.call_later(left, self._idle_expired)
        else:
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Bytes that do not parse as HTTP: uvicorn's 400, as JSON like every other error."""
        body = orjson.dumps({"error": f"malformed HTTP request: {msg}"})
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        self.transport.close()

    def on_message_begin(self) -> None:
        # uvicorn's scope is built at on_headers_complete, and only for a request that goes by ASGI; until then
        # an empty dict marks "a request has begun" (and is the request's identity for the read deadline).
        GATE.seen += 1
        now = time.monotonic()
        received_at = self.received_at
        self.first_byte = received_at(now, self.read_timeout) if received_at is not None else now
        self.url = b""
        self.expect_100_continue = False
        self.raw_headers = []
        self.stall_deadline = 0.0
        self.scope = {}  # type: ignore[typeddict-item]
        self.reading = True
        self.read_deadline_s = self.read_timeout
        self.read_deadline = deadline = now + self.read_timeout
        if self.read_timer is None:
            self._arm(self.read_timeout)
        elif self.read_timer_at > deadline:  # armed for a longer (upload) deadline of an earlier request
            self.read_timer.cancel()
            self._arm(self.read_timeout)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Kept as they came; lower-cased in C, all at once, when the head is complete.
        self.raw_headers += (name, value)

    def on_headers_complete(self) -> None:
        self.shed = None
        url = self.url
        parser = self.parser
        # A request that has already waited past the front end's bound (in the kernel, for a loop that is
        # behind) is refused here, as the gate's are, not by its handler: a refusal must cost far less than
        # an answer, or the work of refusing crowds out the answering, and a loop behind on its reading falls
        # further behind the more it refuses.
        waited = time.monotonic() - self.first_byte
        if waited < GATE.least_wait:
            GATE.least_wait = waited
        shedding: str | None = None  # why this request is refused here ("": the gate's own reason)
        if waited > GATE.wait_bound or waited * 1000.0 > LIMITS.max_frontend_wait_ms:
            shedding = f"this request waited {waited * 1000.0:.0f} ms before it was read"
        elif GATE.drop > 0.0 and GATE.shedding:  # a draw: taken once per request
            shedding = ""
        if (
            self.infer is not None
            and shedding is None
            and url.startswith(b"/v2/models/")
            and url.endswith(b"/infer")
            and parser.get_method() == b"POST"
            and b"?" not in url
            and b"%" not in url
            and not self.access_log
        ):
            raw = self.raw_headers
            headers = dict(zip(map(bytes.lower, raw[-2::-2]), raw[::-2], strict=True))  # the first of a repeat wins
            limit = self.max_concurrency
            if (
                b"expect" not in headers
                and b"upgrade" not in headers
                and b"transfer-encoding" not in headers
                and (limit is None or (len(self.connections) < limit and len(self.tasks) < limit))
            ):
                lane = Lane(
                    self.scope,
                    url.decode("ascii"),
                    headers,
                    self.first_byte,
                    parser.get_http_version() != "1.0" and parser.should_keep_alive(),
                )
                existing = self.cycle
                self.cycle = lane  # type: ignore[assignment]
                if existing is None or existing.response_complete:
                    lane.turn = True
                else:  # pipelined behind a response still being written: started when that one completes
                    self.flow.pause_reading()
                    self.pipeline.appendleft((lane, None))  # type: ignore[arg-type]
                return
        if (
            shedding is not None
            and (self.cycle is None or self.cycle.response_complete)
            and _is_infer(self.url)
            and (self.parser.get_method() == b"POST")
        ):
            # Refused without an ASGI scope: what it costs is what the gate saves.
            GATE.count(self.url)
            raw = self.raw_headers
            if _expects_continue(zip(raw[::2], raw[1::2], strict=True)):  # waits for a 100 to send its body
                self.transport.write(GATE.answer(False, shedding))
                self.transport.close()
                return
            self.shed = shedding  # answered at on_message_complete; its body is parsed and dropped
            return
        self._begin_asgi()
        limit = self.max_concurrency
        if (
            limit is not None
            and (len(self.connections) >= limit or len(self.tasks) >= limit)
            and url not in PROBES  # a probe of a busy process must not fail (PROBES)
        ):
            app, self.app = self.app, over_capacity
            try:
                super().on_headers_complete()
            finally:
                self.app = app
        else:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # this request's cycle; its task runs later
                cycle.__class__ = LeanCycle

    def _begin_asgi(self) -> None:
        """uvicorn's scope for a request that goes by ASGI (what its on_message_begin and on_header build)."""
        raw = self.raw_headers
        self.headers = headers = list(zip(map(bytes.lower, raw[::2]), raw[1::2], strict=True))
        self.expect_100_continue = _expects_continue(headers)
        self.scope.update(
            {  # type: ignore[typeddict-item]
                "type": "http",
                "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
                "http_version": "1.1",
                "server": self.server,
                "client": self.client,
                "scheme": self.scheme,
                "root_path": self.root_path,
                "headers": headers,
                "state": self.app_state.copy(),
                "ferry.first_byte": self.first_byte,
                # Whether the client has gone: checked when the request's turn comes, so a queued request whose
                # client left is dropped unrun, with no task per request watching the connection.
                "ferry.gone": self.transport.is_closing,
                "ferry.extend_read_deadline": self._extend,
            }
        )

    def on_body(self, body: bytes) -> None:
        if self.shed is not None:
            return
        lane = self.cycle
        if type(lane) is not Lane:
            super().on_body(body)
            return
        if lane.refusal is not None or lane.response_complete:
            return  # refused: the rest of its body is read and dropped
        size = len(body)
        lane.received += size
        limit = LIMITS.max_infer_body
        if lane.received > limit:
            _TOO_LARGE.inc()
            self._refuse(lane, 413, f"request body exceeds {limit} bytes", None)
        elif not charge(size):
            self._refuse(lane, 503, "server holds its budget of bytes of request bodies; retry shortly", 1)
        else:
            lane.charged += size
            if lane.body:  # a later chunk: the request's wait in this process counts from its last bytes
                now = time.monotonic()
                received_at = self.received_at
                lane.first_byte = received_at(now, self.read_timeout) if received_at is not None else now
            lane.body.append(body)

    def _refuse(self, lane: Lane, status: int, message: str, retry_after: int | None) -> None:
        """Answer a request of the lane before its body is all in: at once when it is its turn (then close,
        since the rest of its body is not read), else when its turn comes."""
        lane.release()
        lane.body = []
        lane.refusal = (status, message, retry_after)
        if lane.turn:
            self._start_lane(lane)

    def on_message_complete(self) -> None:
        self.reading = False
        lane = self.cycle
        if type(lane) is Lane and self.shed is None:
            lane.more_body = False
            if lane.turn and not lane.started:
                self._start_lane(lane)
            return
        if self.shed is not None:
            reason, self.shed = self.shed, None
            if self.parser.should_keep_alive():
                self.transport.write(GATE.answer(True, reason))
                self.on_response_complete()  # keep-alive timer, flow control, pipelined requests
            else:
                self.transport.write(GATE.answer(False, reason))
                self.transport.close()
            return
        super().on_message_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if type(cycle) is not Lane:
            super()._start_asgi_task(cycle, app)
            return
        cycle.turn = True  # a pipelined lane request's turn: started now if its body is in
        if not cycle.more_body or cycle.refusal is not None:
            self._start_lane(cycle)

    def _start_lane(self, lane: Lane) -> None:
        lane.started = True
        task = self.loop.create_task(self._serve_lane(lane))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _serve_lane(self, lane: Lane) -> None:
        """Answer an inference request of the lane, with the app's handler, and write the answer."""
        transport = self.transport
        refusal = lane.refusal
        if refusal is None:
            body = lane.body
            try:
                request = self.infer(
                    "POST", lane.path, lane.headers, time.monotonic() - lane.first_byte, self._is_closing
                )
                answer = await request.answer(body[0] if len(body) == 1 else b"".join(body), True)
            finally:
                lane.release()
            lane.body = []
            if answer is None:  # its client went away
                lane.response_complete = True
                transport.close()
                return
            status, _, head, payload = answer
        else:
            status, message, retry_after = refusal
            payload = orjson.dumps({"error": message})
            head = (
                b"content-type: application/json\r\n"
                if retry_after is None
                else b"content-type: application/json\r\nretry-after: %d\r\n" % retry_after
            )
            head += b"content-length: %d\r\n" % len(payload)
            lane.keep_alive = False  # the rest of its body was not read
        if lane.disconnected or transport.is_closing():
            lane.response_complete = True
            return
        if self.flow.write_paused:
            await self.flow.drain()
        keep_alive = lane.keep_alive
        transport.write(
            b"".join(
                (
                    STATUS_LINE[status],
                    _default_head(self.server_state.default_headers),
                    head,
                    b"\r\n" if keep_alive else b"connection: close\r\n\r\n",
                    payload,
                )
            )
        )
        lane.response_complete = True
        if not keep_alive:
            transport.close()
        self.on_response_complete()

    def handle_websocket_upgrade(self) -> None:
        self.reading = False
        if self.read_timer is not None:
            self.read_timer.cancel()
            self.read_timer = None
        super().handle_websocket_upgrade()

    def extend_read_deadline(self, scope: Scope, seconds: float) -> None:
        """Give the request of `scope`, if its body is still arriving, `seconds` from its first byte."""
        if scope is self.scope and self.reading:
            self.read_deadline_s = seconds
            self.read_deadline = scope["ferry.first_byte"] + seconds  # the armed timer re-arms for it

    def _arm(self, delay: float) -> None:
        self.read_timer_at = time.monotonic() + delay
        self.read_timer = self.loop.call_later(delay, self._read_expired)

    def _await_body(self) -> None:
        """The lane request's body stalls past FERRY_BODY_TIMEOUT_S from now: answered 408 (the timer fires
        for whichever of that and the whole-request deadline comes first)."""
        self.stall_deadline = at = time.monotonic() + LIMITS.body_timeout
        if self.read_timer is None or self.read_timer_at > at:
            if self.read_timer is not None:
                self.read_timer.cancel()
            self._arm(at - time.monotonic())

    def _read_expired(self) -> None:
        self.read_timer = None
        transport = self.transport
        if not self.reading or transport.is_closing():
            return  # the next request arms a timer at its first byte
        now = time.monotonic()
        remaining = self.read_deadline - now
        stalled = bool(self.stall_deadline) and self.stall_deadline <= now and remaining > 0
        if self.stall_deadline:
            remaining = min(remaining, self.stall_deadline - now)
        if remaining > 0:  # a later request, or an extended deadline
            self._arm(remaining)
            return
        _READ_TIMEOUT.inc()
        if self.scope is not None:  # a request has begun (else: a silent new connection, nothing to answer)
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # the head is in: an app has this request
                answer = not cycle.response_started and not self.pipeline
                cycle.disconnected = True  # its receive() says http.disconnect and its sends are dropped
                cycle.message_event.set()
            else:  # still in the head; answer unless an earlier response is being written
                answer = cycle is None or cycle.response_complete
            if answer:
                transport.write(
                    self._timeout_response(
                        f"request body not received within {LIMITS.body_timeout:g} s of its last bytes"
                        if stalled
                        else f"request not received within {self.read_deadline_s:g} s"
                    )
                )
        transport.close()

    def _timeout_response(self, message: str) -> bytes:
        body = orjson.dumps({"error": message})
        parts = [STATUS_LINE[408]]
        for name, value in self.server_state.default_headers:
            parts += [name, b": ", value, b"\r\n"]
        parts += [
            b"content-type: application/json\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nconnection: close\r\n\r\n",
            body,
        ]
        return b"".join(parts)


class InferRequest(Protocol):
    """`consumers.InferenceRequest`: (method, path, headers, waited, gone), then `answer(body)`."""

    def answer(
        self, body: bytes, infer: bool
    ) -> Awaitable[tuple[int, list[tuple[bytes, bytes]], bytes, bytes] | None]: ...


Infer = Callable[[str, str, dict[bytes, bytes], float, Callable[[], bool]], InferRequest]


class _NoEvent:
    """What uvicorn's callbacks set on a cycle's message_event: a lane request has no receive() to wake."""

    @staticmethod
    def set() -> None:
        return None


class Lane:
    """An inference request the protocol serves itself, standing in for uvicorn's RequestResponseCycle.

    A POST to /v2/models/.../infer (no query, no percent-escapes, no Expect or Transfer-Encoding, no
    upgrade, under the concurrency limit, access log off) is not turned into an ASGI scope, a
    cycle, a task awaiting receive() and a Channels consumer: its body is gathered here, bounded by
    FERRY_MAX_INFER_BODY_BYTES (413) and charged to the process's budget of body bytes (503) as it
    arrives, and once it is complete one task runs the app's handler (`ferry_infer`, the same
    `InferenceRequest.answer` the consumer runs) and writes its answer. That is several hundred
    bytecodes a request fewer on the event loop, the server's ceiling. Keep-alive, pipelining,
    flow control, the read deadline and graceful shutdown keep uvicorn's rules: the protocol sees the
    same attributes it reads on a cycle.
    """

    # What most requests never change is a class default: an instance stores only what differs.
    message_event = _NoEvent
    more_body = True  # its body is still arriving
    received = 0  # body bytes read
    charged = 0  # body bytes charged to the process's budget, not yet given back
    refusal: tuple[int, str, int | None] | None = None  # answered without the app: (status, message, Retry-After)
    turn = False  # no earlier response of the connection is still being written
    started = False
    response_started = False  # answers are written whole, never partly
    response_complete = False
    disconnected = False

    def __init__(
        self, scope: Scope, path: str, headers: dict[bytes, bytes], first_byte: float, keep_alive: bool
    ) -> None:
        self.scope = scope  # the request's identity for the read deadline
        self.path = path
        self.headers = headers
        self.first_byte = first_byte
        self.keep_alive = keep_alive  # uvicorn's shutdown() clears it on a request in progress
        self.body: list[bytes] = []

    def release(self) -> None:
        discharge(self.charged)
        self.charged = 0


class LeanCycle(RequestResponseCycle):
    """uvicorn's request cycle with one shortcut for the inference consumer's answers.

    uvicorn re-validates, lower-cases and inspects every header of every response in Python (about
    40 bytecodes a header, some 300 per inference answer). A response start that carries
    "ferry.head" (its header lines already rendered, by `render_head`, from values the consumer made
    itself: integers, fixed media types, registry-validated model names) and "ferry.length" is
    written as it stands. Any other message, and any start while writing is paused or access logging
    is on, takes uvicorn's own path; so does every body.
    """

    async def send(self, message: dict) -> None:  # type: ignore[override]
        head = message.get("ferry.head")
        if head is None or self.response_started or self.disconnected or self.flow.write_paused or self.access_log:
            return await super().send(message)  # type: ignore[arg-type]
        self.response_started = True
        self.waiting_for_100_continue = False
        self.expected_content_length = message["ferry.length"]
        self.chunked_encoding = False
        self.transport.write(
            b"".join(
                (
                    STATUS_LINE[message["status"]],
                    _default_head(self.default_headers),
                    head,
                    b"\r\n" if self.keep_alive else b"connection: close\r\n\r\n",
                )
            )
        )


_default_rendered: tuple[object, bytes] = (None, b"")


def _default_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default headers (server, date) as header lines: the list is replaced once a second."""
    global _default_rendered
    if _default_rendered[0] is not headers:
        _default_rendered = (headers, b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers))
    return _default_rendered[1]


def render_head(headers: list[tuple[bytes, bytes]]) -> bytes:
    """Header lines for "ferry.head", joined in C. A value holding CR, LF or NUL (which could split the
    head) shows as more line breaks than headers: a ValueError (a bug, answered 500), never sent."""
    if not headers:
        return b""
    head = b"\r\n".join(map(b": ".join, headers)) + b"\r\n"
    lines = len(headers)
    if head.count(b"\n") != lines or head.count(b"\r") != lines or b"\0" in head:
        raise ValueError("a response header holds CR, LF or NUL")
    return head


def _expects_continue(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Whether a request's client waits for a 100 before sending its body (`Expect: 100-continue`)."""
    return any(n.lower() == b"expect" and v.lower() == b"100-continue" for n, v in headers)


def _is_infer(url: bytes) -> bool:
    return url.startswith(b"/v2/models/") and url.split(b"?", 1)[0].rstrip(b"/").endswith(b"/infer")


# -- WebSockets ------------------------------------------------------------------------------------

# A connection's messages before its application accepts it, and, where the application asks, its first message
# after (the inference socket's key, when it comes in a message): bounded to this, before they are read.
FIRST_MESSAGE_BYTES = 4096
_DATA = (Opcode.TEXT, Opcode.BINARY, Opcode.CONT)


class _FirstMessageBound(ServerProtocol):
    """websockets' server protocol with a bound of its own on the first message, checked as websockets checks
    its bound: on each frame's header, before its payload is read. Until the application accepts the
    connection every message is held to FIRST_MESSAGE_BYTES (a client sends nothing before the handshake's
    answer, RFC 6455 4.1: frames sent before it are an attempt to be read unasked); from the accept, the
    connection's bound (`max_size`), or, where the application kept the first bound, from the end of the
    first message after it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.bound = self.max_message_size  # the connection's
        self.max_message_size = FIRST_MESSAGE_BYTES if self.bound is None else min(FIRST_MESSAGE_BYTES, self.bound)
        self.accepted = False
        self.keep_first = False  # the application asked for the first message to be bounded too

    def accept_messages(self) -> None:
        self.accepted = True
        if not self.keep_first:
            self.max_message_size = self.bound

    def recv_frame(self, frame: Frame) -> None:
        super().recv_frame(frame)
        if self.accepted and frame.fin and frame.opcode in _DATA:  # the first message since the accept is in
            self.max_message_size = self.bound


class FrontDoorWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol (the one whose backpressure the inference socket rests on) with
    its first message bounded (`_FirstMessageBound`) and two hooks in the scope of a connection upgraded:

    - `scope["ferry.bound_first_message"]()`: called before the accept, the first message after it is held
      to FIRST_MESSAGE_BYTES too (a larger one is refused unread: close 1009);
    - `scope["ferry.abort"]()`: drop the connection now, without a closing handshake, unsent bytes discarded
      (for a client that stopped reading: a close frame would wait behind what it does not read)."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        conn = self.conn
        self.conn = _FirstMessageBound(
            extensions=conn.available_extensions, max_size=config.ws_max_size, logger=conn.logger
        )

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if self.response.status_code == 101:  # upgraded: the application's task starts next
            scope: dict[str, Any] = self.scope  # type: ignore[assignment]
            scope["ferry.bound_first_message"] = self._bound_first_message
            scope["ferry.abort"] = self.transport.abort

    def _bound_first_message(self) -> None:
        self.conn.keep_first = True  # type: ignore[attr-defined]

    def handle_parser_exception(self) -> None:
        if self.conn.close_sent is None:  # a frame refused before the handshake's answer: no close frame to send
            self.close_sent = True
            self.queue.put_nowait({"type": "websocket.disconnect", "code": 1006})
            self.transport.close()
            return
        super().handle_parser_exception()

    async def send(self, message: Any) -> None:
        if message["type"] == "websocket.accept" and not self.handshake_complete:
            self.conn.accept_messages()  # type: ignore[attr-defined]
        await super().send(message)


def uvicorn_config(app: App | str, host: str, port: int, **overrides: Any) -> uvicorn.Config:
    """The server's configuration, always with the front-door protocol; `overrides` are uvicorn.Config
    keywords (the tests use loop="asyncio" and a quieter log)."""
    options: dict[str, Any] = {
        "loop": "uvloop",
        "lifespan": "on",
        "access_log": False,
        # Behind the proxies of FERRY_TRUSTED_PROXIES (a request whose TCP peer is one of them), X-Forwarded-For
        # and X-Forwarded-Proto name the client's address and scheme: uvicorn's ProxyHeadersMiddleware takes the
        # right-most address of the chain that is not itself a trusted proxy. From any other peer, or with none
        # set, they are ignored and the client is the TCP peer. Django's REMOTE_ADDR is that client: login
        # throttling (axes), the API's throttles (tenants.throttles) and /metrics' allow-list key on it.
        "proxy_headers": bool(settings.FERRY_TRUSTED_PROXIES),
        "forwarded_allow_ips": list(settings.FERRY_TRUSTED_PROXIES),
        "limit_concurrency": settings.FERRY_MAX_CONCURRENCY,
        "log_level": "info",
        "timeout_graceful_shutdown": 10,
        # WebSockets (serving.dataplane.http.websocket): websockets-sansio, the implementation that stops reading
        # a connection while its app has a message unread (the inference socket's backpressure rests on it),
        # with a first message bounded apart (FrontDoorWebSocket); messages bounded as inference bodies are (a
        # binary one carries a 4-byte header length more), and no compression (CPU on the event loop for
        # tensors that hardly compress, and no inflating a small frame into a big one).
        "ws": FrontDoorWebSocket,
        "ws_max_size": settings.FERRY_MAX_INFER_BODY_BYTES + 4,
        "ws_per_message_deflate": False,
    }
    options.update(overrides)
    options["http"] = FrontDoorProtocol
    return uvicorn.Config(app, host=host, port=port, **options)
