"""A node process's Prometheus endpoint (`runnode --metrics-port`): the data-plane families this process
writes (ferry_requests_total, ferry_cold_start_seconds, ferry_evictions_total, ferry_artifact_*, ...) plus
the node's own state, read from it at scrape time:

- ferry_node_stream_entries_total{outcome}: what became of each stream entry, one outcome each (served,
  expired, refused, errors, malformed, handed_back); ferry_node_stream_entries_taken_total{state}: those run
  here, by whether their version was loaded (hot) or not (cold); ferry_node_stream_entries_claimed_total: those
  claimed from lost nodes (NodeProcess.counts);
- ferry_node_held_requests{model,version}: requests this node took off a stream and holds (queued or
  running), and ferry_queue_depth (the batchers' queues, already a data-plane gauge);
- ferry_node_versions{state}: versions hot (loaded) and cold (servable, loaded on demand);
  ferry_node_version_hot{model,version}: 1 per loaded version;
- ferry_node_memory_used_bytes, ferry_node_memory_budget_bytes;
- ferry_node_version_load_seconds{model,version}: the measured load time of each version loaded here;
- ferry_node_busy_ratio and ferry_node_work_utilisation_ratio: the device's busy share of the last 10 s (failed
  calls included) and its work utilisation (rows answered at their version's best-batch device seconds over the
  same time; not capped, so a reference that under-prices the device shows above busy); per version
  ferry_node_rows_served_total and ferry_node_work_seconds_total (serving.dataplane.metrics.busy.WorkMeter).

Served by the standard library's WSGI server, a thread per scrape, off the event loop: a scrape never waits
on it, and reads only copies of the node's dicts. At most MAX_CONNECTIONS connections are served at once (one
more is answered 503 without a thread) and each connection waits on its client, reading the request and
writing the answer, until READ_TIMEOUT_S after its start in all (a client that sends or reads nothing, or
drips its request a byte at a time, is dropped at that deadline), so slow connections cannot pin threads.
Access is the web process's (`metrics_access`): the metrics token reads everything; an allowed address without
it reads private names redacted, judged by the routing snapshot the node follows; anyone else gets 401.
"""

from __future__ import annotations

import io
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, ClassVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.dataplane.errors import ServingError
from serving.dataplane.metrics import metrics_access
from serving.dataplane.node.node_process import OUTCOMES, RESIDENCY

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

    from serving.dataplane.gateway.snapshot import RoutingSnapshot
    from serving.dataplane.node.node import Node
    from serving.dataplane.node.node_process import NodeProcess

log = logging.getLogger(__name__)

# Scrapers are a few Prometheus servers, each with one scrape in flight per target, a scrape a few seconds long.
MAX_CONNECTIONS = 16
READ_TIMEOUT_S = 10.0  # per connection, in all: reading the request, writing the answer


class NodeCollector(Collector):
    def __init__(self, process: NodeProcess) -> None:
        self.process = process

    def collect(self) -> Iterator[Metric]:
        process, node = self.process, self.process.node
        counts = dict(process.counts)
        # Three families, not one: each entry has one outcome, and, run here, one state, so a sum over a label
        # counts each entry once.
        entries = CounterMetricFamily(
            "ferry_node_stream_entries", "Stream entries this node handled, by outcome", labels=["outcome"]
        )
        for outcome in OUTCOMES:
            entries.add_metric([outcome], counts.get(outcome, 0))
        yield entries
        taken = CounterMetricFamily(
            "ferry_node_stream_entries_taken",
            "Stream entries this node ran, by whether their version was loaded (hot) or had to be loaded (cold)",
            labels=["state"],
        )
        for state in RESIDENCY:
            taken.add_metric([state], counts.get(state, 0))
        yield taken
        yield CounterMetricFamily(
            "ferry_node_stream_entries_claimed",
            "Stream entries this node claimed from lost nodes",
            value=counts.get("claimed", 0),
        )

        held = GaugeMetricFamily(
            "ferry_node_held_requests",
            "Requests taken off a stream and held (queued or running)",
            labels=["model", "version"],
        )
        for key, n in sorted(process.held().items()):
            held.add_metric(_labels(key), n)
        yield held

        hosted = dict(node.hosted)
        cold = dict(node.packing.cold)
        versions = GaugeMetricFamily("ferry_node_versions", "Versions this node serves, by state", labels=["state"])
        versions.add_metric(["hot"], len(hosted))
        versions.add_metric(["cold"], len([k for k in cold if k not in hosted]))
        yield versions
        hot = GaugeMetricFamily(
            "ferry_node_version_hot", "1 per version loaded on this node", labels=["model", "version"]
        )
        for key in sorted(hosted):
            hot.add_metric(_labels(key), 1)
        yield hot

        yield GaugeMetricFamily(
            "ferry_node_memory_used_bytes",
            "Measured footprint of the loaded versions",
            value=sum(h.runtime.memory_bytes for h in hosted.values()),
        )
        yield GaugeMetricFamily(
            "ferry_node_memory_budget_bytes", "The node's memory budget", value=process.facts.memory_budget
        )

        loads = GaugeMetricFamily(
            "ferry_node_version_load_seconds",
            "Measured load time (cold start) of each version on this node",
            labels=["model", "version"],
        )
        for key, (_footprint, seconds) in sorted(dict(node.packing.measured).items()):
            loads.add_metric(_labels(key), seconds)
        yield loads
        yield from utilisation_families(node)


def utilisation_families(node: Node) -> Iterator[Metric]:
    """Busy time and work utilisation of the node's device (the last 10 s), and per version the rows served and
    what they are worth at the version's best batch size, so a query can divide any window's increase by it."""
    yield GaugeMetricFamily(
        "ferry_node_busy_ratio",
        "Share of the last 10 s the device spent computing, failed calls included",
        value=node.busy.fraction(),
    )
    yield GaugeMetricFamily(
        "ferry_node_work_utilisation_ratio",
        "Rows answered in the last 10 s, each at its version's best-batch device seconds, over the 10 s; not capped:"
        " above ferry_node_busy_ratio, the profile under-prices the device",
        value=node.work.fraction(),
    )
    rows = CounterMetricFamily(
        "ferry_node_rows_served", "Rows this node's device served, per version", labels=["model", "version"]
    )
    work = CounterMetricFamily(
        "ferry_node_work_seconds",
        "Device seconds the rows served would take at the version's best batch size, by the device's own measured"
        " time (serving.policies.utilisation)",
        labels=["model", "version"],
    )
    served, worth = dict(node.work.rows), dict(node.work.work_seconds)
    for key in sorted(served):
        rows.add_metric(_labels(key), served[key])
        work.add_metric(_labels(key), worth.get(key, 0.0))
    yield rows
    yield work


def _labels(key: str) -> list[str]:
    model, _, version = key.rpartition(":")
    return [model, version]


def serve(process: NodeProcess, port: int, addr: str = "0.0.0.0") -> WSGIServer:  # noqa: S104 (a scrape target)
    """Register the node's collector and serve /metrics on `port`; returns the server (shutdown())."""
    REGISTRY.register(NodeCollector(process))
    return serve_registry(lambda: process.hub.current, port, addr)


def serve_registry(
    snapshot: Callable[[], RoutingSnapshot | None],
    port: int,
    addr: str = "0.0.0.0",  # noqa: S104
    max_connections: int = MAX_CONNECTIONS,
    timeout: float = READ_TIMEOUT_S,
) -> WSGIServer:
    """Serve this process's registry on `port` (the node host of embedded mode: its batches, devices and
    runtimes, which its web processes do not see); `snapshot` judges which names a caller may read. At most
    `max_connections` at once, each connection's exchange bounded by `timeout` seconds in all."""
    handler = type("_Handler", (_QuietHandler,), {"timeout": timeout})
    server = make_server(
        addr,
        port,
        MetricsApp(snapshot),
        server_class=_server_class(addr),
        handler_class=handler,
    )
    server.slots = threading.BoundedSemaphore(max_connections)  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, name="node-metrics", daemon=True).start()
    log.info("node metrics on http://%s:%d/metrics", addr, server.server_port)
    return server


StartResponse = Callable[[str, list[tuple[str, str]]], object]


class MetricsApp:
    """The WSGI application: GET /metrics, admitted by `metrics_access`; JSON errors otherwise."""

    def __init__(self, snapshot: Callable[[], RoutingSnapshot | None]) -> None:
        self.snapshot = snapshot

    def __call__(self, environ: dict, start_response: StartResponse) -> Iterable[bytes]:
        try:
            if environ.get("PATH_INFO", "").rstrip("/") != "/metrics":
                raise ServingError("this port serves only /metrics", status=404)
            if environ.get("REQUEST_METHOD") != "GET":
                raise ServingError("/metrics answers GET only", status=405)
            access = metrics_access.configured()
            authorization = environ.get("HTTP_AUTHORIZATION")
            level = access.admit(
                authorization.encode("latin-1") if authorization is not None else None, environ.get("REMOTE_ADDR")
            )
            body = metrics_access.exposition(level, self.snapshot(), access.label_key)
        except ServingError as exc:
            body = orjson.dumps({"error": exc.message})
            headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            headers += [(name.decode(), value.decode()) for name, value in exc.headers]
            start_response(f"{exc.status} {_REASONS.get(exc.status, 'Error')}", headers)
            return [body]
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [body]


_REASONS = {401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}


_BUSY = orjson.dumps({"error": "metrics endpoint at its connection limit; retry shortly"})
_BUSY_ANSWER = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Content-Length: " + str(len(_BUSY)).encode() + b"\r\nConnection: close\r\n\r\n" + _BUSY
)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `slots` at once: one more is answered 503 by the accepting thread,
    without reading it, and closed."""

    daemon_threads = True  # a scrape in progress does not hold the node's exit
    slots: threading.BoundedSemaphore

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self.slots.acquire(blocking=False):
            try:
                request.setblocking(False)  # a fresh socket's buffer takes the answer; never wait on a client
                request.send(_BUSY_ANSWER)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # type: ignore[arg-type]
        except BaseException:
            self.slots.release()  # no thread started to release it
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)  # type: ignore[arg-type]
        finally:
            self.slots.release()

    def handle_error(self, request: object, client_address: object) -> None:  # type: ignore[override]
        if isinstance(sys.exc_info()[1], OSError):  # a client too slow (its deadline passed) or gone: not news
            return
        super().handle_error(request, client_address)  # type: ignore[arg-type]


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


def _server_class(addr: str) -> type[WSGIServer]:
    return _ThreadingServer6 if ":" in addr else _ThreadingServer


class _DeadlinePassed(ConnectionAbortedError):
    """A ConnectionAbortedError, which wsgiref's handler takes as a client gone while answering (no traceback
    on stderr) and the server's handle_error as an OSError, not news."""


class _DeadlineIO(io.RawIOBase):
    """The connection's reads and writes, each waiting at most what is left of one deadline for the whole
    exchange: a per-operation timeout alone lets a client that sends a byte now and then keep it for ever."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def _wait_at_most_what_is_left(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _DeadlinePassed("the connection's deadline passed")
        self.sock.settimeout(left)

    def readinto(self, buffer: WriteableBuffer) -> int:
        self._wait_at_most_what_is_left()
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError as exc:
            raise _DeadlinePassed("the connection's deadline passed") from exc

    def write(self, data: ReadableBuffer) -> int:
        self._wait_at_most_what_is_left()
        try:
            self.sock.sendall(data)  # its timeout bounds the whole call (Python 3.5+), not each send
        except TimeoutError as exc:
            raise _DeadlinePassed("the connection's deadline passed") from exc
        return memoryview(data).nbytes


class _QuietHandler(WSGIRequestHandler):
    """`timeout` (serve_registry's) is the deadline of the connection's whole exchange, from its thread's start."""

    timeout: ClassVar[float] = READ_TIMEOUT_S

    def setup(self) -> None:
        # StreamRequestHandler.setup's socket file objects, here reading and writing through one deadline
        self.connection = self.request
        raw = _DeadlineIO(self.connection, time.monotonic() + self.timeout)
        self.rfile = io.BufferedReader(raw)
        # unbuffered, as the base class's (wbufsize 0, a BufferedIOBase that holds nothing): goes out as written
        self.wfile = raw  # type: ignore[assignment]

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass  # one line per scrape every few seconds would bury the node's own log
