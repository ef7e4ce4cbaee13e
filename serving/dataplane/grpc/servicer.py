"""inference.GRPCInferenceService (KServe / Triton's Open Inference Protocol over gRPC) on this process's data plane.

Everything behind the protocol is the REST side's: the API key (the `authorization` metadata, `Bearer fy_...`)
is checked by the same `authenticate`; inference passes the same shedding and quota
(`InferenceRequest.admit`) and is served by `Gateway.serve` (routing, deadlines, priorities, admission,
fallback, shadow, usage, metrics); control calls take a request of the quota as REST's do, and load/unload
is REST's `set_loaded`. The request's deadline counts from its arrival, as REST's does: gRPC's own deadline
becomes the request's (never beyond the platform budget). A pipeline is served at a model's name, as REST
serves it (`PipelineRunner.infer`, from a REST body: codec.rest_body). Failures are gRPC statuses
(serving.dataplane.grpc.status), with the message REST would send; a request of a stream that fails is
answered with REST's message and, in its response's parameters, what a unary call's status and trailing
metadata would say.

ServerLive, ServerReady and ServerMetadata are anonymous (probes), as /v2 and /v2/health are; ServerLive and
ServerMetadata answer without a data plane. ModelReady answers ready=false, not NOT_FOUND, for a model the caller
cannot see, as Triton answers for a model it does not have: the same answer for one that does not exist and
one another tenant keeps private. The shared memory, trace and log settings extensions are not offered
(UNIMPLEMENTED, as the generated base answers).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import orjson
from google.protobuf import json_format

from serving.dataplane import plane as dataplane
from serving.dataplane import tracing
from serving.dataplane.errors import DeadlineExceeded, ServingError, Unavailable
from serving.dataplane.gateway.auth import Caller, Forbidden, Unauthenticated, authenticate
from serving.dataplane.gateway.gateway import CLIENT_CLOSED, Reply, parse_version
from serving.dataplane.gateway.pipeline import PipelineRunner
from serving.dataplane.gateway.pipeline import runner_for as pipeline_runner
from serving.dataplane.grpc import codec
from serving.dataplane.grpc.proto import grpc_service_pb2 as pb
from serving.dataplane.grpc.proto import grpc_service_pb2_grpc as rpc
from serving.dataplane.grpc.proto import model_config_pb2
from serving.dataplane.grpc.status import code_of, trailing
from serving.dataplane.http import frontdoor
from serving.dataplane.http.consumers import (
    SERVER_METADATA,
    InferenceRequest,
    _config,
    _default,
    _metadata,
    load_failure,
    model_statistics,
    refuse_load_options,
    repository_state,
)
from serving.dataplane.http.protocol import ProtocolError
from serving.dataplane.metrics import metrics

log = logging.getLogger(__name__)

_SERVER = orjson.loads(SERVER_METADATA)
SERVICE = "inference.GRPCInferenceService"  # the service's full name (the proto's package and service)
# Triton's stream parameters: a request asks for a response flagged final, and such a response says so.
ENABLE_FINAL = "triton_enable_empty_final_response"
FINAL = "triton_final_response"


def _front(rpc_name: str, context: grpc.aio.ServicerContext) -> InferenceRequest:
    """The REST front end's request, for its steps shared by both protocols (shedding, quota, routing key,
    load/unload), over this call's metadata. It arrives now: the handler's start (a stream's request, once it
    has a slot), the first this process sees of it; its wait counts from then (`waited_so_far`)."""
    headers: dict[bytes, bytes] = {}
    for key, value in context.invocation_metadata() or ():
        name = key.lower().encode("latin-1")
        if name not in headers:  # the first of a repeated key counts, as for HTTP headers
            headers[name] = value if isinstance(value, bytes) else value.encode("latin-1")
    return InferenceRequest("POST", f"/inference.GRPCInferenceService/{rpc_name}", headers, 0.0, context.cancelled)


def _answered(span: tracing.Span, status: int) -> None:
    """A traced call's answer: the gRPC code of REST's `status`, as `_abort` answers it (200: OK)."""
    code = grpc.StatusCode.OK if status == 200 else code_of(status)
    tracing.grpc_answered(span, code.value[0], code.name, status)


def _plane() -> dataplane.DataPlane:
    plane = dataplane.current()
    if plane is None:
        raise Unavailable("the data plane is starting", retry_after=1)
    return plane


def _caller(plane: dataplane.DataPlane, front: InferenceRequest, scope: str = "infer") -> Caller:
    caller = authenticate(front.headers.get(b"authorization"), plane.gateway.snapshot, plane.pepper, time.time())
    plane.used_keys.add(caller.prefix)  # last_used_at, written later off this path
    caller.require(scope)
    return caller


def answering(method: Callable) -> Callable:
    """Answer a unary call's ServingError (and a ProtocolError found before routing) with its gRPC status, and
    an unexpected exception with INTERNAL, logged and counted."""

    @functools.wraps(method)
    async def call(self, request, context: grpc.aio.ServicerContext):  # noqa: ANN001, ANN202
        try:
            return await method(self, request, context)
        except ProtocolError as exc:
            await _abort(context, ServingError(exc.message, status=exc.status))
        except ServingError as exc:
            await _abort(context, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:
            log.exception("unhandled error in gRPC %s", method.__name__)
            metrics.INTERNAL_ERRORS.labels("grpc").inc()
            metrics.REQUESTS.labels("", "", "500").inc()
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; the server logged it")

    return call


async def _abort(context: grpc.aio.ServicerContext, exc: ServingError) -> None:
    if isinstance(exc, Unauthenticated | Forbidden):
        metrics.REQUESTS.labels("", "", str(exc.status)).inc()  # refused before routing
    await context.abort(code_of(exc.status), exc.message, trailing_metadata=trailing(exc))


class InferenceServicer(rpc.GRPCInferenceServiceServicer):
    def __init__(self, stream_in_flight: int = 64) -> None:
        self.stream_in_flight = stream_in_flight  # requests of one ModelStreamInfer stream in flight at once

    # -- health and metadata ---------------------------------------------------------------------

    async def ServerLive(self, request, context):  # noqa: ANN001, ANN201, N802
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: ANN001, ANN201, N802
        plane = dataplane.current()
        return pb.ServerReadyResponse(ready=plane is not None and plane.ready)

    async def ServerMetadata(self, request, context):  # noqa: ANN001, ANN201, N802
        return pb.ServerMetadataResponse(**_SERVER)

    @answering
    async def ModelReady(self, request, context):  # noqa: ANN001, ANN201, N802
        plane, front = _plane(), _front("ModelReady", context)
        caller = _caller(plane, front)
        rate = await front._charge(plane, caller.tenant_id)
        routing_key = front._routing_key(caller)
        runner = pipeline_runner(plane.gateway)
        pipeline = runner.find(request.name, caller.tenant_id)  # one the caller may not see: a model's NOT_FOUND
        if pipeline is not None:
            why = runner.unready(pipeline, request.version or None, caller.tenant_id, routing_key, plane.node.is_ready)
            _rate(context, rate)
            return pb.ModelReadyResponse(ready=not why)
        try:
            entry = plane.gateway.route(request.name, request.version or None, caller.tenant_id, routing_key)
        except ServingError as exc:
            if exc.status not in (404, 503):
                raise
            # Not ready, not an error, as Triton answers: unknown (or another tenant's private model, which
            # must answer exactly as unknown), or known with no version ready (loading, or its load failed).
            ready = False
        else:
            ready = plane.node.is_ready(entry.key)
        _rate(context, rate)
        return pb.ModelReadyResponse(ready=ready)

    @answering
    async def ModelMetadata(self, request, context):  # noqa: ANN001, ANN201, N802
        plane, front = _plane(), _front("ModelMetadata", context)
        caller = _caller(plane, front)
        rate = await front._charge(plane, caller.tenant_id)
        version = request.version or None
        runner = pipeline_runner(plane.gateway)
        pipeline = runner.find(request.name, caller.tenant_id)
        if pipeline is not None:
            described = runner.metadata(pipeline, version)
            _rate(context, rate)
            return json_format.ParseDict(described, pb.ModelMetadataResponse())
        model = plane.gateway.model(request.name, caller.tenant_id)
        if version is not None and parse_version(version) not in model.versions:
            raise ServingError(f"model '{request.name}' has no version '{version}'", status=404)
        entry = model.versions[int(version)] if version is not None else _default(model)
        _rate(context, rate)
        return json_format.ParseDict(
            _metadata(request.name, model.versions, entry, version), pb.ModelMetadataResponse()
        )

    @answering
    async def ModelConfig(self, request, context):  # noqa: ANN001, ANN201, N802
        plane, front = _plane(), _front("ModelConfig", context)
        caller = _caller(plane, front)
        rate = await front._charge(plane, caller.tenant_id)
        gateway = plane.gateway
        entry = gateway.route(request.name, request.version or None, caller.tenant_id, front._routing_key(caller))
        config = _config(entry, gateway.snapshot.budget_ms(entry, caller.tenant_id))
        config = json_format.ParseDict(config, model_config_pb2.ModelConfig())
        _rate(context, rate)
        return pb.ModelConfigResponse(config=config)

    @answering
    async def ModelStatistics(self, request, context):  # noqa: ANN001, ANN201, N802
        """Triton's statistics from this process's metrics, for the versions the caller sees (one model's, or
        every model's when `name` is empty): REST's /stats answer (`model_statistics`), as a message."""
        plane, front = _plane(), _front("ModelStatistics", context)
        caller = _caller(plane, front)
        rate = await front._charge(plane, caller.tenant_id)
        stats = model_statistics(plane.gateway, caller.tenant_id, request.name, request.version or None)
        _rate(context, rate)
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    # -- the repository extension ----------------------------------------------------------------

    @answering
    async def RepositoryIndex(self, request, context):  # noqa: ANN001, ANN201, N802
        plane, front = _plane(), _front("RepositoryIndex", context)
        caller = _caller(plane, front)
        rate = await front._charge(plane, caller.tenant_id)
        response = pb.RepositoryIndexResponse()
        for model in plane.gateway.snapshot.models.values():
            if not model.visible_to(caller.tenant_id):
                continue
            for v in model.versions.values():
                state = repository_state(plane, v)
                if request.ready and state != "READY":
                    continue
                reason = v.failure_reason or load_failure(plane, v)
                response.models.add(name=v.model, version=str(v.version), state=state, reason=reason)
        _rate(context, rate)
        return response

    @answering
    async def RepositoryModelLoad(self, request, context):  # noqa: ANN001, ANN201, N802
        plane, front = _plane(), _front("RepositoryModelLoad", context)
        caller = _caller(plane, front, "manage")
        refuse_load_options(request.parameters)
        _rate(context, await front.set_loaded(plane, caller, request.model_name, True))
        return pb.RepositoryModelLoadResponse()

    @answering
    async def RepositoryModelUnload(self, request, context):  # noqa: ANN001, ANN201, N802
        plane, front = _plane(), _front("RepositoryModelUnload", context)
        _rate(context, await front.set_loaded(plane, _caller(plane, front, "manage"), request.model_name, False))
        return pb.RepositoryModelUnloadResponse()

    # -- inference -------------------------------------------------------------------------------

    @answering
    async def ModelInfer(self, request, context):  # noqa: ANN001, ANN201, N802
        response, rate = await self._infer(request, context, "ModelInfer")
        _rate(context, rate)
        return response

    async def _infer(
        self, message: pb.ModelInferRequest, context: grpc.aio.ServicerContext, rpc_name: str
    ) -> tuple[pb.ModelInferResponse, list[tuple[bytes, bytes]]]:
        """One inference request of a unary call or a stream: its response, and the quota's RateLimit fields."""
        plane, front = _plane(), _front(rpc_name, context)
        if not tracing.ENABLED:
            return await self._served(plane, front, message, context)
        # Named and described as OpenTelemetry's RPC conventions say: `{rpc.service}/{rpc.method}`.
        span = tracing.start_request(
            f"{SERVICE}/{rpc_name}",
            tracing.from_metadata(context.invocation_metadata()),
            **{"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": rpc_name, "ferry.model": message.model_name},
        )
        with tracing.active(span, _answered):
            answer = await self._served(plane, front, message, context)
            _answered(span, 200)
            return answer

    async def _served(
        self,
        plane: dataplane.DataPlane,
        front: InferenceRequest,
        message: pb.ModelInferRequest,
        context: grpc.aio.ServicerContext,
    ) -> tuple[pb.ModelInferResponse, list[tuple[bytes, bytes]]]:
        with tracing.child("ferry.auth"):
            caller = _caller(plane, front)
        # The bytes this request holds count against the process's budget of request bodies, shared with REST.
        size = message.ByteSize()
        if not frontdoor.charge(size):
            raise Unavailable("server holds its budget of bytes of request bodies; retry shortly", retry_after=1)
        try:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                # Passed before the call was read: a timeout, not a refusal of work that could still finish.
                raise DeadlineExceeded("the call's gRPC deadline passed before it was served")
            name, version = message.model_name, message.model_version or None
            ticket, limits = await front.admit(plane, name, version, caller.tenant_id)
            try:
                tier, routing_key = limits.priority if limits else 1, front._routing_key(caller)
                # The deadline counts from the request's arrival, `waited` ago (authentication and the quota's
                # round trip are spent from its budget, as REST's are); gRPC's deadline counts from now, so it
                # is moved to the same origin: counted once, whichever is the shorter.
                waited = front.waited_so_far()
                remaining = context.time_remaining()
                timeout = None if remaining is None else waited + remaining
                runner = pipeline_runner(plane.gateway)
                if runner.find(name, caller.tenant_id) is not None:  # a pipeline, served at a model's name
                    reply: Reply | None = await self._pipeline(
                        runner, message, caller.tenant_id, timeout, tier, routing_key, context, waited
                    )
                else:
                    reply = None
                    request = codec.request_of(
                        message,
                        caller.tenant_id,
                        timeout=timeout,
                        tier=tier,
                        routing_key=routing_key,
                        gone=context.cancelled,
                        nbytes=size,
                        waited=waited,
                    )
                    served = await plane.gateway.serve(request)
            finally:
                if ticket is not None:
                    plane.quota.release(ticket)  # type: ignore[union-attr]
        finally:
            frontdoor.discharge(size)
        if reply is not None:
            response = codec.response_of_rest(reply.body, reply.headers)
        else:
            response = codec.response_of(served, request)
        return response, ticket.decision.headers() if ticket is not None else []

    @staticmethod
    async def _pipeline(
        runner: PipelineRunner,
        message: pb.ModelInferRequest,
        viewer: int | None,
        timeout: float | None,
        tier: int,
        routing_key: str,
        context: grpc.aio.ServicerContext,
        waited: float,
    ) -> Reply:
        """A pipeline's call, run as REST runs it (`PipelineRunner.infer`, from a REST body); the body, a second
        copy of the request's bytes, counts against the process's budget too."""
        body, header_length = codec.rest_body(message, timeout)
        if not frontdoor.charge(len(body)):
            raise Unavailable("server holds its budget of bytes of request bodies; retry shortly", retry_after=1)
        try:
            return await runner.infer(
                message.model_name, message.model_version or None, body, header_length, viewer,
                gone=context.cancelled, tier=tier, routing_key=routing_key, waited=waited,
            )  # fmt: skip
        finally:
            frontdoor.discharge(len(body))

    async def ModelStreamInfer(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request down the stream is served as ModelInfer serves one, at most `stream_in_flight` at once
        (past that the stream is not read, so HTTP/2's flow control slows the sender); answers go back as
        they finish, matched by `id` as in Triton. A refusal is that request's `error_message`; the stream
        stays open. A request with `triton_enable_empty_final_response` true is answered as Triton answers one
        of a decoupled model: its response (or refusal) with `triton_final_response` false, then an empty one
        with the request's `id` and `triton_final_response` true, so a client waiting for its final response
        gets it."""
        slots = asyncio.Semaphore(self.stream_in_flight)
        # Each request's answers, at most stream_in_flight requests' at once.
        done: asyncio.Queue[tuple[pb.ModelStreamInferResponse, ...] | None] = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def one(message: pb.ModelInferRequest) -> None:
            final = _final_wanted(message)
            try:
                response, _ = await self._infer(message, context, "ModelStreamInfer")
                answer = pb.ModelStreamInferResponse(infer_response=response)
            except ProtocolError as exc:
                answer = _stream_error(message, ServingError(exc.message, status=exc.status))
            except ServingError as exc:
                if exc.status == CLIENT_CLOSED:
                    slots.release()
                    return
                answer = _stream_error(message, exc)
            except Exception:
                log.exception("unhandled error in gRPC ModelStreamInfer")
                metrics.INTERNAL_ERRORS.labels("grpc").inc()
                answer = _stream_error(message, ServingError("internal error; the server logged it", status=500))
            if final:
                answer.infer_response.parameters[FINAL].bool_param = False
                done.put_nowait((answer, _final_response(message)))
            else:
                done.put_nowait((answer,))

        async def read() -> None:
            try:
                async for message in request_iterator:
                    await slots.acquire()
                    task = asyncio.ensure_future(one(message))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(set(tasks))
            finally:
                done.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                answers = await done.get()
                if answers is None:
                    break
                for answer in answers:
                    yield answer
                slots.release()
            await reader  # a failure to read the stream surfaces here
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()


def _final_wanted(message: pb.ModelInferRequest) -> bool:
    """Whether a stream's request asks for an empty final response (Triton's bool parameter), taking the
    parameter out: it is the stream's to honour, not a parameter of the inference."""
    parameters = message.parameters
    if ENABLE_FINAL not in parameters:
        return False
    wanted = parameters[ENABLE_FINAL]
    asked = wanted.WhichOneof("parameter_choice") == "bool_param" and wanted.bool_param
    del parameters[ENABLE_FINAL]
    return asked


def _final_response(message: pb.ModelInferRequest) -> pb.ModelStreamInferResponse:
    """Triton's empty final response to a stream's request: its model and id, `triton_final_response` true."""
    final = pb.ModelStreamInferResponse(
        infer_response=pb.ModelInferResponse(
            model_name=message.model_name, model_version=message.model_version, id=message.id
        )
    )
    final.infer_response.parameters[FINAL].bool_param = True
    return final


def _stream_error(message: pb.ModelInferRequest, exc: ServingError) -> pb.ModelStreamInferResponse:
    """A stream's answer to a request that failed: Triton's `error_message` (REST's message), and in its
    response's parameters what a unary call would end with: `grpc-code` (the status's name) and, as strings,
    its trailing metadata (`ferry-status`, `retry-after`, the quota's fields)."""
    answer = pb.ModelStreamInferResponse(
        error_message=exc.message,
        infer_response=pb.ModelInferResponse(model_name=message.model_name, id=message.id),
    )
    parameters = answer.infer_response.parameters
    parameters["grpc-code"].string_param = code_of(exc.status).name
    for key, value in trailing(exc):
        parameters[key].string_param = value
    return answer


def _rate(context: grpc.aio.ServicerContext, headers: list[tuple[bytes, bytes]]) -> None:
    """The quota's RateLimit fields of a success, as trailing metadata (REST sends them as headers)."""
    if headers:
        context.set_trailing_metadata(tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers))
