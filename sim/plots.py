"""Plots of a scenario's runs, one PNG per scenario (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLOURS = {
    "predictive": "#1f77b4",
    "forecast-only": "#9467bd",
    "trend-only": "#ff7f0e",
    "reactive": "#d62728",
    "static": "#2ca02c",
    "onset": "#7f7f7f",
}


def scenario_plot(name: str, title: str, runs: list[dict[str, Any]], path: Path, budget_ms: float = 300.0) -> Path:
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    rate_ax, p99_ax, fail_ax, dev_ax = axes
    first = runs[0]["timeline"]
    rate_ax.plot([r["t"] for r in first], [r["rate"] / 1000 for r in first], color="black")
    rate_ax.set_ylabel("offered (k req/s)")
    rate_ax.set_title(title)
    for run in runs:
        tl = run["timeline"]
        t = [r["t"] for r in tl]
        colour = COLOURS.get(run["policy"])
        p99_ax.plot(t, [r["p99_ms"] for r in tl], color=colour, label=f"{run['policy']} (answered)")
        fail_ax.plot(t, [100 * (r["shed_share"] + r["expired_share"]) for r in tl], color=colour, label=run["policy"])
        dev_ax.plot(t, [r.get("devices", 0) for r in tl], color=colour, label=run["policy"])
    p99_ax.axhline(budget_ms, color="grey", linestyle="--", linewidth=1, label=f"{budget_ms:.0f} ms")
    p99_ax.set_yscale("log")
    p99_ax.set_ylabel("p99 per 10 s (ms)")
    p99_ax.legend(fontsize=8)
    fail_ax.set_ylabel("shed + timed out (%)")
    fail_ax.legend(fontsize=8)
    dev_ax.set_ylabel("accelerators on")
    dev_ax.set_xlabel("simulated seconds")
    dev_ax.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
