"""The console's capacity planner: the analytic what-if at once, and a short simulation on request.

Every input has a range (`sim.planner.BOUNDS`): outside it, 400 naming the input and its range. The
analytic answer is open to any logged-in user; the simulation check (POST) needs the engineer role in
some tenant, or platform staff (403), and runs under `serving.planner_runs`: a deadline (504 saying how
far it got), a slot per user and a few per process (429/503 with Retry-After), and cancelled when the
client leaves. The view is async so that Django can cancel it on http.disconnect; what touches the
database or renders (context processors read the user) runs through sync_to_async.
"""

from __future__ import annotations

import base64
import math

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from serving import planner_runs
from sim.budget import Stopped
from sim.planner import BOUNDS, OutOfRange, WhatIf, answer, check_simulable
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
    # An unchecked box is absent from the form; a page opened without the form has batching on.
    values["batching"] = data.get("batching") == "on" or "device" not in data
    values["device"] = data.get("device", defaults.device)
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
            return JsonResponse(result.as_dict())
        return await _page(request, _context(what, "") | {"answer": result})
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
        run, png = await planner_runs.check(
            what, user_id=user.pk, deadline_s=deadline, limit=settings.FERRY_PLANNER_MAX_SIMULATIONS
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
    if as_json:
        return JsonResponse({"answer": result.as_dict(), "simulation": _sim_summary(run)})
    return await _page(
        request, _context(what, "") | {"answer": result, "sim": run, "plot": base64.b64encode(png).decode()}
    )


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
        context = _context(what, error) | ({"answer": result} if result is not None else {})
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


def _context(what: WhatIf, error: str) -> dict:
    fields = [
        {"name": name, "label": label, "value": getattr(what, name), "range": _range(name)}
        for name, (_, label) in FIELDS.items()
    ]
    return {"fields": fields, "what": what, "error": error}
