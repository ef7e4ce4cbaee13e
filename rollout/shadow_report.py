"""The shadow report: how a candidate version's answers compared with the versions that served the same
requests, from the per-minute rows `rollout.shadow_ingest` stores. JSON for the API
(`GET /api/models/{name}/shadow/`), the same dict for the console's page, and `agreement` for the
rollout gates."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.db.models import Sum

from rollout.models import ShadowDisagreement, ShadowMinute
from usage.sketch import FLOOR_SECONDS, GROWTH, merge, quantile

DISAGREEMENTS_SHOWN = 50
# Like with like (serving.dataplane.gateway.shadow.Pair): end to end, a mirror waits at the lowest tier behind callers.
LATENCY_MEASURE = (
    "device seconds per request, both versions measured by the node alike: each request's share, by"
    " rows, of its batch's compute, over the mirrored requests both answered. Not end to end; a"
    " batch of mirrors can be larger than the callers' batches, which lowers the candidate's share"
)
LATENCY_BINS_PER_DOUBLING = 2  # the report's latency histograms: bins 41% wide (sketch buckets are 9%)


def agreement(model_name: str, baseline: int, candidate: int, since: datetime) -> tuple[float | None, int]:
    """The share of rows on which `candidate` agreed with `baseline` (rollout.shadow_compare's rule for the
    model's task kind) in the minutes from `since`'s on, and how many rows were compared; (None, 0) when
    none were."""
    start = since.replace(second=0, microsecond=0)
    totals = ShadowMinute.objects.filter(
        model_name=model_name,
        baseline=baseline,
        candidate=candidate,
        minute__gte=start,
    ).aggregate(compared=Sum("compared"), agreed=Sum("agreed"))
    compared = int(totals["compared"] or 0)
    if not compared:
        return None, 0
    return int(totals["agreed"] or 0) / compared, compared


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _histogram(sketch: dict[int, int], per: int = 1) -> list[dict[str, float]]:
    """A sketch as contiguous bins (`per` sketch buckets each, empty bins between filled ones included):
    [{low, high, count}] in the sketch's unit."""
    if not sketch:
        return []
    first, last = min(sketch) // per, max(sketch) // per
    bins = []
    for b in range(first, last + 1):
        count = sum(sketch.get(i, 0) for i in range(b * per, (b + 1) * per))
        low = 0.0 if b == 0 else FLOOR_SECONDS * GROWTH ** (b * per - 1)  # bucket i holds (F·G^(i-1), F·G^i]
        high = FLOOR_SECONDS * GROWTH ** ((b + 1) * per - 1)
        bins.append({"low": low, "high": high, "count": count})
    return bins


def _latency(sketch: dict[int, int]) -> dict[str, Any]:
    def ms(q: float) -> float | None:
        value = quantile(sketch, q) if sketch else None
        return round(value * 1000, 3) if value is not None else None

    bins = _histogram(sketch, per=16 // LATENCY_BINS_PER_DOUBLING)
    return {
        "count": sum(sketch.values()),
        "p50_ms": ms(0.5),
        "p90_ms": ms(0.9),
        "p99_ms": ms(0.99),
        "histogram": [{"low_ms": b["low"] * 1000, "high_ms": b["high"] * 1000, "count": b["count"]} for b in bins],
    }


def build(
    model: Any, candidate: int, *, baseline: int | None = None, until: datetime, minutes: int = 60
) -> dict[str, Any]:
    """The report for `candidate` of `model` (a serving.models.Model) over the `minutes` before `until`:
    against `baseline` only, or every version whose requests were mirrored to it."""
    since = until - timedelta(minutes=minutes)
    rows = ShadowMinute.objects.filter(
        model_name=model.name,
        candidate=candidate,
        minute__gte=since.replace(second=0, microsecond=0),
        minute__lte=until,
    )
    samples = ShadowDisagreement.objects.filter(
        model_name=model.name, candidate=candidate, at__gte=since, at__lte=until
    )
    if baseline is not None:
        rows, samples = rows.filter(baseline=baseline), samples.filter(baseline=baseline)
    totals = {"mirrored": 0, "shadow_errors": 0, "incomparable": 0, "compared": 0, "agreed": 0}
    abs_sum, abs_count, abs_max = 0.0, 0, None
    similarity_sum, similarity_min = 0.0, None
    difference: dict[int, int] = {}
    primary: dict[int, int] = {}
    shadow: dict[int, int] = {}
    confusion: dict[tuple[int, int], int] = {}
    statuses: dict[str, int] = {}
    per_minute: dict[datetime, dict[str, int]] = {}
    baselines: set[int] = set()
    for row in rows.order_by("minute"):
        baselines.add(row.baseline)
        for field in totals:
            totals[field] += getattr(row, field)
        point = per_minute.setdefault(row.minute, {"mirrored": 0, "compared": 0, "agreed": 0, "shadow_errors": 0})
        for field in point:
            point[field] += getattr(row, field)
        if row.abs_count:
            abs_sum += row.abs_sum
            abs_count += row.abs_count
            abs_max = row.abs_max if abs_max is None else max(abs_max, row.abs_max)
        if row.similarity_min is not None:
            similarity_sum += row.similarity_sum
            similarity_min = row.similarity_min if similarity_min is None else min(similarity_min, row.similarity_min)
        merge(difference, row.difference)
        merge(primary, row.primary_latency)
        merge(shadow, row.shadow_latency)
        for key, count in row.confusion.items():
            a, b = (int(x) for x in key.split(","))
            confusion[(a, b)] = confusion.get((a, b), 0) + int(count)
        for status, count in row.statuses.items():
            statuses[status] = statuses.get(status, 0) + int(count)
    labels = sorted({c for pair in confusion for c in pair})
    return {
        "model": model.name,
        "task": model.task,
        "candidate": candidate,
        "baselines": sorted(baselines) if baseline is None else [baseline],
        "since": since,
        "until": until,
        "shadow": {"version": model.shadow_version, "fraction": model.shadow_fraction},
        "totals": {
            **totals,
            "agreement": _share(totals["agreed"], totals["compared"]),
            "shadow_error_rate": _share(totals["shadow_errors"], totals["mirrored"]),
            "shadow_errors_by_status": statuses,
        },
        "series": [
            {"minute": minute, **point, "agreement": _share(point["agreed"], point["compared"])}
            for minute, point in sorted(per_minute.items())
        ],
        "differences": {
            "histogram": _histogram(difference),
            "mean_abs": abs_sum / abs_count if abs_count else None,
            "max_abs": abs_max,
            "mean_cosine": similarity_sum / totals["compared"]
            if similarity_min is not None and totals["compared"]
            else None,
            "min_cosine": similarity_min,
        },
        "latency": {"measure": LATENCY_MEASURE, "baseline": _latency(primary), "candidate": _latency(shadow)},
        "confusion": {
            "labels": labels,
            "matrix": [[confusion.get((a, b), 0) for b in labels] for a in labels],
        }
        if confusion
        else None,
        "disagreements": [
            {
                "at": s.at,
                "baseline": s.baseline,
                "summary": s.summary,
                "difference": s.difference,
                "output": s.output,
                "inputs": s.inputs,
                "primary": s.primary,
                "shadow": s.shadow,
            }
            for s in samples.order_by("-at", "-id")[:DISAGREEMENTS_SHOWN]
        ],
    }
