"""The console's capacity lab (`/console/planner/`): the analytic what-if at once, and a short simulation on request.

The page's script (static/ferry/planner.js) asks for `?format=json` as the inputs move: the answer's figures and
its pictures rendered here (`console/planner_results.html`, `serving.planner_chart`), so the model has one home
(`sim.planner`). `/console/planner/fleet/` fills the inputs from the running fleet (`serving.planner_fleet`).

Every input has a range (`sim.planner.BOUNDS`): outside it, 400 naming the input and its range. The
analytic answer is open to any logged-in user; the simulation check (POST) needs the engineer role in
some tenant, or platform staff (403), and runs under `serving.planner_runs`: a deadline (504 saying how
far it got), a slot per user and a few per process (429/503 with Retry-After), and cancelled when the
client leaves. The view is async so that Django can cancel it on http.disconnect; what touches the
database or renders (context processors read the user) runs through sync_to_async.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import replace

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.safestring import mark_safe
from django.utils.text import slugify
from django.views.decorators.http import require_GET, require_http_methods

from serving import planner_chart, planner_runs
from serving.fleet_views import may_view, state_for
from serving.planner_fleet import fleet_inputs
from sim.budget import Stopped
from sim.planner import (
    BOUNDS,
    CANARY_WEIGHT,
    HOT_VERSIONS,
    LOW_EFFICIENCY,
    ROW_COST,
    TARGET_UTILISATION,
    Answer,
    Check,
    Meter,
    OutOfRange,
    WhatIf,
    answer,
    check_simulable,
    curve,
    meters,
)
from tenants.models import Role, has_role

FIELDS = {  # name -> (parser, label)
    "rate": (float, "Request rate (req/s)"),
    "latency_ms": (float, "Model latency, one request (ms)"),
    "batch_window_ms": (float, "Batch window (ms)"),
    "replicas": (int, "Replicas (devices)"),
    "models": (int, "Models hosted per device"),
    "p99_ms": (float, "p99 target (ms)"),
}


def _range(name: str) -> str:
    low, high = BOUNDS[name]
    return f"from {low:,g} to {high:,g}"


def _what_if(data) -> tuple[WhatIf, str, str]:  # noqa: ANN001
    """The what-if from a form, the first problem with it ('' when none) and the input it is about: defaults
    for what is absent."""
    defaults = WhatIf()
    values: dict[str, object] = {}
    for name, (parse, label) in FIELDS.items():
        raw = data.get(name, "")
        try:
            values[name] = parse(raw) if raw != "" else getattr(defaults, name)
        except ValueError:
            return defaults, f"{label} must be a number {_range(name)}", name
    # An unchecked box is absent from the form (the lab's form says it is there with `form`); a page opened
    # without the form has the defaults.
    submitted = "form" in data or "device" in data
    values["batching"] = data.get("batching") == "on" or not submitted
    values["device"] = data.get("device", "cpu" if "form" in data else defaults.device)
    values["autoscale"] = data.get("autoscale") == "on"
    values["canary"] = data.get("canary") == "on"
    try:
        return WhatIf(**values), "", ""  # type: ignore[arg-type]
    except OutOfRange as exc:
        if exc.field in FIELDS:
            return defaults, f"{FIELDS[exc.field][1]} must be {_range(exc.field)}", exc.field
        return defaults, str(exc), exc.field


@login_required
@require_http_methods(["GET", "POST"])
async def planner_page(request: HttpRequest) -> HttpResponse:
    data = request.POST if request.method == "POST" else request.GET
    as_json = data.get("format") == "json"
    what, error, field = _what_if(data)
    if error:
        return await _refuse(request, as_json, what, None, 400, error, field=field)
    result = answer(what)
    if request.method == "GET":
        if as_json:
            return JsonResponse(await _answer_doc(what, result))
        return await _page(request, _context(what, "") | _results(what, result))
    try:
        check_simulable(what)
    except OutOfRange as exc:
        return await _refuse(request, as_json, what, result, 400, str(exc), field=exc.field)
    user = await request.auser()
    if not await sync_to_async(has_role)(user, Role.ENGINEER):
        return await _refuse(
            request, as_json, what, result, 403, "a simulation check needs the engineer role in a tenant"
        )
    deadline = settings.FERRY_PLANNER_DEADLINE_S
    try:
        check = await planner_runs.check(
            what, user_id=user.pk, deadline_s=deadline, limit=settings.FERRY_PLANNER_MAX_SIMULATIONS, plot=not as_json
        )
    except planner_runs.Busy as busy:
        return await _refuse(request, as_json, what, result, busy.status, str(busy), retry_after=busy.retry_after)
    except Stopped as stopped:
        message = (
            f"the simulation gave up at its {deadline:g} s deadline after {stopped.simulated_s:.2f} of"
            f" {stopped.duration_s:.2f} simulated seconds; the analytic answer stands"
        )
        return await _refuse(
            request, as_json, what, result, 504, message, simulated_s=stopped.simulated_s, duration_s=stopped.duration_s
        )
    run = check.result
    if as_json:
        doc = await _answer_doc(what, result, check)
        return JsonResponse(
            doc
            | {
                "answer": result.as_dict(),
                "simulation": _sim_summary(run),
                "points": [{k: _finite(v) for k, v in p.items()} for p in check.points],
                "stopped": check.stopped,
            }
        )
    png = base64.b64encode(check.png or b"").decode()
    return await _page(request, _context(what, "") | _results(what, result, check) | {"sim": run, "plot": png})


async def _refuse(
    request: HttpRequest,
    as_json: bool,
    what: WhatIf,
    result: object,
    status: int,
    error: str,
    retry_after: int | None = None,
    **extra: object,
) -> HttpResponse:
    """The refusal as JSON {"error", ...extra} or as the page with the error (and the analytic answer)."""
    if as_json:
        response: HttpResponse = JsonResponse({"error": error, **extra}, status=status)
    else:
        context = _context(what, error) | (_results(what, result) if isinstance(result, Answer) else {})
        response = await _page(request, context, status)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return response


async def _page(request: HttpRequest, context: dict, status: int = 200) -> HttpResponse:
    return await sync_to_async(render)(request, "console/planner.html", context, status=status)


def _sim_summary(run: dict) -> dict:
    """The check's headline figures for JSON: a percentile of no answers (NaN) is null."""
    keys = ("requests", "duration_s", "served_share", "shed_share", "expired_share", "utilisation")
    out = {k: _finite(run[k]) for k in keys}
    out["latency_ms"] = {k: _finite(v) for k, v in run["latency_ms"].items()}
    return out


def _finite(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


# The sliders' own ranges (the number box beside each takes the whole of BOUNDS): (low, high, scale).
SLIDERS = {
    "rate": (1, 100_000, "log"),
    "latency_ms": (0.1, 1_000, "log"),
    "batch_window_ms": (0, 100, "linear"),
    "replicas": (1, 256, "log"),
    "models": (1, 64, "log"),
    "p99_ms": (5, 5_000, "log"),
}
NOTES = {  # what each input stands for in the model, shown beside it
    "rate": "all models together; steady Poisson arrivals",
    "latency_ms": "a batch of one; larger batches by the teaching row cost (below)",
    "batch_window_ms": "how long a batch waits to fill (max_queue_delay_ms)",
    "replicas": "devices, each hosting every model",
    "models": "sharing the traffic evenly",
    "p99_ms": "a replica is sized for 80% of it (admission's headroom)",
}
TOGGLES = (  # (name, label, what it does)
    ("batching", "Dynamic batching", f"batches of up to {WhatIf().max_batch} within the window"),
    ("device", "GPU acceleration", "an accelerator per replica instead of a CPU"),
    ("autoscale", "Autoscale replicas", f"replicas sized as the autoscaler would, at {TARGET_UTILISATION:.0%}"),
    ("canary", "Registry + canary rollout", f"each model rolls out a candidate at {CANARY_WEIGHT:.0%} of its traffic"),
)
_CARD_BASE = {"p99_ms": 300, "models": 1, "autoscale": False, "canary": False}
CARDS = (  # the seed's walkthrough, left to right: (key, title, what it shows, inputs)
    (
        "single",
        "1. A single model endpoint",
        "One CPU server, one request at a time: fine at first, saturated as traffic grows.",
        _CARD_BASE
        | {"rate": 45, "latency_ms": 20, "batch_window_ms": 0, "replicas": 1, "batching": False}
        | {"device": "cpu"},
    ),
    (
        "batching",
        "2. Dynamic batching",
        "The batcher coalesces concurrent requests: more capacity, paid for with the batch window.",
        _CARD_BASE
        | {"rate": 60, "latency_ms": 20, "batch_window_ms": 10, "replicas": 1, "batching": True}
        | {"device": "cpu"},
    ),
    (
        "gpu",
        "3. GPU autoscaling replicas",
        "Batches on accelerators clear many rows per call; replicas track the load.",
        _CARD_BASE
        | {"rate": 3000, "latency_ms": 20, "batch_window_ms": 10, "replicas": 4, "batching": True}
        | {"device": "accelerator", "autoscale": True},
    ),
    (
        "canary",
        "4. Registry + canary rollout",
        "Versions behind stable names; a traffic split sends a slice to the candidate, shadow mirrors requests.",
        _CARD_BASE
        | {"rate": 3000, "latency_ms": 20, "batch_window_ms": 10, "replicas": 4, "batching": True}
        | {"device": "accelerator", "autoscale": True, "canary": True},
    ),
    (
        "packing",
        "5. Multi-model packing at high throughput",
        "Many lighter models share each accelerator: they take turns, and past what a device keeps hot, swap.",
        _CARD_BASE
        | {"rate": 10_000, "latency_ms": 10, "batch_window_ms": 10, "replicas": 4, "batching": True}
        | {"device": "accelerator", "autoscale": True, "canary": False, "models": 16},
    ),
)
TAKEAWAYS = {
    "serving capacity": "The replicas cannot serve this rate within the target: requests queue without bound, and"
    " admission sheds them. Add replicas (or autoscale), or batch on an accelerator.",
    "fleet pressure": "It keeps up, without headroom: a burst or a cold start would queue. Size the fleet for the"
    " target utilisation.",
    "p99 budget": "The tail is over the target. Every gain in throughput spends part of p99: shorten the window, use"
    " a faster model or device, or add replicas to cut the queueing.",
    "multi-model packing": "Many versions share each device: each waits for its turn, and past what a device keeps"
    " hot they would swap. Pack fewer per device, or add replicas.",
    "accelerator efficiency": "The accelerator runs nearly empty: fewer replicas, a longer window or more models per"
    " device would fill its batches.",
    "none": "This design meets its target with headroom: the next step is the next card, or more traffic.",
}
ASSUMPTIONS = (  # (label, text): teaching assumptions are labelled so
    (
        "Teaching assumption",
        f"a batch of b takes latency x (1 + {ROW_COST['accelerator']} (b - 1)) on an accelerator and latency x"
        f" (1 + {ROW_COST['cpu']} (b - 1)) on a CPU: one number stands for a measured profile (from my fleet fills"
        " it from the versions' measured batch of one).",
    ),
    (
        "Ferry's rule",
        "a replica's capacity is the autoscaler's own (serving.policies.autoscale.replica_capacity): the largest"
        " batch whose wait and compute fit 80% of the p99 target (admission's headroom), at that batch's rate.",
    ),
    (
        "Ferry's default",
        f"replicas needed are counted at {TARGET_UTILISATION:.0%} utilisation, a scaling policy's default target.",
    ),
    (
        "Model",
        "p99 = compute + batch window + waiting for the version's turn on a shared device + an M/D/1 queueing tail"
        " (its exponential approximation): it grows without bound as utilisation reaches 1.",
    ),
    (
        "Teaching assumption",
        f"a device keeps {HOT_VERSIONS} versions hot; past that, versions would swap in and out (Ferry's nodes hold"
        " what fits their memory budget). Accelerator batches count as nearly empty below"
        f" {LOW_EFFICIENCY:.0%} of full batches' throughput.",
    ),
    (
        "Teaching assumption",
        f"a canary takes {CANARY_WEIGHT:.0%} of its model's traffic (Ferry's rollouts step 1, 5, 25, 50, 100%);"
        " shadow copies' extra load is not counted.",
    ),
    (
        "Simulation",
        "the check runs the fleet simulator (sim.engine: the same batching, admission and placement policies the"
        " nodes run) for a few seconds of steady Poisson traffic at this rate and at a few others, within"
        " FERRY_PLANNER_DEADLINE_S; its p99 is of the requests answered.",
    ),
)
SOURCES = (  # (claim, text, source, address)
    (
        "Dynamic batching trades latency for accelerator throughput",
        "Triton coalesces individual inference requests into a batch within a configurable delay, so the GPU"
        " processes many requests per call, at the cost of added queueing latency.",
        "NVIDIA Triton Inference Server",
        "https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/user_guide/batcher.html",
    ),
    (
        "Serve versioned models behind a stable name",
        "TF Serving loads versioned model artifacts and can serve several versions of a model, so traffic can move"
        " between versions without redeploying the server.",
        "TensorFlow Serving",
        "https://www.tensorflow.org/tfx/guide/serving",
    ),
    (
        "Canary rollout and autoscaling for inference",
        "KServe exposes traffic splitting for canary rollouts and request-driven autoscaling, so replicas track load.",
        "KServe",
        "https://kserve.github.io/website/",
    ),
    (
        "Tail latency, not the mean, governs interactive serving",
        "In fan-out and high-throughput systems the 99th percentile dominates what users see, so capacity and"
        " batching are sized against p99.",
        "The Tail at Scale (Dean & Barroso, CACM 2013)",
        "https://research.google/pubs/the-tail-at-scale/",
    ),
)


def _context(what: WhatIf, error: str) -> dict:
    fields = []
    for name, (_, label) in FIELDS.items():
        low, high, scale = SLIDERS[name]
        fields.append(
            {
                "name": name,
                "label": label,
                "value": getattr(what, name),
                "range": _range(name),
                "note": NOTES[name],
                "min": BOUNDS[name][0],
                "max": BOUNDS[name][1],
                "step": "1" if FIELDS[name][0] is int else "any",
                "slider": {"low": low, "high": high, "scale": scale},
            }
        )
    toggles = [
        {
            "name": name,
            "label": label,
            "hint": hint,
            "value": "accelerator" if name == "device" else "on",
            "checked": what.device == "accelerator" if name == "device" else getattr(what, name),
        }
        for name, label, hint in TOGGLES
    ]
    cards = [
        {"key": key, "title": title, "text": text, "inputs": json.dumps(inputs)} for key, title, text, inputs in CARDS
    ]
    return {
        "fields": fields,
        "toggles": toggles,
        "cards": cards,
        "what": what,
        "error": error,
        "assumptions": ASSUMPTIONS,
        "sources": SOURCES,
    }


def _results(what: WhatIf, result: Answer, check: Check | None = None) -> dict:
    """What the results part of the page draws: the answer, its meters and pictures (the simulated points on the
    plot when a check ran)."""
    points = check.points if check is not None else None
    return {
        "answer": result,
        "p50_bounded": math.isfinite(result.p50_ms),
        "p99_bounded": math.isfinite(result.p99_ms),
        "meters": [_meter(m) for m in meters(what, result)],
        "takeaway": TAKEAWAYS[result.bottleneck],
        "budget": [p | {"text": _ms(p["ms"])} for p in planner_chart.budget_parts(result)],
        "sim_rows": [_sim_row(what, p) for p in points or []],
        "budget_svg": mark_safe(planner_chart.budget_svg(what, result)),  # noqa: S308 (numbers and fixed labels)
        "diagram_svg": mark_safe(planner_chart.diagram_svg(what, result)),  # noqa: S308 (escapes what it draws)
        "plot_svg": mark_safe(planner_chart.plot_svg(what, result, curve(what, result), points)),  # noqa: S308
        "path": planner_chart.path_nodes(what, result),
        "check": check,
        "what": what,
    }


STATE_TEXT = {"ok": "ok", "warn": "watch", "over": "over the limit", "off": "not in this design"}


def _meter(m: Meter) -> dict:
    bounded = min(m.value, 1.5) if math.isfinite(m.value) else 1.5
    return {
        "key": slugify(m.name),
        "name": m.name,
        "value": m.value,
        "value_text": f"{m.value:.4f}" if math.isfinite(m.value) else "inf",
        "pct": round(100 * bounded, 1),
        "state": m.state,
        "state_text": STATE_TEXT[m.state],
        "reading": m.reading,
        "drives": m.drives,
    }


def _ms(ms: float) -> str:
    return f"{ms:,.1f} ms" if math.isfinite(ms) else "unbounded"


def _sim_row(what: WhatIf, point: dict) -> dict:
    analytic = answer(replace(what, rate=point["rate"])).p99_ms
    p99 = point["p99_ms"]
    return point | {
        "p99_text": _ms(p99) if p99 is not None else "no answers",
        "analytic_text": _ms(analytic),
        "shed_pct": round(100 * point["shed_share"], 1),
    }


async def _answer_doc(what: WhatIf, result: Answer, check: Check | None = None) -> dict:
    """The JSON the page's script reads: the answer's figures, its meters, and the results part rendered."""
    context = _results(what, result, check)
    return result.as_dict() | {
        "meters": [
            {"key": m["key"], "value": _finite(m["value"]), "state": m["state"], "reading": m["reading"]}
            for m in context["meters"]
        ],
        "nodes": [n.key for n in context["path"]],
        "html": render_to_string("console/planner_results.html", context),
    }


@login_required
@require_GET
def planner_fleet(request: HttpRequest) -> HttpResponse:
    """The lab's inputs from the running fleet (`serving.planner_fleet`): viewers and up, as the fleet page."""
    if not may_view(request.user):
        return JsonResponse({"error": "the fleet is shown to viewers and up (a role in some tenant)"}, status=403)
    return JsonResponse(fleet_inputs(request.user, state_for(request.user), timezone.now()))
