"""Autoscaling policy: how many replicas each version wants, decided ahead of its cold start.

Plain Python, no Django, time passed in: the node, the gateway's control plane and the fleet
simulator call the same `Autoscaler.tick(now, observations)`. Loading a replica takes its cold
start plus the scheduler's delay (the lead time), so replicas are sized for the rate forecast at
`now + lead`, not for the rate now.

Per version, each tick:
- rates: arrivals per second over a short window and a long one, from the version's cumulative
  arrival counter (a Prometheus-style counter: a drop is a reset). The long window's rate is
  reported, not decided on: it is what a slow policy would size for;
- forecast: Holt's linear trend (double exponential smoothing) of the per-tick rates, with
  smoothing factors from time constants so uneven ticks weigh right
  (`alpha = 1 - exp(-dt / level_tau)`, `beta = 1 - exp(-dt / trend_tau)`), read at `now + lead`;
  the short window's rate overrides it upward (a falling trend, or one still catching up with
  a step, must not size below what arrives now), so `demand = max(forecast, short rate)`, plus a
  backlog no replica has taken (a live fleet's streams report it) spread over the short window. The
  time constants are seconds, not the windows': a trend seen within ten seconds is what lets a
  30 s cold start be ordered in time, and a burst looks like the start of a ramp, so the trend
  also jumps on one (scale-out is the safe side of that mistake; the cool-down then holds it);
- pooled trend: one version's rate is too noisy to trust a steep trend early (Poisson noise of a
  few hundred requests a second, extrapolated over a 35 s lead, is tens of percent), so a ramp
  that every version shares is seen first in the sum of all of them, whose relative noise is
  small. Each tick fits a least-squares line to the pooled per-tick rates of the last
  `trend_window` seconds; when its slope is positive and significant (over `trend_z` standard
  errors of the slope, from the fit's own residuals), every version's short-window rate is
  scaled by the pooled growth from the window's middle to `now + lead`:
  `short x (1 + slope x (now + lead - middle) / mean)`, and the forecast is the larger of that
  and the version's own. Without a significant rise the factor is 1 and nothing changes. What it
  costs: a rise of a few hot versions lifts the quiet ones too, by at most the pooled growth,
  held by the cool-down;
- daily seasonality (`season`, a period in seconds; 0: off): each version's rate per time-of-day
  bucket over past periods (`serving.policies.seasonal`). Where the profile says `now + lead` is
  busier than the short window's middle, the short window's rate scaled by that ratio is also a
  forecast (the larger one counts, as with the pooled trend): a rise that came at this time of day
  before is ordered one lead time ahead, before any trend can see it. Nor are replicas scaled in
  that a rise the profile knows of, due within one cool-down after the lead time, will need
  (`season_hold`, never more than are there): they would be ordered again, a cold start later, as
  it comes. A fall is left to the cool-down, as always;
- learned headroom (`rise_quantile`, 0.99 by default; 0: off): no forecast from the rate sees a rise before it
  starts, and what is ordered then is ready a lead time later, so the fleet must already hold what the rate can
  reach within one lead time. Each tick records, per version and for the pool (all versions' summed rate),
  the rise of the short window's rate over the last lead time (`rate now / rate one lead ago - 1`, 0 for a
  fall), keeping the largest of each `rise_bucket` seconds (60) over the last `rise_history` seconds (an hour).
  The `rise_quantile` of those is the headroom `h` (with 60 buckets, 0.99 is the largest; the larger of the
  version's own and the pool's; none before `rise_min_samples` rises were seen): each version
  also keeps capacity, at full utilisation rather than the target, for its short-window rate times `1 + h`.
  Nothing is declared: at a flat rate `h` is the rate's own noise, within the target's slack, and costs
  nothing; after a rush has been seen, the fleet holds room for the worst rise of the history on top of its
  rate now, at the cost of that headroom until it leaves the history (at a peak too: in the shipped spike-3x,
  15k -> 45k requests/s, it holds room for 135k while the spike lasts, most of why predictive spends more
  accelerator-hours there than static peak provisioning, docs/simulation.md). A first-seen rise is learnt
  only once it has happened: admission and the fallback answer it meanwhile. With a seasonal profile (the
  version's own, and one of the pool's summed rate), a rise counts only for what the profile does not
  foresee at its time of day (`1 + rise` over the rise the profile reads across that lead time): a rush the
  profile holds is ordered one lead time ahead by the season, and holding its size as headroom all day
  besides would pay for it twice. Its own day counts, as the forecast does with `season_min_periods` at 1:
  what came at this time is taken to come again;
- surge headroom (`surge`, requests a second per second, 0 by default) is the declared form of the same: the
  growth the pool must absorb unannounced, each version holding at full utilisation its demand plus its share
  (its short-window rate over the pool's) of `surge x lead`;
- capacity of one replica (`replica_capacity`): full batches of `b` rows taking `t(b)` serve
  `b / t(b)` requests a second; a request arriving as a batch starts waits for it and then runs
  in the next, `2 t(b)`, which must fit `HEADROOM` of the p99 budget (admission's share of it),
  so `b* = max{b <= max_batch_size : 2 t(b) <= HEADROOM x budget}` and the capacity is
  `b* / t(b*)`;
- capacity seen served: a profile counts the model's compute only, and a replica may serve less (on a CPU
  node, its own request handling and the GIL share the cores with the compute). An interval the
  version's replicas spent saturated (at both of its ends a backlog of a full batch a replica or more
  beyond what they read ahead, and the same replica count) shows
  what they serve: the arrivals admitted (less those refused before the queue, `refused_total`)
  less the backlog's growth, per replica per second, smoothed
  (`served_tau`). Below the profile's capacity, it replaces it; an interval that sees more served
  raises it at once, and it is forgotten `served_ttl` seconds after the last saturated interval
  (the fleet may have changed). Without a backlog (a fleet that keeps up) nothing is learnt and
  the profile stands. What the nodes hold in flight is not counted (at most two
  batches a node), so one interval's sample may be off by that;
- recommendation: `ceil(demand / (capacity x target_utilisation)) + warm_pool`, clamped to
  `[min, max]`; a version with `min_replicas = 0` keeps one replica until it has seen no
  arrival for `idle_to_zero` seconds, then goes to zero;
- cool-down: the answer is the largest recommendation of the last `cool_down` seconds (a
  stabilisation window, as Kubernetes' HPA does it), so scale-out happens at once and scale-in
  only after the lower number has held for the whole cool-down. Going to zero after the idle time
  is not held again: the idle time is its own, longer, hold.

Demand per accelerator type: the replicas wanted of every version on that type, times each
version's memory footprint, over one node's memory, rounded up.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.policies.admission import HEADROOM
from serving.policies.seasonal import SeasonalProfile

Estimate = Callable[[int], float]

_EPS = 1e-9  # float slack in window boundaries
# Demand within a hundredth of a replica over n replicas' worth asks for n: the smoothed rate
# approaches a steady load from above or below, and must not hold an extra replica for a crumb.
_SLACK = 0.01


@dataclass(frozen=True, slots=True)
class ScalingConfig:
    """One version's scaling settings; times in seconds, memory in bytes."""

    accelerator: str
    memory_bytes: int  # footprint of one replica on its accelerator
    cold_start: float  # measured load time on this accelerator type
    latency_budget: float  # the p99 a replica must keep
    max_batch_size: int = 1
    target_utilisation: float = 0.7
    warm_pool: int = 0
    min_replicas: int = 1
    max_replicas: int = 100
    cool_down: float = 300.0
    idle_to_zero: float | None = None  # None: never scale to zero
    scheduling_delay: float = 5.0  # placing the replica before its load starts

    def __post_init__(self) -> None:
        if not 0.0 < self.target_utilisation <= 1.0:
            raise ValueError("target_utilisation must be in (0, 1]")
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.warm_pool < 0 or self.memory_bytes < 0 or self.max_batch_size < 1:
            raise ValueError("warm_pool and memory_bytes must not be negative, max_batch_size >= 1")
        if self.cold_start < 0 or self.scheduling_delay < 0 or self.cool_down < 0:
            raise ValueError("cold_start, scheduling_delay and cool_down must not be negative")
        if self.latency_budget <= 0:
            raise ValueError("latency_budget must be positive")
        if self.idle_to_zero is not None and self.idle_to_zero < 0:
            raise ValueError("idle_to_zero must not be negative")

    @property
    def lead_time(self) -> float:
        return self.cold_start + self.scheduling_delay


@dataclass(frozen=True, slots=True)
class Observation:
    """What one tick knows of a version: its settings, arrival counter, replicas and profile."""

    version: str
    config: ScalingConfig
    arrivals_total: int  # cumulative arrivals, as a counter metric reports them
    replicas: int  # replicas serving now (loaded: a live fleet's heartbeats say which nodes hold it hot)
    estimate: Estimate  # compute seconds per batch size (LatencyProfile.estimate)
    backlog: int = 0  # requests waiting that no replica has taken yet (a live fleet's streams report it)
    # Of `arrivals_total`, those refused before the queue (by admission or a bound): a counter as well. They count
    # as demand, but not as work the replicas took, when what a replica serves is learnt from the backlog.
    refused_total: int = 0


@dataclass(frozen=True, slots=True)
class Capacity:
    batch: int  # the largest batch whose queueing and compute fit the budget
    rate: float  # requests a second one replica serves at that batch size
    fits_budget: bool  # False: even a batch of one misses the budget (rate is batch one's)
    observed: bool = False  # True: `rate` is what saturated replicas were seen to serve, below the profile's


@dataclass(frozen=True, slots=True)
class Decision:
    version: str
    replicas: int
    # forecast | season | season_hold | short_window | headroom | surge | min | max | cool_down | idle | no_data
    # | no_profile
    reason: str
    demand: float  # requests a second the replicas were sized for
    forecast: float  # the trend's rate at now + lead time
    short_rate: float
    long_rate: float
    capacity: Capacity | None


@dataclass(frozen=True, slots=True)
class NodeDemand:
    replicas: int
    memory_bytes: int
    nodes: int


@dataclass(frozen=True, slots=True)
class Plan:
    decisions: dict[str, Decision]
    accelerators: dict[str, NodeDemand]


def replica_capacity(estimate: Estimate, max_batch_size: int, latency_budget: float) -> Capacity | None:
    """Requests a second one replica serves within its budget; None when the profile is empty."""
    limit = HEADROOM * latency_budget
    best: Capacity | None = None
    for b in range(1, max_batch_size + 1):
        t = estimate(b)
        if t <= 0:
            return None
        if 2 * t <= limit and (best is None or b / t > best.rate):
            best = Capacity(b, b / t, True)
    if best is None:
        return Capacity(1, 1 / estimate(1), False)
    return best


@dataclass(frozen=True, slots=True)
class _Pooled:
    """The pooled rate's fitted line over the trend window: `mean` requests a second at `middle`, rising
    `slope` requests a second per second; `slope` is 0 when the rise is not significant."""

    mean: float
    middle: float
    slope: float

    def growth(self, now: float, lead: float) -> float:
        if self.slope <= 0 or self.mean <= 0:
            return 1.0
        return 1.0 + self.slope * (now + lead - self.middle) / self.mean


_FLAT = _Pooled(0.0, 0.0, 0.0)


_MAX_RISE = 10.0  # a rise from almost nothing is capped: a quiet version's 0.2 -> 3 a second is no 14x headroom


class _Rises:
    """A rate's rises over one lead time: the largest of each `bucket` seconds, over the last `history` seconds
    (so the state a tick hands on stays small: an hour of minute buckets is 60 numbers a version), each with the
    time it was seen, so that a seasonal profile can later say how much of it came at its time of day."""

    __slots__ = ("rates", "buckets", "seen", "changes", "cached")

    def __init__(self) -> None:
        self.rates: deque[tuple[float, float]] = deque()  # (at, rate), back to one lead time ago
        self.buckets: deque[list[float]] = deque()  # [bucket start, largest rise in it, when it was seen]
        self.seen = 0  # rises recorded (capped): a quantile needs some history
        self.changes = 0  # bumped whenever `buckets` changes: with the profile's folds, what a quantile depends on
        self.cached: tuple[tuple[int, int, float, float], float] | None = None

    def add(self, now: float, rate: float, lead: float, history: float, bucket: float) -> None:
        rates = self.rates
        if rates and now <= rates[-1][0]:
            return
        rates.append((now, rate))
        while len(rates) > 2 and rates[1][0] <= now - lead + _EPS:
            rates.popleft()
        then, before = rates[0]
        if now - then >= lead - _EPS and before > 0:
            rise = min(max(rate / before - 1.0, 0.0), _MAX_RISE)
            start = math.floor(now / bucket) * bucket
            if self.buckets and self.buckets[-1][0] == start:
                if rise > self.buckets[-1][1]:
                    self.buckets[-1][1:] = [rise, now]
                    self.changes += 1
            else:
                self.buckets.append([start, rise, now])
                self.changes += 1
            self.seen = min(self.seen + 1, 1 << 20)
        while self.buckets and self.buckets[0][0] + bucket < now - history - _EPS:
            self.buckets.popleft()
            self.changes += 1

    def quantile(
        self, q: float, min_samples: int, season: SeasonalProfile | None = None, lead: float = 0.0, span: float = 0.0
    ) -> float:
        """The `q` quantile of the rises kept; with a seasonal profile, of what of each the profile does not foresee:
        the rise over what it says the rise's time of day brings against one lead time before (`span`: the rate's
        window, whose middle the rates stand at). A rise the profile knows of is forecast one lead time ahead
        (`Autoscaler._decide`), so holding headroom for it as well would pay for it twice."""
        if q <= 0 or self.seen < max(min_samples, 1) or not self.buckets:
            return 0.0
        key = (self.changes, -1 if season is None else season.folds, lead, span)
        if self.cached is not None and self.cached[0] == key:
            return self.cached[1]
        if season is None:
            rises = [b[1] for b in self.buckets]
        else:
            rises = [_unforeseen(b[1], season.ratio(b[2] - lead - span / 2, b[2] - span / 2)) for b in self.buckets]
        rises.sort()
        value = rises[min(len(rises) - 1, int(q * len(rises)))]
        self.cached = (key, value)
        return value

    def export(self) -> dict[str, Any]:
        return {"rates": [list(r) for r in self.rates], "buckets": [list(b) for b in self.buckets], "seen": self.seen}

    @classmethod
    def restored(cls, stored: Mapping[str, Any] | None) -> _Rises:
        rises = cls()
        if stored:
            rises.rates.extend((float(a), float(r)) for a, r in stored.get("rates", ()))
            # An earlier release kept no time per bucket: its start stands in.
            rises.buckets.extend(
                [float(b[0]), float(b[1]), float(b[2] if len(b) > 2 else b[0])] for b in stored.get("buckets", ())
            )
            rises.seen = int(stored.get("seen", 0))
        return rises


def _unforeseen(rise: float, ratio: float | None) -> float:
    """What of a rise of `rise` (0.5: 50%) a profile that foresaw the rate multiplied by `ratio` left over."""
    if ratio is None or ratio <= 1.0:
        return rise
    return max((1.0 + rise) / ratio - 1.0, 0.0)


@dataclass
class _Track:
    """One version's history between ticks."""

    last_at: float
    last_total: int
    last_arrival: float
    samples: deque[tuple[float, float, int]] = field(default_factory=deque)  # (start, end, arrivals)
    recommended: deque[tuple[float, int]] = field(default_factory=deque)  # (at, replicas)
    level: float | None = None  # Holt's smoothed rate, as of the middle of the last tick
    trend: float = 0.0  # its slope, requests a second per second
    last_dt: float = 0.0
    last_backlog: int = 0
    last_replicas: int = 0
    last_refused: int = 0
    served: float | None = None  # requests a second one replica was seen to serve saturated (smoothed)
    served_at: float = 0.0  # the end of the last saturated interval
    season: SeasonalProfile | None = None  # its rate by time of day (None: seasonality off)
    rises: _Rises = field(default_factory=_Rises)  # its short-window rate's rises over one lead time


class Autoscaler:
    """Desired replicas per version, one `tick` at a time; state is the history of past ticks."""

    def __init__(
        self,
        node_memory: Mapping[str, int],
        *,
        short_window: float = 10.0,
        long_window: float = 120.0,
        level_tau: float = 5.0,
        trend_tau: float = 10.0,
        trend_window: float = 8.0,
        trend_z: float = 4.0,
        surge: float = 0.0,
        served_tau: float = 30.0,
        served_ttl: float = 3600.0,
        season: float = 0.0,
        season_buckets: int = 48,
        season_gamma: float = 0.5,
        season_min_periods: int = 1,
        rise_quantile: float = 0.99,
        rise_history: float = 3600.0,
        rise_min_samples: int = 20,
        rise_bucket: float = 60.0,
    ) -> None:
        if not 0 < short_window <= long_window:
            raise ValueError("need 0 < short_window <= long_window")
        if level_tau <= 0 or trend_tau <= 0 or trend_window <= 0 or trend_z < 0 or surge < 0:
            raise ValueError("level_tau, trend_tau and trend_window must be positive, trend_z and surge not negative")
        if served_tau <= 0 or served_ttl <= 0:
            raise ValueError("served_tau and served_ttl must be positive")
        if season < 0:
            raise ValueError("season must not be negative (0: off)")
        if not 0.0 <= rise_quantile < 1.0 or rise_history <= 0 or rise_min_samples < 1 or rise_bucket <= 0:
            raise ValueError(
                "need 0 <= rise_quantile < 1 (0: off), rise_history and rise_bucket > 0, rise_min_samples >= 1"
            )
        if any(memory <= 0 for memory in node_memory.values()):
            raise ValueError("node memory must be positive")
        self.node_memory = dict(node_memory)  # bytes of one node, per accelerator type
        self.short_window = short_window
        self.long_window = long_window
        self.level_tau = level_tau
        self.trend_tau = trend_tau
        self.trend_window = trend_window
        self.trend_z = trend_z
        self.surge = surge  # requests a second per second the pool may grow by unannounced
        self.served_tau = served_tau
        self.served_ttl = served_ttl
        self.rise_quantile = rise_quantile
        self.rise_history = rise_history
        self.rise_min_samples = rise_min_samples
        self.rise_bucket = rise_bucket
        self._pool_rises = _Rises()  # the pooled short-window rate's rises over the longest lead seen
        # The seasonal settings, as an empty profile each version's track starts from (None: off).
        self._season = SeasonalProfile(season, season_buckets, season_gamma, season_min_periods) if season > 0 else None
        # All versions' summed rate by time of day: what of the pool's rises it foresees needs no headroom.
        self._pool_season = self._new_season()
        self._tracks: dict[str, _Track] = {}
        self._pool: deque[tuple[float, float, int]] = deque()  # (start, end, arrivals of every version)
        self._pool_at: float | None = None

    def export_state(self) -> dict[str, Any]:
        """The history between ticks as plain JSON-able data, so a tick in another process can go on from it:
        each version's track, and the pooled rates of the trend window."""
        return {
            "tracks": {
                version: {
                    "last_at": t.last_at,
                    "last_total": t.last_total,
                    "last_arrival": t.last_arrival,
                    "samples": [list(s) for s in t.samples],
                    "recommended": [list(r) for r in t.recommended],
                    "level": t.level,
                    "trend": t.trend,
                    "last_dt": t.last_dt,
                    "last_backlog": t.last_backlog,
                    "last_replicas": t.last_replicas,
                    "last_refused": t.last_refused,
                    "served": t.served,
                    "served_at": t.served_at,
                    "season": t.season.export() if t.season is not None else None,
                    "rises": t.rises.export(),
                }
                for version, t in self._tracks.items()
            },
            "pool": [list(p) for p in self._pool],
            "pool_at": self._pool_at,
            "pool_rises": self._pool_rises.export(),
            "pool_season": self._pool_season.export() if self._pool_season is not None else None,
        }

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Take up the history `export_state` gave (replacing this instance's own). A state without "tracks" is
        an earlier release's: its tracks alone, with no pooled history. A track without what replicas were seen
        to serve (an earlier release's) starts with none, and one whose seasonal profile is missing or was cut
        to another period or bucket count starts a new profile."""
        tracks_state = state["tracks"] if "tracks" in state else state
        tracks: dict[str, _Track] = {}
        for version, t in tracks_state.items():
            tracks[version] = _Track(
                float(t["last_at"]),
                int(t["last_total"]),
                float(t["last_arrival"]),
                deque((float(a), float(b), int(c)) for a, b, c in t["samples"]),
                deque((float(a), int(r)) for a, r in t["recommended"]),
                None if t["level"] is None else float(t["level"]),
                float(t["trend"]),
                float(t["last_dt"]),
                int(t.get("last_backlog", 0)),
                int(t.get("last_replicas", 0)),
                int(t.get("last_refused", 0)),
                None if t.get("served") is None else float(t["served"]),
                float(t.get("served_at", 0.0)),
                self._season_from(t.get("season")),
                _Rises.restored(t.get("rises")),
            )
        self._tracks = tracks
        self._pool = deque((float(a), float(b), int(c)) for a, b, c in state.get("pool", ()))
        pool_at = state.get("pool_at")
        self._pool_at = None if pool_at is None else float(pool_at)
        self._pool_rises = _Rises.restored(state.get("pool_rises"))
        self._pool_season = self._season_from(state.get("pool_season"))

    def _season_from(self, stored: Mapping[str, Any] | None) -> SeasonalProfile | None:
        if self._season is None:
            return None
        return self._season.restored(stored) if stored else self._season.fresh()

    def _new_season(self) -> SeasonalProfile | None:
        return self._season.fresh() if self._season is not None else None

    def tick(self, now: float, observations: Iterable[Observation]) -> Plan:
        observed = list(observations)
        for obs in observed:  # all checked before any history changes, so a refused tick leaves none
            node = self.node_memory.get(obs.config.accelerator)
            if node is None:
                raise ValueError(f"no node memory known for accelerator {obs.config.accelerator!r}")
            if obs.config.memory_bytes > node:
                raise ValueError(f"a replica of {obs.version} does not fit one {obs.config.accelerator} node")
        arrivals = 0
        for obs in observed:
            track = self._tracks.get(obs.version)
            if track is not None:
                arrivals += self._record(track, now, obs)
        pooled = self._pooled(now, arrivals)
        lead = max((obs.config.lead_time for obs in observed), default=0.0)
        # The pool's headroom is learnt from the ticks before this one; its sample of this tick is added after.
        pool_headroom = self._pool_rises.quantile(
            self.rise_quantile, self.rise_min_samples, self._pool_season, lead, self.short_window
        )
        decisions: dict[str, Decision] = {}
        configs: dict[str, ScalingConfig] = {}
        for obs in observed:
            configs[obs.version] = obs.config
            decisions[obs.version] = self._decide(now, obs, pooled, pool_headroom)
        if self.rise_quantile > 0 and decisions:
            self._pool_rises.add(
                now, sum(d.short_rate for d in decisions.values()), lead, self.rise_history, self.rise_bucket
            )
        for gone in set(self._tracks) - set(configs):  # a version no longer observed starts afresh
            del self._tracks[gone]
        return Plan(decisions, self._node_demand(decisions, configs))

    def _decide(self, now: float, obs: Observation, pooled: _Pooled, pool_headroom: float = 0.0) -> Decision:
        cfg = obs.config
        track = self._tracks.get(obs.version)
        if track is None:
            self._tracks[obs.version] = _Track(now, obs.arrivals_total, now, season=self._new_season())
            held = min(max(obs.replicas, cfg.min_replicas), cfg.max_replicas)
            return Decision(obs.version, held, "no_data", 0.0, 0.0, 0.0, 0.0, None)
        short = self._rate(track, now, self.short_window)
        long = self._rate(track, now, self.long_window)
        headroom = 0.0
        if self.rise_quantile > 0:
            track.rises.add(now, short, cfg.lead_time, self.rise_history, self.rise_bucket)
            own = track.rises.quantile(
                self.rise_quantile, self.rise_min_samples, track.season, cfg.lead_time, self.short_window
            )
            headroom = max(own, pool_headroom)
        forecast = max(self._forecast(track, cfg.lead_time), 0.0)
        growth = pooled.growth(now, cfg.lead_time)
        if growth > 1.0:  # the pool's significant rise, carried to this version's own rate: also a forecast
            forecast = max(forecast, short * growth)
        seasonal = False
        coming: float | None = None  # the profile's busiest within one cool-down after the lead time, as a ratio
        if track.season is not None:
            # From the short window's middle, whose rate it scales (at `now` the bucket ahead already leaks
            # into the interpolation), to the time a replica ordered now is ready.
            middle, ready = now - self.short_window / 2, now + cfg.lead_time
            ratio = track.season.ratio(middle, ready)
            if ratio is not None and ratio > 1.0 and short * ratio > forecast:
                forecast, seasonal = short * ratio, True
            coming = track.season.peak_ratio(middle, ready, ready + cfg.cool_down)
        # A backlog no replica has taken is work the arrival rate already counted once but the replicas
        # did not keep up with: it is sized to be worked off within the short window, on top of the rate.
        demand = max(forecast, short) + max(obs.backlog, 0) / self.short_window
        capacity = replica_capacity(obs.estimate, cfg.max_batch_size, cfg.latency_budget)
        if track.served is not None and now - track.served_at > self.served_ttl:
            track.served = None
        if capacity is not None and track.served is not None and track.served < capacity.rate:
            capacity = Capacity(capacity.batch, track.served, capacity.fits_budget, observed=True)

        if cfg.min_replicas == 0 and cfg.idle_to_zero is not None and now - track.last_arrival >= cfg.idle_to_zero:
            track.recommended.clear()
            return Decision(obs.version, 0, "idle", demand, forecast, short, long, capacity)

        if capacity is None:
            want, reason = max(obs.replicas, cfg.min_replicas, 1), "no_profile"
        else:
            if demand > 0:
                want = math.ceil(demand / (capacity.rate * cfg.target_utilisation) - _SLACK)
            else:
                want = 0
            reason = ("season" if seasonal else "forecast") if forecast >= short else "short_window"
            if headroom > 0 and short > 0:  # at full utilisation: it overlaps the target's slack
                reach = math.ceil(short * (1.0 + headroom) / capacity.rate - _SLACK)
                if reach > want:
                    want, reason = reach, "headroom"
            if coming is not None and coming > 1.0 and short > 0 and obs.replicas > want:
                # A rise the profile knows of, due within one cool-down after a replica ordered now would be
                # ready: the replicas it will need are kept, not scaled in now only to be ordered again (a cold
                # start each) as it comes. Never more than are there: ordering stays one lead time ahead.
                keep = min(obs.replicas, math.ceil(short * coming / (capacity.rate * cfg.target_utilisation) - _SLACK))
                if keep > want:
                    want, reason = keep, "season_hold"
            if self.surge > 0 and pooled.mean > 0 and short > 0:
                stretch = demand + self.surge * cfg.lead_time * short / pooled.mean
                surge = math.ceil(stretch / capacity.rate - _SLACK)
                if surge > want:
                    want, reason = surge, "surge"
            want += cfg.warm_pool
        floor = max(cfg.min_replicas, 1)  # min 0 still keeps one until the idle time has passed
        if want < floor:
            want, reason = floor, "min"
        if want > cfg.max_replicas:
            want, reason = cfg.max_replicas, "max"

        recommended = track.recommended
        recommended.append((now, want))
        while recommended and recommended[0][0] < now - cfg.cool_down:
            recommended.popleft()
        # Recommendations made under an older, higher max_replicas are held no higher than the max now.
        held = min(max(r for _, r in recommended), cfg.max_replicas)
        if held > want:
            want, reason = held, "cool_down"
        return Decision(obs.version, want, reason, demand, forecast, short, long, capacity)

    def _record(self, track: _Track, now: float, obs: Observation) -> int:
        """Add the interval since the version's last tick; the arrivals in it."""
        if now <= track.last_at:
            return 0  # a repeated or out-of-order tick adds no interval
        total, dt = obs.arrivals_total, now - track.last_at
        reset = total < track.last_total  # a drop is a reset
        count = total if reset else total - track.last_total
        track.samples.append((track.last_at, now, count))
        self._smooth(track, dt, count / dt)
        if count > 0:
            track.last_arrival = now
        if track.season is not None:
            track.season.add(track.last_at, now, count)
        refused = max(obs.refused_total, 0)
        if not reset:
            # A refusal counter behind its last reading restarted with the arrivals' (they live together).
            admitted = count - (refused - track.last_refused if refused >= track.last_refused else refused)
            self._served(track, now, dt, admitted, obs)
        track.last_at, track.last_total = now, total
        track.last_backlog, track.last_replicas, track.last_refused = max(obs.backlog, 0), obs.replicas, refused
        while track.samples and track.samples[0][0] < now - self.long_window - _EPS:
            track.samples.popleft()
        return count

    def _served(self, track: _Track, now: float, dt: float, admitted: int, obs: Observation) -> None:
        """Learn what one replica serves from an interval of `dt` seconds in which `admitted` arrivals queued."""
        replicas, backlog = obs.replicas, max(obs.backlog, 0)
        if replicas <= 0 or replicas != track.last_replicas:
            return  # a replica came or went within the interval: whose work it was is not known
        answered = admitted - (backlog - track.last_backlog)
        if answered <= 0:
            return  # nothing taken: a node restarting or loading says nothing of what a replica serves
        per_replica = answered / dt / replicas
        # Saturated throughout: at both ends, every replica had a full batch waiting beyond what it reads ahead,
        # so it never waited for a batch to fill; this is what they serve. A backlog of a few requests is a
        # burst the replicas were working off, and what they answered then is what was asked, not what they
        # can serve (learnt as capacity, it scaled a version that kept up: sim steady-h200, 2026-12-05).
        full = replicas * obs.config.max_batch_size
        if track.last_backlog >= full and backlog >= full:
            if track.served is None:
                track.served = per_replica
            else:
                track.served += (1.0 - math.exp(-dt / self.served_tau)) * (per_replica - track.served)
            track.served_at = now
        elif track.served is not None and per_replica > track.served:  # they served more than that
            track.served = per_replica

    def _pooled(self, now: float, arrivals: int) -> _Pooled:
        """The line through the pooled rates of the trend window, its slope kept only when significant."""
        if self._pool_at is not None and now > self._pool_at:
            self._pool.append((self._pool_at, now, arrivals))
            if self._pool_season is not None:
                self._pool_season.add(self._pool_at, now, arrivals)
        if self._pool_at is None or now > self._pool_at:
            self._pool_at = now
        pool = self._pool
        while pool and pool[0][0] < now - self.trend_window - _EPS:
            pool.popleft()
        n = len(pool)
        if n < 3:
            return _FLAT
        xs = [(a + b) / 2 for a, b, _ in pool]
        ys = [c / (b - a) for a, b, c in pool]
        span = sum(b - a for a, b, _ in pool)
        mean_x, mean_y = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        if sxx <= 0:
            return _FLAT
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
        residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in zip(xs, ys, strict=True))
        error = math.sqrt(residual / (n - 2) / sxx)
        mean = sum(c for _, _, c in pool) / span
        if slope <= self.trend_z * error:
            return _Pooled(mean, mean_x, 0.0)
        return _Pooled(mean, mean_x, slope)

    @staticmethod
    def _rate(track: _Track, now: float, window: float) -> float:
        """Arrivals a second over the ticks that began within `window` of now."""
        arrivals, start = 0, now
        for begin, _end, count in reversed(track.samples):
            if begin < now - window - _EPS:
                break
            arrivals += count
            start = begin
        return arrivals / (now - start) if now > start else 0.0

    def _smooth(self, track: _Track, dt: float, rate: float) -> None:
        """One Holt step over a tick of `dt` seconds that saw `rate` arrivals a second."""
        track.last_dt = dt
        if track.level is None:
            track.level = rate
            return
        alpha = 1.0 - math.exp(-dt / self.level_tau)
        beta = 1.0 - math.exp(-dt / self.trend_tau)
        prior = track.level + track.trend * dt
        level = prior + alpha * (rate - prior)
        track.trend += beta * ((level - track.level) / dt - track.trend)
        track.level = level

    @staticmethod
    def _forecast(track: _Track, lead: float) -> float:
        """The smoothed rate `lead` seconds from now (the level stands at the last tick's middle)."""
        if track.level is None:
            return 0.0
        return track.level + track.trend * (lead + track.last_dt / 2)

    def _node_demand(
        self, decisions: Mapping[str, Decision], configs: Mapping[str, ScalingConfig]
    ) -> dict[str, NodeDemand]:
        """Nodes wanted per accelerator type: total memory over one node's, a lower bound on packing."""
        replicas: dict[str, int] = {}
        memory: dict[str, int] = {}
        for version, decision in decisions.items():
            cfg = configs[version]
            replicas[cfg.accelerator] = replicas.get(cfg.accelerator, 0) + decision.replicas
            memory[cfg.accelerator] = memory.get(cfg.accelerator, 0) + decision.replicas * cfg.memory_bytes
        return {
            kind: NodeDemand(replicas[kind], memory[kind], -(-memory[kind] // self.node_memory[kind]))
            for kind in sorted(replicas)
        }
