"""Pipelines on the data plane: one request to /v2/models/{pipeline}/infer runs the pipeline's graph
(`serving.policies.pipeline`), each step an ordinary request to its model through `Gateway.serve`.

So every step is routed (rollouts, pins, experiments), admitted, batched with all other traffic to that model,
mirrored to its shadow, falls back to its model's fallback, and is metered as usage of the calling tenant. The
pipeline's deadline is shared: each step gets what is left of it, so a step that cannot finish in time is
refused at admission (503), and the pipeline answers its own fallback model or that 503. The caller's quota
is charged once, by the front end, for the whole call.

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
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from prometheus_client import Counter, Histogram

from serving.dataplane.errors import NotFound, ServingError, Unavailable
from serving.dataplane.gateway.gateway import Gateway, Reply, parse_version
from serving.dataplane.gateway.request import Inference
from serving.dataplane.gateway.snapshot import PipelineEntry, PipelineVersionEntry, VersionEntry
from serving.dataplane.http.protocol import DATATYPES, ProtocolError, encode_infer_response, parse_infer_request
from serving.dataplane.metrics import process_set
from serving.dataplane.metrics.metrics import LATENCY_BUCKETS
from serving.policies.admission import HEADROOM
from serving.policies.pipeline import REQUEST, Node, PipelineError, choose_branch, combine, parse, split_reference
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


class StepMismatch(ServingError):
    """A step's model no longer takes what the pipeline hands it (its routed version changed signature)."""

    status = 409


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


class PipelineStats:
    """Per pipeline, per step; in this process (each gateway has its own; the web processes of one port merge
    theirs: `live`). Bounded: a step's recent latencies are its last 512, and there are as many entries as
    pipelines' steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._steps: dict[tuple[str, str], StepStats] = {}
        self.calls: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}

    def step(self, pipeline: str, step: str, seconds: float, rows: int, refused: bool) -> None:
        with self._lock:
            stats = self._steps.setdefault((pipeline, step), StepStats())
            stats.calls += 1
            if refused:
                stats.refused += 1
            else:
                stats.rows += rows
                stats.recent.append(seconds)

    def call(self, pipeline: str, fell_back: bool) -> None:
        with self._lock:
            self.calls[pipeline] = self.calls.get(pipeline, 0) + 1
            if fell_back:
                self.fallbacks[pipeline] = self.fallbacks.get(pipeline, 0) + 1

    def of(self, pipeline: str) -> dict:
        """{"calls", "fallbacks", "steps": {step: summary}} for the console and the benchmark."""
        with self._lock:
            steps = {s: st.summary() for (p, s), st in self._steps.items() if p == pipeline}
            return {"calls": self.calls.get(pipeline, 0), "fallbacks": self.fallbacks.get(pipeline, 0), "steps": steps}

    def docs(self, only: str | None = None) -> dict[str, dict]:
        """Every pipeline's figures (or the pipeline `only`'s) as another web process can merge them (`live`):
        as `of`, each step's recent latencies a usage.sketch instead of its percentiles."""
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
    """What the console shows of `pipeline`: this process's figures (`stats.of`), or, with several web
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
        status = 500
        fell_back = False
        try:
            chosen = self._version(pipeline, version, viewer)
            try:
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
                deadline,
                viewer,
                tier,
                routing_key,
                gone,
                {k: v for k, v in request.parameters.items() if k == "priority"},
                self._draw,
            )
            try:
                scope = {REQUEST: request.inputs}
                outputs = await self._run(self.graph(pipeline, chosen), request.inputs, scope, request.rows, call)
                model_name, model_version, specs = name, str(chosen.version), chosen.outputs
            except ServingError as refused:
                if refused.status != 503:  # only a refusal (503: shed, queue full, not ready) falls back
                    raise
                served = await self._fallback(pipeline, request.inputs, request.rows, call)
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
        finally:
            PIPELINE_REQUESTS.labels(name, str(status)).inc()
            if status == 200:
                stats.call(name, fell_back)
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

    def _version(self, pipeline: PipelineEntry, version: str | None, viewer: int | None) -> PipelineVersionEntry:
        chosen = self._pick(pipeline, version)
        if chosen.broken:
            raise ServingError(self._broken(pipeline, chosen, viewer), status=503)
        return chosen

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
            answers = await asyncio.gather(
                *(self._run(c, current, b, rows, call) for c, b in zip(node.children, branches, strict=True))
            )
            for b in branches:
                scope.update({k: v for k, v in b.items() if k not in scope})
            response = {t: combine(node.combine, [a[t] for a in answers]) for t in answers[0]}
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
            raise StepMismatch(f"pipeline '{call.pipeline}' switch '{node.label()}': no tensor '{condition.tensor}'")
        mask = condition.rows(np.asarray(tested))
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
        answers = await asyncio.gather(*(p[1] for p in parts))
        if len(parts) == 1:
            return answers[0]
        merged: Tensors = {}
        for name in answers[0]:
            first = answers[0][name]
            out = np.empty((rows, *first.shape[1:]), dtype=first.dtype)
            for (index, _), answer in zip(parts, answers, strict=True):
                out[index] = answer[name]
            merged[name] = out
        return merged

    async def _step(self, node: Node, current: Tensors, scope: dict[str, Tensors], rows: int, call: _Call) -> Tensors:
        left = call.deadline - self._clock()
        started = self._clock()
        if left <= 0:
            stats.step(call.pipeline, node.name, 0.0, rows, refused=True)
            raise Unavailable(
                f"pipeline '{call.pipeline}': its deadline was spent before {self._said(node, call.viewer)}",
                retry_after=1,
            )
        mapped = dict(node.inputs)
        pipeline = call.pipeline

        def decode(request: Inference, entry: VersionEntry) -> None:
            inputs = {}
            for spec in entry.inputs:
                value = _resolve(mapped.get(spec.name, spec.name), current, scope)
                if value is None or not _fits(value, spec):
                    raise StepMismatch(
                        f"pipeline '{pipeline}' step '{node.name}': version {entry.version} of its model does not"
                        f" take what the pipeline gives its input '{spec.name}'"
                    )
                inputs[spec.name] = value
            if rows > entry.batching.max_batch_size:
                raise ServingError(
                    f"pipeline '{pipeline}' step '{node.name}': {rows} rows, its model takes at most"
                    f" {entry.batching.max_batch_size}",
                    status=400,
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
            stats.step(call.pipeline, node.name, self._clock() - started, rows, refused=True)
            raise ServingError(self._not_available(call.pipeline, node, call.viewer), status=503) from None
        except ServingError:
            stats.step(call.pipeline, node.name, self._clock() - started, rows, refused=True)
            raise
        seconds = self._clock() - started
        STEP_SECONDS.labels(call.pipeline, node.name).observe(seconds)
        STEP_ROWS.labels(call.pipeline, node.name).inc(rows)
        stats.step(call.pipeline, node.name, seconds, rows, refused=False)
        call.steps[node.name] = call.steps.get(node.name, 0) + rows
        return dict(served.outputs)

    async def _fallback(
        self, pipeline: PipelineEntry, inputs: Tensors, rows: int, call: _Call
    ) -> tuple[Tensors, VersionEntry] | None:
        """The pipeline's fallback model's answer to the whole call in what is left of its deadline, or None
        (no fallback, or it refused too: the step's refusal is then the answer)."""
        if not pipeline.fallback:
            return None
        left = call.deadline - self._clock()
        if left <= 0:
            return None

        def decode(request: Inference, entry: VersionEntry) -> None:
            if any(spec.name not in inputs or not _fits(inputs[spec.name], spec) for spec in entry.inputs):
                raise Unavailable("the pipeline's fallback does not take its inputs")
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


def _fits(value: np.ndarray, spec) -> bool:  # noqa: ANN001
    if value.dtype != DATATYPES[spec.datatype] or value.ndim != len(spec.shape) + 1:
        return False
    return all(
        (d == s) if s != -1 else d <= m for d, s, m in zip(value.shape[1:], spec.shape, spec.max_shape, strict=True)
    )


def _steps_header(steps: dict[str, int]) -> str:
    return ",".join(f"{name}={rows}" for name, rows in steps.items())


__all__ = ["PipelineRunner", "PipelineError", "stats"]
