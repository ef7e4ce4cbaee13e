"""Tests for serving.policies.seasonal: a rate by time of day learnt from past periods.

A period of 100 s in ten buckets of 10 s, fed by one-second ticks: 100 requests a second in the first half
of each period, 300 in the second."""

from __future__ import annotations

import pytest

from serving.policies.seasonal import SeasonalProfile


def feed(profile: SeasonalProfile, start: float, end: float, rate) -> None:  # noqa: ANN001
    t = start
    while t < end:
        profile.add(t, t + 1.0, int(rate(t)))
        t += 1.0


def step(t: float) -> float:
    return 100.0 if t % 100 < 50 else 300.0


def test_after_one_period_the_profile_gives_the_rate_by_time_of_day_and_the_ratio_ahead() -> None:
    profile = SeasonalProfile(100.0, 10)
    # given one period seen, and a second begun (the last bucket of the first is folded in when it ends)
    feed(profile, 0.0, 101.0, step)
    # then at bucket centres it is what was seen, and between them a straight line
    assert profile.at(125.0) == pytest.approx(100.0)
    assert profile.at(155.0) == pytest.approx(300.0)
    assert profile.at(150.0) == pytest.approx(200.0)
    # and 15 s before the step, the profile says 15 s later is three times as busy
    assert profile.ratio(140.0, 155.0) == pytest.approx(3.0)
    # across the period's end too: the last bucket's centre (95) to the first's (105, i.e. 5)
    assert profile.at(200.0) == pytest.approx(200.0)


def test_nothing_is_said_before_enough_periods_are_seen() -> None:
    once, twice = SeasonalProfile(100.0, 10), SeasonalProfile(100.0, 10, min_periods=2)
    feed(once, 0.0, 50.0, step)
    # the buckets ahead of the first period's progress have nothing yet
    assert once.at(75.0) is None and once.ratio(20.0, 50.0) is None
    feed(once, 50.0, 101.0, step)
    feed(twice, 0.0, 101.0, step)
    assert once.at(125.0) is not None
    assert twice.at(125.0) is None
    feed(twice, 101.0, 201.0, step)
    assert twice.at(225.0) == pytest.approx(100.0)


def test_a_new_period_weighs_gamma_and_a_bucket_seen_for_less_than_half_its_width_is_left_out() -> None:
    profile = SeasonalProfile(100.0, 10, gamma=0.5)
    # given a first period whose first bucket was seen for 4 s only (registered mid-bucket)
    feed(profile, 6.0, 100.0, step)
    # when the next period's first half runs at 200 instead of 100
    feed(profile, 100.0, 201.0, lambda t: 200.0 if t % 100 < 50 else 300.0)
    # then bucket 1 holds the mean of the two periods, bucket 0 only the second's
    assert profile.rates[1] == pytest.approx(150.0)
    assert profile.rates[0] == pytest.approx(200.0) and profile.seen[0] == 1


def test_where_nothing_arrived_at_this_time_of_day_there_is_no_ratio() -> None:
    profile = SeasonalProfile(100.0, 10)
    feed(profile, 0.0, 101.0, lambda t: 0.0 if t % 100 < 50 else 50.0)
    assert profile.ratio(120.0, 130.0) is None


def test_export_and_restore_go_on_the_same() -> None:
    import json

    profile = SeasonalProfile(100.0, 10)
    feed(profile, 0.0, 133.0, step)
    copy = SeasonalProfile(100.0, 10).restored(json.loads(json.dumps(profile.export())))
    feed(profile, 133.0, 250.0, step)
    feed(copy, 133.0, 250.0, step)
    assert copy == profile


def test_settings_that_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError):
        SeasonalProfile(0.0, 10)
    with pytest.raises(ValueError):
        SeasonalProfile(100.0, 1)
    with pytest.raises(ValueError):
        SeasonalProfile(100.0, 10, gamma=0.0)


def test_an_interval_longer_than_a_bucket_is_left_out_rather_than_smeared() -> None:
    profile = SeasonalProfile(100.0, 10)
    feed(profile, 0.0, 30.0, step)
    # when the ticks pause from 30 s to 76 s (one interval of 46 s with its arrivals), then go on
    profile.add(30.0, 76.0, 46 * 200)
    feed(profile, 76.0, 101.0, step)
    # then the buckets it spanned learnt nothing, and neither did the one it ended in (seen only in part)
    assert profile.seen[:3] == [1, 1, 1]
    assert profile.seen[3:8] == [0, 0, 0, 0, 0]
    assert profile.seen[8:] == [1, 1]
