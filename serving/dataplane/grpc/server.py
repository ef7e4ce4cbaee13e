"""grpcio's asyncio server for inference.GRPCInferenceService, on the web process's event loop beside HTTP.

Started and stopped by the ASGI lifespan (serving.lifespan) on FERRY_GRPC_HOST:FERRY_GRPC_PORT (8001 by
default, as Triton's; 0 turns it off). Several web processes (`manage.py serve --workers N`) each bind the
same port: grpcio sets SO_REUSEPORT, so the kernel spreads connections over them as it does HTTP's.

Bounded as the REST side is: a message over FERRY_MAX_INFER_BODY_BYTES is refused by grpcio itself
(RESOURCE_EXHAUSTED) before it is held; at most FERRY_GRPC_MAX_CONCURRENT_RPCS calls run at once (past that
grpcio answers RESOURCE_EXHAUSTED), and each ModelStreamInfer stream has at most FERRY_GRPC_STREAM_IN_FLIGHT
requests in flight.
"""

from __future__ import annotations

import logging

import grpc
from django.conf import settings

from serving.dataplane.grpc.proto import grpc_service_pb2_grpc as rpc
from serving.dataplane.grpc.servicer import InferenceServicer

log = logging.getLogger(__name__)

GRACE_SECONDS = 5.0  # calls in progress at shutdown get this long to finish

_server: grpc.aio.Server | None = None


async def start() -> grpc.aio.Server | None:
    """Serve gRPC in this process (None when FERRY_GRPC_PORT is 0); raises when the port cannot be bound."""
    global _server
    port = settings.FERRY_GRPC_PORT
    if not port:
        return None
    limit = settings.FERRY_MAX_INFER_BODY_BYTES
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            # An answer is bounded by the version's outputs times its batch bound; the protocol's own limit.
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 1),
        ],
        maximum_concurrent_rpcs=settings.FERRY_GRPC_MAX_CONCURRENT_RPCS,
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
