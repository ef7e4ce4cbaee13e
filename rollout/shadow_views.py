"""The console's shadow report page: the same report as the API (rollout.shadow_report), drawn on the
server as inline SVG charts and a heat table."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.safestring import mark_safe

from rollout import charts, shadow_report
from rollout.models import ShadowMinute
from rollout.views import panel
from tenants.scoping import shadow_report_refusal, visible_models

WINDOWS = (60, 360, 1440)  # minutes


def _int(text: str | None, default: int | None, *, low: int, high: int) -> int | None:
    if text is None or not text.isdigit() or not low <= int(text) <= high:
        return default
    return int(text)


def _heat(confusion: dict | None) -> dict | None:
    """The confusion matrix as table rows of (count, opacity 0..1), the diagonal marked."""
    if not confusion:
        return None
    top = max((c for row in confusion["matrix"] for c in row), default=0) or 1
    return {
        "labels": confusion["labels"],
        "rows": [
            {
                "label": a,
                "cells": [
                    {"count": c, "alpha": round(0.08 + 0.92 * c / top, 3) if c else 0, "diagonal": a == b}
                    for b, c in zip(confusion["labels"], row, strict=True)
                ],
            }
            for a, row in zip(confusion["labels"], confusion["matrix"], strict=True)
        ],
    }


def _minutes(report: dict) -> list[tuple]:
    """One point per minute of the window, minutes that compared nothing included (as gaps)."""
    by_minute = {p["minute"]: p for p in report["series"]}
    at = report["since"].replace(second=0, microsecond=0)
    points = []
    while at <= report["until"]:
        p = by_minute.get(at)
        points.append((at, p["agreement"] if p else None, p["compared"] if p else 0))
        at += timedelta(minutes=1)
    return points


def _rounded(value: object) -> object:
    """Tensor rows for the page: numbers to 4 significant digits, nesting kept."""
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _latency_bins(latency: dict) -> list[tuple[str, int, int | None]]:
    """Both versions' latency histograms over the union of their bins (the bins line up: same sketch)."""
    edges: dict[tuple[float, float], list[int]] = {}
    for who, index in (("baseline", 0), ("candidate", 1)):
        for b in latency[who]["histogram"]:
            edges.setdefault((b["low_ms"], b["high_ms"]), [0, 0])[index] = b["count"]
    return [(f"{charts.number(high)} ms", a, c) for (_, high), (a, c) in sorted(edges.items())]


@login_required
def shadow_page(request: HttpRequest, name: str) -> HttpResponse:
    """A model's shadow report, with its rollouts' panel (gate verdicts; Approve, Reject, Promote, Roll back
    for those allowed to press them). The owning tenant's engineers (approvers, admins) and platform staff read
    it; anyone else who sees the model gets the API's 403."""
    model = visible_models(request.user).select_related("tenant").filter(name=name).first()
    if model is None:
        raise Http404("no such model")
    refusal = shadow_report_refusal(request.user, model)
    if refusal is not None:
        raise PermissionDenied(refusal)
    candidates = sorted(
        set(ShadowMinute.objects.filter(model_name=model.name).values_list("candidate", flat=True).distinct())
        | ({model.shadow_version} - {None})
    )
    candidate = _int(
        request.GET.get("candidate"),
        model.shadow_version or (candidates[-1] if candidates else None),
        low=1,
        high=2**31 - 1,
    )
    minutes = _int(request.GET.get("minutes"), 60, low=1, high=7 * 24 * 60)
    context: dict = {
        "model": model,
        "candidate": candidate,
        "candidates": candidates,
        "minutes": minutes,
        "windows": WINDOWS,
        **panel(request.user, model),
        "rollout_candidates": [],
    }
    if candidate is not None:
        report = shadow_report.build(model, candidate, until=timezone.now(), minutes=minutes)  # type: ignore[arg-type]
        differences = report["differences"]["histogram"]
        context.update(
            report=report,
            agreement_chart=mark_safe(charts.agreement_svg(_minutes(report))),  # noqa: S308 (numbers, times only)
            difference_chart=mark_safe(
                charts.histogram_svg(  # noqa: S308
                    [(f"≤{charts.number(b['high'])}", b["count"]) for b in differences],
                    css="shadow-differences",
                    label="distribution of per-row output differences",
                )
            ),
            latency_chart=mark_safe(
                charts.paired_svg(  # noqa: S308
                    _latency_bins(report["latency"]),
                    css="shadow-latency",
                    label="latency distributions of the baseline and the candidate",
                )
            ),
            heat=_heat(report["confusion"]),
            disagreements=[
                {
                    **d,
                    "inputs": _rounded(d["inputs"]),
                    "primary": _rounded(d["primary"]),
                    "shadow": _rounded(d["shadow"]),
                }
                for d in report["disagreements"]
            ],
        )
    return render(request, "console/shadow.html", context)
