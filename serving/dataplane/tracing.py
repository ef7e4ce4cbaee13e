"""OpenTelemetry traces of the inference path: gateway, queue, batch, device, reply.

Off unless the standard variables ask for it (`wanted`): OTEL_EXPORTER_OTLP_ENDPOINT or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT set, or OTEL_TRACES_EXPORTER set to an exporter (not "none");
OTEL_SDK_DISABLED=true turns it off whatever else is set. Off, the hot path pays one module attribute
read per hook (`ENABLED`) and nothing else: no tracer, no context look-up, no span objects.

On, the same variables say the rest: head sampling (OTEL_TRACES_SAMPLER, default parentbased_always_on;
`parentbased_traceidratio` with OTEL_TRACES_SAMPLER_ARG=0.01 keeps 1%: `sampler`), the service name
(OTEL_SERVICE_NAME, else a `service.name` in OTEL_RESOURCE_ATTRIBUTES, else the process's default), and, read by
the SDK, the OTLP/HTTP exporter's endpoint, headers and timeout, the batch processor's bounded queue
(OTEL_BSP_MAX_QUEUE_SIZE: spans past it are dropped, never held). Only OTLP over http/protobuf is installed: another
OTEL_EXPORTER_OTLP_PROTOCOL fails at start. A request's children are made only while its span records, so an
unsampled request costs one sampler decision. A caller's `traceparent` makes its request's span a child of the
caller's, but its sampled flag decides nothing unless FERRY_TRACES_TRUST_CALLERS=true: any client could otherwise
have every request it sends traced, whatever the ratio (`sampler`).

The spans of one request: the server span, named as OpenTelemetry's conventions name it (REST: `POST
/v2/models/{model_name}/infer`, `http_server`; gRPC: `inference.GRPCInferenceService/ModelInfer`; a WebSocket
message: `WS /ws/v2/models/{model_name}/infer`), the child of an incoming W3C `traceparent`, with children
`ferry.auth`, `ferry.quota`, `ferry.route`, `ferry.admission`, `ferry.queue` (its time in the version's queue),
`ferry.batch` (the batch it ran in: `ferry.batch.rows` and `ferry.batch.requests`, a link to every traced request
in it; the child of the first of them, so that request's trace holds the batch), under it `ferry.device` (the
device's compute), and `ferry.reply`. Where the node is another process (a `runnode`, or the node host of
`serve --workers N`), the node's part sits under `ferry.node` (CONSUMER), whose parent travels with the request
(`carrier`, `from_carrier`), so one trace crosses the processes. A 5xx (gRPC: a server error's code) sets a span's
status to ERROR; a 4xx is the caller's and leaves it unset.

The provider is this module's own (not the API's global one), so tests can configure it more than once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from urllib.parse import unquote

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

ENABLED = False  # read by every hook on the hot path; True only between `configure` and `shutdown`
_tracer: trace.Tracer | None = None
_provider: TracerProvider | None = None
# W3C Trace Context only: the one format the issue and every OIP client speak.
_propagator = TraceContextTextMapPropagator()
TRACE_HEADERS = ("traceparent", "tracestate")
# W3C Trace Context: a tracestate may be cut to 512 characters, by whole members, those over 128 first, then from
# the end. What a request carries to another process is cut so (`carrier`); the stream codec bounds it there too.
TRACESTATE_MAX = 512
TRACESTATE_LONG_MEMBER = 128
CLIENT_CLOSED = 499  # what a request whose client left (or a cancelled call) answers: the gateway's status

SERVER = SpanKind.SERVER
CONSUMER = SpanKind.CONSUMER


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard OTEL_* variables ask for traces."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporters(env: Mapping[str, str]) -> list[SpanExporter]:
    names = [n.strip().lower() for n in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    found: list[SpanExporter] = []
    for name in names:
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            if protocol and protocol.strip().lower() != "http/protobuf":
                # Refused, not sent over HTTP instead: the endpoint of a gRPC collector (:4317) takes no
                # OTLP/HTTP, so every span would be lost with nothing but a warning at start to say so.
                raise ValueError(
                    f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r} is not installed: Ferry exports traces over"
                    " http/protobuf only (point the endpoint at the collector's OTLP/HTTP port, 4318)"
                )
            # Imported here: the exporter pulls in requests and protobuf, which a process with tracing off skips.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            found.append(OTLPSpanExporter())  # endpoint, headers, timeout from the OTEL_EXPORTER_OTLP_* variables
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            found.append(ConsoleSpanExporter())
        elif name != "none":
            raise ValueError(f"OTEL_TRACES_EXPORTER names an exporter Ferry does not ship: {name!r}")
    return found


class _Callers(Sampler):
    """A parent-based sampler's choice for a remote parent: for a server span (a caller's request, whose
    `traceparent` anyone may write) the root sampler's, whatever the caller's sampled flag; for any other (the
    node's `ferry.node`, whose parent is this platform's gateway) the parent's, `parent`."""

    def __init__(self, root: Sampler, parent: Sampler) -> None:
        self._root = root
        self._parent = parent

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        chosen = self._root if kind is SpanKind.SERVER else self._parent
        return chosen.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return f"CallersByRoot{{{self._root.get_description()}}}"


def sampler(env: Mapping[str, str] = os.environ) -> Sampler:
    """The head sampler OTEL_TRACES_SAMPLER names (the specification's names; default parentbased_always_on),
    with OTEL_TRACES_SAMPLER_ARG the ratio of the traceidratio ones (default 1.0). A bad value fails at start.

    A parent-based one follows a caller's sampled flag only with FERRY_TRACES_TRUST_CALLERS=true (a proxy in
    front that samples for the platform): otherwise the root sampler decides a server span whatever its remote
    parent says, so a client cannot have all its requests traced past the ratio (nor, with a 00 flag, hide them).
    Its trace id stays the caller's: the span is still the child of the caller's."""
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    raw = (env.get("OTEL_TRACES_SAMPLER_ARG") or "").strip()
    ratio = 1.0
    if name.endswith("traceidratio") and raw:
        try:
            ratio = float(raw)
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], not {raw!r}") from None
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], not {raw!r}")
    roots: dict[str, Sampler] = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "traceidratio": TraceIdRatioBased(ratio),
    }
    if name in roots:
        return roots[name]
    if name.startswith("parentbased_") and name[len("parentbased_") :] in roots:
        root = roots[name[len("parentbased_") :]]
        if env.get("FERRY_TRACES_TRUST_CALLERS", "").strip().lower() == "true":
            return ParentBased(root)
        return ParentBased(
            root, remote_parent_sampled=_Callers(root, ALWAYS_ON), remote_parent_not_sampled=_Callers(root, ALWAYS_OFF)
        )
    raise ValueError(f"OTEL_TRACES_SAMPLER names a sampler Ferry does not know: {name!r}")


def configure(
    env: Mapping[str, str] = os.environ,
    *,
    exporter: SpanExporter | None = None,
    service: str = "ferry",
) -> bool:
    """Turn tracing on when `env` asks for it, or with `exporter` (tests: every span handed over as it ends).
    Returns whether it is on. A second call replaces the first's provider (flushed and shut down)."""
    shutdown()
    if exporter is None and not wanted(env):
        return False
    global ENABLED, _tracer, _provider
    resource = Resource.create(resource_attributes(env, service))
    provider = TracerProvider(resource=resource, sampler=sampler(env))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        for each in _exporters(env):
            provider.add_span_processor(BatchSpanProcessor(each))
    _provider = provider
    _tracer = provider.get_tracer("ferry.serving")
    ENABLED = True
    return True


def resource_attributes(env: Mapping[str, str], service: str) -> dict[str, str]:
    """The resource's attributes as the specification reads them from `env`: OTEL_RESOURCE_ATTRIBUTES
    (`key=value` pairs, percent-decoded), OTEL_SERVICE_NAME over its `service.name`, and `service` (the
    process's default name) only where neither names the service."""
    found: dict[str, str] = {}
    for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            found[key.strip()] = unquote(value.strip())
    named = env.get("OTEL_SERVICE_NAME") or found.get("service.name")
    found["service.name"] = named or service
    return found


def shutdown() -> None:
    """Flush what is queued and turn tracing off."""
    global ENABLED, _tracer, _provider
    provider, _provider = _provider, None
    ENABLED, _tracer = False, None
    if provider is not None:
        provider.shutdown()


def force_flush(timeout_ms: int = 5000) -> bool:
    return _provider.force_flush(timeout_ms) if _provider is not None else True


# -- context in and out ----------------------------------------------------------------------


def from_headers(headers: Mapping[bytes, bytes]) -> Context | None:
    """The W3C trace context of an HTTP request (lower-case header names, as the front door keeps them);
    None when it carries none, or a malformed one (a bad `traceparent` starts a new trace, never an error)."""
    raw = headers.get(b"traceparent")
    if raw is None:
        return None
    carrier = {"traceparent": raw.decode("latin-1")}
    state = headers.get(b"tracestate")
    if state is not None:
        carrier["tracestate"] = state.decode("latin-1")
    return from_carrier(carrier)


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The W3C trace context of a gRPC call's invocation metadata (`context.invocation_metadata()`)."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        name = key.lower()
        if name in TRACE_HEADERS and name not in carrier:
            carrier[name] = value.decode("latin-1") if isinstance(value, bytes) else value
    return from_carrier(carrier) if "traceparent" in carrier else None


def from_carrier(carrier: Mapping[str, str] | None) -> Context | None:
    """A context from a carrier of W3C headers (the stream entry's `trace`); None when it holds no valid one."""
    if not carrier:
        return None
    context = _propagator.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def carrier() -> dict[str, str] | None:
    """The current span's W3C headers, to travel with a request to another process; None while nothing
    records (tracing off, or the request not sampled: the node then traces nothing of it either)."""
    if not ENABLED or not trace.get_current_span().is_recording():
        return None
    out: dict[str, str] = {}
    _propagator.inject(out)
    state = out.get("tracestate")
    if state is not None and len(state) > TRACESTATE_MAX:
        # A caller's tracestate may be longer than the other process takes: cut, never a reason to fail.
        cut = fit_tracestate(state)
        if cut:
            out["tracestate"] = cut
        else:
            del out["tracestate"]
    return out or None


def fit_tracestate(state: str, limit: int = TRACESTATE_MAX) -> str:
    """`state` cut to `limit` characters as W3C Trace Context cuts a tracestate: whole members only, those
    longer than 128 characters first, then from the end (the oldest); "" when none is left."""
    members = [m.strip() for m in state.split(",") if m.strip()]
    if len(",".join(members)) > limit:
        members = [m for m in members if len(m) <= TRACESTATE_LONG_MEMBER]
    while members and len(",".join(members)) > limit:
        members.pop()
    return ",".join(members)


# -- spans -------------------------------------------------------------------------------------


class _Noop(contextlib.AbstractContextManager):
    """What `child` gives while nothing records: enters as None, so a hook can test for a span."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NOOP = _Noop()


def start_request(name: str, parent: Context | None = None, *, kind: SpanKind = SERVER, **attributes: object) -> Span:
    """The span of one request, the child of `parent` (an incoming context) or a new trace's root. The
    sampler decides here; a request it drops gets a non-recording span and no children. Call only when on."""
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes or None)  # type: ignore[union-attr]


# How a span records its request's answer, by the HTTP status the REST side would answer (a `ServingError`'s).
Answered = Callable[[Span, int], None]


def http_answered(span: Span, status: int) -> None:
    """An HTTP server span's answer (OpenTelemetry's HTTP conventions): `http.response.status_code`; a 5xx
    also `error.type` (the status) and ERROR. A 4xx is the caller's error, not the server's: status unset."""
    if span.is_recording():
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR))


def answered(span: Span, status: int) -> None:
    """The answer of a span that is no HTTP exchange (a WebSocket message, the node's part of a request):
    `ferry.status`, the HTTP status the REST side would answer; a 5xx also `error.type` and ERROR."""
    if span.is_recording():
        span.set_attribute("ferry.status", status)
        if status >= 500:
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR))


# OpenTelemetry's RPC conventions: the gRPC codes that are the server's error (an ERROR server span); the others
# (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, CANCELLED, ...) are the caller's, and leave the status unset.
GRPC_SERVER_ERRORS = frozenset({2, 4, 12, 13, 14, 15})  # UNKNOWN, DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL,
# UNAVAILABLE, DATA_LOSS


def grpc_answered(span: Span, code: int, name: str, status: int) -> None:
    """A gRPC server span's answer: `rpc.grpc.status_code` (`code`, named `name`), `ferry.status` (the HTTP
    status REST would answer, which the call's trailing metadata carries as ferry-status); ERROR and `error.type`
    (the code's name) for a server error's code."""
    if span.is_recording():
        span.set_attribute("rpc.grpc.status_code", code)
        span.set_attribute("ferry.status", status)
        if code in GRPC_SERVER_ERRORS:
            span.set_attribute("error.type", name)
            span.set_status(Status(StatusCode.ERROR))


def active(span: Span | None, on_error: Answered = http_answered) -> contextlib.AbstractContextManager:
    """Make `span` current for the block and end it after; None (tracing off) is the shared no-op. An
    exception leaving the block is recorded by `on_error` with its status: a `ServingError`'s, 500 for any
    other, 499 for a cancellation (the client left)."""
    return NOOP if span is None else _active(span, on_error)


@contextlib.contextmanager
def _active(span: Span, on_error: Answered) -> Iterator[Span]:
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield span
        except asyncio.CancelledError:
            on_error(span, CLIENT_CLOSED)
            raise
        except Exception as exc:
            on_error(span, getattr(exc, "status", 500))
            raise


def server_address(host: bytes | None) -> dict[str, object]:
    """`server.address` and `server.port` of a request's Host header (OpenTelemetry's HTTP server
    conventions); the port only where the header names one."""
    if not host:
        return {}
    text = host.decode("latin-1")
    if text.startswith("["):  # an IPv6 literal: [::1]:8000
        address, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        address, _, port = text.partition(":")
    found: dict[str, object] = {"server.address": address}
    if port.isdigit():
        found["server.port"] = int(port)
    return found


def child(name: str, **attributes: object) -> contextlib.AbstractContextManager:
    """A child of the current span for the block; nothing (a shared no-op) while nothing records."""
    if not ENABLED:
        return NOOP
    parent = trace.get_current_span()
    if not parent.is_recording():
        return NOOP
    return _tracer.start_as_current_span(  # type: ignore[union-attr]
        name, attributes=attributes or None, record_exception=False, set_status_on_exception=False
    )


def since() -> int:
    """The start of a step a hook may record with `mark`: now in ns while traces are on, else 0. A hook's cost
    with traces off is then two flag reads and no call into a context manager:

        begun = tracing.since() if tracing.ENABLED else 0
        ...the step...
        if begun:
            tracing.mark("ferry.step", begun)
    """
    return time.time_ns()


def mark(name: str, begun_ns: int, **attributes: object) -> None:
    """Record a step that ran from `begun_ns` to now as a child of the current span, if it records."""
    if _tracer is None or not trace.get_current_span().is_recording():
        return
    span = _tracer.start_span(name, attributes=attributes or None, start_time=begun_ns)
    span.end()


def start_child(name: str, **attributes: object) -> Span | None:
    """A child of the current span that the caller ends (`end`); None while nothing records."""
    if not ENABLED:
        return None
    if not trace.get_current_span().is_recording():
        return None
    return _tracer.start_span(name, attributes=attributes or None)  # type: ignore[union-attr]


def end(span: Span, error: str | None = None) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def now_ns() -> int:
    return time.time_ns()


def _batch_span(queued: list[Span], rows: int, started_ns: int) -> Span | None:
    """The span of a batch that started at `started_ns`: it links to each traced request's span (the parents of
    `queued`, their queue spans) and is the child of the first's. None when none of them is traced."""
    parents = [s.parent for s in queued if getattr(s, "parent", None) is not None]
    if not parents or _tracer is None:
        return None
    context = trace.set_span_in_context(NonRecordingSpan(parents[0]))
    return _tracer.start_span(
        "ferry.batch",
        context=context,
        links=[Link(p) for p in parents],
        attributes={"ferry.batch.rows": rows, "ferry.batch.requests": len(queued)},
        start_time=started_ns,
    )


def batch_failed(queued: list[Span], rows: int, started_ns: int, exc: BaseException) -> None:
    """Record a batch whose run failed (`exc`): its span, ERROR with `error.type` the exception's class, and no
    device span (what the device did is unknown). Its requests' answers say what each got (bisected, 503, 500)."""
    span = _batch_span(queued, rows, started_ns)
    if span is None:
        return
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))
    span.end()


def batch(queued: list[Span], rows: int, started_ns: int, device_offset_s: float, device_s: float) -> None:
    """Record a batch that ran: `queued` are the queue spans of its traced requests (ended already, at
    `started_ns`), `rows` its size; the device computed for `device_s` seconds from `device_offset_s` after
    the batch began. The batch span links to each request's span and is the child of the first's."""
    span = _batch_span(queued, rows, started_ns)
    if span is None or _tracer is None:
        return
    device_start = started_ns + int(device_offset_s * 1e9)
    device = _tracer.start_span(
        "ferry.device", context=trace.set_span_in_context(span), start_time=device_start, attributes={"rows": rows}
    )
    device.end(end_time=device_start + int(device_s * 1e9))
    span.end()
