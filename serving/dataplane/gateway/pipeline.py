"""Pipelines on the data plane: one request to /v2/models/{pipeline}/infer runs the pipeline's graph
(`serving.policies.pipeline`), each step an ordinary request to its model through `Gateway.serve`.

So every step is routed (rollouts, pins, experiments), admitted, batched with all other traffic to that model,
mirrored to its shadow, falls back to its model's fallback, and is metered as usage of the calling tenant. The
pipeline's deadline is shared: each step gets what is left of it, so a step that cannot finish in time is
refused at admission (503), and the pipeline answers its own fallback model or that 503. The caller's quota
is charged once, by the front end, for the whole call.

Each step's routed version (stable, canary, an arm, a pin) is held, before it runs, to the signature the
pipeline was checked with (the version the snapshot's check typed the step with): one that takes or gives
other tensors is a 503 (`StepMismatch`, logged), as is a version the check marked broken, and both hand the
call to the pipeline's fallback as a refused step does. Branches run side by side (an ensemble's members, a
switch's two sides); the first to fail cancels the others.

No database access: the pipeline and its graph come from the routing snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Counter, Histogram

from serving.dataplane.errors import NotFound, ServingError, Unavailable
from serving.dataplane.gateway.gateway import CLIENT_CLOSED, Gateway, Reply, parse_version
from serving.dataplane.gateway.request import Inference
from serving.dataplane.gateway.snapshot import PipelineEntry, PipelineVersionEntry, VersionEntry
from serving.dataplane.http.protocol import (
    DATATYPES,
    ProtocolError,
    TensorSpec,
    encode_infer_response,
    parse_infer_request,
)
from serving.dataplane.metrics import process_set
from serving.dataplane.metrics.metrics import LATENCY_BUCKETS
from serving.policies.admission import HEADROOM
from serving.policies.pipeline import (
    REQUEST,
    CombineError,
    Node,
    PipelineError,
    choose_branch,
    combine_answers,
    parse,
    split_reference,
)
from usage import sketch

log = logging.getLogger(__name__)

Tensors = dict[str, np.ndarray]

PLATFORM = "ferry_pipeline"  # the OIP metadata's `platform` of a pipeline (a model's names its format)

STEP_SECONDS = Histogram(
    "ferry_pipeline_step_seconds",
    "Time of each pipeline step, from its request to its answer",
    ["model", "step"],
    buckets=LATENCY_BUCKETS,
)
STEP_ROWS = Counter("ferry_pipeline_step_rows", "Rows each pipeline step ran", ["model", "step"])
PIPELINE_REQUESTS = Counter("ferry_pipeline_requests", "Pipeline calls answered", ["model", "status"])
PIPELINE_FALLBACKS = Counter(
    "ferry_pipeline_fallbacks", "Pipeline calls answered by the pipeline's fallback", ["model"]
)


class StepMismatch(Unavailable):
    """A step's routed version does not take or give what the pipeline was checked with (a canary, an
    experiment's arm or a tenant's pin with another signature, or a model changed since the snapshot's
    check): the platform's routing, not the caller's request, so a 503 that the pipeline's fallback may
    answer instead, with Retry-After (the next call may be routed to a version that fits)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after=1)


@dataclass
class StepStats:
    """What the console shows of one step: calls, rows, refusals, and its recent latencies."""

    calls: int = 0
    rows: int = 0
    refused: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=512))  # seconds of its last calls

    def summary(self) -> dict:
        latencies = sorted(self.recent)
        n = len(latencies)

        def q(p: float) -> float | None:
            return round(latencies[min(n - 1, int(p * n))] * 1000, 2) if n else None

        return {"calls": self.calls, "rows": self.rows, "refused": self.refused, "p50_ms": q(0.5), "p99_ms": q(0.99)}


OWNER = "@"  # between a pipeline's name and its owner in `stats_key`: no name has it (serving.models.MODEL_NAME)


def stats_key(name: str, tenant_id: int | None) -> str:
    """The key of a pipeline's console figures: its name and its owner's tenant ("" for a platform one). A
    pipeline deleted and its name registered again by another tenant starts from nothing: the console never
    shows it the previous owner's steps (often named after that owner's private models) or calls."""
    return f"{name}{OWNER}{'' if tenant_id is None else tenant_id}"


class PipelineStats:
    """Per pipeline (`stats_key`: its name and owner), per step; in this process (each gateway has its own;
    the web processes of one port merge theirs: `live`). Bounded: a step's recent latencies are its last 512,
    and there are as many entries as pipelines' steps: the figures of a name's previous owner are dropped
    when another owner's pipeline of that name is called."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, str], StepStats] = {}
        self.calls: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self._owners: dict[str, str] = {}  # a pipeline's name -> the key its figures are kept under

    def _claim(self, pipeline: str) -> None:
        """Make `pipeline` (a key) the one whose figures its name keeps; the caller holds the lock."""
        name = pipeline.rpartition(OWNER)[0] or pipeline
        held = self._owners.get(name)
        if held == pipeline:
            return
        self._owners[name] = pipeline
        if held is not None:
            self.calls.pop(held, None)
            self.fallbacks.pop(held, None)
            for key in [k for k in self._steps if k[0] == held]:
                del self._steps[key]

    def step(self, pipeline: str, step: str, seconds: float, rows: int, refused: bool) -> None:
        with self._lock:
            self._claim(pipeline)
            stats = self._steps.setdefault((pipeline, step), StepStats())
            stats.calls += 1
            if refused:
                stats.refused += 1
            else:
                stats.rows += rows
                stats.recent.append(seconds)

    def call(self, pipeline: str, fell_back: bool) -> None:
        with self._lock:
            self._claim(pipeline)
            self.calls[pipeline] = self.calls.get(pipeline, 0) + 1
            if fell_back:
                self.fallbacks[pipeline] = self.fallbacks.get(pipeline, 0) + 1

    def of(self, pipeline: str) -> dict:
        """{"calls", "fallbacks", "steps": {step: summary}} of `pipeline` (a key) for the console and the
        benchmark."""
        with self._lock:
            steps = {s: st.summary() for (p, s), st in self._steps.items() if p == pipeline}
            return {"calls": self.calls.get(pipeline, 0), "fallbacks": self.fallbacks.get(pipeline, 0), "steps": steps}

    def docs(self, only: str | None = None) -> dict[str, dict]:
        """Every pipeline's figures (or the pipeline `only`'s), by key, as another web process can merge them
        (`live`): as `of`, each step's recent latencies a usage.sketch instead of its percentiles."""
        with self._lock:
            names = set(self.calls) | {p for p, _ in self._steps}
            out: dict[str, dict] = {}
            for name in names if only is None else names & {only}:
                steps = {}
                for (p, step), st in self._steps.items():
                    if p == name:
                        latency: dict[int, int] = {}
                        for seconds in st.recent:
                            sketch.add(latency, seconds)
                        steps[step] = {"calls": st.calls, "rows": st.rows, "refused": st.refused, "latency": latency}
                out[name] = {"calls": self.calls.get(name, 0), "fallbacks": self.fallbacks.get(name, 0), "steps": steps}
            return out


stats = PipelineStats()


def live(pipeline: str) -> dict:
    """What the console shows of `pipeline` (a `stats_key`): this process's figures (`stats.of`), or, with several web
    processes on one port, all of theirs (`process_set`): counts summed, each step's p50 and p99 from the
    merged sketches of their recent latencies."""
    shared = process_set.current()
    if shared is None:
        return stats.of(pipeline)
    docs = shared.console("pipelines", pipeline, alive_only=False)
    steps: dict[str, dict] = {}
    for doc in docs:
        for step, figures in doc["steps"].items():
            into = steps.setdefault(step, {"calls": 0, "rows": 0, "refused": 0, "latency": {}})
            for count in ("calls", "rows", "refused"):
                into[count] += int(figures[count])
            sketch.merge(into["latency"], figures["latency"])

    def ms(latency: dict[int, int], q: float) -> float | None:
        found = sketch.quantile(latency, q)
        return None if found is None else round(found * 1000, 2)

    return {
        "calls": sum(int(d["calls"]) for d in docs),
        "fallbacks": sum(int(d["fallbacks"]) for d in docs),
        "steps": {
            step: {
                "calls": f["calls"],
                "rows": f["rows"],
                "refused": f["refused"],
                "p50_ms": ms(f["latency"], 0.5),
                "p99_ms": ms(f["latency"], 0.99),
            }
            for step, f in steps.items()
        },
    }


@dataclass(slots=True)
class _Call:
    """One pipeline call's shared state: its deadline, and what every step inherits."""

    pipeline: str
    key: str  # its figures' (`stats_key`)
    deadline: float
    viewer: int | None
    tier: int
    routing_key: str
    gone: Callable[[], bool] | None
    parameters: dict
    draw: Callable[[], float]
    steps: dict[str, int] = field(default_factory=dict)  # rows each step ran


def _rows(tensors: Tensors) -> int:
    return next(iter(tensors.values())).shape[0] if tensors else 0


def _take(tensors: Tensors, index: np.ndarray) -> Tensors:
    return {k: v[index] for k, v in tensors.items()}


class PipelineRunner:
    def __init__(self, gateway: Gateway, clock: Callable[[], float] = time.monotonic) -> None:
        self.gateway = gateway
        self._clock = clock
        self._graphs: dict[tuple[str, int], tuple[dict, Node]] = {}
        self._draw = random.Random().random
        self._warned: set[tuple[str, str, str]] = set()  # the mismatches logged (`_mismatch`)

    def find(self, name: str, viewer: int | None) -> PipelineEntry | None:
        """The pipeline `name` if there is one `viewer` may see; None lets the request go on as a model's
        (whose 404 is the same for a pipeline the caller may not see)."""
        snapshot = self.gateway.hub.current
        entry = snapshot.pipelines.get(name) if snapshot is not None else None
        if entry is None or not entry.visible_to(viewer):
            return None
        return entry

    def graph(self, pipeline: PipelineEntry, version: PipelineVersionEntry) -> Node:
        key = (pipeline.name, version.version)
        held = self._graphs.get(key)
        if held is None or held[0] is not version.spec:
            if len(self._graphs) > 4096:  # pipelines deleted over a long life
                self._graphs.clear()
            held = self._graphs[key] = (version.spec, parse(version.spec))
        return held[1]

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
        """Run and answer one call of pipeline `name`, as `Gateway.infer` answers a model's (the same
        arguments, so the front end calls either). `waited`: how long the request already waited in this
        process before its handler ran (the front door's measure, from its first byte); the call's deadline
        counts from then."""
        arrived = self._clock() - max(0.0, waited)
        pipeline = self.find(name, viewer)
        if pipeline is None:
            raise NotFound(f"unknown model '{name}'")
        key = stats_key(name, pipeline.tenant_id)
        status = 500
        fell_back = False
        try:
            chosen = self._pick(pipeline, version)
            try:
                # A broken version's stored signature still reads the request: its fallback may answer it.
                request = parse_infer_request(body, header_length, chosen.inputs, max_rows=chosen.max_rows)
                known = {o.name for o in chosen.outputs}
                for wanted in request.outputs or ():
                    if wanted.name not in known:
                        raise ProtocolError(f"pipeline '{name}' has no output {wanted.name!r}")
                budget_ms = self.gateway.snapshot.tenant_budget_ms(viewer)  # the platform's, or the plan's lower
                # The steps run against HEADROOM of the call's time. A model's request holds back the rest
                # for its front end at admission; a pipeline's steps each hold back a share of what is left
                # to them, which shrinks step by step, so the call holds back its own share once, for what
                # runs after the last step: merging, encoding, writing, and the hand-backs of a late loop.
                deadline = arrived + HEADROOM * Gateway._timeout(budget_ms, request.parameters)
            except ProtocolError as exc:
                raise ServingError(exc.message, status=exc.status) from None
            call = _Call(
                name,
                key,
                deadline,
                viewer,
                tier,
                routing_key,
                gone,
                {k: v for k, v in request.parameters.items() if k == "priority"},
                self._draw,
            )
            try:
                if chosen.broken:
                    raise ServingError(self._broken(pipeline, chosen, viewer), status=503)
                scope = {REQUEST: request.inputs}
                outputs = await self._run(self.graph(pipeline, chosen), request.inputs, scope, request.rows, call)
                self._check_outputs(chosen, outputs, call)
                model_name, model_version, specs = name, str(chosen.version), chosen.outputs
            except ServingError as refused:
                # Only a refusal (503: shed, queue full, not ready, a broken version, a routed version of
                # another signature) falls back: a 4xx is about the request, which the fallback would refuse too.
                if refused.status != 503:
                    raise
                served = await self._fallback(pipeline, chosen, request.inputs, request.rows, call)
                if served is None:
                    raise
                fell_back = True
                outputs, entry = served
                model_name, model_version, specs = entry.model, str(entry.version), entry.outputs
            try:
                payload, headers = encode_infer_response(
                    model_name=model_name,
                    model_version=model_version,
                    request_id=request.id,
                    outputs=outputs,
                    output_specs=specs,
                    requested=request.outputs,
                    binary_output=request.binary_output,
                    parameters={"fallback_from": f"{name}:{chosen.version}"} if fell_back else None,
                )
            except ProtocolError as exc:
                raise ServingError(exc.message, status=exc.status) from None
            headers.append((b"x-ferry-model-version", model_version.encode()))
            headers.append((b"x-ferry-pipeline-steps", _steps_header(call.steps).encode()))
            if fell_back:
                headers.append((b"x-ferry-fallback-from", f"{name}:{chosen.version}".encode()))
            status = 200
            return Reply(200, payload, headers)
        except ServingError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            # Its client left (a gRPC call cancelled, a stream closed): 499 as the gateway counts it, not a 500.
            status = CLIENT_CLOSED
            raise
        finally:
            PIPELINE_REQUESTS.labels(name, str(status)).inc()
            if status == 200:
                stats.call(key, fell_back)
            if fell_back:
                PIPELINE_FALLBACKS.labels(name).inc()

    def metadata(self, pipeline: PipelineEntry, version: str | None) -> dict:
        """The OIP model metadata of `pipeline` (of its version `version`, else of the one unpinned calls
        run): its versions and the signature its registration derived."""
        chosen = self._pick(pipeline, version)
        return {
            "name": pipeline.name,
            "versions": [version] if version else [str(v) for v in sorted(pipeline.versions)],
            "platform": PLATFORM,
            "inputs": [s.to_metadata() for s in chosen.inputs],
            "outputs": [s.to_metadata() for s in chosen.outputs],
        }

    def unready(
        self,
        pipeline: PipelineEntry,
        version: str | None,
        viewer: int | None,
        routing_key: str,
        is_ready: Callable[[str], bool],
    ) -> str:
        """Why the version of `pipeline` a call of `viewer` would run cannot serve now, or "" when it can:
        it is not broken and every step's model routes, for this caller, to a version `is_ready` (by key).
        Every step counts, a switch's or splitter's branch too: any of them may be asked. A step whose model
        the caller may not see is said without the model's name (`_said`)."""
        chosen = self._pick(pipeline, version)
        if chosen.broken:
            return self._broken(pipeline, chosen, viewer)
        for step in self.graph(pipeline, chosen).steps():
            pinned = str(step.version) if step.version is not None else None
            try:
                entry = self.gateway.route(step.model, pinned, viewer, routing_key)
            except NotFound:
                return self._not_available(pipeline.name, step, viewer)
            except ServingError as exc:  # known to the caller, but no version of it can serve now
                return f"pipeline '{pipeline.name}' step '{step.label()}': {exc.message}"
            if not is_ready(entry.key):
                where = f"pipeline '{pipeline.name}' step '{step.label()}'"
                return f"{where}: model '{step.model}' version {entry.version} is loading"
        return ""

    def _pick(self, pipeline: PipelineEntry, version: str | None) -> PipelineVersionEntry:
        """The version `version` names (404 when it has none), else the latest."""
        number = pipeline.latest
        if version is not None:
            pinned = parse_version(version)
            if pinned is None or pinned not in pipeline.versions:
                raise NotFound(f"pipeline '{pipeline.name}' has no version '{version}'")
            number = pinned
        return pipeline.versions[number]

    def _broken(self, pipeline: PipelineEntry, chosen: PipelineVersionEntry, viewer: int | None) -> str:
        """Why `chosen` cannot run, as `viewer` may be told it. The snapshot's check names steps, tensors
        (`S.X`) and at times a step's model, so where any step's model is one the caller may not see (gone
        private since: the usual reason a version breaks) it says only that a step is not available."""
        said = chosen.broken
        if any(not self._sees(step.model, viewer) for step in self.graph(pipeline, chosen).steps()):
            said = "a step of this pipeline is not available"
        return f"pipeline '{pipeline.name}' version {chosen.version} cannot run: {said}"

    def _not_available(self, pipeline: str, step: Node, viewer: int | None) -> str:
        return f"pipeline '{pipeline}': {self._said(step, viewer)} of this pipeline is not available"

    def _said(self, step: Node, viewer: int | None) -> str:
        """How an answer to `viewer` names `step`: by its name, unless that is the name of a model the caller
        may not see (a step without a `name` is named after its model), as the API unsays it
        (`serving.pipelines.redact_spec`): a public pipeline must not tell its callers a private model's name."""
        return "a step" if self._unsaid(step, viewer) else f"step '{step.name}'"

    def _unsaid(self, step: Node, viewer: int | None) -> bool:
        return step.name == step.model and not self._sees(step.model, viewer)

    def _sees(self, name: str, viewer: int | None) -> bool:
        model = self.gateway.snapshot.models.get(name)
        return model is not None and model.visible_to(viewer)

    def _checked_outputs(self, step: Node) -> tuple[TensorSpec, ...] | None:
        """The outputs of the version the snapshot's check typed `step` with (the version it names, else its
        model's stable one, as `serving.pipelines.snapshot_signatures` takes them); None where the snapshot
        has no such version (the check then marked the pipeline's version broken)."""
        model = self.gateway.snapshot.models.get(step.model)
        if model is None:
            return None
        number = step.version if step.version is not None else model.routes.stable
        entry = model.versions.get(number) if number is not None else None
        return entry.outputs if entry is not None else None

    def _mismatch(self, call: _Call, node: Node | None, what: str, entry: VersionEntry | None = None) -> StepMismatch:
        """The refusal of a call where `node` (a step; a switch or an ensemble merging; None: the graph's
        answer) met a version of another signature than the pipeline was checked with: a 503
        (`StepMismatch`). Logged once per pipeline, node and version in this process: the platform's routing
        is at fault, and its operator is to hear of it. A step whose model the caller may not see is said
        without the model's name (`_said`)."""
        if node is None:
            where = ""
        elif node.kind == "model":
            where = f" {self._said(node, call.viewer)}"
            what = f"version {entry.version} of its model {what}" if entry is not None else what
        else:
            where = f" {node.kind}" + (f" '{node.name}'" if node.name else "")
        key = (call.key, node.label() if node is not None else "", entry.key if entry is not None else "")
        if key not in self._warned:
            if len(self._warned) > 4096:  # pipelines and versions come and go over a long life
                self._warned.clear()
            self._warned.add(key)
            log.warning("pipeline %s %s %s: %s", call.pipeline, key[1], key[2], what)
        return StepMismatch(f"pipeline '{call.pipeline}'{where}: {what}")

    def _check_outputs(self, chosen: PipelineVersionEntry, outputs: Tensors, call: _Call) -> None:
        """The graph's answer has the outputs the pipeline's version declares, each of its type and shape: the
        encoder converts a datatype and never checks a shape, so a version answering apart would otherwise
        answer the caller something else than the metadata says, silently."""
        for spec in chosen.outputs:
            value = outputs.get(spec.name)
            if value is None or not _fits(value, spec):
                raise self._mismatch(call, None, f"its graph did not answer its output '{spec.name}' as declared")

    async def _run(self, node: Node, current: Tensors, scope: dict[str, Tensors], rows: int, call: _Call) -> Tensors:
        if node.kind == "model":
            response = await self._step(node, current, scope, rows, call)
        elif node.kind == "sequence":
            response = current
            for child in node.children:
                response = await self._run(child, response, scope, rows, call)
        elif node.kind == "switch":
            response = await self._switch(node, current, scope, rows, call)
        elif node.kind == "ensemble":
            branches = [dict(scope) for _ in node.children]
            answers = await _all(
                [self._run(c, current, b, rows, call) for c, b in zip(node.children, branches, strict=True)]
            )
            for b in branches:
                scope.update({k: v for k, v in b.items() if k not in scope})
            try:
                response = combine_answers(node.combine, answers)
            except CombineError as exc:  # members that answered apart, past `_step`'s check
                raise self._mismatch(call, node, f"its members' answers do not combine: {exc.message}") from None
        else:  # splitter: one branch for the whole call
            branch = choose_branch(node.weights, call.draw())
            response = await self._run(node.children[branch], current, dict(scope), rows, call)
        if node.name:
            scope[node.name] = response
        return response

    async def _switch(self, node: Node, current: Tensors, scope: dict[str, Tensors], rows: int, call: _Call) -> Tensors:
        condition = node.condition
        assert condition is not None
        tested = _resolve(condition.tensor, current, scope)
        if tested is None:
            raise self._mismatch(call, node, "the tensor its condition tests is not there")
        tested = np.asarray(tested)
        if tested.ndim > 1 and 0 in tested.shape[1:]:
            # A step's variable dimension answered empty for this input (a request's is at least 1): no
            # version or retry would test it otherwise, so the request's answer, not a refusal to fall back on.
            raise ServingError(
                f"pipeline '{call.pipeline}' switch '{node.label()}': the tensor its condition tests is empty"
                " for this request",
                status=422,
            )
        try:
            mask = condition.rows(tested)
        except CombineError as exc:
            raise self._mismatch(call, node, f"its condition cannot test its tensor: {exc.message}") from None
        then_rows = np.flatnonzero(mask)
        else_rows = np.flatnonzero(~mask)
        otherwise = node.children[1] if node.has_else else None

        async def branch(child: Node | None, index: np.ndarray) -> Tensors:
            if child is None:
                return _take(current, index) if len(index) != rows else current
            if len(index) == rows:
                return await self._run(child, current, dict(scope), rows, call)
            sub_scope = {k: _take(v, index) for k, v in scope.items()}
            return await self._run(child, _take(current, index), sub_scope, len(index), call)

        parts = []
        if len(then_rows):
            parts.append((then_rows, branch(node.children[0], then_rows)))
        if len(else_rows):
            parts.append((else_rows, branch(otherwise, else_rows)))
        answers = await _all([p[1] for p in parts])
        if len(parts) == 1:
            return answers[0]
        merged: Tensors = {}
        try:
            for name in answers[0]:
                first = answers[0][name]
                out = np.empty((rows, *first.shape[1:]), dtype=first.dtype)
                for (index, _), answer in zip(parts, answers, strict=True):
                    out[index] = answer[name]
                merged[name] = out
        except (ValueError, KeyError) as exc:  # numpy's, for branches that answered apart, past `_step`'s check
            raise self._mismatch(call, node, f"its branches' answers do not merge ({exc})") from None
        return merged

    async def _step(self, node: Node, current: Tensors, scope: dict[str, Tensors], rows: int, call: _Call) -> Tensors:
        left = call.deadline - self._clock()
        started = self._clock()
        if left <= 0:
            stats.step(call.key, node.name, 0.0, rows, refused=True)
            raise Unavailable(
                f"pipeline '{call.pipeline}': its deadline was spent before {self._said(node, call.viewer)}",
                retry_after=1,
            )
        mapped = dict(node.inputs)
        checked = self._checked_outputs(node)

        def decode(request: Inference, entry: VersionEntry) -> None:
            # The version routed to (a canary, an arm, a pin) is held to what the pipeline was checked with,
            # before it runs: its inputs against the tensors handed to it, its outputs against those of the
            # version the check typed the step with, which the steps after it, a merge or a combination and
            # the pipeline's own outputs were checked against.
            inputs = {}
            for spec in entry.inputs:
                value = _resolve(mapped.get(spec.name, spec.name), current, scope)
                if value is None or not _fits(value, spec):
                    raise self._mismatch(
                        call, node, f"does not take what the pipeline gives its input '{spec.name}'", entry
                    )
                inputs[spec.name] = value
            if checked is not None and entry.outputs is not checked and not _gives(entry.outputs, checked):
                raise self._mismatch(call, node, "does not give the outputs the pipeline was checked with", entry)
            if rows > entry.batching.max_batch_size:  # the call's rows are within the checked versions' batches
                raise self._mismatch(
                    call, node, f"takes at most {entry.batching.max_batch_size} rows, the call has {rows}", entry
                )
            request.inputs, request.rows = inputs, rows
            request.nbytes = sum(v.nbytes for v in inputs.values())

        request = Inference(
            node.model,
            str(node.version) if node.version is not None else None,
            call.viewer,
            parameters=dict(call.parameters),
            timeout=left,
            tier=call.tier,
            routing_key=call.routing_key,
            gone=call.gone,
            decode=decode,
        )
        try:
            served = await self.gateway.serve(request)
        except NotFound:
            # The caller may not see the step's model (made private since), or it is gone: the pipeline
            # cannot be served to this caller; the model's name stays unsaid.
            stats.step(call.key, node.name, self._clock() - started, rows, refused=True)
            raise ServingError(self._not_available(call.pipeline, node, call.viewer), status=503) from None
        except ServingError:
            stats.step(call.key, node.name, self._clock() - started, rows, refused=True)
            raise
        seconds = self._clock() - started
        STEP_SECONDS.labels(call.pipeline, node.name).observe(seconds)
        STEP_ROWS.labels(call.pipeline, node.name).inc(rows)
        stats.step(call.key, node.name, seconds, rows, refused=False)
        call.steps[node.name] = call.steps.get(node.name, 0) + rows
        return dict(served.outputs)

    async def _fallback(
        self, pipeline: PipelineEntry, chosen: PipelineVersionEntry, inputs: Tensors, rows: int, call: _Call
    ) -> tuple[Tensors, VersionEntry] | None:
        """The pipeline's fallback model's answer to the whole call in what is left of its deadline, or None
        (no fallback, it refused too, or the version routed to does not take the inputs or give the outputs
        of the pipeline's version `chosen`: the step's refusal is then the answer)."""
        if not pipeline.fallback:
            return None
        left = call.deadline - self._clock()
        if left <= 0:
            return None

        def decode(request: Inference, entry: VersionEntry) -> None:
            if any(spec.name not in inputs or not _fits(inputs[spec.name], spec) for spec in entry.inputs):
                raise Unavailable("the pipeline's fallback does not take its inputs")
            if not _gives(entry.outputs, chosen.outputs):
                raise Unavailable("the pipeline's fallback does not give its outputs")
            request.inputs, request.rows = {s.name: inputs[s.name] for s in entry.inputs}, rows
            request.nbytes = sum(v.nbytes for v in request.inputs.values())

        request = Inference(
            pipeline.fallback,
            None,
            call.viewer,
            parameters=dict(call.parameters),
            timeout=left,
            tier=call.tier,
            routing_key=call.routing_key,
            gone=call.gone,
            decode=decode,
        )
        try:
            served = await self.gateway.serve(request)
        except ServingError:
            return None
        return dict(served.outputs), served.entry


_runners: weakref.WeakKeyDictionary[Gateway, PipelineRunner] = weakref.WeakKeyDictionary()


def runner_for(gateway: Gateway) -> PipelineRunner:
    """The pipeline runner of `gateway` (one per gateway, made on first use)."""
    runner = _runners.get(gateway)
    if runner is None:
        runner = _runners[gateway] = PipelineRunner(gateway, gateway._clock)
    return runner


def _resolve(reference: str, current: Tensors, scope: dict[str, Tensors]) -> np.ndarray | None:
    source, tensor = split_reference(reference, scope)
    if source is not None:
        return scope[source].get(tensor)
    value = current.get(tensor)
    return value if value is not None else scope[REQUEST].get(tensor)


def _gives(outputs: tuple[TensorSpec, ...], checked: tuple[TensorSpec, ...]) -> bool:
    """Whether a version's `outputs` are those the pipeline was `checked` with: the same names, each of the
    same datatype and shape, a variable dimension within the checked maximum."""
    if len(outputs) != len(checked):
        return False
    by_name = {spec.name: spec for spec in outputs}
    for want in checked:
        have = by_name.get(want.name)
        if have is None or have.datatype != want.datatype or have.shape != want.shape:
            return False
        if have.max_shape is not None and want.max_shape is not None:
            if any(h > w for h, w in zip(have.max_shape, want.max_shape, strict=True)):
                return False
    return True


async def _all(coros: list[Coroutine[object, object, Tensors]]) -> list[Tensors]:
    """The answers of branches run side by side, in order. The first to fail fails the call: the others are
    cancelled (their steps' requests dropped from their queues, their answers of no use now) and its error
    raised once they have stopped, so no branch of a call still runs after the call has answered."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
        raise


def _fits(value: np.ndarray, spec) -> bool:  # noqa: ANN001
    if value.dtype != DATATYPES[spec.datatype] or value.ndim != len(spec.shape) + 1:
        return False
    return all(
        (d == s) if s != -1 else d <= m for d, s, m in zip(value.shape[1:], spec.shape, spec.max_shape, strict=True)
    )


def _steps_header(steps: dict[str, int]) -> str:
    return ",".join(f"{name}={rows}" for name, rows in steps.items())


__all__ = ["PipelineRunner", "PipelineError", "stats"]
