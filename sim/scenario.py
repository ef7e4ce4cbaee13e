"""Scenarios: a YAML file read into frozen dataclasses, checked when read.

A scenario names its traffic (level and shape), its catalogue of models (how many versions, how
skewed their popularity, which hardware each family needs), its fleet (node types with a budget,
memory, speed, cost and cold starts) and the scaling policies to compare.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from serving.policies.placement import (
    CONSOLIDATE_BELOW,
    CONSOLIDATE_HOLD,
    CONSOLIDATE_MOVES,
    MAX_LOAD,
    RELIEVE_ABOVE,
    RELIEVE_MOVES,
)
from sim import profiles

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
POLICIES = ("predictive", "forecast-only", "trend-only", "reactive", "static", "onset")
DEFAULT_POLICIES = ("predictive", "reactive", "static")
# The traffic shapes with one rise, whose first instant the onset reference knows (sim.scaling.Onset).
ONSET_SHAPES = ("ramp", "spike")
ONSET_NEEDS = "the onset reference needs a ramp or a spike: a rise with one first instant"


@dataclass(frozen=True)
class Traffic:
    """Total requests a second over time. Shapes:
    steady (rate); diurnal (rate is the peak, low the trough, one day compressed into `period`
    seconds, starting at the trough); ramp (from `low` to `rate` over `length` seconds from `start`);
    spike (`low` steady, `factor` x `low` from `start` for `length` seconds); rush (every `period`
    seconds, a day compressed: `low` until `start`, up to `rate` over `length` seconds, held, and back
    down to `low` over the period's last `length` seconds)."""

    shape: str = "steady"
    rate: float = 1000.0
    low: float = 0.0
    period: float = 600.0
    start: float = 0.0
    length: float = 60.0
    factor: float = 3.0

    def __post_init__(self) -> None:
        if self.shape not in ("steady", "diurnal", "ramp", "spike", "rush"):
            raise ValueError(f"unknown traffic shape {self.shape!r}")
        if self.rate < 0 or self.low < 0 or self.period <= 0 or self.length <= 0 or self.factor <= 0:
            raise ValueError("traffic rates, period, length and factor must be positive")
        if self.shape == "rush" and (self.start < 0 or self.start + 2 * self.length > self.period):
            raise ValueError("a rush must rise and fall within its period: start + 2 x length <= period")

    def at(self, t: float) -> float:
        if self.shape == "steady":
            return self.rate
        if self.shape == "diurnal":
            return self.low + (self.rate - self.low) * (1.0 - math.cos(2 * math.pi * t / self.period)) / 2
        if self.shape == "ramp":
            frac = min(max((t - self.start) / self.length, 0.0), 1.0)
            return self.low + (self.rate - self.low) * frac
        if self.shape == "rush":
            phase = t % self.period
            up = (phase - self.start) / self.length
            down = (self.period - phase) / self.length
            return self.low + (self.rate - self.low) * min(max(min(up, down), 0.0), 1.0)
        inside = self.start <= t < self.start + self.length
        return self.low * (self.factor if inside else 1.0)

    def peak(self, duration: float) -> float:
        if self.shape == "spike":
            return self.low * max(self.factor, 1.0)
        if self.shape == "diurnal" and duration < self.period / 2:
            return self.at(duration)
        return max(self.rate, self.low)


@dataclass(frozen=True)
class Family:
    """A kind of model: where it may run and the ranges its versions are drawn from.
    Latency on the reference accelerator (speed 1): t(b) = base + per_row x b, in milliseconds."""

    name: str
    share: float  # of the models
    accelerator: str
    memory_gb: tuple[float, float]
    base_ms: tuple[float, float]
    per_row_ms: tuple[float, float]
    max_batch_size: int = 32
    max_queue_delay_ms: float = 5.0
    profile_ms: tuple[tuple[int, float], ...] = ()  # measured (batch, ms) points: used as they are, at speed 1
    # Each version's profile is `profile_ms` times a factor drawn from this range (the catalogue's models differ).
    scale: tuple[float, float] = (1.0, 1.0)
    # Where `profile_ms` comes from: (key, text) pairs; `kind` is published (with link, model, table, derived),
    # measured (with command, when) or assumption. `tests/test_sim.py` refuses a shipped scenario without one.
    source: tuple[tuple[str, str], ...] = ()
    # The cold start its versions' scaling plans by, where that is a recorded measurement of its own (a real
    # fleet's autoscaler reads each version's: sim.validation_fleet's twin); None: the node type's. A load itself
    # still takes the node type's.
    cold_start: float | None = None
    # Its versions' target utilisation, where it is their own (a real fleet's is each version's ScalingPolicy's:
    # sim.validation_fleet's twin); None: the scenario's `scaling.target_utilisation`.
    target_utilisation: float | None = None
    # False: no scaling policy, as a version registered without one (or with no minimum) is in production: it opens
    # with one replica, the scaling policy never observes or scales it, and placement may evict it, least recently
    # used first, to make room for what the policy wants (sim.validation_fleet's twin).
    autoscaled: bool = True

    @property
    def cited(self) -> dict[str, str]:
        return dict(self.source)


@dataclass(frozen=True)
class NodeType:
    name: str
    nodes: int  # the budget: at most this many nodes of the type
    memory_gb: float
    speed: float  # compute speed relative to the reference accelerator
    cost_per_hour: float
    cold_start: float  # seconds to load a replica: cold_start + cold_start_per_gb x footprint
    cold_start_per_gb: float = 0.0
    source: str = ""  # where its memory, cost and cold start come from, or that they are assumptions


@dataclass(frozen=True)
class Scaling:
    tick: float = 1.0
    # When the first scaling tick runs (seconds, under one tick): a real fleet's ticks run at its own phase to the
    # traffic, and a twin compared with it ticks where it did (sim.validation_fleet).
    tick_phase: float = 0.0
    cool_down: float = 60.0
    target_utilisation: float = 0.7
    warm_pool: int = 0
    surge: float = 0.0  # predictive: requests/s per second the whole fleet absorbs unannounced (Autoscaler)
    rise_quantile: float = 0.99  # predictive: the quantile of past rises over one lead time kept as headroom
    rise_history: float = 3600.0  # predictive: seconds of rises it learns from
    season: float = 0.0  # predictive: the period of the rate's seasonality in seconds (0: none; Autoscaler)
    season_buckets: int = 48
    scheduling_delay: float = 5.0  # what the autoscaler plans a replica's lead time by, beside its cold start
    # What the fleet takes from a scaling decision to a load's start, where it differs from what the autoscaler
    # plans by (None: the same): a real fleet's, measured, in a twin compared with it (sim.validation_fleet).
    placement_delay: float | None = None
    latency_budget: float = 0.3  # the p99 a replica is sized to keep
    timeout: float = 1.0  # each request's deadline after its arrival
    max_queue_size: int = 4096  # rows per version
    max_device_load: float = MAX_LOAD  # placement: share of a device's throughput its replicas may plan on
    # Consolidation (`placement.consolidate`): a device whose replicas plan on under `consolidate_below` of it for
    # `consolidate_hold` seconds is emptied onto others, at most `consolidate_moves` moves in flight (0: off).
    # The defaults are production's (placement's CONSOLIDATE_*); the shipped scenarios set their own, for minutes.
    consolidate_below: float = CONSOLIDATE_BELOW
    consolidate_hold: float = CONSOLIDATE_HOLD
    consolidate_moves: int = CONSOLIDATE_MOVES
    # Relief (`placement.relieve`): replicas move off a device whose replicas plan on over `relieve_above` of it, at
    # most `relieve_moves` moves (of either kind) in flight (0: off). The defaults are production's.
    relieve_above: float = RELIEVE_ABOVE
    relieve_moves: int = RELIEVE_MOVES
    fixed_replicas: int = 0  # static policy: this many replicas of every version (0: what the peak needs)
    # Replicas of every version at t = 0, warm (0: what the policy wants for the opening load). A real fleet
    # compared with its twin starts from what it placed (sim.validation_fleet: one of each), not from that.
    opening_replicas: int = 0

    def __post_init__(self) -> None:
        if self.opening_replicas < 0 or self.fixed_replicas < 0:
            raise ValueError("opening_replicas and fixed_replicas must not be negative")
        if not 0.0 <= self.tick_phase < self.tick:
            raise ValueError("tick_phase must be at least 0 and under one tick")
        if self.placement_delay is not None and self.placement_delay < 0:
            raise ValueError("placement_delay must not be negative")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    duration: float
    traffic: Traffic
    families: tuple[Family, ...]
    fleet: tuple[NodeType, ...]
    versions: int = 200
    canary_share: float = 0.25  # models with a canary at `canary_weight` of their traffic
    canary_weight: float = 0.1
    fallback_share: float = 0.2  # models whose refused requests go to a small fallback model
    zipf: float = 1.0
    seed: int = 1
    window: float = 10.0  # seconds per reported time step
    scaling: Scaling = field(default_factory=Scaling)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    jitter: float = 0.05  # lognormal sigma of a batch's compute time around its profile
    # The family of each model, most popular first (empty: drawn by share): a validation names its real versions.
    assignment: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.duration <= 0 or self.versions < 1:
            raise ValueError("duration and versions must be positive")
        for policy in self.policies:
            if policy not in POLICIES:
                raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if "onset" in self.policies and self.traffic.shape not in ONSET_SHAPES:
            raise ValueError(ONSET_NEEDS)
        kinds = {node.name for node in self.fleet}
        for family in self.families:
            if family.accelerator not in kinds:
                raise ValueError(f"family {family.name} needs {family.accelerator!r}, which the fleet lacks")
        if not self.families or abs(sum(f.share for f in self.families) - 1.0) > 1e-6:
            raise ValueError("family shares must sum to 1")

    def scaled(self, **changes: Any) -> Scenario:
        return replace(self, **changes)


def _pair(value: Any) -> tuple[float, float]:
    if isinstance(value, (int, float)):
        return float(value), float(value)
    low, high = value
    return float(low), float(high)


def _family(name: str, spec: dict[str, Any]) -> Family:
    profile = spec.get("profile_ms") or {}
    source = {str(k): str(v) for k, v in (spec.get("source") or {}).items()}
    measured = spec.get("measured")
    if measured:  # a profile file `bench/gpu_check.sh` wrote (sim.profiles): its points and where they come from
        if profile:
            raise ValueError(f"family {name}: give profile_ms or measured, not both")
        profile, source = profiles.read(measured["file"], measured["model"])
    return Family(
        name=name,
        share=float(spec["share"]),
        accelerator=spec["accelerator"],
        memory_gb=_pair(spec["memory_gb"]),
        base_ms=_pair(spec.get("base_ms", 0.0)),
        per_row_ms=_pair(spec.get("per_row_ms", 0.0)),
        max_batch_size=int(spec.get("max_batch_size", 32)),
        max_queue_delay_ms=float(spec.get("max_queue_delay_ms", 5.0)),
        cold_start=None if spec.get("cold_start") is None else float(spec["cold_start"]),
        target_utilisation=None if spec.get("target_utilisation") is None else float(spec["target_utilisation"]),
        autoscaled=bool(spec.get("autoscaled", True)),
        profile_ms=tuple(sorted((int(b), float(ms)) for b, ms in profile.items())),
        scale=_pair(spec.get("scale", 1.0)),
        source=tuple(sorted(source.items())),
    )


def _node_type(name: str, spec: dict[str, Any]) -> NodeType:
    measured = spec.pop("measured_cold_start", None)
    if measured:  # the cold start a profile file measured (sim.profiles.cold_start), and where it comes from
        if "cold_start" in spec or "cold_start_per_gb" in spec:
            raise ValueError(f"node type {name}: give cold_start or measured_cold_start, not both")
        seconds, per_gb, source = profiles.cold_start(measured)
        spec.update(cold_start=seconds, cold_start_per_gb=per_gb)
        spec["source"] = "; ".join(s for s in (spec.get("source", ""), source) if s)
    return NodeType(name=name, **spec)


def from_dict(doc: dict[str, Any]) -> Scenario:
    families = tuple(_family(name, spec) for name, spec in doc["families"].items())
    for family in families:
        if family.profile_ms and family.max_batch_size not in dict(family.profile_ms):
            raise ValueError(f"family {family.name}'s measured profile lacks its max_batch_size")
    fleet = tuple(_node_type(name, dict(spec)) for name, spec in doc["fleet"].items())
    known = {
        k: doc[k]
        for k in ("versions", "canary_share", "canary_weight", "fallback_share", "zipf", "seed", "window", "jitter")
        if k in doc
    }
    return Scenario(
        name=doc["name"],
        title=doc.get("title", doc["name"]),
        duration=float(doc["duration"]),
        traffic=Traffic(**doc["traffic"]),
        families=families,
        fleet=fleet,
        scaling=Scaling(**doc.get("scaling", {})),
        policies=tuple(doc.get("policies", DEFAULT_POLICIES)),
        **known,
    )


PUBLISHED = ("link", "what", "model", "table", "derived")
MEASURED = ("command", "when", "model", "table")


def unsourced(scenario: Scenario) -> list[str]:
    """Why each family's latency profile is not sourced (empty: every one is): a profile must be points, and
    cite a published measurement (its link, what and which model, the table's numbers, each point among them,
    and how the profile was derived) or the Ferry command that measured it."""
    problems = []
    for f in scenario.families:
        cited = f.cited
        kind = cited.get("kind")
        if not f.profile_ms:
            problems.append(f"{f.name}: no profile_ms (base_ms and per_row_ms are no measurement)")
        elif kind not in ("published", "measured"):
            problems.append(f"{f.name}: source kind {kind!r}, not published or measured")
        else:
            missing = [k for k in (PUBLISHED if kind == "published" else MEASURED) if not cited.get(k)]
            if missing:
                problems.append(f"{f.name}: its source lacks {', '.join(missing)}")
            elif kind == "published":
                table = {
                    (int(b), float(ms)) for b, ms in re.findall(r"(?<![\d.])(\d+): (\d+(?:\.\d+)?)", cited["table"])
                }
                absent = [f"{b}: {ms:g}" for b, ms in f.profile_ms if (b, ms) not in table]
                if absent or not cited["link"].startswith("https://"):
                    problems.append(f"{f.name}: points {', '.join(absent) or '-'} not in its cited table, or no link")
    return problems


def with_gain(scenario: Scenario, gain: float) -> Scenario:
    """The scenario with every family's profile reshaped so that a batch of 32 serves `gain` times the
    requests a second a batch of one does: t(b) = t(1) x (1 + (b - 1) x (32 / gain - 1) / 31), t(1) the
    family's own, at the family's own batch sizes (a sensitivity check of the batching gain)."""
    if not 1.0 <= gain <= 32.0:
        raise ValueError("a batch of 32 gains between 1x and 32x")
    slope = (32.0 / gain - 1.0) / 31.0
    families = []
    for f in scenario.families:
        if not f.profile_ms:
            raise ValueError(f"family {f.name} has no profile to reshape")
        t1 = dict(f.profile_ms).get(1, f.profile_ms[0][1] / f.profile_ms[0][0])
        shaped = tuple((b, t1 * (1.0 + (b - 1) * slope)) for b, _ in f.profile_ms)
        families.append(replace(f, profile_ms=shaped))
    return replace(scenario, families=tuple(families))


def with_window(scenario: Scenario, window_ms: float) -> Scenario:
    """The scenario with every family's batch window (`max_queue_delay_ms`) set to `window_ms`: how much of the
    latency budget a quiet version waits to fill a batch (a sensitivity check of the window)."""
    if window_ms < 0:
        raise ValueError("a batch window must not be negative")
    return replace(scenario, families=tuple(replace(f, max_queue_delay_ms=window_ms) for f in scenario.families))


def load(path: str | Path) -> Scenario:
    path = Path(path)
    if not path.exists() and not path.suffix:
        path = SCENARIO_DIR / f"{path}.yaml"
    with open(path) as f:
        return from_dict(yaml.safe_load(f))


def shipped() -> list[Path]:
    return sorted(SCENARIO_DIR.glob("*.yaml"))
