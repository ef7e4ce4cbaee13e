"""Usage over a time range at a granularity: minute cells summed per tenant, model, version and period,
with latency percentiles from the merged sketches. Shared by the API and the console."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db.models import QuerySet

from usage.models import UsageMinute
from usage.sketch import Sketch, merge, quantile

GRANULARITY = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
# The longest range a report may span, per granularity, and its default: bounds on what one request reads.
MAX_RANGE = {"minute": timedelta(days=1), "hour": timedelta(days=14), "day": timedelta(days=92)}
DEFAULT_RANGE = {"minute": timedelta(hours=1), "hour": timedelta(days=1), "day": timedelta(days=30)}
MAX_CELLS = 500_000  # minute rows one report may read


class TooMuchUsage(ValueError):
    pass


@dataclass
class Period:
    tenant: str
    model: str
    version: int
    start: datetime
    requests: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    items: int = 0
    compute_seconds: float = 0.0
    latency: Sketch = field(default_factory=dict)

    def percentile_ms(self, q: float) -> float | None:
        seconds = quantile(self.latency, q)
        return None if seconds is None else round(seconds * 1000, 3)

    def as_row(self) -> dict:
        return {
            "tenant": self.tenant,
            "model": self.model,
            "version": self.version,
            "start": self.start,
            "requests": self.requests,
            "errors_4xx": self.errors_4xx,
            "errors_5xx": self.errors_5xx,
            "items": self.items,
            "compute_seconds": round(self.compute_seconds, 6),
            "p50_ms": self.percentile_ms(0.50),
            "p95_ms": self.percentile_ms(0.95),
            "p99_ms": self.percentile_ms(0.99),
        }


def truncate(at: datetime, granularity: str) -> datetime:
    if granularity == "minute":
        return at.replace(second=0, microsecond=0)
    if granularity == "hour":
        return at.replace(minute=0, second=0, microsecond=0)
    return at.replace(hour=0, minute=0, second=0, microsecond=0)


def periods(cells: QuerySet[UsageMinute], *, start: datetime, end: datetime, granularity: str) -> list[Period]:
    """Sum the minute cells in [start, end) into periods, ordered by start, tenant, model, version."""
    chosen = cells.filter(minute__gte=start, minute__lt=end)
    if chosen.count() > MAX_CELLS:
        raise TooMuchUsage(f"the range holds more than {MAX_CELLS} minute rows; narrow it or filter by model")
    found: dict[tuple, Period] = {}
    rows = chosen.values_list(
        "tenant__slug",
        "model_name",
        "version",
        "minute",
        "requests",
        "errors_4xx",
        "errors_5xx",
        "items",
        "compute_seconds",
        "latency",
    )
    for slug, model, version, minute, requests, e4, e5, items, compute, latency in rows.iterator(chunk_size=5000):
        begins = truncate(minute, granularity)
        key = (begins, slug, model, version)
        period = found.get(key)
        if period is None:
            period = found[key] = Period(slug, model, version, begins)
        period.requests += requests
        period.errors_4xx += e4
        period.errors_5xx += e5
        period.items += items
        period.compute_seconds += compute
        merge(period.latency, latency)
    return [found[k] for k in sorted(found)]
