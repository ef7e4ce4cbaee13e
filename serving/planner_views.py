"""The console's capacity planner: the analytic what-if at once, and a short simulation on request."""

from __future__ import annotations

import base64

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from sim.planner import WhatIf, answer, simulate

FIELDS = {  # name -> (parser, label)
    "rate": (float, "Request rate (req/s)"),
    "latency_ms": (float, "Model latency, one request (ms)"),
    "batch_window_ms": (float, "Batch window (ms)"),
    "replicas": (int, "Replicas (devices)"),
    "models": (int, "Models hosted per device"),
    "p99_ms": (float, "p99 target (ms)"),
}


def _what_if(data) -> tuple[WhatIf, str]:  # noqa: ANN001
    """The what-if from a form, and the first problem with it ('' when none): defaults for what is absent."""
    defaults = WhatIf()
    values: dict[str, object] = {}
    for name, (parse, label) in FIELDS.items():
        raw = data.get(name, "")
        try:
            values[name] = parse(raw) if raw != "" else getattr(defaults, name)
        except ValueError:
            return defaults, f"{label} must be a number"
    # An unchecked box is absent from the form; a page opened without the form has batching on.
    values["batching"] = data.get("batching") == "on" or "device" not in data
    values["device"] = data.get("device", defaults.device)
    try:
        return WhatIf(**values), ""  # type: ignore[arg-type]
    except ValueError as exc:
        return defaults, str(exc)


@login_required
@require_http_methods(["GET", "POST"])
def planner_page(request: HttpRequest) -> HttpResponse:
    data = request.POST if request.method == "POST" else request.GET
    what, error = _what_if(data)
    if error:
        if data.get("format") == "json":
            return JsonResponse({"error": error}, status=400)
        return render(request, "console/planner.html", _context(what, error), status=400)
    result = answer(what)
    if data.get("format") == "json":
        return JsonResponse(result.as_dict())
    context = _context(what, "") | {"answer": result}
    if request.method == "POST":
        try:
            run, png = simulate(what)
        except ValueError as exc:
            return render(request, "console/planner.html", context | {"error": str(exc)}, status=400)
        context["sim"] = run
        context["plot"] = base64.b64encode(png).decode()
    return render(request, "console/planner.html", context)


def _context(what: WhatIf, error: str) -> dict:
    fields = [{"name": name, "label": label, "value": getattr(what, name)} for name, (_, label) in FIELDS.items()]
    return {"fields": fields, "what": what, "error": error}
