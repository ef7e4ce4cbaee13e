"""Console pages for pipelines: the list, and one pipeline's graph drawn as SVG with each step's live latency
(the executors of this web process and of the others on its port, `serving.dataplane.gateway.pipeline.live`,
polled every 2 s)."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render

from serving.api.pipelines import visible_pipelines
from serving.dataplane.gateway.pipeline import live, stats_key
from serving.models import Pipeline
from serving.pipelines import implicit_steps, step_models
from serving.policies.pipeline import Node, PipelineError, parse
from tenants.scoping import visible_models

BOX_W, BOX_H, GAP, FORK_W, ROW_GAP = 170, 50, 36, 150, 18
HIDDEN = "hidden model"  # what the console says in place of a model the reader may not see


@dataclass
class Box:
    x: float
    y: float
    w: float
    h: float
    label: str
    detail: str = ""
    step: str = ""  # a model step: its live figures are drawn in it
    kind: str = "model"
    model: str = ""  # a model step's model
    version: int | None = None


@dataclass
class Layout:
    boxes: list[Box] = field(default_factory=list)
    edges: list[tuple[float, float, float, float, str]] = field(default_factory=list)  # x1 y1 x2 y2 label


def _place(node: Node, x: float, y: float, out: Layout) -> tuple[float, float, float]:
    """Draw `node` with its top-left at (x, y); returns (width, height, the y of its entry and exit)."""
    if node.kind == "model":
        version = f" v{node.version}" if node.version is not None else ""
        detail = f"{node.model}{version}" if node.model != node.name else (version.strip() or "")
        out.boxes.append(
            Box(x, y, BOX_W, BOX_H, node.name, detail, step=node.name, model=node.model, version=node.version)
        )
        return BOX_W, BOX_H, y + BOX_H / 2
    if node.kind == "sequence":
        cx, height, mids = x, 0.0, []
        for i, child in enumerate(node.children):
            w, h, mid = _place(child, cx, y, out)
            if i:
                out.edges.append((cx - GAP, mids[-1][1], cx, mid, ""))
            mids.append((cx + w, mid))
            cx += w + GAP
            height = max(height, h)
        return cx - GAP - x, height, mids[0][1] if len(mids) == 1 else mids[-1][1]
    # A fork (switch, ensemble, splitter), its branches stacked, and a join.
    if node.kind == "switch":
        c = node.condition
        detail = f"{c.reduce}({c.tensor}) {c.op} {c.value:g}" if c else ""
        labels = ["then", "else"]
    elif node.kind == "ensemble":
        detail, labels = f"combine: {node.combine}", [""] * len(node.children)
    else:
        detail, labels = "one branch per call", [f"{w:.0%}" for w in node.weights]
    fork = Box(x, y, FORK_W, BOX_H, node.name or node.kind, detail, kind=node.kind)
    out.boxes.append(fork)
    bx, by, width, placed = x + FORK_W + GAP, y, 0.0, []
    for child in node.children:
        w, h, mid = _place(child, bx, by, out)
        placed.append((w, mid))
        width, by = max(width, w), by + h + ROW_GAP
    if node.kind == "switch" and not node.has_else:
        placed.append((0.0, by + BOX_H / 2))  # the rows that pass through
        by += BOX_H + ROW_GAP
    height = max(BOX_H, by - ROW_GAP - y)
    fork.h = height
    join_x = bx + width + GAP
    fork_mid = y + height / 2
    for (w, mid), label in zip(placed, labels, strict=False):
        if w:
            out.edges.append((x + FORK_W, fork_mid, bx, mid, label))
            out.edges.append((bx + w, mid, join_x, fork_mid, ""))
        else:
            out.edges.append((x + FORK_W, fork_mid, join_x, fork_mid, "else: kept"))
    out.boxes.append(Box(join_x, fork_mid - 6, 12, 12, "", kind="join"))
    return join_x + 12 - x, height, fork_mid


def layout(spec: object, hidden: set[str] | frozenset[str] = frozenset()) -> tuple[Layout, float, float]:
    """The graph's boxes and edges, the request on the left and the response on the right. A step whose
    model is in `hidden` (one the reader may not see) is drawn without the model's name: as "hidden model",
    and named so too where the step is named after its model."""
    out = Layout()
    root = parse(spec)
    w, h, mid = _place(root, 110, 10, out)
    for box in out.boxes:
        if box.kind == "model" and box.model in hidden:
            if box.label == box.model:  # the step is named after its model
                box.label, box.step = HIDDEN, ""
            box.detail = HIDDEN + (f" v{box.version}" if box.version is not None else "")
            box.model = ""
    out.boxes.insert(0, Box(0, mid - 20, 70, 40, "request", kind="end"))
    out.edges.insert(0, (70, mid, 110, mid, ""))
    out.boxes.append(Box(110 + w + GAP, mid - 20, 80, 40, "response", kind="end"))
    out.edges.append((110 + w, mid, 110 + w + GAP, mid, ""))
    return out, 110 + w + GAP + 90, h + 20


def _pipeline(request: HttpRequest, name: str) -> Pipeline:
    found = visible_pipelines(request.user).filter(name=name).prefetch_related("versions").first()
    if found is None:
        raise Http404(f"no pipeline '{name}'")
    return found


def _hidden(user: object, names: set[str]) -> set[str]:
    """Those of `names` that are not models `user` sees: the console does not name them."""
    return names - set(visible_models(user).filter(name__in=names).values_list("name", flat=True))


def _live(pipeline: Pipeline, hidden: set[str]) -> dict:
    """The live figures of this pipeline (of its owner's: `stats_key`), of the steps its versions have, without
    those named after a model the reader may not see."""
    figures = live(stats_key(pipeline.name, pipeline.tenant_id))
    unsaid = set().union(*(implicit_steps(v.spec, hidden) for v in pipeline.versions.all())) if hidden else set()
    ours = _step_names(pipeline)
    steps = {k: v for k, v in figures["steps"].items() if k not in unsaid and (ours is None or k in ours)}
    return {**figures, "steps": steps}


def _step_names(pipeline: Pipeline) -> set[str] | None:
    """The names of the steps of `pipeline`'s versions; None where a stored spec no longer parses (it is
    shown, not drawn: its figures are all shown too)."""
    names: set[str] = set()
    for version in pipeline.versions.all():
        try:
            names |= {step.name for step in parse(version.spec).steps()}
        except PipelineError:
            return None
    return names


def _step_models(pipeline: Pipeline) -> set[str]:
    return set().union(*(step_models(v.spec) for v in pipeline.versions.all()))


@login_required
def pipelines_page(request: HttpRequest) -> HttpResponse:
    pipelines = list(visible_pipelines(request.user).select_related("tenant", "fallback").prefetch_related("versions"))
    fallbacks = {p.fallback.name for p in pipelines if p.fallback is not None}
    hidden = _hidden(request.user, fallbacks) if fallbacks else set()
    rows = [
        {
            "pipeline": p,
            "fallback": p.fallback.name if p.fallback else None,
            "fallback_hidden": p.fallback is not None and p.fallback.name in hidden,
        }
        for p in pipelines
    ]
    return render(request, "console/pipelines.html", {"rows": rows})


@login_required
def pipeline_page(request: HttpRequest, name: str) -> HttpResponse:
    pipeline = _pipeline(request, name)
    latest = max(pipeline.versions.all(), key=lambda v: v.version, default=None)
    names = _step_models(pipeline) | ({pipeline.fallback.name} if pipeline.fallback else set())
    hidden = _hidden(request.user, names) if names else set()
    drawing, width, height, problem = None, 0.0, 0.0, ""
    if latest is not None:
        try:
            drawing, width, height = layout(latest.spec, hidden)
        except PipelineError as exc:  # a stored spec from before a rule: shown, not drawn
            problem = exc.message
            for model in hidden:
                problem = problem.replace(model, HIDDEN)
    context = {
        "pipeline": pipeline,
        "latest": latest,
        "fallback_hidden": pipeline.fallback is not None and pipeline.fallback.name in hidden,
        "drawing": drawing,
        "width": width,
        "height": height,
        "problem": problem,
        "live": _live(pipeline, hidden),
    }
    return render(request, "console/pipeline.html", context)


@login_required
def pipeline_live(request: HttpRequest, name: str) -> JsonResponse:
    pipeline = _pipeline(request, name)
    return JsonResponse(_live(pipeline, _hidden(request.user, _step_models(pipeline))))
