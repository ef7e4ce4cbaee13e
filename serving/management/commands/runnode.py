import asyncio
import logging
import signal
import socket
from dataclasses import asdict

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from serving import artifacts
from serving.dataplane import tracing
from serving.dataplane.metrics import node_metrics
from serving.dataplane.node import runtime_process, sandbox
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_process import NodeProcess, facts_for, parse_bytes, parse_labels
from serving.dataplane.node.packing import LoadReport
from serving.dataplane.node.runtime import configure_torch_threads, pick_device
from serving.node_tasks import NodeWorker


class Command(BaseCommand):
    help = (
        "Run a worker node: host model versions and serve their Redis streams (distributed mode, REDIS_URL). "
        "Without CUDA it runs on the CPU with the accelerator, memory and labels it is given."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("--name", default=socket.gethostname(), help="unique in the fleet (default: host name)")
        parser.add_argument("--accelerator", default=None, help="declared accelerator type on CPU, e.g. a10g")
        parser.add_argument("--memory", default=None, help="memory budget, e.g. 24GiB (CUDA: at most the device's)")
        parser.add_argument("--labels", action="append", default=[], help="k=v[,k=v] (repeatable)")
        parser.add_argument("--device", default=settings.FERRY_DEVICE, help="cpu, cuda, cuda:1 (default: cuda if any)")
        parser.add_argument(
            "--metrics-port",
            type=int,
            default=settings.FERRY_NODE_METRICS_PORT,
            help="serve Prometheus /metrics on this port (default FERRY_NODE_METRICS_PORT; 0: off)",
        )

    def handle(self, *args: object, **options: object) -> None:
        if not settings.REDIS_URL:
            raise CommandError("runnode needs REDIS_URL: nodes take requests from Redis streams")
        try:
            memory = parse_bytes(options["memory"]) if options["memory"] else None
            labels = parse_labels(options["labels"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        configure_torch_threads(settings.FERRY_TORCH_THREADS)
        runtime_process.warn_if_inline()
        tracing.configure(service="ferry-node")  # off unless the OTEL_* variables ask for traces
        device = str(pick_device(options["device"]))
        check_sandbox(device)
        facts = facts_for(
            options["name"], device, options["accelerator"], memory, labels, settings.FERRY_NODE_MEMORY_BYTES
        )
        try:
            # uvloop, as the web process runs (frontdoor.uvicorn_config): the stream hop is mostly event-loop work.
            with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                runner.run(self._run(facts, int(options["metrics_port"])))
        except RuntimeError as exc:
            raise CommandError(str(exc)) from None

    async def _run(self, facts, metrics_port: int) -> None:  # noqa: ANN001
        node = Node(
            artifact_path=artifacts.for_node(),
            device=facts.device,
            memory_budget=facts.memory_budget,
            max_queue_bytes=settings.FERRY_MAX_QUEUE_BYTES,
            admission=settings.FERRY_ADMISSION,
            accelerator=facts.accelerator,
            max_queued_loads=settings.FERRY_MAX_QUEUED_LOADS,
            warm_budget=settings.FERRY_NODE_WARM_BYTES,
            mirror_share=settings.FERRY_SHADOW_DEVICE_PERCENT / 100,
            report=_report,
        )
        process = NodeProcess(node, settings.REDIS_URL, facts, on_disk=artifacts.on_node_disk())
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        if metrics_port:
            node_metrics.serve(process, metrics_port)
        await process.start()
        # Load and unload for the placement reconciler: this node's own Celery queue, on a thread of its own.
        worker = NodeWorker(process, loop)
        worker.start()
        self.stdout.write(
            f"node {facts.name}: {facts.accelerator} on {node.device}, budget {facts.memory_budget}"
            f" bytes, labels {facts.labels}",
            ending="\n",
        )
        self.stdout.flush()
        await stopping.wait()
        await asyncio.to_thread(worker.stop)
        await process.stop()
        await asyncio.to_thread(tracing.shutdown)  # export what is still queued


def check_sandbox(device: str) -> None:
    """Build the runtime process's walls once, at start (sandbox.self_check): a node where they cannot be built
    would fail every load while it looked healthy, so it stops here (CommandError: exit 1) saying why, unless
    FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX allows it (then the missing walls are logged at WARNING)."""
    if settings.FERRY_RUNTIME_ISOLATION == "inline":
        return  # no runtime process: warn_if_inline has said so
    try:
        record = sandbox.self_check(
            hidden=runtime_process.hidden_paths(),
            project_root=runtime_process.PROJECT_ROOT,
            device=device,
            required=not settings.FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX,
            timeout_s=settings.FERRY_RUNTIME_START_TIMEOUT_S,
        )
    except sandbox.ConfinementError as exc:
        raise CommandError(f"the model sandbox cannot be built on this machine: {exc}. {sandbox.REQUIREMENT}") from None
    weak = {k: v for k, v in record.skipped.items() if k not in sandbox.OPTIONAL_LAYERS}
    if weak:
        logging.getLogger(__name__).warning(
            "the model sandbox applies without: %s", "; ".join(f"{k} ({v})" for k, v in weak.items())
        )


async def _report(report: LoadReport) -> None:
    """Measurements to the registry, through the control plane's Celery worker (a node never touches the ORM)."""
    from serving.tasks import record_placement

    await asyncio.to_thread(record_placement.delay, asdict(report))


def _loop_factory():  # noqa: ANN202
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
