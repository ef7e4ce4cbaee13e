import asyncio
import logging
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving import wiring
from serving.dataplane.gateway.snapshot import hub
from serving.dataplane.metrics import node_metrics
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_host import NodeHost
from serving.policies.quota import InProcessQuota


class Command(BaseCommand):
    help = (
        "The node host of embedded mode with several web processes: holds the models and the quotas, and answers"
        " the web processes on a Unix socket. `serve --workers N` starts it; it is not run by hand."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--socket", required=True, help="the Unix socket to listen on (mode 0600)")
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=settings.FERRY_NODE_METRICS_PORT,
            help="serve the host's Prometheus /metrics (batches, devices) on 127.0.0.1:PORT (0: off)",
        )

    def handle(self, *args: object, **options: object) -> None:
        if not settings.EMBEDDED or settings.FERRY_NODE_SOCKET:
            raise CommandError("nodehost is embedded mode's (no REDIS_URL), and is not itself a web process")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        try:
            import uvloop  # noqa: PLC0415  (optional: uvicorn[standard] brings it; the loop runs without it)

            factory = uvloop.new_event_loop
        except ImportError:
            factory = None
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(self._run(str(options["socket"]), int(options["metrics_port"])))

    async def _run(self, path: str, metrics_port: int) -> None:
        # The embedded data plane without HTTP: the node, the registry's refresh loop, rollout evaluation, quotas.
        plane = await wiring.start(service="ferry-node")  # its spans are the node's part of a request
        assert isinstance(plane.node, Node)

        async def refresh() -> int:
            await plane.refresh_once()
            if hub.current is not None:
                await plane.wait_reconciled(hub.current.serial)
            return plane.node.reconciled_serial

        quota = plane.quota.local if plane.quota is not None else InProcessQuota()
        host = NodeHost(plane.node, quota, refresh=refresh)
        await host.start(path)
        if metrics_port:
            node_metrics.serve_registry(lambda: hub.current, metrics_port, "127.0.0.1")
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        self.stdout.write(f"node host on {path}: {', '.join(sorted(plane.node.hosted)) or 'nothing loaded'}")
        self.stdout.flush()
        await stopping.wait()
        await host.close()
        await wiring.stop()
