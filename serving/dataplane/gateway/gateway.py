"""The gateway: route a request by the snapshot, hand it to the transport, shape the answer.

No database access here: everything comes from the routing snapshot held in memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from rollout.routing import RouteError, choose_version
from serving.dataplane import tracing
from serving.dataplane.errors import NotFound, ServingError, Shed, Unavailable
from serving.dataplane.gateway.request import Inference, Served
from serving.dataplane.gateway.shadow import Mirror, may_keep_sample
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub, VersionEntry
from serving.dataplane.http.protocol import InferRequest, ProtocolError, encode_infer_response, parse_infer_request
from serving.dataplane.metrics import metrics
from serving.dataplane.transport.transport import Transport
from serving.policies.batching import SHADOW_PRIORITY
from usage.recorder import UsageRecorder

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": counted, never sent


def parse_version(text: str) -> int | None:
    """A version path segment: ASCII digits only ("²" and "١" pass str.isdigit but are no version)."""
    if not text or len(text) > 9 or not text.isascii() or not text.isdigit():
        return None
    return int(text)


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Gateway:
    def __init__(
        self,
        hub: SnapshotHub,
        transport: Transport,
        clock=time.monotonic,
        *,
        fallback: bool = True,  # noqa: ANN001
        usage: UsageRecorder | None = None,
        ready: Callable[[str], bool] | None = None,
        mirror: Mirror | None = None,
    ) -> None:
        self.hub = hub
        self.transport = transport
        self._clock = clock
        # Off only with admission off (FERRY_ADMISSION=false), for contrast runs.
        self.use_fallback = fallback
        self.usage = usage  # per-tenant metering; None meters nothing
        # Whether a version (by key) is loaded and ready on a node: routing chooses no other. None trusts the
        # snapshot's state (tests with stand-in transports).
        self.ready = ready
        self.mirror = mirror  # shadow traffic (serving.dataplane.gateway.shadow); None mirrors nothing
        # Why a version the node will not serve is not ready (its load failed, it can never fit), if known.
        self.unready_reason: Callable[[str], str] | None = None

    @property
    def snapshot(self) -> RoutingSnapshot:
        snapshot = self.hub.current
        if snapshot is None:
            raise Unavailable("no routing snapshot yet", retry_after=1)
        return snapshot

    def model(self, name: str, viewer: int | None) -> ModelEntry:
        """The model `name` as tenant `viewer` may see it: one it may not see is unknown to it, with the
        same 404 as a model that does not exist. `viewer` None is the data plane's own look-up (metrics)."""
        entry = self.snapshot.models.get(name)
        if entry is None or not entry.visible_to(viewer):
            raise NotFound(f"unknown model '{name}'")
        return entry

    def route(self, name: str, version: str | None, viewer: int | None, routing_key: str = "") -> VersionEntry:
        """The version that serves a request (rollout.routing): pinned by `version`, else by the rules for
        tenant `viewer` and the sticky `routing_key`, among the versions ready on a node."""
        model = self.model(name, viewer)
        pinned = None
        if version is not None:
            pinned = parse_version(version)
            if pinned is None:
                raise NotFound(f"model '{name}' has no version '{version}'")
        try:
            return choose_version(model, pinned, tenant_id=viewer, routing_key=routing_key, ready=self.ready)
        except RouteError as exc:
            message = exc.message
            known = pinned is not None and exc.status == 503 and self.unready_reason is not None
            why = self.unready_reason(f"{name}:{pinned}") if known else ""  # type: ignore[misc]
            if why:  # the node knows better than "loading": a failed load, a version that can never fit
                message = f"model '{name}' version {pinned} cannot be served: {why}"
            raise ServingError(message, status=exc.status, retry_after=1 if exc.status == 503 else None) from None

    async def infer(
        self,
        name: str,
        version: str | None,
        body: bytes,
        header_length: int | None,
        viewer: int | None,
        gone: Callable[[], bool] | None = None,
        tier: int = 1,
        routing_key: str = "",
        waited: float = 0.0,
    ) -> Reply:
        """One REST (KServe V2 / Triton HTTP) inference request: its body decoded for the routed version's
        signature, served by `serve`, and its outputs encoded as JSON or binary tensors. `tier` is the
        caller's tenant's priority tier: a request may ask for a lower priority (a higher level), never a
        higher one. `routing_key` keeps a caller on one side of an experiment or a canary
        (X-Ferry-Routing-Key, else its API key's prefix). `waited`: how long it waited before its handler
        began (`Inference.waited`), spent from its deadline."""
        parsed: list[InferRequest] = []

        def decode(request: Inference, entry: VersionEntry) -> None:
            rest = parse_infer_request(body, header_length, entry.inputs, max_rows=entry.batching.max_batch_size)
            parsed.append(rest)
            request.inputs, request.rows = rest.inputs, rest.rows
            request.parameters, request.id = rest.parameters, rest.id
            if rest.outputs is not None:
                request.outputs = tuple(o.name for o in rest.outputs)

        request = Inference(
            name,
            version,
            viewer,
            tier=tier,
            routing_key=routing_key,
            gone=gone,
            nbytes=len(body),
            decode=decode,
            waited=waited,
        )
        served = await self.serve(request)
        rest = parsed[0]
        entry = served.entry
        begun = tracing.since() if tracing.ENABLED else 0
        try:
            payload, headers = encode_infer_response(
                model_name=entry.model,
                model_version=str(entry.version),
                request_id=rest.id,
                outputs=served.outputs,
                output_specs=entry.outputs,
                requested=rest.outputs,
                binary_output=rest.binary_output,
                parameters={"fallback_from": served.asked.key} if served.fell_back else None,
            )
        except ProtocolError as exc:
            raise ServingError(exc.message, status=exc.status) from None
        if begun:
            tracing.mark("ferry.reply", begun)
        headers.append((b"x-ferry-model-version", str(entry.version).encode()))
        if served.fell_back:
            headers.append((b"x-ferry-fallback-from", served.asked.key.encode()))
        return Reply(200, payload, headers)

    async def serve(self, request: Inference) -> Served:
        """Route, decode (`request.decode`), run and count one inference request, whatever its protocol:
        the deadline is the budget (the platform's, lowered by the version's and the tenant's plan), or the
        client's shorter one (Triton's "timeout" parameter, `request.timeout`); the priority is the one
        asked for within the tenant's tier; a refusal (Unavailable) falls back to the model's fallback when
        there is one; the shadow gets its copy; metrics and usage count the answer, refusals included.
        Raises ServingError (a ProtocolError from decoding becomes one, with its status) for every answer
        but a success."""
        # The deadline counts from when the request reached the machine: what it waited before its handler
        # (in the listen queue, a socket's buffer, the loop's backlog) is spent from its budget, as its client
        # sees it, not given back (pipeline.PipelineRunner.infer counts the same).
        arrived = self._clock() - max(0.0, request.waited)
        name, viewer = request.name, request.viewer
        begun = tracing.since() if tracing.ENABLED else 0
        entry = self.route(name, request.version, viewer, request.routing_key)
        if begun:
            tracing.mark("ferry.route", begun, **{"ferry.version": entry.key})
        asked = vm = metrics.for_version(entry.model, entry.version)
        counted = entry
        try:
            if request.decode is not None:
                request.decode(request, entry)
            # The output names asked for: a remote node answers with only those (stream_codec).
            wanted = request.outputs
            if wanted is not None:
                known = {o.name for o in entry.outputs}
                unknown = [o for o in wanted if o not in known]
                if unknown:
                    raise ProtocolError(f"model '{name}' has no output {unknown[0]!r}")
            budget_ms = self.snapshot.budget_ms(entry, viewer)  # the platform's, the version's, the plan's least
            deadline = arrived + self._timeout(budget_ms, request.parameters, request.timeout)
            priority = _priority(request.parameters, request.tier)
            served = entry
            try:
                outputs = await self.transport.infer(
                    entry,
                    request.inputs,
                    request.rows,
                    deadline,
                    priority,
                    nbytes=request.nbytes,
                    gone=request.gone,
                    tenant=viewer,
                    outputs=wanted,
                )
                if self.mirror is not None:
                    self._mirror(entry, request.inputs, request.rows, request.nbytes, outputs, viewer)
            except Unavailable as refused:
                served = (
                    self._fallback(entry, name, request.rows, viewer, request.routing_key)
                    if self.use_fallback
                    else None
                )
                if served is None:
                    raise
                try:
                    outputs = await self.transport.infer(
                        served,
                        request.inputs,
                        request.rows,
                        deadline,
                        priority,
                        nbytes=request.nbytes,
                        gone=request.gone,
                        tenant=viewer,
                        outputs=wanted,
                    )
                except Unavailable:
                    raise refused from None  # the caller asked for the primary: its refusal is the answer
                # The answer counts for the version that served it; the refusal, for the one asked (its
                # metered `fell_back`, which a rollout's gates count against it).
                metrics.FALLBACKS.labels(entry.model, str(entry.version), served.model).inc()
                if self.usage is not None and viewer is not None:
                    self.usage.fell_back(viewer, entry.model, entry.version)
                vm = metrics.for_version(served.model, served.version)
                counted = served
            for spec in served.outputs:
                if (wanted is None or spec.name in wanted) and spec.name not in outputs:
                    # Never the model's doing nor the client's: a runtime checks every output against the
                    # signature (a model that breaks it fails its batch, 422), and the transports carry every
                    # output asked for. A missing one is a bug in the node or the codec, or a version skew between
                    # processes: 500, logged and counted, not a 503 that invites a retry.
                    log.error("%s answered without its output %r (asked for %s)", served.key, spec.name, wanted)
                    metrics.INTERNAL_ERRORS.labels("gateway_outputs").inc()
                    raise ServingError(f"internal error: the answer lacks output {spec.name!r}; the server logged it")
        except ProtocolError as exc:
            self._answered(vm, counted, viewer, exc.status, self._clock() - arrived)
            asked.saturation.mark("error")
            raise ServingError(exc.message, status=exc.status) from None
        except ServingError as exc:
            self._answered(vm, counted, viewer, exc.status, self._clock() - arrived)
            # Every answer is one kind in the console's figures: a failure that is not a shed (a 504, a 500, a
            # 422) is an error, or a version that only times out would read as all served.
            if isinstance(exc, Shed):
                asked.shed(exc.reason, exc.tier)
            else:
                asked.saturation.mark("error")
            raise
        self._answered(
            vm, counted, viewer, 200, self._clock() - arrived, request.rows, getattr(outputs, "compute_seconds", 0.0)
        )
        fell_back = served is not entry
        asked.saturation.mark("fallback" if fell_back else "served")
        return Served(entry, served, outputs)

    def _mirror(
        self,
        entry: VersionEntry,
        inputs: dict,
        rows: int,
        nbytes: int,
        outputs: dict,
        viewer: int | None,
    ) -> None:
        """Queue this request of tenant `viewer` for the model's shadow when it is its turn, marked whether
        it may be kept as a sample (`may_keep_sample`); never awaited, never raises."""
        snapshot = self.hub.current
        model = snapshot.models.get(entry.model) if snapshot is not None else None
        if snapshot is None or model is None or model.routes.shadow is None:
            return
        try:
            candidate = self.mirror.candidate(model, entry)  # type: ignore[union-attr]
            if candidate is not None:
                self.mirror.offer(
                    model.task,
                    entry,
                    candidate,
                    inputs,
                    rows,
                    nbytes,  # type: ignore[union-attr]
                    outputs,
                    getattr(outputs, "compute_seconds", 0.0),
                    keep_sample=may_keep_sample(model, viewer, snapshot.tenants),
                    budget_ms=snapshot.budget_ms(candidate),
                )
        except Exception:  # a bug in the shadow's path must not cost the caller its answer
            log.exception("mirroring a request of %s failed", entry.key)
            metrics.INTERNAL_ERRORS.labels("shadow").inc()

    def _answered(
        self,
        vm: metrics.VersionMetrics,
        entry: VersionEntry,
        viewer: int | None,
        status: int,
        latency: float,
        rows: int = 0,
        compute_seconds: float = 0.0,
    ) -> None:
        vm.answered(status, latency)
        if self.usage is not None and viewer is not None:
            self.usage.record(viewer, entry.model, entry.version, status, rows, compute_seconds, latency)

    def _fallback(
        self,
        entry: VersionEntry,
        name: str,
        rows: int,
        viewer: int | None,
        routing_key: str = "",
    ) -> VersionEntry | None:
        """The model's smaller fallback, when the caller may see it, it takes the same inputs, gives the
        same outputs and takes a batch this large."""
        fallback_name = self.snapshot.models[name].fallback
        fallback = self.snapshot.models.get(fallback_name) if fallback_name else None
        if fallback is None or not fallback.visible_to(viewer):
            return None
        try:
            candidate = choose_version(fallback, tenant_id=viewer, routing_key=routing_key, ready=self.ready)
        except RouteError:
            return None
        if candidate.inputs != entry.inputs or candidate.outputs != entry.outputs:
            return None
        if rows > candidate.batching.max_batch_size:
            return None
        return candidate

    @staticmethod
    def _timeout(budget_ms: int, parameters: dict, limit: float | None = None) -> float:
        """The request's time in seconds: its version's latency budget (`RoutingSnapshot.budget_ms`), or the
        client's shorter deadline (Triton's "timeout" parameter, and the transport's own `limit`, gRPC's
        deadline). A longer one is cut to the budget, so admission, which admits what can finish by the
        deadline, keeps what it admits within the budget whatever the client asked."""
        # Triton's request parameter "timeout" is in microseconds.
        raw = parameters.get("timeout")
        if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool) or raw <= 0):
            raise ProtocolError("parameter 'timeout' must be a positive integer of microseconds")
        budget = budget_ms / 1000.0
        if limit is not None:
            budget = min(budget, limit)
        return budget if raw is None else min(raw / 1e6, budget)


def _priority(parameters: dict, tier: int = 1) -> int:
    # Triton: 0 means the default level, 1 is the highest; the default is the tenant's tier, and the
    # tier is also the highest level its requests may ask for. The lowest level is the shadow's alone.
    raw = parameters.get("priority", 0)
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise ProtocolError("parameter 'priority' must be a non-negative integer")
    return min(max(raw, tier), SHADOW_PRIORITY - 1)
