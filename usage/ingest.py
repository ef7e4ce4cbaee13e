"""Adding drained usage into UsageMinute: additive, and at most once per batch.

Several gateways write the same (tenant, model, version, minute) cell, and Celery may run a task twice
(acks_late, a worker lost mid-task). So one transaction records the batch id first, where a second run
of the same batch stops, creates the missing cells empty (INSERT ... ON CONFLICT DO NOTHING), locks the
cells in key order (so two batches over the same cells cannot deadlock), and adds the counts and the
latency sketches in. The sketch is a JSON map, which SQL cannot add portably (embedded mode runs on
SQLite), so the addition happens here under the row lock rather than in ON CONFLICT DO UPDATE.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from django.db import IntegrityError, transaction

from tenants.models import Tenant
from usage.models import UsageBatch, UsageMinute
from usage.sketch import merge, to_json

log = logging.getLogger(__name__)

MAX_BATCH_ROWS = 50_000  # a recorder holds at most its max_keys cells; this bounds what a task accepts

Key = tuple[int, str, int, datetime]


def _key(row: dict) -> Key:
    return (
        int(row["tenant"]),
        str(row["model"]),
        int(row["version"]),
        datetime.fromtimestamp(int(row["minute"]) * 60, tz=UTC),
    )


def ingest(batch_id: str, rows: list[dict]) -> int:
    """Add `rows` (usage.recorder.Drained.rows) into UsageMinute unless `batch_id` was added before.
    Returns the number of cells written (0 for a repeated batch). Rows of a tenant deleted meanwhile
    are dropped, and logged."""
    if len(rows) > MAX_BATCH_ROWS:
        raise ValueError(f"a usage batch holds at most {MAX_BATCH_ROWS} rows, not {len(rows)}")
    totals: dict[Key, dict] = {}
    for row in rows:  # a batch may name a cell twice (several drains resent together): add them first
        key = _key(row)
        total = totals.setdefault(
            key,
            {
                "requests": 0,
                "errors_4xx": 0,
                "errors_5xx": 0,
                "items": 0,
                "compute_seconds": 0.0,
                "latency": {},
                "fell_back": 0,
            },
        )
        for field in ("requests", "errors_4xx", "errors_5xx", "items"):
            total[field] += int(row[field])
        total["fell_back"] += int(row.get("fell_back", 0))  # absent from a process of an earlier release
        total["compute_seconds"] += float(row["compute_seconds"])
        merge(total["latency"], row["latency"])
    with transaction.atomic():
        try:
            with transaction.atomic():
                UsageBatch.objects.create(batch_id=batch_id, rows=len(totals))
        except IntegrityError:
            log.info("usage batch %s was recorded before; adding nothing", batch_id)
            return 0
        tenants = set(Tenant.objects.filter(pk__in={k[0] for k in totals}).values_list("pk", flat=True))
        gone = [k for k in totals if k[0] not in tenants]
        if gone:
            log.warning(
                "usage batch %s: dropping %d cells of deleted tenants %s",
                batch_id,
                len(gone),
                sorted({k[0] for k in gone}),
            )
            for key in gone:
                del totals[key]
        if not totals:
            return 0
        UsageMinute.objects.bulk_create(
            [UsageMinute(tenant_id=t, model_name=m, version=v, minute=at) for t, m, v, at in sorted(totals)],
            ignore_conflicts=True,
        )
        cells = _locked(totals)
        for cell in cells:
            total = totals[(cell.tenant_id, cell.model_name, cell.version, cell.minute)]
            cell.requests += total["requests"]
            cell.errors_4xx += total["errors_4xx"]
            cell.errors_5xx += total["errors_5xx"]
            cell.items += total["items"]
            cell.compute_seconds += total["compute_seconds"]
            cell.fell_back += total["fell_back"]
            cell.latency = to_json(merge(merge({}, cell.latency), total["latency"]))
        UsageMinute.objects.bulk_update(
            cells,
            ["requests", "errors_4xx", "errors_5xx", "items", "compute_seconds", "latency", "fell_back"],
            batch_size=1000,
        )
        return len(cells)


def _locked(totals: dict[Key, dict]) -> list[UsageMinute]:
    minutes = {k[3] for k in totals}
    candidates = (
        UsageMinute.objects.select_for_update()
        .filter(
            tenant_id__in={k[0] for k in totals},
            model_name__in={k[1] for k in totals},
            minute__gte=min(minutes),
            minute__lte=max(minutes),
        )
        .order_by("tenant_id", "model_name", "version", "minute")
    )
    cells = [c for c in candidates if (c.tenant_id, c.model_name, c.version, c.minute) in totals]
    if len(cells) != len(totals):
        raise RuntimeError(f"usage cells missing after insert: {len(totals) - len(cells)}")
    return cells
