"""A run's numbers: totals, shares, latency percentiles, utilisation, accelerator-hours, and the timeline."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from sim.metrics import percentile, percentile_all


class Finished(Protocol):
    """What a summary reads of a finished run (`sim.engine.Simulation`, which imports this module)."""

    metrics: Any
    duration: float
    snap: Any
    sc: Any
    policy: Any
    versions: Any
    models: Any
    fleet: Any
    events: Any


def summarise(sim: Finished, wall: float, cpu: float) -> dict[str, Any]:
    m = sim.metrics
    totals = m.totals()
    arrived = totals["arrived"]
    hist = m.hists.sum(axis=0)
    timeline = m.timeline(sim.duration)
    kinds = sim.snap.get("kinds", {}) if sim.snap else {}
    costs = {node.name: node.cost_per_hour for node in sim.sc.fleet}
    hours = {kind: v["on_seconds"] / 3600 for kind, v in kinds.items()}  # type: ignore[union-attr]
    on = sum(v["on_seconds"] for v in kinds.values())  # type: ignore[union-attr]
    busy = sum(v["busy_seconds"] for v in kinds.values())  # type: ignore[union-attr]
    work = sum(v["work_seconds"] for v in kinds.values())  # type: ignore[union-attr]
    p99s = [row["p99_ms"] for row in timeline if row["answered"] and not np.isnan(row["p99_ms"])]
    return {
        "scenario": sim.sc.name,
        "policy": sim.policy.name,
        "duration_s": sim.duration,
        "versions": len(sim.versions),
        "models": len(sim.models),
        "requests": arrived,
        "outcomes": totals,
        "unanswered": arrived - totals["served"] - totals["fallback"] - totals["shed"] - totals["expired"],
        "served_share": totals["served"] / arrived if arrived else 0.0,
        "fallback_share": totals["fallback"] / arrived if arrived else 0.0,
        "shed_share": totals["shed"] / arrived if arrived else 0.0,
        "expired_share": totals["expired"] / arrived if arrived else 0.0,
        "shed_reasons": m.shed_reasons(),
        "latency_ms": {
            name: percentile(hist, q) * 1000 for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
        },
        # Every request, a refused or timed-out one counting as past any budget: None when over 1% failed.
        "p99_all_ms": _ms(percentile_all(hist, totals["shed"] + totals["expired"], 0.99)),
        "worst_window_p99_ms": max(p99s) if p99s else float("nan"),
        "windows_p99_all_over_300ms": sum(
            1 for row in timeline if row["p99_all_ms"] is None or row["p99_all_ms"] > 300
        ),
        "windows": len(timeline),
        "utilisation": busy / on if on else 0.0,
        # Rows served at their best batch's cost over powered time (serving.policies.utilisation): what the
        # "> 60%" is judged on, since busy time reads near 100% at any load on a batching device.
        "work_utilisation": work / on if on else 0.0,
        "work_utilisation_by_type": {
            kind: (v["work_seconds"] / v["on_seconds"] if v["on_seconds"] else 0.0)  # type: ignore[index]
            for kind, v in kinds.items()
        },
        "utilisation_by_type": {
            kind: (v["busy_seconds"] / v["on_seconds"] if v["on_seconds"] else 0.0)  # type: ignore[index]
            for kind, v in kinds.items()
        },
        "accelerator_hours": sum(hours.values()),
        "accelerator_hours_by_type": hours,
        "cost": sum(hours[k] * costs[k] for k in hours),
        "cold_starts": sim.fleet.cold_starts,
        "evictions": [[round(at, 3), replica.version.key] for at, replica in sim.fleet.evicted],
        "unschedulable": sim.fleet.unschedulable,
        "peak_devices": max((row.get("devices", 0) for row in timeline), default=0),
        "events": sim.events,
        "wall_s": wall,
        "cpu_s": cpu,  # this process's CPU time: what one core spent, whatever else shared the machine
        "timeline": timeline,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
