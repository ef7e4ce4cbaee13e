"""The numbers a rollout's gates judge, read from metered usage and the shadow comparison.

Usage comes from `usage.models.UsageMinute` (every tenant's answers, per version and minute), which the data
plane flushes every FERRY_USAGE_FLUSH_SECONDS, so the newest seconds are not in it yet. Cells are whole
minutes: a window "since t" reads the minute t falls in onwards, so it starts up to a minute early. The
candidate serves no unpinned traffic before its rollout, so its early part is almost all the step's;
the baseline's holds up to a minute of the previous step's, a share it also had then.
"""

from __future__ import annotations

from datetime import datetime

from rollout.gates import Evidence, Side
from usage import sketch


def usage_side(model_name: str, version: int, since: datetime) -> Side:
    """One version's answers to every tenant from the minute `since` falls in onwards. A request it refused
    that the model's fallback answered counts here as asked and failed: the caller got the fallback's answer,
    but the version under judgement did not serve it (its latency is the fallback's, and left out)."""
    from usage.models import UsageMinute

    rows = UsageMinute.objects.filter(
        model_name=model_name,
        version=version,
        minute__gte=since.replace(second=0, microsecond=0),
    ).values_list("requests", "errors_4xx", "errors_5xx", "fell_back", "latency")
    requests = errors = 0
    latency: sketch.Sketch = {}
    for n, e4, e5, fell_back, cells in rows:
        requests += n + fell_back
        errors += e4 + e5 + fell_back
        sketch.merge(latency, cells or {})
    p99 = sketch.quantile(latency, 0.99)
    return Side(requests=requests, errors=errors, p99_ms=None if p99 is None else p99 * 1000)


def shadow_agreement(model_name: str, baseline: int, candidate: int, since: datetime) -> tuple[float | None, int]:
    """The shadow comparison's agreement fraction (None without one) and how many outputs it compared.
    The comparison lives in `rollout.shadow_report`; where that module is not installed the gate has no data."""
    try:
        from rollout.shadow_report import agreement
    except ModuleNotFoundError as exc:
        if exc.name != "rollout.shadow_report":
            raise  # the module is there but broken: a bug to see, not an absence to tolerate
        return None, 0
    return agreement(model_name, baseline, candidate, since)


def gather(
    *,
    model_name: str,
    baseline: int,
    candidate: int,
    since: datetime,
    fallback_since: datetime,
    min_requests: int,
    with_usage: bool = True,
) -> tuple[Evidence, dict]:
    """The evidence over the window from `since`, and where each part came from. The baseline is read over
    the same window when it has enough answers there (same load, same hour); otherwise (at a 100% step it
    has none) from `fallback_since`, the rollout's start."""
    windows = {"candidate_since": since.isoformat(), "baseline_since": since.isoformat()}
    if with_usage:
        cand = usage_side(model_name, candidate, since)
        base = usage_side(model_name, baseline, since)
        if base.requests < min_requests and fallback_since < since:
            base = usage_side(model_name, baseline, fallback_since)
            windows["baseline_since"] = fallback_since.isoformat()
    else:
        cand = base = Side()
    agreement, compared = shadow_agreement(model_name, baseline, candidate, since)
    return Evidence(baseline=base, candidate=cand, agreement=agreement, compared=compared), windows
