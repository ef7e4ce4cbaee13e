"""The scaling policies a scenario compares, each answering desired replicas per version per tick.

- predictive: `serving.policies.autoscale.Autoscaler`, the production policy itself (forecast at
  now + cold start + scheduling delay, warm pool, cool-down, the headroom it learns from the rises it has
  seen, and the scenario's seasonality where it declares one), observing what production's
  `autoscaling.observe` does: the requests asked (refused ones included), the replicas loaded, and the
  backlog no replica took;
- forecast-only: the same without headroom, where a scenario asks to see what forecasting alone does;
- trend-only: the same without the seasonality, where a scenario declares one (`scaling.season`);
- reactive: queue depth, as Knative's KPA scales on concurrency: desired = ceil(average concurrency
  over the last `window` seconds / a replica's target concurrency), where a replica's target is what
  it holds serving the predictive policy's target utilisation of its capacity: batches of b rows with
  b = rate x t(b) (a busy device gathers the next batch while one runs), one batch on the device and
  half of the next gathering, 1.5 b. Scale-out at once, scale-in only after the same cool-down (the
  largest answer of the last `cool_down` seconds);
- static: the replicas the scenario's peak needs at the target utilisation, loaded before the start;
- onset: a reference, not a policy production could run: it knows the scenario's rise, and at the rise's first
  instant orders what its peak needs. Until then it holds what the opening load needs at the target, as the
  others start. A policy that has not seen the rise before and holds only the target's slack can order no
  sooner and no more usefully, so what `onset` refuses or answers late is the least such a policy can.
"""

from __future__ import annotations

import math
from collections import deque

from serving.policies.autoscale import Autoscaler, Observation
from serving.policies.batching import untaken
from sim.catalogue import SimVersion
from sim.fleet import replicas_for, staying
from sim.scenario import ONSET_NEEDS, ONSET_SHAPES, Scenario


class Predictive:
    name = "predictive"

    def __init__(
        self, scenario: Scenario, versions: list[SimVersion], *, headroom: bool = True, season: bool = True
    ) -> None:
        memory = {node.name: int(node.memory_gb * 2**30) for node in scenario.fleet}
        scaling = scenario.scaling
        self.autoscaler = Autoscaler(
            memory,
            surge=scaling.surge if headroom else 0.0,
            season=scaling.season if season else 0.0,
            season_buckets=scaling.season_buckets,
            rise_quantile=scaling.rise_quantile if headroom else 0.0,
            rise_history=scaling.rise_history,
        )
        self.versions = versions
        self.nodes_wanted: dict[str, int] = {}

    def desired(self, now: float) -> dict[SimVersion, int]:
        # As production observes a version (autoscaling.observe): every request asked of it (refused ones too),
        # its replicas serving (a heartbeat's hot versions: loaded, not loading), and the backlog its stream would
        # hold, what those replicas reading ahead as nodes do have not taken.
        plan = self.autoscaler.tick(
            now,
            [
                Observation(
                    v.key,
                    v.scaling,
                    v.arrivals_total,
                    v.ready_count,
                    v.estimate,
                    untaken(v.queue.rows + v.in_service, v.ready_count, v.max_batch),
                    v.refused_total,
                )
                for v in self.versions
            ],
        )
        self.nodes_wanted = {kind: demand.nodes for kind, demand in plan.accelerators.items()}
        out: dict[SimVersion, int] = {}
        for v in self.versions:
            decision = plan.decisions[v.key]
            if decision.reason != "no_data":
                v.demand = decision.demand
            out[v] = decision.replicas
        return out


class ForecastOnly(Predictive):
    """The same `Autoscaler` without headroom (neither learnt nor declared): what forecasting alone achieves."""

    name = "forecast-only"

    def __init__(self, scenario: Scenario, versions: list[SimVersion]) -> None:
        super().__init__(scenario, versions, headroom=False)


class TrendOnly(Predictive):
    """The same `Autoscaler` without the scenario's seasonality: what the trend alone achieves."""

    name = "trend-only"

    def __init__(self, scenario: Scenario, versions: list[SimVersion]) -> None:
        super().__init__(scenario, versions, season=False)


class Reactive:
    name = "reactive"

    def __init__(self, scenario: Scenario, versions: list[SimVersion], window: float = 6.0) -> None:
        self.versions = versions
        self.window = window
        self.cool_down = scenario.scaling.cool_down
        self._samples: dict[str, deque[tuple[float, int, int]]] = {v.key: deque() for v in versions}
        self._answers: dict[str, deque[tuple[float, int]]] = {v.key: deque() for v in versions}
        self.nodes_wanted: dict[str, int] = {}
        self.per_replica = {v.key: 1.5 * _batch_at(v, v.scaling.target_utilisation * v.capacity.rate) for v in versions}

    def desired(self, now: float) -> dict[SimVersion, int]:
        out: dict[SimVersion, int] = {}
        for v in self.versions:
            samples = self._samples[v.key]
            samples.append((now, v.queue.rows + v.in_service, v.arrivals_total))
            while samples[0][0] < now - self.window:
                samples.popleft()
            concurrency = sum(s[1] for s in samples) / len(samples)
            per_replica = self.per_replica[v.key]
            want = min(max(1, math.ceil(concurrency / per_replica)), v.scaling.max_replicas)
            answers = self._answers[v.key]
            if not answers:  # the replicas it starts with count as an answer: the cool-down holds them too
                answers.append((now, staying(v)))
            answers.append((now, want))
            while answers[0][0] < now - self.cool_down:
                answers.popleft()
            out[v] = max(a for _, a in answers)
            span = now - samples[0][0]
            if span > 0:  # what placement plans each replica's load on: the arrival rate now
                v.demand = (v.arrivals_total - samples[0][2]) / span
        return out


def _batch_at(v: SimVersion, rate: float) -> float:
    """The batch a replica settles at serving `rate`: the fixed point of b = rate x t(b) in [1, max batch]."""
    b = 1.0
    for _ in range(50):
        b = min(max(rate * v.estimate(max(1, round(b))), 1.0), float(v.max_batch))
    return b


class Static:
    name = "static"

    def __init__(self, scenario: Scenario, versions: list[SimVersion]) -> None:
        peak = scenario.traffic.peak(scenario.duration)
        self.replicas: dict[SimVersion, int] = {}
        for v in versions:
            v.demand = peak * v.model.popularity * v.weight
            fixed = scenario.scaling.fixed_replicas
            self.replicas[v] = fixed if fixed > 0 else replicas_for(v, v.demand, v.scaling.target_utilisation)
        self.nodes_wanted: dict[str, int] = {}

    def desired(self, now: float) -> dict[SimVersion, int]:
        return self.replicas


class Onset:
    name = "onset"

    def __init__(self, scenario: Scenario, versions: list[SimVersion]) -> None:
        traffic = scenario.traffic
        if traffic.shape not in ONSET_SHAPES:
            raise ValueError(ONSET_NEEDS)
        self.onset = traffic.start
        self.before = traffic.at(0.0)
        self.peak = traffic.peak(scenario.duration)
        self.versions = versions
        self.nodes_wanted: dict[str, int] = {}

    def desired(self, now: float) -> dict[SimVersion, int]:
        # It holds the peak's replicas to the end, after a spike too: what it is for is the refused share.
        rate = self.before if now < self.onset else self.peak
        out: dict[SimVersion, int] = {}
        for v in self.versions:
            v.demand = rate * v.model.popularity * v.weight
            out[v] = replicas_for(v, v.demand, v.scaling.target_utilisation)
        return out


def make(name: str, scenario: Scenario, versions: list[SimVersion]) -> Predictive | Reactive | Static | Onset:
    policies = {
        "predictive": Predictive,
        "forecast-only": ForecastOnly,
        "trend-only": TrendOnly,
        "reactive": Reactive,
        "static": Static,
        "onset": Onset,
    }
    # A version no policy scales (its family not autoscaled) is not observed either: production's autoscaler
    # observes the versions with a scaling policy.
    return policies[name](scenario, [v for v in versions if v.family.autoscaled])
