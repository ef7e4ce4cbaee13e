"""The shed controller (serving.policies.shedding) without a server: lag samples and draws passed in."""

from __future__ import annotations

import pytest

from serving.policies.shedding import LAG_WEIGHT, ShedGate, smoothed_lag


def test_the_shed_gate_steers_its_refusals_by_the_loop_lag() -> None:
    gate = ShedGate()
    # given a loop on time / then nothing is refused
    gate.steer(0.010, 0.040)
    assert gate.drop == 0 and not gate.shedding
    # when it runs late, the more so the faster the share of refusals rises
    gate.steer(0.080, 0.040)
    after_twice = gate.drop
    gate.reset()
    gate.steer(0.050, 0.040)
    assert 0 < gate.drop < after_twice
    for _ in range(100):
        gate.steer(1.0, 0.040)
    assert gate.drop == gate.MAX_DROP == 0.98  # never all: some requests keep measuring the way through
    assert "1000 ms late; refusing 98% of inference" in gate.reason
    # and once it keeps up again, the share falls back, step by step, to none
    for _ in range(100):
        gate.steer(0.005, 0.040)
    assert gate.drop == 0
    # and a late loop with too few requests to be their doing (a model loading) refuses nothing
    gate.steer(0.200, 0.040, requests=gate.MIN_PRESSURE - 1)
    assert gate.drop == 0
    gate.steer(0.200, 0.040, requests=gate.MIN_PRESSURE)
    assert gate.drop > 0


def test_a_tick_steers_by_the_requests_seen_since_the_last_and_resets_the_count() -> None:
    gate = ShedGate()
    # given fewer requests than could make the loop late / when it ticks late / then nothing is refused
    gate.seen = gate.MIN_PRESSURE - 1
    gate.tick(0.200, 0.040)
    assert gate.drop == 0 and gate.seen == 0
    # given enough of them / then it starts refusing, and the count starts again
    gate.seen = gate.MIN_PRESSURE
    gate.tick(0.200, 0.040)
    assert gate.drop > 0 and gate.seen == 0
    # and a tick without requests in between does not raise the share further
    drop = gate.drop
    gate.tick(0.200, 0.040)
    assert gate.drop == drop


def test_the_refusal_is_a_draw_against_the_drop_share() -> None:
    draws = iter([0.1, 0.5, 0.9])
    gate = ShedGate(draw=lambda: next(draws))
    gate.drop = 0.5
    assert [gate.shedding, gate.shedding, gate.shedding] == [True, False, False]
    # and with nothing to drop no draw is taken
    gate.reset()
    assert not gate.shedding


def test_the_lag_is_smoothed_and_never_negative() -> None:
    # a timer that ran early counts as on time
    assert smoothed_lag(0.0, due=10.0, ran=9.9) == 0.0
    # one late tick moves the smoothed lag by its weight, not all the way
    once = smoothed_lag(0.0, due=10.0, ran=10.1)
    assert once == pytest.approx(LAG_WEIGHT * 0.1)
    # and a lag that lasts converges to itself
    lag = 0.0
    for _ in range(60):
        lag = smoothed_lag(lag, due=10.0, ran=10.1)
    assert lag == pytest.approx(0.1, rel=1e-6)


def test_a_target_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        ShedGate().steer(0.1, 0.0)


def test_a_busy_loop_whose_requests_are_refused_past_the_gate_refuses_more_of_them_at_the_door() -> None:
    gate = ShedGate()
    # given a loop on time but busy, half of whose requests past the gate are refused after all (admission's
    # 503, after the body, the key and the route were paid for) / then the gate takes more of them itself
    gate.steer(0.0, 0.040, requests=100, refused=0.5, busy=0.9)
    assert gate.drop == pytest.approx(gate.REFUSED_GAIN * (0.5 - gate.REFUSED_TARGET))
    assert "50% of the inference it took was refused for want of capacity" in gate.reason
    # and the more refused, the faster
    more = ShedGate()
    more.steer(0.0, 0.040, requests=100, refused=0.9, busy=0.9)
    assert more.drop > gate.drop
    # and once few are refused past it, the share falls back, step by step, to none
    for _ in range(100):
        gate.steer(0.0, 0.040, requests=100, refused=0.0, busy=0.9)
    assert gate.drop == 0


def test_refusals_past_the_gate_of_an_idle_loop_or_within_the_target_refuse_nothing_at_the_door() -> None:
    # a compute-bound model refuses much of its overload at admission while the loop idles: refusing at the
    # door would save no work and would refuse what its fallback answers
    idle = ShedGate()
    idle.steer(0.0, 0.040, requests=100, refused=0.9, busy=ShedGate.BUSY - 0.1)
    assert idle.drop == 0
    within = ShedGate()
    within.steer(0.0, 0.040, requests=100, refused=ShedGate.REFUSED_TARGET, busy=1.0)
    assert within.drop == 0


def test_a_tick_remembers_a_burst_of_refusals_for_a_few_ticks_and_resets_its_counts() -> None:
    gate = ShedGate()
    # given one tick in which most requests past the gate were refused, on a busy loop
    gate.passed, gate.refused = 100, 80
    gate.tick(0.0, 0.040, busy=0.9)
    assert gate.drop > 0 and gate.passed == gate.refused == 0
    first = gate.drop
    # when the next ticks refuse none / then the burst still counts for a tick or two, then no longer
    gate.passed = 100
    gate.tick(0.0, 0.040, busy=0.9)
    assert gate.drop > first  # 64 of 180 remembered: still over the target
    for _ in range(10):
        gate.passed = 100
        gate.tick(0.0, 0.040, busy=0.9)
    assert gate.drop < first
    # and too few requests to judge by count for nothing
    fresh = ShedGate()
    fresh.passed, fresh.refused = fresh.MIN_PRESSURE - 1, fresh.MIN_PRESSURE - 1
    fresh.tick(0.0, 0.040, busy=1.0)
    assert fresh.drop == 0


def test_a_standing_queue_before_the_read_lowers_the_wait_bound_to_the_sojourn_target() -> None:
    gate = ShedGate()
    front_end, target = 0.150, 0.020

    def tick(least: float, seen: int = gate.MIN_PRESSURE) -> None:
        gate.least_wait, gate.seen = least, seen
        gate.tick(0.0, 0.040, wait_bound=front_end, sojourn=target)

    # given no requests yet / then the bound is the front end's
    tick(float("inf"), 0)
    assert gate.wait_bound == front_end
    # when every request read waits past the target for a tick / then that may be a burst draining: unchanged
    tick(target * 2)
    assert gate.wait_bound == front_end and gate.least_wait == float("inf")
    # and for STANDING_TICKS in a row / then a queue stands: a request that waited past the target is refused
    for _ in range(gate.STANDING_TICKS - 1):
        tick(target * 2)
    assert gate.wait_bound == target
    # and one request read within the target in a tick / then the queue drained: the front end's bound again
    tick(target / 2)
    assert gate.wait_bound == front_end
    # and ticks with too few requests to be a queue's (a test's, a health check's) do not count
    for _ in range(gate.STANDING_TICKS):
        tick(target * 2, gate.MIN_PRESSURE - 1)
    assert gate.wait_bound == front_end
    # and a target of 0 turns the rule off
    for _ in range(gate.STANDING_TICKS):
        gate.least_wait, gate.seen = target * 2, gate.MIN_PRESSURE
        gate.tick(0.0, 0.040, wait_bound=front_end, sojourn=0.0)
    assert gate.wait_bound == front_end
