"""A real OTLP/HTTP trace receiver for tests: the collector's protocol (a protobuf `ExportTraceServiceRequest`
POSTed to /v1/traces), decoded with opentelemetry-proto, in a thread of the test process."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    kind: int
    service: str
    attributes: dict
    links: tuple[str, ...]  # the linked spans' ids
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    server: ThreadingHTTPServer
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1/traces"

    def take(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if trace_id is None or s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(v) -> object:  # noqa: ANN001
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def start() -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                self.send_response(404)
                self.end_headers()
                return
            request = ExportTraceServiceRequest.FromString(body)
            got = []
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        got.append(
                            ReceivedSpan(
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                service=str(resource.get("service.name", "")),
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                links=tuple(link.span_id.hex() for link in s.links),
                                start_ns=s.start_time_unix_nano,
                                end_ns=s.end_time_unix_nano,
                            )
                        )
            with receiver.lock:
                receiver.spans.extend(got)
            payload = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = Receiver(server)
    threading.Thread(target=server.serve_forever, daemon=True, name="otlp-receiver").start()
    return receiver
