"""grpcio's asyncio server for inference.GRPCInferenceService, on the web process's event loop beside HTTP.

Started and stopped by the ASGI lifespan (serving.lifespan) on FERRY_GRPC_HOST:FERRY_GRPC_PORT (8001 by
default, as Triton's; 0 turns it off). Several web processes (`manage.py serve --workers N`) each bind the
same port: grpcio sets SO_REUSEPORT, so the kernel spreads connections over them as it does HTTP's.

Bounded as the REST side is: a message over FERRY_MAX_INFER_BODY_BYTES is refused by grpcio itself
(RESOURCE_EXHAUSTED) before it is held; at most FERRY_GRPC_MAX_CONCURRENT_RPCS calls run at once, past which
a call is answered UNAVAILABLE with `retry-after` (`ConcurrencyLimit`: REST's concurrency limit answers 503
with Retry-After; RESOURCE_EXHAUSTED is the quota's answer), and each ModelStreamInfer stream has at most
FERRY_GRPC_STREAM_IN_FLIGHT requests in flight. The health calls pass that limit (`HEALTH`): a probe of a busy
process must not fail, or Kubernetes restarts a pod for being loaded.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from django.conf import settings

from serving.dataplane.grpc.proto import grpc_service_pb2_grpc as rpc
from serving.dataplane.grpc.servicer import InferenceServicer
from serving.dataplane.http import frontdoor

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0  # calls in progress at shutdown get this long to finish

_server: grpc.aio.Server | None = None

# What a call past the limit is told, as REST's concurrency limit tells an HTTP request (503, Retry-After: 1).
BUSY = "server at its limit of concurrent calls; retry shortly"
BUSY_METADATA = (("ferry-status", "503"), ("retry-after", "1"))
_REFUSED = frontdoor.REFUSED.labels("concurrency")  # REST's refusals at its limit count here too
# The calls `ConcurrencyLimit` neither counts nor refuses: probes, none of which waits on a model (ModelReady
# checks a key and takes a request of the quota, as REST's /ready does: the quota bounds a tenant's rate of
# them). grpcio's backstop (`maximum_concurrent_rpcs`) still counts them: it cannot tell calls apart.
HEALTH = frozenset(f"/inference.GRPCInferenceService/{name}" for name in ("ServerLive", "ServerReady", "ModelReady"))


class ConcurrencyLimit(grpc.aio.ServerInterceptor):
    """At most `limit` calls served at once, health calls (`HEALTH`) aside; one more is answered UNAVAILABLE
    with `ferry-status: 503` and `retry-after: 1` in its trailing metadata. A call found over the limit is
    refused before any of its messages is read (its handler is one that takes a stream and never reads it); one
    let through is counted while its handler runs, and refused at the handler's start if others took the room
    meanwhile.

    grpcio's own `maximum_concurrent_rpcs` stays set, at twice the limit (`start`), as a backstop on the calls
    held at once, refusals included: past it grpcio answers RESOURCE_EXHAUSTED, without metadata."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:  # no such method: grpcio answers UNIMPLEMENTED
            return None
        if details.method in HEALTH:
            return handler
        if self.active >= self.limit:
            return grpc.stream_unary_rpc_method_handler(self._refuse)
        if inspect.iscoroutinefunction(handler.unary_unary):
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.stream_stream), handler.request_deserializer, handler.response_serializer
            )
        return handler  # the generated base's UNIMPLEMENTED answers: nothing to hold

    async def _refuse(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        _REFUSED.inc()
        await context.abort(grpc.StatusCode.UNAVAILABLE, BUSY, trailing_metadata=BUSY_METADATA)

    def _unary(self, behavior: Callable) -> Callable:
        async def counted(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.active >= self.limit:
                await self._refuse(None, context)
            self.active += 1
            try:
                return await behavior(request, context)
            finally:
                self.active -= 1

        return counted

    def _stream(self, behavior: Callable) -> Callable:
        async def counted(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator:
            if self.active >= self.limit:
                await self._refuse(None, context)
            self.active += 1
            try:
                async for response in behavior(requests, context):
                    yield response
            finally:
                self.active -= 1

        return counted


async def start() -> grpc.aio.Server | None:
    """Serve gRPC in this process (None when FERRY_GRPC_PORT is 0); raises when the port cannot be bound."""
    global _server
    port = settings.FERRY_GRPC_PORT
    if not port:
        return None
    limit = settings.FERRY_MAX_INFER_BODY_BYTES
    calls = settings.FERRY_GRPC_MAX_CONCURRENT_RPCS
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            # An answer is bounded by the version's outputs times its batch bound; the protocol's own limit.
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 1),
        ],
        interceptors=[ConcurrencyLimit(calls)],
        maximum_concurrent_rpcs=2 * calls,  # the backstop (ConcurrencyLimit's docstring)
    )
    rpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(settings.FERRY_GRPC_STREAM_IN_FLIGHT), server)
    address = f"{settings.FERRY_GRPC_HOST}:{port}"
    server.add_insecure_port(address)  # raises RuntimeError when the address cannot be bound
    await server.start()
    log.info("gRPC (inference.GRPCInferenceService) on %s", address)
    _server = server
    return server


async def stop() -> None:
    global _server
    server, _server = _server, None
    if server is not None:
        await server.stop(GRACE_SECONDS)
