"""Tests for serving.policies.autoscale: the autoscaling policy, driven tick by tick on a fake clock.

Most tests use a profile where every row costs 10 ms whatever the batch, so one replica serves
100 requests a second, and a target utilisation of 0.5, so each replica is sized for 50.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from serving.policies.autoscale import Autoscaler, Capacity, Observation, ScalingConfig, replica_capacity
from serving.policies.batching import LatencyProfile

GB = 1 << 30


def per_row(rows: int) -> float:
    return 0.010 * rows


def config(**changes: object) -> ScalingConfig:
    params: dict = {
        "accelerator": "gpu",
        "memory_bytes": 10 * GB,
        "cold_start": 30.0,
        "scheduling_delay": 5.0,
        "latency_budget": 1.0,
        "max_batch_size": 8,
        "target_utilisation": 0.5,
        "cool_down": 60.0,
        **changes,
    }
    return ScalingConfig(**params)


class Driver:
    """One version fed to an autoscaler once a second: `rate(t)` arrivals in the second ending at t."""

    def __init__(
        self, cfg: ScalingConfig, *, short_window: float = 10.0, long_window: float = 60.0, rise_quantile: float = 0.99
    ) -> None:
        self.cfg = cfg
        self.scaler = Autoscaler(
            {"gpu": 80 * GB, "cpu": 16 * GB},
            short_window=short_window,
            long_window=long_window,
            rise_quantile=rise_quantile,
        )
        self.total = 0
        self.replicas = cfg.min_replicas
        self.now = 0.0
        self.scaler.tick(0.0, [self.observe()])

    def observe(self) -> Observation:
        return Observation("m:1", self.cfg, self.total, self.replicas, per_row)

    def run(self, seconds: int, rate: Callable[[float], float]):
        decisions = []
        for _ in range(seconds):
            self.now += 1.0
            self.total += int(rate(self.now))
            decision = self.scaler.tick(self.now, [self.observe()]).decisions["m:1"]
            self.replicas = decision.replicas
            decisions.append((self.now, decision))
        return decisions


# --- capacity ---------------------------------------------------------------------------------


def test_capacity_from_a_latency_profile_worked_by_hand() -> None:
    # given a measured profile (ms): 1 -> 10, 8 -> 20, 16 -> 30, 32 -> 50, interpolated between,
    # and a p99 budget of 110 ms, of which admission's HEADROOM (0.8) is 88 ms
    profile = LatencyProfile({1: 0.010, 8: 0.020, 16: 0.030, 32: 0.050})
    # when the capacity is derived
    capacity = replica_capacity(profile.estimate, 32, 0.110)
    # then the largest batch with 2 t(b) <= 88 ms is the one with t(b) <= 44 ms:
    # t(b) = 30 + (b - 16) x 1.25 ms <= 44  =>  b <= 27.2, so b = 27 with t(27) = 43.75 ms,
    # and a replica serves 27 / 0.04375 = 617.14 requests a second
    assert capacity is not None
    assert capacity.batch == 27
    assert capacity.rate == pytest.approx(617.142857, rel=1e-6)
    assert capacity.fits_budget
    # and a larger max batch than the budget allows does not raise it; a smaller one caps it
    assert replica_capacity(profile.estimate, 8, 0.110) == Capacity(8, pytest.approx(400.0), True)


def test_a_budget_no_batch_meets_is_flagged_and_an_empty_profile_has_no_capacity() -> None:
    profile = LatencyProfile({1: 0.010, 8: 0.020})
    # 2 x 10 ms does not fit 80% of 20 ms: batch one's rate, flagged
    assert replica_capacity(profile.estimate, 8, 0.020) == Capacity(1, pytest.approx(100.0), False)
    assert replica_capacity(LatencyProfile().estimate, 8, 1.0) is None


# --- steady load, ramps and bursts -----------------------------------------------------------


def test_steady_load_gives_stable_replicas() -> None:
    # given 200 requests a second, alternating 190 and 210, on replicas sized for 55 a second each
    driver = Driver(config(target_utilisation=0.55))
    # when it runs for five minutes
    decisions = driver.run(300, lambda t: 190 if int(t) % 2 else 210)
    # then past the start-up (the trend's first seconds overshoot, and the cool-down holds that for
    # 60 s) the answer is 4 replicas every time (3 x 55 < 210, 4 x 55 >= 210), the noise moving the
    # forecast by a few requests only
    settled = [d for t, d in decisions if t > 120]
    assert {d.replicas for d in settled} == {4}
    assert all(abs(d.forecast - 200) < 5 for d in settled)


def test_a_ramp_scales_out_ahead_of_demand_by_the_lead_time() -> None:
    # given 100 requests a second, then from t = 60 a ramp of 10 more each second, a 30 s cold start
    # and a 5 s scheduling delay (lead time 35 s); the count of each second is the rate at its middle; the
    # forecast alone (no learned headroom, which the ramp's own rises would raise above it)
    def rate(t: float) -> float:
        return 100 if t <= 60 else 100 + 10 * (t - 0.5 - 60)

    driver = Driver(config(max_replicas=100), rise_quantile=0.0)
    decisions = dict(driver.run(300, rate))

    # then, once the trend has caught up with the ramp, the forecast is the rate 35 s ahead
    assert decisions[200].forecast == pytest.approx(rate(235.5), rel=1e-4)
    assert decisions[200].reason == "forecast"
    # and 40 replicas (sized for 50 a second each: more than 1950 a second) are asked for by
    # t = 211, while the rate itself passes 1950 only at t = 246: a whole lead time earlier
    asked = min(t for t, d in decisions.items() if d.replicas >= 40)
    needed = min(t for t in decisions if rate(t) > 1950)
    assert (asked, needed) == (211, 246)
    assert asked <= needed - driver.cfg.lead_time


def test_a_burst_raises_replicas_at_the_first_tick_where_the_long_window_would_not() -> None:
    # given 100 a second for four minutes, then five seconds at 600
    driver = Driver(config())
    driver.run(240, lambda t: 100)
    before = driver.replicas
    burst = driver.run(5, lambda t: 600)
    # then the short window (10 s) sees it at once: after one second of it the short rate is 150,
    # and the replicas rise at that very tick, by at least what the short window alone asks for
    assert before == 2
    first = burst[0][1]
    assert first.short_rate == pytest.approx(150.0)
    assert first.replicas >= math.ceil(150 / 50) > before
    # while the long window's (60 s) rate barely moves: sized on it, the burst would find 3 replicas
    last = burst[-1][1]
    assert last.short_rate == pytest.approx(350.0)
    assert last.long_rate == pytest.approx((55 * 100 + 5 * 600) / 60)
    assert math.ceil(last.long_rate / 50) == 3
    assert last.replicas >= math.ceil(350 / 50)


def test_after_a_fall_the_short_window_keeps_what_arrives_now() -> None:
    # given a load falling from 400 to 100 a second in a second: the trend turns steeply down
    driver = Driver(config(cool_down=0.0))
    driver.run(120, lambda t: 400)
    after = driver.run(3, lambda t: 100)
    # then the forecast 35 s ahead falls below what arrives now, and the short window decides
    _, d = after[-1]
    assert d.forecast < d.short_rate
    assert d.reason == "short_window"
    assert d.replicas == math.ceil(d.short_rate / 50 - 0.01)


# --- cool-down, idle, clamps ------------------------------------------------------------------


def test_cool_down_holds_scale_in_then_releases_it_and_scale_out_is_immediate() -> None:
    driver = Driver(config(cool_down=60.0))
    driver.run(120, lambda t: 400)
    assert driver.replicas == 8
    # when the load drops to 100 a second
    after = driver.run(200, lambda t: 100)
    # then for the whole cool-down the replicas stay at 8, held by it
    assert all(d.replicas == 8 for t, d in after if t <= 120 + 60)
    assert any(d.reason == "cool_down" for t, d in after if t <= 120 + 60)
    # then they come down, never up, and settle at 2
    counts = [d.replicas for _, d in after]
    assert counts == sorted(counts, reverse=True)
    assert counts[-1] == 2
    # and a step up is answered at the very next tick, with no cool-down
    ((_, up),) = driver.run(1, lambda t: 1000)
    assert up.replicas > 2 and up.reason == "forecast"


def test_a_lowered_max_applies_at_the_next_tick_despite_the_cool_down() -> None:
    # given a version scaled out to 8 replicas, its recommendations held by a 60 s cool-down
    driver = Driver(config(cool_down=60.0, max_replicas=10))
    driver.run(120, lambda t: 400)
    assert driver.replicas == 8
    # when its max_replicas is lowered to 3 under the same load
    driver.cfg = dataclasses.replace(driver.cfg, max_replicas=3)
    ((_, d),) = driver.run(1, lambda t: 400)
    # then the very next decision is the new max, not the 8 the cool-down remembers
    assert (d.replicas, d.reason) == (3, "max")
    # and when the load falls, the cool-down still holds no more than the max
    assert all(d.replicas <= 3 for _, d in driver.run(30, lambda t: 50))


def test_idle_scales_to_zero_when_allowed() -> None:
    driver = Driver(config(min_replicas=0, idle_to_zero=300.0))
    driver.run(100, lambda t: 100)
    # when no request arrives after t = 100
    idle = dict(driver.run(400, lambda t: 0))
    # then one replica is kept until 300 s without an arrival, then none
    assert all(d.replicas >= 1 for t, d in idle.items() if t < 400)
    assert idle[399].replicas == 1 and idle[399].reason == "min"
    assert idle[400].replicas == 0 and idle[400].reason == "idle"
    assert all(d.replicas == 0 for t, d in idle.items() if t >= 400)
    # and a request for the version scaled to zero brings a replica back at the next tick
    ((_, back),) = driver.run(1, lambda t: 1)
    assert back.replicas == 1


def test_idle_never_scales_to_zero_with_a_minimum_of_one() -> None:
    driver = Driver(config(min_replicas=1, idle_to_zero=300.0))
    driver.run(100, lambda t: 100)
    idle = driver.run(600, lambda t: 0)
    assert {d.replicas for _, d in idle[-300:]} == {1}
    assert idle[-1][1].reason == "min"


def test_min_and_max_clamp_and_the_warm_pool_adds() -> None:
    busy = Driver(config(max_replicas=20))
    ((_, d),) = busy.run(120, lambda t: 5000)[-1:]
    assert (d.replicas, d.reason) == (20, "max")

    quiet = Driver(config(min_replicas=3))
    ((_, d),) = quiet.run(120, lambda t: 10)[-1:]
    assert (d.replicas, d.reason) == (3, "min")

    warm = Driver(config(warm_pool=2))
    ((_, d),) = warm.run(120, lambda t: 200)[-1:]
    assert (d.replicas, d.reason) == (4 + 2, "forecast")


def test_config_refuses_settings_that_cannot_hold() -> None:
    with pytest.raises(ValueError, match="target_utilisation"):
        config(target_utilisation=0.0)
    with pytest.raises(ValueError, match="min_replicas"):
        config(min_replicas=5, max_replicas=4)
    with pytest.raises(ValueError, match="latency_budget"):
        config(latency_budget=0.0)
    with pytest.raises(ValueError, match="accelerator 'tpu'"):
        Autoscaler({"gpu": GB}).tick(0.0, [Observation("m:1", config(accelerator="tpu"), 0, 1, per_row)])
    with pytest.raises(ValueError, match="node memory must be positive"):
        Autoscaler({"gpu": 0})


def test_a_refused_tick_changes_no_history() -> None:
    # given a tick whose second version's replica is larger than a node
    scaler = Autoscaler({"gpu": 16 * GB})
    fits = Observation("a:1", config(), 0, 1, per_row)
    too_big = Observation("b:1", config(memory_bytes=20 * GB), 0, 1, per_row)
    with pytest.raises(ValueError, match="a replica of b:1 does not fit one gpu node"):
        scaler.tick(0.0, [fits, too_big])
    # then the first version was not recorded either: its next tick is still its first
    assert scaler.tick(1.0, [fits]).decisions["a:1"].reason == "no_data"


def test_a_counter_reset_counts_the_new_total() -> None:
    driver = Driver(config())
    driver.run(20, lambda t: 100)
    # the node restarted: its counter starts again from 0 and reads 100 a second later
    driver.total = 0
    ((_, d),) = driver.run(1, lambda t: 100)
    assert d.short_rate == pytest.approx(100.0)


# --- demand per accelerator type ---------------------------------------------------------------


def test_demand_per_accelerator_type_in_nodes() -> None:
    # given two 30 GB versions on 80 GB GPU nodes (3 and 2 replicas) and a 4 GB CPU version
    scaler = Autoscaler({"gpu": 80 * GB, "cpu": 16 * GB})
    big = config(memory_bytes=30 * GB)
    small = config(accelerator="cpu", memory_bytes=4 * GB)
    observations = [
        Observation("a:1", big, 0, 3, per_row),
        Observation("b:1", big, 0, 2, per_row),
        Observation("c:1", small, 0, 1, per_row),
    ]
    # when the first tick holds what runs
    plan = scaler.tick(0.0, observations)
    # then 150 GB of GPU replicas want two 80 GB nodes, and 4 GB of CPU replicas one 16 GB node
    assert {v: d.replicas for v, d in plan.decisions.items()} == {"a:1": 3, "b:1": 2, "c:1": 1}
    assert plan.accelerators["gpu"].replicas == 5
    assert plan.accelerators["gpu"].memory_bytes == 150 * GB
    assert plan.accelerators["gpu"].nodes == 2
    assert plan.accelerators["cpu"].nodes == 1


# --- predictive against reactive ----------------------------------------------------------------


def test_predictive_scaling_under_provisions_a_ramp_far_less_than_reactive() -> None:
    # given a ramp from 1000 to 5000 requests a second in one minute after two steady minutes,
    # 30 s cold starts, replicas of 100 a second at a target utilisation of 0.7
    cold = 30
    cfg = config(cold_start=float(cold), scheduling_delay=0.0, target_utilisation=0.7, max_replicas=200)

    def rate(t: float) -> float:
        return 1000 + min(max(t - 120, 0), 60) * 4000 / 60

    def simulate(policy: Callable[[float, int, int], int]) -> list[float]:
        """Per second: the policy asks, loads finish `cold` s later, scale-in is at once; returns
        the requests a second above ready capacity, second by second."""
        ready, loading, total = 15, [], 0
        over = []
        for step in range(1, 301):
            now = float(step)
            arrivals = int(rate(now))
            total += arrivals
            ready += sum(1 for at in loading if at <= now)
            loading = [at for at in loading if at > now]
            over.append(max(0.0, arrivals - ready * 100))
            want = policy(now, total, ready + len(loading))
            if want > ready + len(loading):
                loading += [now + cold] * (want - ready - len(loading))
            while want < ready + len(loading):
                if loading:
                    loading.pop()
                else:
                    ready -= 1
        return over

    scaler = Autoscaler({"gpu": 80 * GB})
    scaler.tick(0.0, [Observation("m:1", cfg, 0, 15, per_row)])

    def predictive(now: float, total: int, replicas: int) -> int:
        return scaler.tick(now, [Observation("m:1", cfg, total, replicas, per_row)]).decisions["m:1"].replicas

    last = {"total": 0}

    def reactive(now: float, total: int, replicas: int) -> int:
        current = total - last["total"]
        last["total"] = total
        return math.ceil(current / (100 * 0.7))

    ahead, behind = simulate(predictive), simulate(reactive)
    # then neither can help the ramp's first 30 s (what was ordered before it is all that can be
    # ready), but once the trend shows, predictive scaling has capacity ready where reactive
    # scaling, ordering for the rate of 30 s ago, stays short until the ramp ends
    assert sum(behind) > 1.5 * sum(ahead)
    late_ahead = [t for t, over in enumerate(ahead, 1) if over and t > 120 + cold + 10]
    late_behind = [t for t, over in enumerate(behind, 1) if over and t > 120 + cold + 10]
    assert late_ahead == []
    assert late_behind and max(late_behind) >= 175


# --- the pooled trend ---------------------------------------------------------------------------


def test_a_ramp_every_version_shares_is_seen_in_the_pool_before_any_one_version_shows_it() -> None:
    # given 40 versions of 25 requests a second each (Poisson, seeded), 1,000 in all, for two minutes,
    # then all of them ramping to five times that in a minute; 30 s cold starts
    rng = np.random.default_rng(7)
    cfg = config(cold_start=30.0, scheduling_delay=5.0, target_utilisation=0.5, max_replicas=500)
    names = [f"m{i}:1" for i in range(40)]

    def rate(t: float) -> float:
        return 25.0 * (1 + 4 * min(max(t - 120, 0), 60) / 60)

    arrivals = [[int(n) for n in rng.poisson(rate(t), len(names))] for t in range(1, 151)]

    def wanted(scaler: Autoscaler) -> list[int]:
        totals = [0] * len(names)
        scaler.tick(0.0, [Observation(n, cfg, 0, 1, per_row) for n in names])
        out = []
        for t, counts in enumerate(arrivals, 1):
            totals = [a + c for a, c in zip(totals, counts, strict=True)]
            plan = scaler.tick(
                float(t), [Observation(n, cfg, total, 1, per_row) for n, total in zip(names, totals, strict=True)]
            )
            out.append(sum(d.replicas for d in plan.decisions.values()))
        return out

    pooled = wanted(Autoscaler({"gpu": 80 * GB}))
    alone = wanted(Autoscaler({"gpu": 80 * GB}, trend_z=math.inf))  # each version's own trend only
    # then through the steady minutes the pool lifts nothing: its noise is not a trend
    assert pooled[:120] == alone[:120]
    # and five seconds into the ramp the pool asks for what the rate 40 s on needs (rising 1.67 a second
    # a version from 25: about 90 a version, two replicas of 50 each, 80 in all), while each version
    # alone has not yet seen its trend through its own noise
    assert pooled[124] == 80
    assert alone[124] < 0.7 * pooled[124]


def test_learned_headroom_holds_what_past_rises_reached_in_one_lead_time() -> None:
    # given replicas of 100 requests a second sized at a 0.5 target, a 35 s lead, no cool-down, and a rate of
    # 100 a second that steps to 300 for a minute at t = 200 (a rise of 2x its rate within one lead time)
    def rate(t: float) -> float:
        return 300.0 if 200 < t <= 260 else 100.0

    def run(**kw: float) -> dict[float, object]:
        driver = Driver(config(cool_down=0.0, max_replicas=50), **kw)
        return dict(driver.run(700, rate))

    learnt, plain = run(), run(rise_quantile=0.0)
    # then before the step nothing has risen: both hold the target's 2 replicas, no headroom asked
    assert learnt[190].replicas == plain[190].replicas == 2  # type: ignore[attr-defined]
    assert learnt[190].reason != "headroom"  # type: ignore[attr-defined]
    # and once it has been seen, at 100 a second again, the learnt one holds at full utilisation what the
    # rise reached: 100 x (1 + 2) / 100 = 3 replicas, where the target alone asks for 2
    assert plain[400].replicas == 2  # type: ignore[attr-defined]
    assert learnt[400].replicas == 3  # type: ignore[attr-defined]
    assert learnt[400].reason == "headroom"  # type: ignore[attr-defined]


def test_learned_rises_leave_the_history_and_survive_the_exported_state() -> None:
    # given the same step and a history of 100 s
    def rate(t: float) -> float:
        return 300.0 if 200 < t <= 260 else 100.0

    cfg = config(cool_down=0.0, max_replicas=50)
    driver = Driver(cfg)
    driver.scaler = Autoscaler({"gpu": 80 * GB}, rise_history=100.0)
    driver.scaler.tick(0.0, [driver.observe()])
    decisions = dict(driver.run(330, rate))
    # (the rise over one lead time passed 1x until about t = 235: the rate 35 s before was still 100)
    assert (decisions[330].replicas, decisions[330].reason) == (3, "headroom")
    # when its state is handed to another autoscaler, that one holds the same headroom
    fresh = Autoscaler({"gpu": 80 * GB}, rise_history=100.0)
    fresh.restore_state(json.loads(json.dumps(driver.scaler.export_state())))
    driver.scaler = fresh
    assert (dict(driver.run(1, rate))[331].replicas, fresh.export_state()["pool_rises"]["buckets"] != []) == (3, True)
    # and 100 s after the last rise, the headroom is gone
    later = dict(driver.run(200, rate))
    assert later[531].replicas == 2
    assert later[531].reason != "headroom"
    with pytest.raises(ValueError, match="rise_quantile"):
        Autoscaler({"gpu": GB}, rise_quantile=1.0)


def following(rate: Callable[[float], float], cfg: ScalingConfig, ticks: range, **settings: Any) -> dict[int, Any]:
    """One version on an `Autoscaler(**settings)` ticked once a second, holding what each decision asked for (two
    replicas to start): its decision at each tick."""
    scaler = Autoscaler({"gpu": 80 * GB}, **settings)
    total, replicas, decisions = 0, 2, {}
    for t in ticks:
        total += int(rate(t))
        decision = scaler.tick(float(t), [Observation("m:1", cfg, total, replicas, per_row)]).decisions["m:1"]
        decisions[t], replicas = decision, decision.replicas
    return decisions


def test_a_rise_the_season_holds_is_ordered_ahead_not_kept_as_headroom_all_day() -> None:
    # given "days" of 200 s (20 buckets of 10 s) with a rush from 100 to 300 a second from t = 100 to 160 each
    # day, replicas of 100 a second at a 0.5 target, a 35 s lead, no cool-down, learned headroom on, and the
    # season on or off
    def rate(t: float) -> float:
        return 300.0 if 100 <= t % 200 < 160 else 100.0

    cfg = config(cool_down=0.0, max_replicas=50)
    seasonal, plain = (following(rate, cfg, range(400), season=s, season_buckets=20) for s in (200.0, 0.0))
    # then in the quiet hours after the rush, without the season, the fleet holds at full utilisation what the
    # rush reached within one lead time (100 x (1 + 2) / 100 = 3 replicas where the target asks for 2); the
    # seconds around the day's turn at 200 are left out (the trend, overshooting out of the fall, asks for 3 in
    # both), and those from 251, when the seasonal one begins to order the rush
    quiet = [*range(170, 194), *range(230, 251)]
    assert all((plain[t].replicas, plain[t].reason) == (3, "headroom") for t in quiet)
    # while the seasonal one holds the target's 2: the profile knows the rush at that time of day (its own day
    # counted, as the forecast counts it), so none of it is headroom
    assert all(seasonal[t].replicas == 2 for t in quiet)
    # and it orders the rush one lead time ahead instead (300 / 50 = 6), before it comes
    assert seasonal[295].replicas >= 6 > plain[295].replicas


def test_the_seasons_view_of_past_rises_survives_the_exported_state() -> None:
    # Given the same days, an autoscaler with the season and learned headroom, its state handed at t = 250 (after
    # day 1's rush) to a fresh one through JSON, as the production tick hands it on
    def rate(t: float) -> float:
        return 300.0 if 100 <= t % 200 < 160 else 100.0

    cfg = config(cool_down=0.0, max_replicas=50)

    def run(scaler: Autoscaler, ticks: range, total: int, replicas: int) -> tuple[list[tuple[int, str]], int, int]:
        out = []
        for t in ticks:
            total += int(rate(t))
            decision = scaler.tick(float(t), [Observation("m:1", cfg, total, replicas, per_row)]).decisions["m:1"]
            replicas = decision.replicas
            out.append((decision.replicas, decision.reason))
        return out, total, replicas

    scaler = Autoscaler({"gpu": 80 * GB}, season=200.0, season_buckets=20)
    _, total, replicas = run(scaler, range(0, 250), 0, 2)
    fresh = Autoscaler({"gpu": 80 * GB}, season=200.0, season_buckets=20)
    fresh.restore_state(json.loads(json.dumps(scaler.export_state())))
    # When both go on with the same arrivals, then they decide alike: the pool's profile came across too
    assert fresh.export_state()["pool_season"] == scaler.export_state()["pool_season"]
    assert run(fresh, range(250, 400), total, replicas)[0] == run(scaler, range(250, 400), total, replicas)[0]


def test_surge_headroom_holds_what_a_ramp_reaches_in_one_lead_time_at_full_utilisation() -> None:
    # given replicas of 100 requests a second sized at a 0.5 target, a 35 s lead, and a declared surge of
    # 10 requests a second per second: 350 more within one lead time
    def steady(rate: int, surge: float) -> tuple[int, str]:
        scaler = Autoscaler({"gpu": 80 * GB}, surge=surge)
        total, d = 0, None
        for t in range(30):
            d = scaler.tick(float(t), [Observation("m:1", config(max_replicas=100), total, 1, per_row)])
            total += rate
        return d.decisions["m:1"].replicas, d.decisions["m:1"].reason

    # when 100 a second arrive: the target asks for 2, the surge for (100 + 350) / 100 = 5, at full use
    assert steady(100, 0.0) == (2, "forecast")
    assert steady(100, 10.0) == (5, "surge")
    # and at 1,000 a second the target's own slack (20 replicas for 1,000 + 1,000) already covers it
    assert steady(1000, 10.0) == steady(1000, 0.0) == (20, "forecast")
    with pytest.raises(ValueError, match="surge"):
        Autoscaler({"gpu": GB}, surge=-1.0)


# --- state carried between processes and the backlog -----------------------------------------


def test_exported_state_lets_another_instance_go_on_exactly_where_this_one_stopped() -> None:
    # given two autoscalers fed the same ramp for two minutes, one of them handing its history
    # (through JSON, as Redis stores it) to a fresh instance halfway
    import json

    def rate(t: float) -> float:
        return 50 + 5 * t

    cfg = config(max_replicas=100)
    whole, first = Driver(cfg), Driver(cfg)
    whole.run(60, rate)
    first.run(60, rate)
    fresh = Autoscaler({"gpu": 80 * GB, "cpu": 16 * GB}, short_window=10.0, long_window=60.0)
    fresh.restore_state(json.loads(json.dumps(first.scaler.export_state())))
    first.scaler = fresh
    # when both go on for another minute, with a scale-in hold and a trend in flight
    went_on = first.run(60, lambda t: 20)
    kept = whole.run(60, lambda t: 20)
    # then every decision is the same: the forecast, the rates and the cool-down's hold
    assert went_on == kept
    assert any(d.reason == "cool_down" for _, d in kept)


def test_a_backlog_no_replica_took_adds_its_share_of_the_short_window_to_demand() -> None:
    # given a steady 100 a second (two replicas at 50 each), and a copy of that history
    driver = Driver(config())
    driver.run(60, lambda t: 100)
    twin = Autoscaler({"gpu": 80 * GB, "cpu": 16 * GB}, short_window=10.0, long_window=60.0)
    twin.restore_state(driver.scaler.export_state())
    # when the next second brings the same 100 arrivals to both, one of them also seeing 300 waiting
    total = driver.total + 100
    calm = driver.scaler.tick(61.0, [Observation("m:1", driver.cfg, total, 2, per_row)]).decisions["m:1"]
    pressed = twin.tick(61.0, [Observation("m:1", driver.cfg, total, 2, per_row, backlog=300)]).decisions["m:1"]
    # then its demand is higher by 300 / the 10 s short window = 30 a second, and it asks one replica more
    assert calm.replicas == 2
    assert pressed.demand == pytest.approx(calm.demand + 30.0)
    assert pressed.replicas == 3


# --- what replicas are seen to serve --------------------------------------------------------


class Saturated:
    """One version at two replicas whose nodes serve `served` requests a second each, whatever the profile
    says (100 a second: `per_row`), fed `rate` a second; the backlog is what they did not take."""

    def __init__(self, served: float, **changes: object) -> None:
        self.cfg = config(cool_down=0.0, max_replicas=50)
        self.scaler = Autoscaler({"gpu": 80 * GB}, **changes)  # type: ignore[arg-type]
        self.served, self.total, self.backlog, self.now, self.refused = served, 0, 0.0, 0.0, 0

    def run(self, seconds: int, rate: float, replicas: int = 2, refused: float = 0.0):
        """`rate` a second admitted, and `refused` a second more asked for and refused before the queue."""
        decision = None
        for _ in range(seconds):
            self.now += 1.0
            self.total += int(rate + refused)
            self.refused += int(refused)
            self.backlog = max(0.0, self.backlog + rate - self.served * replicas)
            obs = Observation(
                "m:1", self.cfg, self.total, replicas, per_row, backlog=int(self.backlog), refused_total=self.refused
            )
            decision = self.scaler.tick(self.now, [obs]).decisions["m:1"]
        return decision


def test_saturated_replicas_that_serve_less_than_the_profile_size_the_version_by_what_they_serve() -> None:
    # given two replicas whose profile says 100 a second each, but which serve 30 a second each (a CPU node),
    # fed 80 a second: more than they serve, so a backlog grows every second
    fleet = Saturated(30.0)
    decision = fleet.run(40, 80.0)
    # then the capacity the decision used is the 30 a second they were seen to serve, flagged as observed
    assert decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(30.0)
    # and the replicas are sized by it: demand over 30 x 0.5 target (the profile alone would ask for
    # ceil(demand / 50))
    assert decision.replicas == math.ceil(decision.demand / 15.0 - 0.01)
    assert decision.replicas > math.ceil(decision.demand / 50.0)


def test_a_burst_of_a_few_requests_left_over_is_not_saturation() -> None:
    # given two replicas (the profile's 100 a second each, batches of 8) asked 80 a second, which they keep up
    # with, and a stream whose backlog holds a few requests at every tick (bursts they are working off)
    fleet = Saturated(60.0)
    total, decision = 0, None
    for second, backlog in enumerate([3, 2, 5, 1, 4, 15, 15, 9] * 5, start=1):
        total += 80
        obs = Observation("m:1", fleet.cfg, total, 2, per_row, backlog=backlog)
        decision = fleet.scaler.tick(float(second), [obs]).decisions["m:1"]
    # then nothing is learnt: what they answered was what was asked (80 a second, 40 each), not what they can
    # serve, and sized by that they would be scaled out although they keep up
    assert not decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(100.0)
    # and a backlog of a full batch a replica (16) at both ends of a tick is saturation, learnt at once
    total += 80
    fleet.scaler.tick(41.0, [Observation("m:1", fleet.cfg, total, 2, per_row, backlog=16)])
    total += 80
    decision = fleet.scaler.tick(42.0, [Observation("m:1", fleet.cfg, total, 2, per_row, backlog=16)]).decisions["m:1"]
    assert decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(40.0)


def test_requests_refused_before_the_queue_are_demand_but_not_work_the_replicas_took() -> None:
    # given the same two replicas serving 30 a second each, of 200 a second asked for 80 admitted (a backlog
    # grows) and 120 refused by admission before the queue
    fleet = Saturated(30.0)
    decision = fleet.run(40, 80.0, refused=120.0)
    # then what a replica serves is learnt from the admitted alone: 30, not the (200 - backlog growth) / 2 the
    # refused would make of it
    assert decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(30.0)
    # and the demand sized for is every request asked for, refused ones too (plus the backlog to work off)
    assert decision.short_rate == pytest.approx(200.0)
    assert decision.replicas == math.ceil(decision.demand / 15.0 - 0.01)


def test_without_a_backlog_nothing_is_learnt_and_the_profile_stands() -> None:
    # given replicas that keep up with what arrives (no backlog at any tick)
    fleet = Saturated(60.0)
    decision = fleet.run(40, 80.0)
    # then the capacity is the profile's 100 a second
    assert not decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(100.0)


def test_what_was_seen_served_rises_when_replicas_serve_more_and_is_forgotten_after_its_ttl() -> None:
    # given replicas seen saturated at 30 a second each
    fleet = Saturated(30.0, served_ttl=120.0)
    fleet.run(30, 80.0)
    # when the load falls to 40 a second until the backlog is gone, and they then serve 45 each with no
    # backlog (a noisy neighbour left)
    fleet.run(40, 40.0)
    assert fleet.backlog == 0
    fleet.served = 45.0
    decision = fleet.run(5, 90.0)
    # then the capacity rises to what they served, at once
    assert decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(45.0)
    # and two minutes after the last saturated interval the profile's 100 stands again
    decision = fleet.run(120, 90.0)
    assert not decision.capacity.observed
    assert decision.capacity.rate == pytest.approx(100.0)


def test_an_interval_where_replicas_came_or_went_or_the_counter_reset_teaches_nothing() -> None:
    # given a version whose two replicas are saturated at 10 a second by the profile's measure
    fleet = Saturated(10.0)
    fleet.run(1, 80.0)  # the first interval: no backlog at its start
    scaler = fleet.scaler
    # when the replica count changes between two saturated ticks, and then the counter resets
    fleet.total += 80
    scaler.tick(2.0, [Observation("m:1", fleet.cfg, fleet.total, 3, per_row, backlog=500)])
    scaler.tick(3.0, [Observation("m:1", fleet.cfg, 5, 3, per_row, backlog=600)])
    decision = scaler.tick(3.5, [Observation("m:1", fleet.cfg, 5, 3, per_row, backlog=600)]).decisions["m:1"]
    # then nothing was learnt (the last interval answered nothing: no sample either)
    assert not decision.capacity.observed


def test_what_was_seen_served_survives_the_exported_state() -> None:
    import json

    # given two identical saturated versions, one of them handing its history (through JSON) to a fresh
    # autoscaler after 30 s
    whole, handed = Saturated(30.0), Saturated(30.0)
    whole.run(30, 80.0)
    handed.run(30, 80.0)
    fresh = Autoscaler({"gpu": 80 * GB})
    fresh.restore_state(json.loads(json.dumps(handed.scaler.export_state())))
    handed.scaler = fresh
    # when both go on for ten seconds
    went_on, kept = handed.run(10, 80.0), whole.run(10, 80.0)
    # then they decide the same, on the capacity seen served
    assert went_on == kept
    assert went_on.capacity.observed


# --- daily seasonality ----------------------------------------------------------------------


def test_a_step_seen_at_this_time_of_day_before_is_ordered_one_lead_time_ahead() -> None:
    # given "days" of 200 s (20 buckets of 10 s) where the rate steps from 100 to 400 a second halfway
    # through each, a 35 s lead, no cool-down, and two autoscalers: one with the season, one without (neither
    # with learned headroom, which would hold what the first day's step reached all day)
    def rate(t: float) -> float:
        return 100.0 if t % 200 < 100 else 400.0

    cfg = config(cool_down=0.0, max_replicas=50)
    runs = {}
    for season in (200.0, 0.0):
        scaler = Autoscaler({"gpu": 80 * GB}, season=season, season_buckets=20, rise_quantile=0.0)
        total, decisions = 0, {}
        for t in range(0, 400):
            total += int(rate(t))
            decisions[t] = scaler.tick(float(t), [Observation("m:1", cfg, total, 2, per_row)]).decisions["m:1"]
        runs[season] = decisions
    seasonal, plain = runs[200.0], runs[0.0]
    # then on the first day neither sees the step coming: both hold 2 replicas (100 / 50) until it comes
    assert seasonal[95].replicas == plain[95].replicas == 2
    # and on the second day, 10 s before the step, the seasonal one already holds what 400 a second needs
    # (400 / 50 = 8), ordered as the profile ahead began to rise (its reason says so), where the other
    # still holds 2
    assert plain[290].replicas == 2
    assert seasonal[290].replicas >= 8
    first = min(t for t in range(240, 300) if seasonal[t].replicas >= 8)
    assert seasonal[first].reason == "season"
    assert 300 - 45 <= first <= 300 - 25  # one lead time (35 s) ahead, within a bucket's interpolation


def test_replicas_a_known_rise_will_need_within_a_cool_down_are_not_scaled_in_before_it() -> None:
    # given "days" of 100 s (10 buckets of 10 s) with a 20 s rush to 400 a second from t = 50, 100 otherwise, a
    # 35 s lead and a 30 s cool-down: after day 1's rush the cool-down ends at 100, and day 2's rush at 150 is
    # then within one cool-down after the lead time. The version holds what the last decision asked for.
    def rate(t: float) -> float:
        return 400.0 if 50 <= t % 100 < 70 else 100.0

    cfg = config(cool_down=30.0, max_replicas=50)
    seasonal, plain = (
        following(rate, cfg, range(200), season=s, season_buckets=10, rise_quantile=0.0) for s in (100.0, 0.0)
    )
    # then both held the rush's replicas through the cool-down, and without the season scale in after it, to
    # what 100 a second needs (3: 100 / 50, rounded up over the trend's forecast)
    assert seasonal[75].replicas == plain[75].replicas >= 8
    assert plain[110].replicas == 3
    # where the seasonal one keeps what day 2's rush will need (400 / 50 = 8; the reason says so) until the rush
    # is one lead time off and it is ordered as ever, never holding more than it had
    held = [t for t in range(100, 150) if seasonal[t].reason == "season_hold"]
    assert 105 in held and 110 in held
    assert all(seasonal[t].replicas == 8 for t in range(105, 150))
    assert all(seasonal[t].replicas <= seasonal[t - 1].replicas for t in held)
    # and after day 2's rush the cool-down holds both alike
    assert seasonal[199].replicas == plain[199].replicas


def test_a_season_survives_the_exported_state_and_a_changed_season_starts_afresh() -> None:
    import json

    cfg = config()
    scaler = Autoscaler({"gpu": 80 * GB}, season=100.0, season_buckets=10)
    for t in range(150):
        scaler.tick(float(t), [Observation("m:1", cfg, 50 * t, 2, per_row)])
    state = json.loads(json.dumps(scaler.export_state()))
    same = Autoscaler({"gpu": 80 * GB}, season=100.0, season_buckets=10)
    same.restore_state(state)
    other = Autoscaler({"gpu": 80 * GB}, season=86400.0)
    other.restore_state(state)
    off = Autoscaler({"gpu": 80 * GB})
    off.restore_state(state)
    assert same.export_state() == scaler.export_state()
    assert other.export_state()["tracks"]["m:1"]["season"]["seen"] == [0] * 48
    assert off.export_state()["tracks"]["m:1"]["season"] is None
    with pytest.raises(ValueError):
        Autoscaler({"gpu": GB}, season=-1.0)
    with pytest.raises(ValueError):
        Autoscaler({"gpu": GB}, season=100.0, season_buckets=1)
