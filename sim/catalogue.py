"""The simulated catalogue: models with Zipf-skewed popularity, their versions, profiles and routing.

Each version carries the same objects the node and the gateway hold for it: a
`serving.policies.batching.BatchQueue` with a `BatchingConfig`, a `LatencyProfile`, a
`serving.policies.autoscale.ScalingConfig`, and a `serving.dataplane.gateway.snapshot.VersionEntry` inside its
model's `ModelEntry`, whose `RouteTable` (stable, canary weights) `rollout.routing.choose_version` reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout.routing import RouteTable
from serving.dataplane.gateway.snapshot import ModelEntry, VersionEntry
from serving.policies.admission import DeviceShare
from serving.policies.autoscale import Capacity, ScalingConfig, replica_capacity
from serving.policies.batching import BatchingConfig, BatchQueue, LatencyProfile
from serving.policies.placement import replica_load
from serving.policies.utilisation import best_row_seconds
from sim.scenario import Family, NodeType, Scaling, Scenario

GB = 2**30
ROUTING_KEYS = tuple(f"caller-{i}" for i in range(1000))  # callers whose sticky hashes split a model's traffic


@dataclass(eq=False)
class SimVersion:
    key: str
    model: SimModel
    number: int
    family: Family
    node: NodeType
    memory_bytes: int
    profile: LatencyProfile
    batching: BatchingConfig
    scaling: ScalingConfig
    capacity: Capacity
    queue: BatchQueue
    weight: float  # its share of its model's traffic when every version is ready
    times: list[float]  # the profile's estimate for 0..max_batch_size rows (`times_of`), its queue's too
    replicas: list = field(default_factory=list)  # sim.fleet.Replica, loading or ready
    moving: int = 0  # of those, the copies loading for a consolidation move (sim.fleet): not replicas of their own
    ready_count: int = 0
    arrivals_total: int = 0  # offered to this version (routed or fallen back), as a counter metric
    refused_total: int = 0  # of arrivals_total, refused by admission (production's gateways count theirs in Redis)
    in_service: int = 0  # rows on a device now
    last_used: float = 0.0  # when a batch of it last began: what placement's LRU eviction orders by
    # Of its replicas' devices (they share its queue), the one that takes its next turn; the others do not
    # wake for it (sim.engine: `_covered`, `_hand_off`). None: whichever looks next claims it.
    waker: Any = None
    demand: float = 0.0  # requests a second the scaling policy last sized it for
    observed: float = 0.0  # requests a second arriving now (smoothed over ~10 s)
    counted: int = 0  # arrivals_total when `observed` was last updated
    # Its compute's wall time over its profile's, where the machine runs slower or faster than when the profile was
    # measured (a shared CPU's contention, sim.validation_fleet): scales each batch's time on the device only;
    # admission and the scaling policy keep estimating by the profile they were given.
    slowdown: float = 1.0
    # Seconds a load of it takes on its node type, where that differs from the cold start its scaling plans by
    # (`scaling.cold_start`, the family's recorded measurement: sim.validation_fleet); None: that cold start.
    load_s: float | None = None
    # Device seconds a second admitted for it, as a node counts them (`Node.infer`'s `hosted.share`): what
    # admission reads as the work arriving for a version packed beside the one it judges.
    share: DeviceShare = field(default_factory=DeviceShare)

    def __post_init__(self) -> None:
        self.max_batch = self.batching.max_batch_size
        self.estimate = _estimator(self.times, self.profile)
        self.window = self.batching.max_queue_delay
        self.full_batch = self.estimate(self.max_batch)
        self.best_row = best_row_seconds(self.estimate, self.max_batch)  # a row's worth at the best batch

    def busy_share(self, rate: float) -> float:
        """Device seconds a second that `rate` requests take on a shared device (`placement.replica_load`,
        batches at most the capacity batch)."""
        return replica_load(rate, self.estimate, self.capacity.batch, self.batching.max_queue_delay)


@dataclass(eq=False)
class SimModel:
    name: str
    popularity: float  # share of all traffic
    entry: ModelEntry | None = None
    versions: dict[int, SimVersion] = field(default_factory=dict)
    fallback: SimModel | None = None
    t: float = 0.0  # arrivals generated up to here
    next_arrival: float = math.inf
    rate: float = 0.0  # requests a second now
    routes: list[tuple[SimVersion, float]] = field(default_factory=list)
    routes_dirty: bool = True
    trace: list[float] | None = None  # arrival times to replay instead of drawing (sim.engine's `arrivals`)
    traced: int = 0  # of those, the next not yet generated


def _entry(name: str, number: int, batching: BatchingConfig, timeout: float, profile: dict[int, float]) -> VersionEntry:
    return VersionEntry(
        model=name,
        version=number,
        state="ready",
        loaded=True,
        artifact_sha256="",
        format="torchscript",
        inputs=(),
        outputs=(),
        batching=batching,
        default_timeout_ms=int(timeout * 1000),
        latency_profile=profile,
    )


def build(scenario: Scenario) -> list[SimModel]:
    """The scenario's models, most popular first; deterministic in the scenario's seed."""
    rng = np.random.default_rng(scenario.seed)
    n_models = max(1, round(scenario.versions / (1 + scenario.canary_share)))
    n_canary = min(scenario.versions - n_models, n_models)
    ranks = np.arange(1, n_models + 1, dtype=float)
    popularity = ranks**-scenario.zipf
    popularity /= popularity.sum()
    shares = np.array([f.share for f in scenario.families])
    family_of = rng.choice(len(scenario.families), size=n_models, p=shares / shares.sum())
    if scenario.assignment:  # drawn all the same, so what follows draws as it would
        family_of = np.array([scenario.assignment[i % len(scenario.assignment)] for i in range(n_models)])
    with_canary = set(rng.choice(n_models, size=n_canary, replace=False).tolist()) if n_canary else set()
    nodes = {node.name: node for node in scenario.fleet}
    scaling = scenario.scaling

    models: list[SimModel] = []
    for i in range(n_models):
        family = scenario.families[family_of[i]]
        model = SimModel(name=f"m{i:03d}-{family.name}", popularity=float(popularity[i]))
        numbers = (1, 2) if i in with_canary else (1,)
        for number in numbers:
            canary = scenario.canary_weight
            weight = 1.0 if len(numbers) == 1 else (canary if number == 2 else 1 - canary)
            model.versions[number] = _version(rng, model, number, family, nodes[family.accelerator], scaling, weight)
        models.append(model)

    # Refused requests of a model with a fallback go to the cheapest model on the same accelerator type.
    cheapest: dict[str, SimModel] = {}
    for model in models:
        kind = model.versions[1].node.name
        if kind not in cheapest or _cost(model) < _cost(cheapest[kind]):
            cheapest[kind] = model
    n_fallback = round(scenario.fallback_share * n_models)
    for i in rng.choice(n_models, size=min(n_fallback, n_models), replace=False).tolist():
        target = cheapest[models[i].versions[1].node.name]
        if target is not models[i]:
            models[i].fallback = target

    for model in models:
        weights = {n: v.weight for n, v in model.versions.items()} if len(model.versions) > 1 else {}
        model.entry = ModelEntry(
            name=model.name,
            task="",
            description="",
            fallback=model.fallback.name if model.fallback else None,
            versions={
                n: _entry(model.name, n, v.batching, scaling.timeout, v.profile.as_dict())
                for n, v in model.versions.items()
            },
            routes=RouteTable(stable=1, weights=weights),
        )
    return models


def _cost(model: SimModel) -> float:
    v = model.versions[1]
    return v.estimate(v.max_batch) / v.max_batch


def _version(
    rng: np.random.Generator,
    model: SimModel,
    number: int,
    family: Family,
    node: NodeType,
    scaling: Scaling,
    weight: float,
) -> SimVersion:
    base = rng.uniform(*family.base_ms) / 1000 / node.speed
    per_row = rng.uniform(*family.per_row_ms) / 1000 / node.speed
    memory = int(rng.uniform(*family.memory_gb) * GB)
    # Warm-up measures the profile at powers of two up to the largest batch, as the node does.
    sizes = sorted(
        {1 << k for k in range(family.max_batch_size.bit_length()) if 1 << k <= family.max_batch_size}
        | {family.max_batch_size}
    )
    # A cited or measured profile is one model's: the catalogue's versions are that times a factor from `scale`.
    factor = rng.uniform(*family.scale) if family.profile_ms else 1.0
    measured = {b: factor * ms / 1000 / node.speed for b, ms in family.profile_ms}
    profile = LatencyProfile(measured or {b: base + per_row * b for b in sizes})
    batching = BatchingConfig(
        max_batch_size=family.max_batch_size,
        max_queue_delay=family.max_queue_delay_ms / 1000,
        max_queue_size=scaling.max_queue_size,
    )
    cold_start = node.cold_start + node.cold_start_per_gb * memory / GB
    config = ScalingConfig(
        accelerator=node.name,
        memory_bytes=memory,
        cold_start=family.cold_start if family.cold_start is not None else cold_start,
        latency_budget=scaling.latency_budget,
        max_batch_size=family.max_batch_size,
        target_utilisation=(
            family.target_utilisation if family.target_utilisation is not None else scaling.target_utilisation
        ),
        warm_pool=scaling.warm_pool,
        min_replicas=1,
        max_replicas=max(1, node.nodes),
        cool_down=scaling.cool_down,
        scheduling_delay=scaling.scheduling_delay,
    )
    capacity = replica_capacity(profile.estimate, family.max_batch_size, scaling.latency_budget)
    assert capacity is not None  # a profile with points always has a capacity
    # The queue is bounded in rows through its byte bound: a simulated request weighs one "byte". Its
    # estimates are the profile's, looked up: a batch never holds more than max_batch_size rows.
    times = times_of(profile, family.max_batch_size)
    queue = BatchQueue(batching, times.__getitem__, max_bytes=scaling.max_queue_size)
    return SimVersion(
        key=f"{model.name}:{number}",
        model=model,
        number=number,
        family=family,
        node=node,
        memory_bytes=memory,
        profile=profile,
        batching=batching,
        scaling=config,
        capacity=capacity,
        queue=queue,
        weight=weight,
        times=times,
        load_s=cold_start if family.cold_start is not None else None,
    )


def times_of(profile: LatencyProfile, max_batch: int) -> list[float]:
    """The profile's estimate for 0..max_batch rows, as a list: an interpolated size costs a bisect per call,
    and the engine asks per batch. The profile is the truth's mean here and is not re-learnt."""
    return [0.0] + [profile.estimate(rows) for rows in range(1, max_batch + 1)]


def _estimator(times: list[float], profile: LatencyProfile) -> Callable[[int], float]:
    top = len(times) - 1

    def estimate(rows: int) -> float:
        return times[rows] if 0 <= rows <= top else profile.estimate(rows)

    return estimate
