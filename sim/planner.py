"""The capacity planner: an analytic what-if answered at once, and a short simulation that checks it.

Plain Python (the console's planner page calls it). The analytic model uses the autoscaler's own
`replica_capacity`: the largest batch whose wait plus compute fits admission's share of the p99 target,
and the rate one replica serves at it. A device hosting several models splits its time between them, so
each model gets its share of a replica; with dynamic batching off every batch is one request.

Latency profile from one number: a batch of one takes `latency_ms`; on an accelerator a batch of b takes
about `latency x (1 + 0.04 (b - 1))` (batched rows are nearly free until the device is full), on a CPU
`latency x (1 + 0.7 (b - 1))` (rows cost almost as much batched as alone).
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass
from typing import Any

from serving.policies.admission import HEADROOM
from serving.policies.autoscale import replica_capacity
from serving.policies.batching import LatencyProfile
from sim.budget import Budget
from sim.engine import simulate as run
from sim.scenario import from_dict

ROW_COST = {"accelerator": 0.04, "cpu": 0.7}
TARGET_UTILISATION = 0.7
MAX_BATCH = 32
SIM_SECONDS = 20.0
MAX_SIM_REQUESTS = 30_000  # a check is a second or two of one core, not a benchmark (docs/operating.md)
MAX_SIM_REPLICAS = 200  # replicas x models placed for a check: placement grows with the square of the fleet


# Every input's range (inclusive). Past them the analytic answer means nothing and a check could not finish in
# a request: a p99 target sets the simulated deadline and so how long the run drains, a latency far below a
# device's turn makes every request its own event.
BOUNDS: dict[str, tuple[float, float]] = {
    "rate": (0.1, 1_000_000.0),
    "latency_ms": (0.01, 60_000.0),
    "batch_window_ms": (0.0, 10_000.0),
    "replicas": (1, 1000),
    "models": (1, 200),
    "p99_ms": (1.0, 60_000.0),
}


class OutOfRange(ValueError):
    """A what-if input outside its range (`BOUNDS`), naming the input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class WhatIf:
    rate: float = 1000.0  # requests a second, all models together
    latency_ms: float = 10.0  # one request alone on the device
    batch_window_ms: float = 5.0
    replicas: int = 4  # devices
    models: int = 1  # models hosted on each device, sharing the traffic evenly
    p99_ms: float = 300.0
    batching: bool = True
    device: str = "accelerator"  # or "cpu"

    def __post_init__(self) -> None:
        if self.device not in ROW_COST:
            raise OutOfRange("device", "device must be 'accelerator' or 'cpu'")
        for name, (low, high) in BOUNDS.items():
            value = getattr(self, name)
            if not low <= value <= high:  # NaN too: every comparison with it is false
                raise OutOfRange(name, f"{name} must be from {low:,g} to {high:,g}")

    @property
    def max_batch(self) -> int:
        return MAX_BATCH if self.batching else 1

    def profile(self) -> dict[int, float]:
        cost = ROW_COST[self.device]
        sizes = sorted({1 << k for k in range(6) if 1 << k <= self.max_batch} | {self.max_batch})
        return {b: self.latency_ms / 1000 * (1 + cost * (b - 1)) for b in sizes}


@dataclass(frozen=True)
class Answer:
    capacity: float  # requests a second the replicas serve within the target, all models together
    utilisation: float  # offered over capacity
    batch: int  # the batch a replica runs at capacity
    replicas_needed: int  # at the target utilisation
    p50_ms: float
    p99_ms: float
    bottleneck: str
    explanation: str

    def as_dict(self) -> dict[str, Any]:
        """For JSON: an unbounded latency (utilisation at or past 1) is None."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def answer(w: WhatIf) -> Answer:
    profile = LatencyProfile(w.profile())
    cap = replica_capacity(profile.estimate, w.max_batch, w.p99_ms / 1000)
    assert cap is not None
    # Each device serves its models in turn: a model's replica gets 1/models of a device.
    per_device = cap.rate
    capacity = per_device * w.replicas
    rho = w.rate / capacity
    needed = max(1, math.ceil(w.rate / (per_device * TARGET_UTILISATION)))
    # Every device hosts every model and each model's queue is shared by all its replicas, so a model gets a
    # turn every `gap` = models x t(b) / replicas, and its batch is what arrives in between: b = rate x gap /
    # models = (rate / replicas) x t(b).
    per_device_rate = w.rate / w.replicas
    b = 1.0
    for _ in range(50):
        b = min(max(per_device_rate * profile.estimate(max(1, round(b))), 1.0), float(w.max_batch))
    batch = max(1, round(b))
    compute = profile.estimate(batch)
    gap = w.models * compute / w.replicas
    window = w.batch_window_ms / 1000 if batch < w.max_batch else 0.0
    if rho < 1:
        # M/D/1's wait in units of a batch, its tail by the exponential approximation (ln 100 for p99)
        wait = rho / (2 * (1 - rho)) * compute
        p50 = window / 2 + gap / 2 + compute + wait * math.log(2)
        p99 = window + gap + compute + wait * math.log(100)
    else:
        p50 = p99 = math.inf

    budget = HEADROOM * w.p99_ms / 1000
    if not cap.fits_budget:
        name, why = (
            "p99 budget",
            (
                f"even a batch of one waits and runs for {2 * profile.estimate(1) * 1000:.0f} ms,"
                f" over {budget * 1000:.0f} ms (80% of the target): a faster model or device"
            ),
        )
    elif rho >= 1:
        name, why = (
            "serving capacity",
            (
                f"{w.rate:.0f} requests/s against {capacity:.0f} the replicas serve within"
                f" the target: {needed} replicas at {TARGET_UTILISATION:.0%} utilisation"
            ),
        )
    elif rho > TARGET_UTILISATION or needed > w.replicas:
        name, why = (
            "fleet pressure",
            (
                f"utilisation {rho:.0%} leaves no room for a burst or a cold start:"
                f" {needed} replicas keep {TARGET_UTILISATION:.0%}"
            ),
        )
    elif w.models > 1 and p99 > w.p99_ms / 1000:
        name, why = (
            "multi-model packing",
            (f"{w.models} models take turns on each device: a model waits about {gap * 1000:.0f} ms for its turn"),
        )
    elif p99 > w.p99_ms / 1000:
        name, why = "p99 budget", f"queueing at {rho:.0%} utilisation puts p99 near {p99 * 1000:.0f} ms"
    elif w.device == "accelerator" and batch <= 2:
        name, why = (
            "accelerator efficiency",
            (
                f"batches of {batch}: the accelerator runs almost empty; fewer"
                " replicas, a longer window or more models per device would fill it"
            ),
        )
    else:
        name, why = "none", f"utilisation {rho:.0%}, batches of {batch}, p99 near {p99 * 1000:.0f} ms"
    return Answer(capacity, rho, cap.batch, needed, p50 * 1000, p99 * 1000, name, why)


def sim_requests(w: WhatIf) -> float:
    """The requests a check simulates at most: each device turn looks at every model it hosts, so a check of
    many models per device gets fewer requests (the simulated seconds shrink, the figures stay comparable)."""
    return MAX_SIM_REQUESTS * 4 / (w.models + 3)


def scenario_doc(w: WhatIf, seconds: float = SIM_SECONDS) -> dict[str, Any]:
    """The what-if as a simulator scenario: `models` versions on `replicas` identical devices."""
    seconds = min(seconds, sim_requests(w) / w.rate)
    profile_ms = {b: s * 1000 for b, s in w.profile().items()}
    return {
        "name": "planner",
        "duration": seconds,
        "seed": 1,
        "versions": w.models,
        "canary_share": 0.0,
        "fallback_share": 0.0,
        "zipf": 0.0,
        "window": max(1.0, seconds / 20),
        "traffic": {"shape": "steady", "rate": w.rate},
        "families": {
            "model": {
                "share": 1.0,
                "accelerator": "device",
                "memory_gb": 1.0,
                "base_ms": 1,
                "per_row_ms": 0,
                "max_batch_size": w.max_batch,
                "max_queue_delay_ms": w.batch_window_ms,
                "profile_ms": profile_ms,
            }
        },
        "fleet": {
            "device": {
                "nodes": w.replicas,
                "memory_gb": max(1.0, w.models * 1.0),
                "speed": 1.0,
                "cost_per_hour": 1.0,
                "cold_start": 0,
            }
        },
        "scaling": {
            "latency_budget": w.p99_ms / 1000,
            "timeout": max(1.0, 2 * w.p99_ms / 1000),
            "max_device_load": 10.0,
            "fixed_replicas": w.replicas,
        },
        "policies": ["static"],
    }


def check_simulable(w: WhatIf) -> None:
    """OutOfRange when the what-if is too large to check in a request (the analytic answer still stands)."""
    if w.replicas * w.models > MAX_SIM_REPLICAS:
        raise OutOfRange(
            "replicas",
            f"{w.replicas} replicas x {w.models} models is too large to simulate here"
            f" (at most {MAX_SIM_REPLICAS}); `python -m sim.report` runs fleets of any size",
        )


def simulate(w: WhatIf, budget: Budget | None = None) -> tuple[dict[str, Any], bytes]:
    """Run the short check; the summary and a PNG of latency and load over time. OutOfRange when the
    what-if is too large to check in a request; `sim.budget.Stopped` when `budget` ran out first."""
    check_simulable(w)
    result = run(from_dict(scenario_doc(w)), "static", budget=budget)
    return result, _plot(result, w)


def _plot(result: dict[str, Any], w: WhatIf) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    t = [r["t"] for r in tl]
    fig, (lat, load) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    lat.plot(t, [r["p50_ms"] for r in tl], label="p50")
    lat.plot(t, [r["p99_ms"] for r in tl], label="p99")
    lat.axhline(w.p99_ms, color="grey", linestyle="--", linewidth=1, label="p99 target")
    lat.set_ylabel("ms")
    lat.legend(fontsize=8)
    load.plot(t, [100 * r.get("utilisation", 0) for r in tl], label="device busy %")
    load.plot(t, [100 * (r["shed_share"] + r["expired_share"]) for r in tl], label="shed + timed out %")
    load.set_ylabel("%")
    load.set_xlabel("simulated seconds")
    load.legend(fontsize=8)
    for ax in (lat, load):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    plt.close(fig)
    return buf.getvalue()
