"""The capacity lab's "from my fleet": the what-if's inputs read from the running platform, each with where it
came from, so the lab starts from the fleet as it is.

- rate: the answers usage metering counted over the last `RATE_MINUTES` whole minutes (`usage.UsageMinute`),
  for the caller's tenants (platform staff: every tenant), divided by the seconds;
- per-request latency: the servable versions' measured profiles (a batch of one, else the smallest batch measured
  divided by its rows), weighted by the versions' share of that traffic (evenly without traffic);
- batch window and dynamic batching: the same versions' `max_queue_delay_ms` and `max_batch_size`;
- replicas, device, models per device: the live nodes of `serving.fleet_state` (heartbeats), the hot versions each
  holds, and whether any has an accelerator;
- p99 target: FERRY_LATENCY_BUDGET_MS, the budget the autoscaler sizes replicas for;
- canary: whether a rollout of a model of the caller's tenants is running (platform staff: any); another tenant's
  rollouts are its own workflow, unsaid even for a model the caller may call (`rollout.api.views`).

What the fleet cannot say (no traffic, no live node, no measured profile) is listed in `missing`, and the lab
keeps its own value for it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Sum

from rollout.models import Rollout
from serving.models import ModelVersion
from sim.planner import BOUNDS
from tenants.scoping import member_tenant_ids, visible_models
from usage.models import UsageMinute

RATE_MINUTES = 5


def _clamp(name: str, value: float) -> float:
    low, high = BOUNDS[name]
    return min(max(value, low), high)


def one_request_ms(profile: dict[str, Any]) -> float | None:
    """A batch of one's milliseconds from a measured profile ({batch size: ms}, keys as JSON strings), else the
    smallest batch measured per row; None for an empty or unreadable profile."""
    points: list[tuple[int, float]] = []
    for size, ms in (profile or {}).items():
        try:
            b, t = int(size), float(ms)
        except (TypeError, ValueError):
            continue
        if b >= 1 and math.isfinite(t) and t > 0:
            points.append((b, t))
    if not points:
        return None
    b, t = min(points)
    return t / b


def _rollout_running(user: Any) -> bool:
    """Whether a rollout runs that `user` may read: of a model its tenants own (platform staff: any), as
    /api/rollouts/ scopes them, so a public or shared model of another tenant tells nothing of its rollouts."""
    rollouts = Rollout.objects.active()
    if not user.is_staff:
        rollouts = rollouts.filter(model__tenant_id__in=member_tenant_ids(user))
    return rollouts.exists()


def fleet_inputs(user: Any, state: dict[str, Any], now: datetime) -> dict[str, Any]:
    """The inputs (only those the fleet answers), a sentence per input on where it came from, and `missing`."""
    inputs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    missing: list[str] = []

    models = visible_models(user)
    versions = list(ModelVersion.objects.servable().filter(model__in=models))
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=RATE_MINUTES)
    usage = UsageMinute.objects.filter(minute__gte=start, minute__lt=end)
    if not user.is_staff:
        usage = usage.filter(tenant_id__in=member_tenant_ids(user))
    served: dict[tuple[str, int], int] = defaultdict(int)
    for row in usage.values("model_name", "version").annotate(n=Sum("requests")):
        served[(row["model_name"], row["version"])] += row["n"]
    total = sum(served.values())
    if total > 0:
        inputs["rate"] = round(_clamp("rate", total / (RATE_MINUTES * 60)), 2)
        sources["rate"] = f"{total:,} answers metered over the last {RATE_MINUTES} whole minutes (usage)"
    else:
        missing.append("rate")

    weights = {v.pk: served.get((v.model.name, v.version), 0) for v in versions}
    if not any(weights.values()):
        weights = dict.fromkeys(weights, 1)
    measured = [(v, one_request_ms(v.latency_profile)) for v in versions]
    measured = [(v, ms) for v, ms in measured if ms is not None]
    if measured:
        weight = sum(weights[v.pk] for v, _ in measured) or 1
        inputs["latency_ms"] = round(_clamp("latency_ms", sum(weights[v.pk] * ms for v, ms in measured) / weight), 3)
        sources["latency_ms"] = f"the measured profiles of {len(measured)} servable versions, weighted by traffic"
    else:
        missing.append("latency_ms")
    if versions:
        weight = sum(weights.values()) or 1
        window = sum(weights[v.pk] * v.max_queue_delay_ms for v in versions) / weight
        inputs["batch_window_ms"] = round(_clamp("batch_window_ms", window), 2)
        batched = sum(weights[v.pk] for v in versions if v.max_batch_size > 1)
        inputs["batching"] = batched * 2 >= weight
        sources["batch_window_ms"] = f"the batch window of {len(versions)} servable versions, weighted by traffic"
        sources["batching"] = "dynamic batching where most traffic goes to versions batching more than one request"
    else:
        missing += ["batch_window_ms", "batching"]

    canary = _rollout_running(user)
    live = [n for n in state.get("nodes", []) if n.get("state") == "live"]
    if live:
        inputs["replicas"] = int(_clamp("replicas", len(live)))
        inputs["device"] = "accelerator" if any(n.get("accelerator_count", 0) > 0 for n in live) else "cpu"
        hot = [sum(1 for r in n.get("resident", []) if r.get("tier") == "hot") for n in live]
        per_model = 2 if canary else 1  # a rollout's candidate is the second version of its model
        inputs["models"] = int(_clamp("models", max(1, round(sum(hot) / len(live) / per_model))))
        sources["replicas"] = f"{len(live)} live node{'s' if len(live) > 1 else ''} (heartbeats)"
        sources["device"] = "an accelerator where any live node reports one"
        sources["models"] = "the hot versions a live node holds, on average"
    else:
        missing += ["replicas", "device", "models"]

    inputs["p99_ms"] = _clamp("p99_ms", float(settings.FERRY_LATENCY_BUDGET_MS))
    sources["p99_ms"] = "FERRY_LATENCY_BUDGET_MS, the p99 the autoscaler sizes replicas for"
    inputs["canary"] = canary
    sources["canary"] = "a rollout is running (/api/rollouts/ lists it)" if canary else "no rollout is running"
    inputs["autoscale"] = False
    sources["autoscale"] = "off: the replicas are the nodes running now"
    return {"inputs": inputs, "sources": sources, "missing": missing, "nodes": len(live), "versions": len(versions)}
