"""Open Inference Protocol over HTTP, served by a lean Channels consumer (no Django middleware).

Paths (KServe V2 / Triton): /v2, /v2/health/{live,ready}, /v2/models/{name}[/versions/{v}]
[/ready|/config|/stats|/infer], /v2/models/stats, /v2/repository/index,
/v2/repository/models/{name}/{load,unload}, and /metrics. Every failure answers {"error": "..."} with its
status. Bad input is a 4xx found by validation; an unexpected exception is a bug: a 500, logged and counted,
never relabelled. Health answers the OIP's bodies: {"live": true}, {"ready": true}, and a model's
{"name": ..., "ready": true}; not ready is a 503 failure like any other (Retry-After), as KServe's server
answers, so a Kubernetes readiness probe sees it.

/v2 (server metadata) and /v2/health/{live,ready} are anonymous (probes); /v2 and /v2/health/live answer while
the process runs, data plane or not (a liveness probe must not restart a process that is starting or busy, and
the front door lets both probes past its connection limit); /metrics needs the metrics token
or an allowed address, and then hides private names from a caller without the token
(`serving.dataplane.metrics.metrics_access`); every other endpoint needs an API key
(`serving.dataplane.gateway.auth`): 401
without a usable one, 403 without the scope (load/unload need `manage`, the rest `infer`) or for load/unload
of a model another tenant owns, and 404 for a model the key's tenant may not see.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace

import orjson
from channels.consumer import get_handler_name
from channels.exceptions import StopConsumer
from channels.generic.http import AsyncHttpConsumer
from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST

from serving.dataplane import plane as dataplane
from serving.dataplane import tracing
from serving.dataplane.errors import NotFound, ServingError, Shed, Unavailable
from serving.dataplane.gateway.auth import Caller, Forbidden, Unauthenticated, authenticate
from serving.dataplane.gateway.gateway import CLIENT_CLOSED, Gateway, parse_version
from serving.dataplane.gateway.pipeline import runner_for as pipeline_runner
from serving.dataplane.gateway.quota_gate import QuotaExceeded, Ticket
from serving.dataplane.gateway.snapshot import ModelEntry, TenantEntry, VersionEntry
from serving.dataplane.http import frontdoor
from serving.dataplane.http.protocol import error_body
from serving.dataplane.metrics import metrics, metrics_access
from serving.policies.quota import CONTROL, IN_FLIGHT, MONTHLY, RATE, Decision

log = logging.getLogger(__name__)

JSON = [(b"content-type", b"application/json")]
NOT_IN_FLIGHT = 2**31  # the in-flight limit of a control call answered at once (`_control_ticket`)
# The extensions both protocols implement: model_repository (index, load, unload), statistics (REST's
# /v2/models[/{m}[/versions/{v}]]/stats, gRPC's ModelStatistics, one computation: `model_statistics`) and
# model_configuration (/config, ModelConfig). binary_tensor_data is REST's alone (gRPC's tensors are binary).
SERVER_METADATA = orjson.dumps(
    {
        "name": "ferry",
        "version": "0.1.0",
        "extensions": ["binary_tensor_data", "model_repository", "statistics", "model_configuration"],
    }
)
LIVE = orjson.dumps({"live": True})
READY = orjson.dumps({"ready": True})
# The OIP metadata's and the model configuration's `platform` of each artifact format: Triton's name for
# TorchScript; Triton has none for a torch.export program, so Ferry's own.
PLATFORMS = {"torchscript": "pytorch_libtorch", "torch_export": "pytorch_export"}
# The request body encodings understood (Content-Encoding); a compressed body is refused 415, not inflated.
ENCODINGS = (b"", b"identity")
# The routes of inference (OpenTelemetry's `http.route`: the path's template), which name a traced request's span.
INFER_ROUTE = "/v2/models/{model_name}/infer"
INFER_VERSION_ROUTE = "/v2/models/{model_name}/versions/{model_version}/infer"


class MethodNotAllowed(ServingError):
    status = 405


class OverQuota(ServingError):
    """429 with Retry-After and the RateLimit headers of the limit that refused."""

    status = 429

    def __init__(self, decision: Decision) -> None:
        messages = {
            RATE: "requests per second over the tenant's quota",
            IN_FLIGHT: "too many requests in flight for the tenant's quota",
            MONTHLY: "the tenant's monthly request budget is spent",
            CONTROL: "repository loads and unloads over the tenant's quota",
        }
        super().__init__(
            f"{messages[decision.reason]} ({decision.reason} limit {decision.limit});"
            f" retry after {math.ceil(decision.retry_after)} s"
        )
        self.headers = tuple(decision.headers())


class InferenceConsumer(AsyncHttpConsumer):
    """Channels' HTTP consumer without the per-message costs this path never needs: no channel on
    the channel layer, no task per receive, and no closing of stale database connections (a thread
    hop per message; this path never touches the database)."""

    async def __call__(self, scope: dict, receive, send) -> None:  # noqa: ANN001
        self.scope = scope
        self.channel_layer = None
        self.base_send = send
        self._receive = receive
        # How long this request waited in this process before its handler started: from its first byte
        # (stamped by the front door) through header parsing and the event loop's ready queue.
        first_byte = scope.get("ferry.first_byte")
        self._waited = time.monotonic() - first_byte if first_byte is not None else 0.0
        self._received = self._charged = 0
        try:
            # Most requests arrive in one message: handled here without a dispatch or a body list. A body
            # still coming must keep coming.
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                chunk = message.get("body", b"")
                if chunk:
                    await self._count(chunk)
                await self.handle(chunk)
                return
            while True:
                await self.dispatch(message)
                message = await asyncio.wait_for(receive(), settings.FERRY_BODY_TIMEOUT_S)
        except StopConsumer:
            pass
        except TimeoutError:
            body = error_body(f"request body not received within {settings.FERRY_BODY_TIMEOUT_S:g} s")
            await self.send_response(408, body, headers=[*JSON, (b"content-length", str(len(body)).encode())])
        finally:
            frontdoor.discharge(self._charged)

    async def dispatch(self, message: dict) -> None:
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def http_request(self, message: dict) -> None:
        chunk = message.get("body", b"")
        if chunk:
            self.body.append(chunk)
            await self._count(chunk)
        if not message.get("more_body"):
            try:
                await self.handle(b"".join(self.body))
            finally:
                raise StopConsumer()

    async def _count(self, chunk: bytes) -> None:
        """Count a chunk against this request's bound and the process's budget of body bytes held (the
        front door's, shared with Django's routes); past either, answer and stop."""
        size = len(chunk)
        self._received += size
        if self._received > frontdoor.LIMITS.max_infer_body:
            await self._too_large()
        if not frontdoor.charge(size):
            await self._over_budget()
        self._charged += size

    async def _too_large(self) -> None:
        limit = settings.FERRY_MAX_INFER_BODY_BYTES
        body = error_body(f"request body exceeds {limit} bytes")
        await self.send_response(413, body, headers=[*JSON, (b"content-length", str(len(body)).encode())])
        raise StopConsumer()

    async def _over_budget(self) -> None:
        body = error_body("server holds its budget of bytes of request bodies; retry shortly")
        await self.send_response(
            503, body, headers=[*JSON, (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]
        )
        raise StopConsumer()

    async def handle(self, body: bytes) -> None:
        scope = self.scope
        # The headers as a dict, built in C (reversed: the first of a repeated header counts).
        client = scope.get("client")
        request = InferenceRequest(
            scope["method"],
            scope["path"],
            dict(reversed(scope["headers"])),
            self._waited,
            scope.get("ferry.gone"),
            client[0] if client else None,
        )
        answer = await request.answer(body)
        if answer is None:
            return  # its client went away: nothing to send
        status, headers, head, payload = answer
        # Standard ASGI messages; "ferry.head" lets the front door's LeanCycle skip uvicorn's per-header work.
        await self.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": headers,
                "ferry.head": head,
                "ferry.length": len(payload),
            }
        )
        await self.send({"type": "http.response.body", "body": payload})


class InferenceRequest:
    """One request on the inference paths, whichever way it came: through the ASGI consumer above, or
    straight from the front door's protocol (`frontdoor.FrontDoorProtocol`'s lane for inference), which
    has already read its whole body. `answer` never raises: every outcome is an answer to write."""

    __slots__ = ("method", "path", "headers", "waited", "began", "gone", "client", "websocket")

    def __init__(
        self,
        method: str,
        path: str,
        headers: dict[bytes, bytes],
        waited: float,
        gone: Callable[[], bool] | None,
        client: str | None = None,
        websocket: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.headers = headers  # lower-case names; the first of a repeated header
        # How long this request waited in this process before its handler started: from its first byte
        # through header parsing and the event loop's ready queue.
        self.waited = waited
        self.began = time.monotonic()
        self.gone = gone  # whether its client has gone (checked when a queued request's turn comes)
        self.client = client  # the peer's address, for /metrics' allow-list (None: unknown, token only)
        self.websocket = websocket  # a WebSocket message (serving.dataplane.http.websocket), for its span

    def waited_so_far(self) -> float:
        """What the request has waited since its first byte reached the machine: before its handler began, and
        in the handler since (authentication, the quota's round trip). Its deadline counts from that."""
        return self.waited + (time.monotonic() - self.began)

    async def answer(
        self, body: bytes, infer: bool = False
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, bytes] | None:
        """(status, headers, the headers rendered as lines, payload); None when the client went away.
        `infer`: a POST to a path ending in /infer (the front door's lane checked it), routed directly."""
        frontdoor.GATE.passed += 1
        try:
            status, payload, headers = await (self._infer_path(body) if infer else self._dispatch(body))
        except ServingError as exc:
            if exc.status == CLIENT_CLOSED:
                return None
            if isinstance(exc, Shed):  # refused for want of capacity after all this request cost: the gate learns
                frontdoor.GATE.refused += 1
            status, payload, headers = exc.status, error_body(exc.message), [*JSON, *exc.headers]
            if isinstance(exc, Unauthenticated | Forbidden):
                metrics.REQUESTS.labels("", "", str(exc.status)).inc()  # refused before routing
            if exc.retry_after is not None:
                headers.append((b"retry-after", str(math.ceil(exc.retry_after)).encode()))
        except Exception:
            log.exception("unhandled error on %s %s", self.method, self.path)
            metrics.INTERNAL_ERRORS.labels("inference").inc()
            self._count_unrouted(500)
            status, payload, headers = 500, error_body("internal error; the server logged it"), list(JSON)
        headers = [*headers, (b"content-length", str(len(payload)).encode())]
        try:
            head = frontdoor.render_head(headers)
        except ValueError:
            log.exception("unsafe response header on %s", self.path)
            metrics.INTERNAL_ERRORS.labels("inference").inc()
            self._count_unrouted(500)
            payload = error_body("internal error; the server logged it")
            headers = [*JSON, (b"content-length", str(len(payload)).encode())]
            status, head = 500, frontdoor.render_head(headers)
        return status, headers, head, payload

    async def _dispatch(self, body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        path = self.path.rstrip("/")
        method = self.method
        if path == "/metrics":
            _method(method, "GET")
            access = metrics_access.configured()
            level = access.admit(self.headers.get(b"authorization"), self.client)
            plane = dataplane.current()
            snapshot = plane.gateway.snapshot if plane is not None else None
            body = metrics_access.exposition(level, snapshot, access.label_key)
            return 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        parts = path.split("/")[2:]  # after "", "v2"
        # Server metadata and liveness need nothing of the data plane: they answer while the process runs.
        if not parts:
            _method(method, "GET")
            return 200, SERVER_METADATA, JSON
        head = parts[0]
        if parts == ["health", "live"]:
            _method(method, "GET")
            return 200, LIVE, JSON
        plane = dataplane.current()
        if plane is None:
            raise Unavailable("the data plane is starting", retry_after=1)
        if parts == ["health", "ready"]:
            _method(method, "GET")
            if not plane.ready:
                raise Unavailable("not ready: models are loading", retry_after=1)
            return 200, READY, JSON
        # Everything else needs a key: one dict lookup and one HMAC, against the snapshot in memory.
        caller = authenticate(self.headers.get(b"authorization"), plane.gateway.snapshot, plane.pepper, time.time())
        plane.used_keys.add(caller.prefix)  # last_used_at, written later off this path
        if head == "models" and len(parts) >= 2:
            return await self._model_path(plane, caller, method, parts[1:], body)
        if head == "repository":
            return await self._repository(plane, caller, method, parts[1:], body)
        raise NotFound(f"no such endpoint {path}")

    async def _infer_path(self, body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """A POST to .../infer: /v2/models/{name}[/versions/{v}]/infer, without `_dispatch`'s general parse."""
        parts = self.path.split("/")
        if len(parts) == 5 and parts[2] == "models":
            name, version = parts[3], None
        elif len(parts) == 7 and parts[2] == "models" and parts[4] == "versions":
            name, version = parts[3], parts[5]
        else:
            return await self._dispatch(body)
        plane = dataplane.current()
        if plane is None:
            raise Unavailable("the data plane is starting", retry_after=1)
        if tracing.ENABLED:
            return await self._traced(plane, name, version, body)
        caller = authenticate(self.headers.get(b"authorization"), plane.gateway.snapshot, plane.pepper, time.time())
        plane.used_keys.add(caller.prefix)  # last_used_at, written later off this path
        caller.require("infer")
        return await self._infer(plane, caller, name, version, body)

    async def _traced(
        self, plane: dataplane.DataPlane, name: str, version: str | None, body: bytes
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """`_infer_path`'s steps under the request's span (`serving.dataplane.tracing`), the child of the
        caller's `traceparent` when it sent one (a WebSocket message: the one its connection's handshake sent).
        Named and described as OpenTelemetry's HTTP server conventions say: `POST {route}` with the route's
        template; a WebSocket message is no HTTP request, so `WS {route}`, its answer in `ferry.status`."""
        route = INFER_ROUTE if version is None else INFER_VERSION_ROUTE
        attributes: dict[str, object] = {"url.path": self.path, "ferry.model": name}
        attributes.update(tracing.server_address(self.headers.get(b"host")))
        answered: tracing.Answered
        if self.websocket:
            route = "/ws" + route
            attributes.update({"url.path": "/ws" + self.path, "url.scheme": "ws", "network.protocol.name": "websocket"})
            answered = tracing.answered
            span_name = f"WS {route}"
        else:
            # This server speaks plain HTTP (TLS, where there is any, ends in front of it).
            attributes.update({"http.request.method": self.method, "http.route": route, "url.scheme": "http"})
            answered = tracing.http_answered
            span_name = f"{self.method} {route}"
        span = tracing.start_request(span_name, tracing.from_headers(self.headers), **attributes)
        with tracing.active(span, answered):
            with tracing.child("ferry.auth"):
                snapshot = plane.gateway.snapshot
                caller = authenticate(self.headers.get(b"authorization"), snapshot, plane.pepper, time.time())
                plane.used_keys.add(caller.prefix)
                caller.require("infer")
            status, payload, headers = await self._infer(plane, caller, name, version, body)
            answered(span, status)
            return status, payload, headers

    async def _infer(
        self, plane: dataplane.DataPlane, caller: Caller, name: str, version: str | None, body: bytes
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        viewer = caller.tenant_id
        gateway = plane.gateway
        self._identity_only()  # before the quota: a body that cannot be read spends none of it
        ticket, limits = await self.admit(plane, name, version, viewer)
        try:
            raw_length = self.headers.get(b"inference-header-content-length")
            runner = pipeline_runner(gateway)  # a pipeline is served at a model's path, charged once above
            tier, routing_key = limits.priority if limits else 1, self._routing_key(caller)
            if runner.find(name, viewer) is not None:
                reply = await runner.infer(
                    name, version, body, _header_length(raw_length), viewer, gone=self.gone, tier=tier,
                    routing_key=routing_key, waited=self.waited_so_far(),
                )  # fmt: skip
            else:
                reply = await gateway.infer(
                    name, version, body, _header_length(raw_length), viewer, gone=self.gone, tier=tier,
                    routing_key=routing_key, waited=self.waited_so_far(),
                )  # fmt: skip
        finally:
            if ticket is not None:
                plane.quota.release(ticket)  # type: ignore[union-attr]
        if ticket is not None:
            return reply.status, reply.body, [*reply.headers, *ticket.decision.headers()]
        return reply.status, reply.body, reply.headers

    async def admit(
        self, plane: dataplane.DataPlane, name: str, version: str | None, viewer: int
    ) -> tuple[Ticket | None, TenantEntry | None]:
        """What an inference request passes before the gateway, whatever its protocol (REST here, gRPC in
        serving.dataplane.grpc): shed when this process is saturated, then the tenant's quota (OverQuota,
        429, counted and metered). The quota's ticket (None: quotas off; the caller releases it once
        answered) and the tenant's limits (its priority tier)."""
        # Shed before the quota: a request the server cannot take now must not spend its tenant's budget.
        self._shed_if_saturated(plane, name, version, viewer)
        limits = plane.gateway.snapshot.tenants.get(viewer)
        quota = plane.quota
        begun = tracing.since() if tracing.ENABLED and quota is not None else 0
        try:
            if quota is None or limits is None:  # quotas off, or a snapshot from a build without them
                ticket = None
            elif quota.shared is None:  # in-process: decided without a coroutine
                ticket = quota.admit_here(viewer, limits)
            else:
                ticket = await quota.admit(viewer, limits)
        except QuotaExceeded as refused:
            if begun:
                tracing.mark("ferry.quota", begun, **{"ferry.refused": refused.decision.reason})
            self._over_quota(plane, limits, name, version, viewer, refused.decision)  # type: ignore[arg-type]
        if begun:
            tracing.mark("ferry.quota", begun)
        return ticket, limits

    def _identity_only(self) -> None:
        """415 for a body sent with a Content-Encoding other than identity (tritonclient's
        request_compression_algorithm): read as it came it would fail as malformed, a misleading 400.
        Refused, not inflated: inflating would need a second bound, on the inflated bytes, and a second
        charge against the process's budget of body bytes, for a body the client can as well send plain."""
        encoding = self.headers.get(b"content-encoding")
        if encoding is not None and encoding.strip().lower() not in ENCODINGS:
            self._count_unrouted(415)
            raise ServingError(
                f"Content-Encoding {encoding.decode('latin-1')!r} is not supported: send the body uncompressed"
                " (supported: identity)",
                status=415,
            )

    async def _model_path(
        self, plane: dataplane.DataPlane, caller: Caller, method: str, parts: list[str], body: bytes
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        caller.require("infer")  # inference, metadata, ready, config and statistics alike
        viewer = caller.tenant_id
        if parts == ["stats"]:  # every model's statistics (Triton's path: a model named "stats" is pinned here)
            _method(method, "GET")
            rate = await self._charge(plane, viewer)
            return 200, orjson.dumps(model_statistics(plane.gateway, viewer, "", None)), [*JSON, *rate]
        name, rest = parts[0], parts[1:]
        version = None
        if len(rest) >= 2 and rest[0] == "versions":
            version, rest = rest[1], rest[2:]
        if len(rest) > 1:
            raise NotFound("no such endpoint")
        action = rest[0] if rest else ""
        gateway = plane.gateway
        if action == "infer":
            _method(method, "POST")
            return await self._infer(plane, caller, name, version, body)
        _method(method, "GET")
        rate = await self._charge(plane, viewer)  # metadata, ready, config and statistics take a request of the quota
        if action == "stats":
            return 200, orjson.dumps(model_statistics(gateway, viewer, name, version)), [*JSON, *rate]
        runner = pipeline_runner(gateway)
        pipeline = runner.find(name, viewer)  # one the caller may not see is a model's 404 below
        if pipeline is not None:
            if action == "ready":
                why = runner.unready(pipeline, version, viewer, self._routing_key(caller), plane.node.is_ready)
                if why:
                    raise Unavailable(why, retry_after=1)
                return 200, orjson.dumps({"name": name, "ready": True}), [*JSON, *rate]
            if action == "":
                return 200, orjson.dumps(runner.metadata(pipeline, version)), [*JSON, *rate]
            raise NotFound(f"no such endpoint for pipeline '{name}': {action}")
        model = gateway.model(name, viewer)
        if version is not None and parse_version(version) not in model.versions:
            raise NotFound(f"model '{name}' has no version '{version}'")
        if action == "ready":
            entry = gateway.route(name, version, viewer, self._routing_key(caller))
            if not plane.node.is_ready(entry.key):
                raise Unavailable(f"model '{name}' version {entry.version} is loading", retry_after=1)
            return 200, orjson.dumps({"name": name, "ready": True}), [*JSON, *rate]
        if action == "":
            entry = model.versions[int(version)] if version is not None else _default(model)
            return 200, orjson.dumps(_metadata(name, model.versions, entry, version)), [*JSON, *rate]
        if action == "config":
            entry = gateway.route(name, version, viewer, self._routing_key(caller))
            return 200, orjson.dumps(_config(entry, gateway.snapshot.budget_ms(entry, viewer))), [*JSON, *rate]
        raise NotFound(f"no such endpoint for model '{name}': {action}")

    async def _repository(
        self, plane: dataplane.DataPlane, caller: Caller, method: str, parts: list[str], body: bytes
    ) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        _method(method, "POST")
        if parts == ["index"]:
            caller.require("infer")
            self._identity_only()
            rate = await self._charge(plane, caller.tenant_id)
            options = _json_options(body, {"ready": bool})
            rows = [
                {
                    "name": v.model,
                    "version": str(v.version),
                    "state": repository_state(plane, v),
                    "reason": v.failure_reason or load_failure(plane, v),
                }
                for m in plane.gateway.snapshot.models.values()
                if m.visible_to(caller.tenant_id)
                for v in m.versions.values()
            ]
            if options.get("ready"):
                rows = [r for r in rows if r["state"] == "READY"]
            return 200, orjson.dumps(rows), [*JSON, *rate]
        if len(parts) == 3 and parts[0] == "models" and parts[2] in ("load", "unload"):
            caller.require("manage")
            self._identity_only()
            options = _json_options(body, {"parameters": dict})
            if parts[2] == "load":
                refuse_load_options(options.get("parameters", {}))
            return 200, b"", [*JSON, *await self.set_loaded(plane, caller, parts[1], parts[2] == "load")]
        raise NotFound("no such repository endpoint")

    async def set_loaded(
        self, plane: dataplane.DataPlane, caller: Caller, name: str, load: bool
    ) -> list[tuple[bytes, bytes]]:
        """The repository extension's load or unload of model `name` by `caller` (who has the `manage`
        scope), whatever the protocol: 404 for a model it may not see, 403 for one it sees but does not own,
        429 past its quota, 409 when the load failed, 503 with Retry-After when the registry is out of reach
        or slow, or the change is not done in time (`DataPlane.write_loaded`, `wait_loaded`). The quota's
        RateLimit headers."""
        model = plane.gateway.model(name, caller.tenant_id)  # 404 before touching the database
        if model.tenant_id != caller.tenant_id:
            # Seeing a model (public, shared, platform) is not owning it: taking it out of service is
            # its own tenant's call.
            raise Forbidden(f"model '{name}' belongs to another tenant: only its own keys load or unload it")
        if plane.set_loaded is None:
            raise Unavailable("this process cannot change what is loaded; use the control plane's API")
        # Each writes the database and republishes the snapshot for every gateway: a request of the
        # quota and a token of the tenant's own, slower, load/unload bucket.
        ticket = await self._control_ticket(plane, caller.tenant_id, loads=True)
        try:
            try:
                snapshot = await plane.write_loaded(name, load)
            except Unavailable:
                if ticket is not None and plane.quota is not None and plane.quota.control is not None:
                    plane.quota.control.refund(caller.tenant_id)  # not done: its retry is not one load more
                raise
            await plane.wait_loaded(name, load, snapshot.serial)
        finally:
            if ticket is not None:
                plane.quota.release(ticket)  # type: ignore[union-attr]
        if load:
            failures = [f.reason for k, f in plane.node.failures.items() if k.startswith(f"{name}:")]
            if failures:
                raise ServingError(f"load failed: {failures[0]}", status=409)
        return ticket.decision.headers() if ticket is not None else []

    async def _charge(self, plane: dataplane.DataPlane, tenant_id: int) -> list[tuple[bytes, bytes]]:
        """Take one request of the tenant's quota for a control call answered at once (metadata, ready,
        config, repository index), as inference does: 429 past it. Its RateLimit headers."""
        ticket = await self._control_ticket(plane, tenant_id, holds=False)
        if ticket is None:
            return []
        plane.quota.release(ticket)  # type: ignore[union-attr]  # answered without waiting: in flight no longer
        return ticket.decision.headers()

    async def _control_ticket(
        self, plane: dataplane.DataPlane, tenant_id: int, *, loads: bool = False, holds: bool = True
    ) -> Ticket | None:
        """The tenant's quota for a control call (None: quotas off), with a token of its load/unload bucket
        first when `loads`; OverQuota (429) when either refuses, and a refusal takes nothing. A call that
        does not `hold` (answered at once) is not limited by `max_in_flight`: that limit is for work that
        waits, and a tenant held at 0 in flight can still read its models' metadata."""
        limits = plane.gateway.snapshot.tenants.get(tenant_id)
        quota = plane.quota
        if quota is None or limits is None:
            return None
        if not holds:
            limits = replace(limits, max_in_flight=NOT_IN_FLIGHT)
        control = quota.control if loads else None
        if control is not None:
            decision = control.admit(tenant_id)
            if not decision.admitted:
                metrics.QUOTA_REFUSALS.labels(limits.slug, decision.reason).inc()
                raise OverQuota(decision)
        try:
            return quota.admit_here(tenant_id, limits) if quota.shared is None else await quota.admit(tenant_id, limits)
        except QuotaExceeded as refused:
            if control is not None:
                control.refund(tenant_id)
            metrics.QUOTA_REFUSALS.labels(limits.slug, refused.decision.reason).inc()
            raise OverQuota(refused.decision) from None

    def _over_quota(
        self,
        plane: dataplane.DataPlane,
        limits: TenantEntry,
        name: str,
        version: str | None,
        viewer: int,
        decision: Decision,
    ) -> None:
        """Answer 429 for a request its tenant's quota refused: counted, and metered as the tenant's."""
        metrics.QUOTA_REFUSALS.labels(limits.slug, decision.reason).inc()
        entry = self._routed_or_none(plane, name, version, viewer)
        if entry is None:
            metrics.REQUESTS.labels("", "", "429").inc()
        else:  # counted as every answer is, so the version's console figures show its refusals as errors
            vm = metrics.for_version(entry.model, entry.version)
            vm.answered(429, self.waited_so_far())
            vm.saturation.mark("error")
        usage = plane.gateway.usage
        if usage is not None and entry is not None:  # the tenant sees its refusals in its usage too
            usage.record(viewer, entry.model, entry.version, 429, 0, 0.0, self.waited)
        raise OverQuota(decision)

    def _shed_if_saturated(self, plane: dataplane.DataPlane, name: str, version: str | None, viewer: int) -> None:
        """Refuse at once when this process is behind on reading requests: past that point a request
        waits in socket buffers and the event loop's backlog, where no queue bound or deadline sees it.
        Two measures: how late the loop runs its timers (the wait of bytes not yet read), and how long
        this request waited between its first byte and this handler (the wait of bytes read)."""
        lag_ms = plane.loop_lag * 1000
        waited_ms = self.waited * 1000
        limits = frontdoor.LIMITS
        if lag_ms <= limits.max_loop_lag_ms and waited_ms <= limits.max_frontend_wait_ms:
            return
        entry = plane.count_saturation_shed(name, version, viewer, waited_ms / 1000)
        if entry is not None and plane.gateway.usage is not None:
            plane.gateway.usage.record(viewer, entry.model, entry.version, 503, 0, 0.0, waited_ms / 1000)
        raise Shed(
            f"server saturated: its event loop runs {lag_ms:.0f} ms late and this request waited"
            f" {waited_ms:.0f} ms before it was handled",
            reason="frontend",
            tier=0,
            retry_after=1,
        )

    @staticmethod
    def _routed_or_none(
        plane: dataplane.DataPlane, name: str, version: str | None, viewer: int | None
    ) -> VersionEntry | None:
        try:
            return plane.gateway.route(name, version, viewer)
        except ServingError:
            return None

    def _count_unrouted(self, status: int) -> None:
        """Count an answer the gateway did not count (it never got that far)."""
        parts = self.path.rstrip("/").split("/")
        plane = dataplane.current()
        if len(parts) >= 5 and parts[2] == "models" and parts[-1] == "infer" and plane is not None:
            version = parts[5] if len(parts) >= 7 and parts[4] == "versions" else None
            entry = self._routed_or_none(plane, parts[3], version, None)
            if entry is not None:  # as the gateway counts an answer, so the version's console figures show it
                vm = metrics.for_version(entry.model, entry.version)
                vm.answered(status, self.waited_so_far())
                vm.saturation.mark("error")
                return
        metrics.REQUESTS.labels("", "", str(status)).inc()

    def _routing_key(self, caller: Caller) -> str:
        """X-Ferry-Routing-Key (an end user's id, say), else the API key's prefix, so one key's traffic all
        goes one way through an experiment or a canary."""
        routing = self.headers.get(b"x-ferry-routing-key")
        return routing.decode("latin-1") if routing is not None else caller.prefix


def _header_length(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ServingError("Inference-Header-Content-Length is not an integer", status=400) from None


def _json_options(body: bytes, allowed: dict[str, type]) -> dict:
    """An optional JSON object body with only the named keys, each of its type (400 otherwise)."""
    if not body.strip():
        return {}
    try:
        options = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ServingError(f"malformed JSON body: {exc}", status=400) from None
    if not isinstance(options, dict):
        raise ServingError("the body must be a JSON object", status=400)
    for key, value in options.items():
        kind = allowed.get(key)
        if kind is None:
            raise ServingError(f"unknown field {key!r}; allowed: {', '.join(allowed)}", status=400)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ServingError(f"field {key!r} must be a {kind.__name__}", status=400)
    return options


def _method(method: str, allowed: str) -> None:
    if method != allowed:
        raise MethodNotAllowed(f"method {method} not allowed here; use {allowed}")


def _default(model: ModelEntry) -> VersionEntry:
    """The version unversioned metadata describes: the stable one (what unpinned traffic gets), else the
    newest servable, else the newest."""
    versions = model.versions
    if not versions:
        raise Unavailable("model has no versions", retry_after=1)
    stable = versions.get(model.routes.stable) if model.routes.stable is not None else None
    if stable is not None:
        return stable
    ready = [v for v in versions.values() if v.servable]
    return max(ready or versions.values(), key=lambda v: v.version)


def _metadata(name: str, versions: dict[int, VersionEntry], entry: VersionEntry, pinned: str | None) -> dict:
    return {
        "name": name,
        "versions": [pinned] if pinned else [str(v) for v in sorted(versions)],
        "platform": PLATFORMS[entry.format],
        "inputs": [s.to_metadata() for s in entry.inputs],
        "outputs": [s.to_metadata() for s in entry.outputs],
    }


def _config(entry: VersionEntry, budget_ms: int) -> dict:
    """Triton's model configuration; its default timeout is the deadline a request without one gets
    (`budget_ms`, `RoutingSnapshot.budget_ms`), not the version's stored `default_timeout_ms` alone."""

    def tensors(specs):  # noqa: ANN001, ANN202
        return [{"name": s.name, "data_type": f"TYPE_{s.datatype}", "dims": list(s.shape)} for s in specs]

    batching = entry.batching
    return {
        "name": entry.model,
        "platform": PLATFORMS[entry.format],
        "backend": "ferry",
        "max_batch_size": batching.max_batch_size,
        "input": tensors(entry.inputs),
        "output": tensors(entry.outputs),
        "dynamic_batching": {
            "preferred_batch_size": list(batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(batching.max_queue_delay * 1e6),
            "default_queue_policy": {
                "max_queue_size": batching.max_queue_size,
                "default_timeout_microseconds": budget_ms * 1000,
            },
        },
        "version_policy": {"specific": {"versions": [entry.version]}},
    }


def refuse_load_options(parameters: dict | object) -> None:
    """Refuse, naming it, a load parameter Ferry cannot honour (400; gRPC's INVALID_ARGUMENT): Triton's
    `config` (an override of the model's configuration) and `file:<path>` (the model's files sent with the
    load). A load here serves the version as registered; taking either silently would report a change that
    was never made. `parameters`: the request's map, a dict (REST) or a protobuf map (gRPC)."""
    for key in parameters:  # type: ignore[attr-defined]
        if key == "config" or key.startswith("file:"):
            raise ServingError(
                f"load parameter {key!r} is not supported: a load serves the version as registered;"
                " register a new version to change its configuration or files",
                status=400,
            )


# Triton's statistics of one version that Ferry does not measure: always 0 (in gRPC, protobuf's default).
_UNMEASURED = ("fail", "compute_input", "compute_output", "cache_hit", "cache_miss")


def model_statistics(gateway: Gateway, viewer: int, name: str, version: str | None) -> dict:
    """Triton's statistics extension (`{"model_stats": [...]}`, the JSON of ModelStatisticsResponse) from this
    process's metrics, for the versions tenant `viewer` sees: model `name`'s (every one when `name` is ""), of
    version `version` (all when None or ""). Successes and their time (`ferry_request_seconds`), time queued
    and computing, batches run (`execution_count`) and rows computed (`inference_count`); in distributed mode
    the queue, compute and batch figures live in the node processes and read 0 here. A model the viewer may
    not see is unknown (404), as everywhere. REST's /stats paths and gRPC's ModelStatistics both answer this."""
    if name:
        model = gateway.model(name, viewer)
        if version and parse_version(version) not in model.versions:
            raise NotFound(f"model '{name}' has no version '{version}'")
        models = [model]
    else:
        models = [m for m in gateway.snapshot.models.values() if m.visible_to(viewer)]
    pinned = parse_version(version) if version else None
    stats = []
    for model in models:
        for number, entry in sorted(model.versions.items()):
            if pinned is not None and number != pinned:
                continue
            vm = metrics.for_version(entry.model, entry.version)
            rows, batches = _count_sum(vm.batch_size)
            inference = {
                "success": _duration(vm.total),
                "queue": _duration(vm.queue_wait),
                "compute_infer": _duration(vm.compute),
                **{field: {"count": 0, "ns": 0} for field in _UNMEASURED},
            }
            stats.append(
                {
                    "name": entry.model,
                    "version": str(entry.version),
                    "last_inference": 0,  # not kept
                    "inference_count": int(rows),
                    "execution_count": batches,
                    "inference_stats": inference,
                    "batch_stats": [],
                }
            )
    return {"model_stats": stats}


def _duration(histogram: object) -> dict:
    """Triton's StatisticDuration of a histogram of seconds: how many, and their total in nanoseconds."""
    seconds, count = _count_sum(histogram)
    return {"count": count, "ns": int(seconds * 1e9)}


def _count_sum(histogram: object) -> tuple[float, int]:
    """A histogram child's sum and count of observations."""
    counts, total = histogram.snapshot()  # type: ignore[attr-defined]
    return total, sum(counts)


def repository_state(plane: dataplane.DataPlane, entry: VersionEntry) -> str:
    if entry.state != "ready":
        return entry.state.upper()
    if plane.node.is_ready(entry.key):
        return "READY"
    if entry.key in plane.node.failures:
        return "UNAVAILABLE"
    if entry.key in plane.node.packing.cold:  # loadable; a request loads it
        return "LOADING" if entry.key in plane.node.packing.loading else "UNAVAILABLE"
    return "LOADING" if entry.loaded else "UNAVAILABLE"


def load_failure(plane: dataplane.DataPlane, entry: VersionEntry) -> str:
    failure = plane.node.failures.get(entry.key)
    if failure is not None:
        return failure.reason
    packing = plane.node.packing
    if entry.key in packing.cold and entry.key not in packing.loading:
        held = packing.no_room.get(entry.key)
        return f"cold: no room now ({held})" if held else "cold: not in memory; the next request loads it"
    return ""
