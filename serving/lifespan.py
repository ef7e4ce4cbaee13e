"""ASGI lifespan: start this process's data plane before serving, stop it cleanly on shutdown."""

import logging

from django.conf import settings

from serving import wiring
from serving.dataplane.grpc import server as grpc_server

log = logging.getLogger(__name__)


class Lifespan:
    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    # Without an embedded node the gateway needs Redis to reach the node processes.
                    if settings.FERRY_EMBEDDED_NODE or settings.REDIS_URL:
                        await wiring.start()
                    # gRPC beside HTTP on FERRY_GRPC_PORT (0: off); it answers UNAVAILABLE without a data plane.
                    await grpc_server.start()
                except Exception as exc:
                    log.exception("data plane failed to start")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await grpc_server.stop()
                await wiring.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return
