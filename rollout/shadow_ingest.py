"""Adding a gateway's flushed shadow comparison into ShadowMinute, at most once per batch, and keeping the
newest disagreements only (FERRY_SHADOW_SAMPLES per model, baseline and candidate).

As usage.ingest does: the batch id is recorded first, where a second run stops; missing cells are
created empty, locked in key order, and the counts and sketches added under the lock (JSON maps
cannot be added in portable SQL)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.conf import settings
from django.db import IntegrityError, transaction

from rollout.models import ShadowBatch, ShadowDisagreement, ShadowMinute
from usage.sketch import merge, to_json

log = logging.getLogger(__name__)

MAX_BATCH_ROWS = 50_000
MAX_BATCH_SAMPLES = 2_000
_SUMS = ("mirrored", "shadow_errors", "incomparable", "compared", "agreed", "abs_count")
_FLOATS = ("abs_sum", "similarity_sum")
_MAPS = ("difference", "confusion", "primary_latency", "shadow_latency", "statuses")

Key = tuple[str, int, int, datetime]


def _minute(value: int) -> datetime:
    return datetime.fromtimestamp(int(value) * 60, tz=UTC)


def _add_map(into: dict, other: dict) -> dict:
    for k, v in other.items():
        into[str(k)] = into.get(str(k), 0) + int(v)
    return into


def ingest(batch_id: str, rows: list[dict], samples: list[dict]) -> int:
    """Add `rows` (rollout.shadow_compare.aggregate) and `samples` unless `batch_id` was added before.
    Returns the cells written (0 for a repeated batch)."""
    if len(rows) > MAX_BATCH_ROWS or len(samples) > MAX_BATCH_SAMPLES:
        raise ValueError(f"a shadow batch holds at most {MAX_BATCH_ROWS} rows and {MAX_BATCH_SAMPLES} samples")
    totals: dict[Key, dict] = {}
    for row in rows:
        key = (str(row["model"]), int(row["baseline"]), int(row["candidate"]), _minute(row["minute"]))
        total = totals.setdefault(
            key,
            {
                "task": str(row["task"]),
                **{f: 0 for f in _SUMS},
                **{f: 0.0 for f in _FLOATS},
                "abs_max": 0.0,
                "similarity_min": None,
                **{f: {} for f in _MAPS},
            },
        )
        for f in _SUMS:
            total[f] += int(row[f])
        for f in _FLOATS:
            total[f] += float(row[f])
        total["abs_max"] = max(total["abs_max"], float(row["abs_max"]))
        total["similarity_min"] = _lowest(total["similarity_min"], row["similarity_min"])
        for f in _MAPS:
            _add_map(total[f], row[f])
    with transaction.atomic():
        try:
            with transaction.atomic():
                ShadowBatch.objects.create(batch_id=batch_id)
        except IntegrityError:
            log.info("shadow batch %s was recorded before; adding nothing", batch_id)
            return 0
        if totals:
            ShadowMinute.objects.bulk_create(
                [
                    ShadowMinute(model_name=m, baseline=b, candidate=c, minute=at, task=totals[(m, b, c, at)]["task"])
                    for m, b, c, at in sorted(totals)
                ],
                ignore_conflicts=True,
            )
            cells = _locked(totals)
            for cell in cells:
                total = totals[(cell.model_name, cell.baseline, cell.candidate, cell.minute)]
                for f in (*_SUMS, *_FLOATS):
                    setattr(cell, f, getattr(cell, f) + total[f])
                cell.abs_max = max(cell.abs_max, total["abs_max"])
                cell.similarity_min = _lowest(cell.similarity_min, total["similarity_min"])
                for f in ("difference", "primary_latency", "shadow_latency"):
                    setattr(cell, f, to_json(merge(merge({}, getattr(cell, f)), total[f])))
                for f in ("confusion", "statuses"):
                    setattr(cell, f, _add_map(dict(getattr(cell, f)), total[f]))
            ShadowMinute.objects.bulk_update(
                cells, [*_SUMS, *_FLOATS, "abs_max", "similarity_min", *_MAPS], batch_size=1000
            )
        _keep_samples(samples)
        return len(totals)


def _lowest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return None if b is None else float(b)
    return a if b is None else min(a, float(b))


def _locked(totals: dict[Key, dict]) -> list[ShadowMinute]:
    minutes = {k[3] for k in totals}
    candidates = (
        ShadowMinute.objects.select_for_update()
        .filter(model_name__in={k[0] for k in totals}, minute__gte=min(minutes), minute__lte=max(minutes))
        .order_by("model_name", "baseline", "candidate", "minute")
    )
    cells = [c for c in candidates if (c.model_name, c.baseline, c.candidate, c.minute) in totals]
    if len(cells) != len(totals):
        raise RuntimeError(f"shadow cells missing after insert: {len(totals) - len(cells)}")
    return cells


def _keep_samples(samples: list[dict]) -> None:
    if not samples:
        return
    ShadowDisagreement.objects.bulk_create(
        [
            ShadowDisagreement(
                model_name=s["model"],
                baseline=int(s["baseline"]),
                candidate=int(s["candidate"]),
                at=datetime.fromtimestamp(float(s["at"]), tz=UTC),
                summary=str(s["summary"])[:500],
                difference=s.get("difference"),
                output=str(s.get("output", ""))[:100],
                inputs=s.get("inputs"),
                primary=s.get("primary"),
                shadow=s.get("shadow"),
            )
            for s in samples
        ]
    )
    keep = settings.FERRY_SHADOW_SAMPLES
    for model, baseline, candidate in sorted({(s["model"], int(s["baseline"]), int(s["candidate"])) for s in samples}):
        stale = (
            ShadowDisagreement.objects.filter(model_name=model, baseline=baseline, candidate=candidate)
            .order_by("-at", "-id")
            .values_list("id", flat=True)[keep:]
        )
        ShadowDisagreement.objects.filter(id__in=list(stale)).delete()
