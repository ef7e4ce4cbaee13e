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
