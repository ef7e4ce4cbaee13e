"""The capacity planner: an analytic what-if answered at once, and a short simulation that checks it.

Plain Python (the console's planner page calls it). The analytic model uses the autoscaler's own
`replica_capacity`: the largest batch whose wait plus compute fits admission's share of the p99 target,
and the rate one replica serves at it. A device hosting several models splits its time between them, so
each model gets its share of a replica; with dynamic batching off every batch is one request.

Latency profile from one number: a batch of one takes `latency_ms`; on an accelerator a batch of b takes
about `latency x (1 + 0.04 (b - 1))` (batched rows are nearly free until the device is full), on a CPU
`latency x (1 + 0.7 (b - 1))` (rows cost almost as much batched as alone).

The lab's extras (the console's /console/planner/): `autoscale` sizes the replicas as the autoscaler
would (its target utilisation), `canary` gives every model a candidate version at a tenth of its traffic
(two versions per model on each device). `meters` turns an answer into the five bottleneck meters,
`curve` into p99 and throughput against the rate, and `simulate` checks a few rates of that curve.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from serving.policies.admission import HEADROOM
from serving.policies.autoscale import replica_capacity
from serving.policies.batching import LatencyProfile
from sim.budget import Budget, Stopped
from sim.engine import simulate as run
from sim.scenario import from_dict

ROW_COST = {"accelerator": 0.04, "cpu": 0.7}
TARGET_UTILISATION = 0.7
MAX_BATCH = 32
CANARY_WEIGHT = 0.1  # a candidate's share of its model's traffic while its rollout runs
# Teaching assumptions, labelled so on the page: versions one device keeps hot before it would swap them in
# and out (Ferry's nodes hold what fits their memory budget; the simulator gives each device room for all),
# and an accelerator's batches counted as "almost empty" below this share of a full batch's throughput.
HOT_VERSIONS = 8
LOW_EFFICIENCY = 0.25
SWEEP = (0.25, 0.5, 0.75, 1.0)  # a check's extra rates, as shares of the curve's widest rate
CURVE_POINTS = 48
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
    autoscale: bool = False  # replicas as the autoscaler would size them (`replicas` ignored)
    canary: bool = False  # every model rolls out a candidate at CANARY_WEIGHT of its traffic

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

    @property
    def versions(self) -> int:
        """Versions on each device: its models, and their candidates while a canary runs."""
        return self.models * (2 if self.canary else 1)

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
    replicas: int  # the devices answered for: the what-if's, or the autoscaler's pick
    versions: int  # versions on each device
    running_batch: int  # the batch a replica runs at this rate
    compute_ms: float  # p99's parts: the batch's compute,
    window_ms: float  # the batch window (none once batches fill before it ends),
    turn_ms: float  # the wait for the version's turn on a device it shares,
    queue_ms: float  # and the queueing tail
    efficiency: float  # rows a device serves a second, as a share of what full batches would

    def as_dict(self) -> dict[str, Any]:
        """For JSON: an unbounded latency (utilisation at or past 1) is None."""
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}


def answer(w: WhatIf) -> Answer:
    profile = LatencyProfile(w.profile())
    cap = replica_capacity(profile.estimate, w.max_batch, w.p99_ms / 1000)
    assert cap is not None
    # Each device serves its versions in turn; what it serves within the target is the same whichever asks.
    per_device = cap.rate
    needed = max(1, math.ceil(w.rate / (per_device * TARGET_UTILISATION)))
    replicas = min(needed, int(BOUNDS["replicas"][1])) if w.autoscale else w.replicas
    capacity = per_device * replicas
    rho = w.rate / capacity
    # Every device hosts every version and each version's queue is shared by all its replicas, so a version gets
    # a turn every `gap` = versions x t(b) / replicas, and its batch is what arrives in between: b = rate x gap /
    # versions = (rate / replicas) x t(b).
    per_device_rate = w.rate / replicas
    b = 1.0
    for _ in range(50):
        b = min(max(per_device_rate * profile.estimate(max(1, round(b))), 1.0), float(w.max_batch))
    batch = max(1, round(b))
    compute = profile.estimate(batch)
    gap = w.versions * compute / replicas
    window = w.batch_window_ms / 1000 if batch < w.max_batch else 0.0
    if rho < 1:
        # M/D/1's wait in units of a batch, its tail by the exponential approximation (ln 100 for p99)
        wait = rho / (2 * (1 - rho)) * compute
        p50 = window / 2 + gap / 2 + compute + wait * math.log(2)
        p99 = window + gap + compute + wait * math.log(100)
        queue = wait * math.log(100)
    else:
        p50 = p99 = queue = math.inf
    best = MAX_BATCH / (w.latency_ms / 1000 * (1 + ROW_COST[w.device] * (MAX_BATCH - 1)))  # full batches
    efficiency = min(w.rate, capacity) / replicas / best

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
    elif rho > TARGET_UTILISATION or needed > replicas:
        name, why = (
            "fleet pressure",
            (
                f"utilisation {rho:.0%} leaves no room for a burst or a cold start:"
                f" {needed} replicas keep {TARGET_UTILISATION:.0%}"
            ),
        )
    elif w.versions > HOT_VERSIONS:
        name, why = (
            "multi-model packing",
            (
                f"{w.versions} versions on each device, more than the {HOT_VERSIONS} one keeps hot (a teaching"
                " assumption): more replicas, or pack fewer models per device"
            ),
        )
    elif w.versions > 1 and p99 > w.p99_ms / 1000:
        name, why = (
            "multi-model packing",
            (f"{w.versions} versions take turns on each device: one waits about {gap * 1000:.0f} ms for its turn"),
        )
    elif p99 > w.p99_ms / 1000:
        name, why = "p99 budget", f"queueing at {rho:.0%} utilisation puts p99 near {p99 * 1000:.0f} ms"
    elif w.device == "accelerator" and efficiency < LOW_EFFICIENCY:
        name, why = (
            "accelerator efficiency",
            (
                f"batches of {batch}: the accelerator runs almost empty; fewer"
                " replicas, a longer window or more models per device would fill it"
            ),
        )
    else:
        name, why = "none", f"utilisation {rho:.0%}, batches of {batch}, p99 near {p99 * 1000:.0f} ms"
    return Answer(
        capacity,
        rho,
        cap.batch,
        needed,
        p50 * 1000,
        p99 * 1000,
        name,
        why,
        replicas=replicas,
        versions=w.versions,
        running_batch=batch,
        compute_ms=compute * 1000,
        window_ms=window * 1000,
        turn_ms=gap * 1000,
        queue_ms=queue * 1000,
        efficiency=efficiency,
    )


@dataclass(frozen=True)
class Meter:
    name: str
    value: float  # 1 is the limit (for efficiency: full batches, all the time); inf past saturation
    state: str  # "ok", "warn", "over"; "off" for accelerator efficiency on a CPU
    reading: str  # the figure as the page shows it
    drives: str  # what moves it


def meters(w: WhatIf, a: Answer) -> list[Meter]:
    """The five bottleneck meters of the lab, each from the answer's own figures."""
    target = w.p99_ms
    p99_share = a.p99_ms / target

    def state(value: float, warn: float, over: float) -> str:
        return "over" if value > over else "warn" if value > warn else "ok"

    p99_text = "unbounded" if math.isinf(a.p99_ms) else f"{a.p99_ms:,.0f} ms"
    if w.device == "cpu":
        efficiency = Meter(
            "Accelerator efficiency", a.efficiency, "off", "no accelerator", "a CPU gains little from batching"
        )
    else:
        efficiency = Meter(
            "Accelerator efficiency",
            a.efficiency,
            "warn" if a.efficiency < LOW_EFFICIENCY else "ok",
            f"{a.efficiency:.0%} of full batches",
            f"batches of {a.running_batch} of {w.max_batch} at this rate per replica; under {LOW_EFFICIENCY:.0%}"
            " counts as nearly empty (teaching assumption)",
        )
    return [
        Meter(
            "Serving capacity",
            a.utilisation,
            "over" if a.utilisation >= 1 else state(a.utilisation, TARGET_UTILISATION, 1.0),
            f"{a.utilisation:.0%} of {a.capacity:,.0f} req/s",
            "rate against replicas x what one serves within 80% of the target (admission's headroom)",
        ),
        Meter(
            "p99 latency budget",
            p99_share,
            state(p99_share, HEADROOM, 1.0),
            f"{p99_text} of {target:,.0f} ms",
            "compute (teaching row cost) + batch window + waiting for a turn + M/D/1 queueing",
        ),
        efficiency,
        Meter(
            "Replica fleet pressure",
            a.replicas_needed / a.replicas,
            state(a.replicas_needed / a.replicas, 1.0, 1 / TARGET_UTILISATION),
            f"{a.replicas_needed:,} needed at {TARGET_UTILISATION:.0%}, {a.replicas:,} running",
            f"needed at {TARGET_UTILISATION:.0%} (a scaling policy's default) against "
            + ("the autoscaler's pick" if w.autoscale else "the replicas you set"),
        ),
        Meter(
            "Multi-model packing",
            a.versions / HOT_VERSIONS,
            "over" if a.versions > HOT_VERSIONS else "warn" if a.versions > 1 and a.turn_ms > target / 4 else "ok",
            f"{a.versions} version{'s' if a.versions > 1 else ''} per device, {a.turn_ms:,.1f} ms for a turn",
            f"models{' x 2 (canary)' if w.canary else ''} against {HOT_VERSIONS} a device keeps hot"
            " (teaching assumption)",
        ),
    ]


def curve_rates(w: WhatIf, a: Answer) -> list[float]:
    """The rates the plot draws, from near zero to past what the replicas serve (twice the rate when
    autoscaled: the fleet grows with it)."""
    low, high = BOUNDS["rate"]
    top = 2 * w.rate if w.autoscale else max(1.5 * w.rate, 1.25 * a.capacity)
    top = min(max(top, 10 * low), high)
    return [max(low, top * (i + 1) / CURVE_POINTS) for i in range(CURVE_POINTS)]


def curve(w: WhatIf, a: Answer) -> list[dict[str, float | None]]:
    """p99 (None where unbounded) and throughput (what the replicas serve within the target; the rest is shed)
    against the request rate, the analytic model at each rate of `curve_rates`."""
    out = []
    for rate in curve_rates(w, a):
        at = answer(replace(w, rate=rate))
        out.append(
            {
                "rate": rate,
                "p99_ms": None if math.isinf(at.p99_ms) else at.p99_ms,
                "throughput": min(rate, at.capacity),
            }
        )
    return out


def sim_requests(w: WhatIf) -> float:
    """The requests a check simulates at most, over all its rates: each device turn looks at every version it
    hosts, so a check of many versions per device gets fewer requests (the simulated seconds shrink, the
    figures stay comparable)."""
    return MAX_SIM_REQUESTS * 4 / (w.versions + 3)


def fixed(w: WhatIf) -> WhatIf:
    """The what-if with its replicas fixed: the autoscaler's pick where it is autoscaled."""
    return replace(w, replicas=answer(w).replicas, autoscale=False) if w.autoscale else w


def scenario_doc(w: WhatIf, seconds: float = SIM_SECONDS, requests: float | None = None) -> dict[str, Any]:
    """The what-if as a simulator scenario: `versions` versions on `replicas` identical devices, at most
    `requests` of them (default `sim_requests`)."""
    w = fixed(w)
    seconds = min(seconds, (sim_requests(w) if requests is None else requests) / w.rate)
    profile_ms = {b: s * 1000 for b, s in w.profile().items()}
    return {
        "name": "planner",
        "duration": seconds,
        "seed": 1,
        "versions": w.versions,
        "canary_share": 1.0 if w.canary else 0.0,
        "canary_weight": CANARY_WEIGHT,
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
                "memory_gb": max(1.0, w.versions * 1.0),
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


def simulable(w: WhatIf) -> bool:
    f = fixed(w)
    return f.replicas * f.versions <= MAX_SIM_REPLICAS


def check_simulable(w: WhatIf) -> None:
    """OutOfRange when the what-if is too large to check in a request (the analytic answer still stands)."""
    if not simulable(w):
        f = fixed(w)
        raise OutOfRange(
            "replicas",
            f"{f.replicas} replicas x {f.versions} versions is too large to simulate here"
            f" (at most {MAX_SIM_REPLICAS}); `python -m sim.report` runs fleets of any size",
        )


@dataclass
class Check:
    result: dict[str, Any]  # the run at the what-if's own rate
    points: list[dict[str, Any]]  # every simulated rate, that one first: rate, p50/p99 ms, throughput, shed
    stopped: str | None  # why the sweep of other rates ended early (sim.budget's reason), None when it did not
    png: bytes | None  # latency and load over time at the what-if's rate, when asked for


def sweep_rates(w: WhatIf) -> list[float]:
    """The other rates a check simulates: shares of the plot's widest rate, those a fleet small enough to
    simulate serves, apart from the what-if's own."""
    top = curve_rates(w, answer(w))[-1]
    rates = [max(BOUNDS["rate"][0], share * top) for share in SWEEP]
    return [r for r in rates if abs(r - w.rate) > 0.05 * top and simulable(replace(w, rate=r))]


def simulate(w: WhatIf, budget: Budget | None = None, *, plot: bool = True) -> Check:
    """Run the short check: half its requests at the what-if's rate, the rest over `sweep_rates`; a PNG of the
    first run's latency and load over time when `plot`. OutOfRange when the what-if is too large to check in
    a request; `sim.budget.Stopped` when `budget` ran out during the first run (a later one ends the sweep
    there, and the check says so)."""
    check_simulable(w)
    rates = sweep_rates(w)
    total = sim_requests(w)
    result = run(from_dict(scenario_doc(w, requests=total / 2 if rates else total)), "static", budget=budget)
    points = [_point(w.rate, result)]
    stopped = None
    for rate in rates:
        at = replace(w, rate=rate)
        try:
            other = run(from_dict(scenario_doc(at, requests=total / 2 / len(rates))), "static", budget=budget)
        except Stopped as exc:
            stopped = exc.reason
            break
        points.append(_point(rate, other))
    return Check(result, points, stopped, _plot(result, fixed(w)) if plot else None)


def _point(rate: float, result: dict[str, Any]) -> dict[str, Any]:
    def ms(value: float) -> float | None:
        return None if not math.isfinite(value) else value

    return {
        "rate": rate,
        "p50_ms": ms(result["latency_ms"]["p50"]),
        "p99_ms": ms(result["latency_ms"]["p99"]),
        "throughput": rate * result["served_share"],
        "shed_share": result["shed_share"] + result["expired_share"],
        "requests": result["requests"],
    }


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
