"""Tests for serving.policies.batching: the pure dynamic-batching policy, driven by a fake clock.

Times are plain floats handed to `poll(now)`; dyadic values (0.25, 0.5, 1.5...) keep the
arithmetic exact so boundaries can be asserted with `==`.
"""

from __future__ import annotations

import math
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from serving.policies.batching import (
    BatchingConfig,
    BatchQueue,
    Decision,
    LatencyProfile,
    Pending,
    QueueFull,
    tier_share,
)

INF = float("inf")


def item(name: str, rows: int = 1, arrival: float = 0.0, deadline: float = INF, priority: int = 1) -> Pending:
    return Pending(payload=name, rows=rows, arrival=arrival, deadline=deadline, priority=priority)


def names(items: list[Pending]) -> list[str]:
    return [p.payload for p in items]


def queue(
    max_batch_size: int = 4,
    max_queue_delay: float = 1.0,
    max_queue_size: int = 100,
    preferred: tuple[int, ...] = (),
    estimate=None,
) -> BatchQueue:
    config = BatchingConfig(max_batch_size, max_queue_delay, max_queue_size, preferred)
    return BatchQueue(config, estimate)


# --- BatchingConfig ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be at least 1"),
        ({"max_batch_size": -3}, "max_batch_size must be at least 1"),
        ({"max_queue_delay": -0.001}, "max_queue_delay must not be negative"),
        ({"max_queue_size": 0}, "max_queue_size must be at least 1"),
        ({"preferred_batch_sizes": (0,)}, "preferred batch size 0 is outside"),
        ({"preferred_batch_sizes": (2, 9)}, "preferred batch size 9 is outside"),
    ],
)
def test_config_rejects_invalid_values(kwargs: dict, message: str) -> None:
    # given a config that breaks one rule
    params = {"max_batch_size": 8, "max_queue_delay": 0.005, "max_queue_size": 10, **kwargs}
    # when it is built / then it refuses with a message naming the rule
    with pytest.raises(ValueError, match=message):
        BatchingConfig(**params)


def test_config_accepts_boundaries_and_normalises_preferred_sizes() -> None:
    # given boundary values: zero delay, max_queue_size 1, preferred sizes equal to 1 and to the max,
    # unsorted and repeated
    config = BatchingConfig(
        max_batch_size=8, max_queue_delay=0.0, max_queue_size=1, preferred_batch_sizes=(8, 2, 8, 1, 4)
    )
    # then the preferred sizes are deduplicated and sorted ascending
    assert config.preferred_batch_sizes == (1, 2, 4, 8)
    assert config.max_queue_delay == 0.0
    # and the config is immutable
    with pytest.raises(FrozenInstanceError):
        config.max_batch_size = 16  # type: ignore[misc]


# --- put / bookkeeping ------------------------------------------------------------------------


def test_empty_poll_returns_nothing_and_no_wake_time() -> None:
    # given an empty queue
    q = queue()
    # when polled
    decision = q.poll(123.0)
    # then nothing leaves, nothing expired, and there is nothing to wake up for
    assert decision == Decision(batch=[], expired=[], wake_at=None)
    assert len(q) == 0 and q.rows == 0


def test_put_counts_requests_and_rows() -> None:
    # given an empty queue
    q = queue(max_batch_size=8)
    # when requests of 1, 3 and 2 rows are put
    q.put(item("a", 1))
    assert (len(q), q.rows) == (1, 1)
    q.put(item("b", 3))
    assert (len(q), q.rows) == (2, 4)
    q.put(item("c", 2, priority=0))
    # then len counts requests and rows counts rows
    assert (len(q), q.rows) == (3, 6)


@pytest.mark.parametrize("rows", [0, -1, 5])
def test_request_that_cannot_fit_a_batch_is_refused(rows: int) -> None:
    # given a queue with max_batch_size 4 holding one request
    q = queue(max_batch_size=4)
    q.put(item("a", 2))
    # when a request of 0, negative, or more than 4 rows is put
    with pytest.raises(ValueError, match="cannot fit max_batch_size 4"):
        q.put(item("big", rows))
    # then the queue is unchanged
    assert (len(q), q.rows) == (1, 2)
    # and it is never dispatched
    assert names(q.poll(10.0).batch) == ["a"]


def test_overflow_raises_queue_full_at_max_queue_size() -> None:
    # given a queue that holds at most 2 requests, full
    q = queue(max_batch_size=4, max_queue_size=2)
    q.put(item("a"))
    q.put(item("b", 2))
    # when a third request arrives
    with pytest.raises(QueueFull):
        q.put(item("c"))
    # then the queue still holds only the first two
    assert (len(q), q.rows) == (2, 3)
    # and once a batch leaves there is room again
    assert names(q.poll(1.0).batch) == ["a", "b"]
    q.put(item("c", arrival=1.0))
    assert (len(q), q.rows) == (1, 1)


def test_queue_full_is_counted_in_requests_not_rows() -> None:
    # given max_queue_size 2 and max_batch_size 8
    q = queue(max_batch_size=8, max_queue_size=2)
    # when two single-row requests are put
    q.put(item("a"))
    q.put(item("b"))
    # then a third is refused although only 2 of 8 rows wait
    with pytest.raises(QueueFull):
        q.put(item("c"))


# --- batch leaves when full -------------------------------------------------------------------


def test_batch_leaves_at_once_when_full_of_single_rows() -> None:
    # given max_batch_size 4 and a long window
    q = queue(max_batch_size=4, max_queue_delay=10.0)
    for n in "abc":
        q.put(item(n))
    # when 3 rows wait it does not leave yet
    assert q.poll(0.0).batch == []
    # when the 4th row arrives
    q.put(item("d"))
    decision = q.poll(0.0)
    # then all four leave at once, in arrival order, and the queue is empty
    assert names(decision.batch) == ["a", "b", "c", "d"]
    assert decision.wake_at is None
    assert (len(q), q.rows) == (0, 0)


@pytest.mark.parametrize("rows", [[3, 1], [2, 2], [4], [1, 1, 2]])
def test_batch_leaves_at_once_when_multi_row_requests_fill_it(rows: list[int]) -> None:
    # given max_batch_size 4 and requests whose rows add up to exactly 4
    q = queue(max_batch_size=4, max_queue_delay=10.0)
    for i, r in enumerate(rows):
        q.put(item(f"r{i}", r))
    # when polled before the window ends
    decision = q.poll(0.0)
    # then they all leave together
    assert sum(p.rows for p in decision.batch) == 4
    assert len(decision.batch) == len(rows)
    assert (len(q), q.rows) == (0, 0)


def test_a_full_batch_leaves_and_the_rest_waits_for_its_window() -> None:
    # given max_batch_size 4 and 6 single-row requests arriving at 0.0 .. 1.25
    q = queue(max_batch_size=4, max_queue_delay=2.0)
    for i in range(6):
        q.put(item(f"r{i}", arrival=i * 0.25))
    # when polled at 1.25
    decision = q.poll(1.25)
    # then the 4 oldest leave and 2 remain
    assert names(decision.batch) == ["r0", "r1", "r2", "r3"]
    assert (len(q), q.rows) == (2, 2)
    # and the remainder waits for its own oldest request's window: 1.0 + 2.0
    decision = q.poll(1.25)
    assert decision.batch == [] and decision.wake_at == 3.0


# --- batch leaves when the window expires -------------------------------------------------------


def test_batch_leaves_when_the_window_expires_and_not_before() -> None:
    # given a 0.5 s window and two requests arriving at 1.0 and 1.25
    q = queue(max_batch_size=8, max_queue_delay=0.5)
    q.put(item("a", arrival=1.0))
    q.put(item("b", arrival=1.25))
    # when polled inside the window
    early = q.poll(1.25)
    # then nothing leaves and the policy asks to be woken at the window's end (oldest + delay)
    assert early.batch == [] and early.expired == []
    assert early.wake_at == 1.5
    # and just before the end nothing leaves either
    assert q.poll(math.nextafter(1.5, 0.0)).batch == []
    assert (len(q), q.rows) == (2, 2)
    # when polled at the window's end
    decision = q.poll(1.5)
    # then both leave
    assert names(decision.batch) == ["a", "b"]
    assert decision.wake_at is None
    assert (len(q), q.rows) == (0, 0)


def test_window_is_measured_from_the_oldest_request_not_the_newest() -> None:
    # given requests arriving at 0.0 and 0.75 with a 1.0 s window
    q = queue(max_batch_size=8, max_queue_delay=1.0)
    q.put(item("late", arrival=0.75, priority=0))  # put first and higher priority, but younger
    q.put(item("old", arrival=0.0))
    # then the window ends at 1.0, from the oldest arrival
    assert q.poll(0.75).wake_at == 1.0
    assert names(q.poll(1.0).batch) == ["late", "old"]


def test_zero_window_dispatches_immediately() -> None:
    # given no queue delay
    q = queue(max_batch_size=8, max_queue_delay=0.0)
    q.put(item("a", arrival=5.0))
    # when polled at the arrival time
    decision = q.poll(5.0)
    # then the request leaves alone at once
    assert names(decision.batch) == ["a"]


# --- batch leaves early for a deadline ----------------------------------------------------------


def test_batch_leaves_early_when_deadline_minus_predicted_compute_is_reached() -> None:
    # given a long window and a compute estimate of 0.5 s per row
    calls: list[int] = []

    def estimate(rows: int) -> float:
        calls.append(rows)
        return 0.5 * rows

    q = queue(max_batch_size=8, max_queue_delay=10.0, estimate=estimate)
    q.put(item("a", arrival=0.0, deadline=5.0))
    q.put(item("b", arrival=0.0, deadline=4.0))  # the earliest deadline
    q.put(item("c", arrival=0.0, deadline=9.0))
    # when polled well before the window ends
    decision = q.poll(1.0)
    # then it asks to be woken at earliest deadline - compute(3 rows) = 4.0 - 1.5
    assert decision.batch == []
    assert decision.wake_at == 2.5
    assert calls and calls[-1] == 3
    # and the batch does not leave just before that
    assert q.poll(2.25).batch == []
    # when that moment comes, all three leave though the window is far off
    decision = q.poll(2.5)
    assert names(decision.batch) == ["a", "b", "c"]
    assert decision.expired == []


def test_deadline_without_compute_estimate_wakes_at_the_deadline() -> None:
    # given no compute estimate (zero predicted compute) and a deadline inside the window
    q = queue(max_batch_size=8, max_queue_delay=10.0)
    q.put(item("a", arrival=0.0, deadline=3.0))
    # then the policy wakes at the deadline itself, not at the window's end
    assert q.poll(1.0).wake_at == 3.0


def test_window_wins_when_it_ends_before_the_deadline_allowance() -> None:
    # given a 1 s window, a deadline at 10 and 0.5 s of predicted compute
    q = queue(max_batch_size=8, max_queue_delay=1.0, estimate=lambda rows: 0.5)
    q.put(item("a", arrival=0.0, deadline=10.0))
    # then it wakes at the window's end
    assert q.poll(0.0).wake_at == 1.0


# --- expiry ------------------------------------------------------------------------------------


def test_expired_requests_are_returned_and_never_batched() -> None:
    # given three requests, one with a deadline at 1.0
    q = queue(max_batch_size=8, max_queue_delay=4.0)
    q.put(item("a", arrival=0.0, deadline=1.0, priority=0))
    q.put(item("b", arrival=0.0, deadline=50.0))
    q.put(item("c", 2, arrival=0.0))
    # when polled exactly at that deadline (deadline <= now counts as missed)
    decision = q.poll(1.0)
    # then it is returned as expired, the others keep waiting
    assert names(decision.expired) == ["a"]
    assert decision.batch == []
    assert (len(q), q.rows) == (2, 3)
    assert decision.wake_at == 4.0
    # and when the window ends the batch holds only the live requests
    decision = q.poll(4.0)
    assert names(decision.batch) == ["b", "c"]
    assert decision.expired == []


def test_expired_request_is_dropped_from_a_batch_that_leaves_in_the_same_poll() -> None:
    # given max_batch_size 2 and three single-row requests, the first already past its deadline
    q = queue(max_batch_size=2, max_queue_delay=10.0)
    q.put(item("gone", arrival=0.0, deadline=0.5))
    q.put(item("b", arrival=0.25))
    q.put(item("c", arrival=0.25))
    # when polled after its deadline
    decision = q.poll(0.75)
    # then it is expired and the two live ones form the full batch
    assert names(decision.expired) == ["gone"]
    assert names(decision.batch) == ["b", "c"]
    assert (len(q), q.rows) == (0, 0)


def test_everything_expired_leaves_an_empty_queue_with_no_wake_time() -> None:
    # given two requests with deadlines at 1.0 and 2.0, in different priority levels
    q = queue(max_batch_size=8, max_queue_delay=10.0)
    q.put(item("a", 3, deadline=1.0, priority=0))
    q.put(item("b", 2, deadline=2.0, priority=2))
    # when polled after both deadlines
    decision = q.poll(2.0)
    # then both are expired and nothing is left to wake for
    assert sorted(names(decision.expired)) == ["a", "b"]
    assert decision.batch == [] and decision.wake_at is None
    assert (len(q), q.rows) == (0, 0)
    # and a later request is served normally (the emptied priority levels are gone)
    q.put(item("c", arrival=3.0, priority=0))
    assert names(q.poll(13.0).batch) == ["c"]


def test_wake_time_is_the_next_deadline_when_it_comes_before_the_window() -> None:
    # given a request whose deadline (2.0) comes before the window's end (10.0), zero compute
    q = queue(max_batch_size=8, max_queue_delay=10.0)
    q.put(item("a", deadline=2.0))
    q.put(item("b", deadline=30.0))
    # then the policy wakes at that deadline
    assert q.poll(1.0).wake_at == 2.0
    # and at 2.0 the request is expired, the other keeps waiting for the window
    decision = q.poll(2.0)
    assert names(decision.expired) == ["a"]
    assert decision.wake_at == 10.0


# --- preferred batch sizes -----------------------------------------------------------------------


def test_preferred_size_dispatches_at_once_when_the_largest_can_be_formed() -> None:
    # given max 8, preferred sizes 2 and 4, and a long window
    q = queue(max_batch_size=8, max_queue_delay=10.0, preferred=(2, 4))
    for n in "abc":
        q.put(item(n))
    # when 3 rows wait (the preferred 2 can be formed, the largest 4 cannot) nothing leaves
    decision = q.poll(0.0)
    assert decision.batch == [] and decision.wake_at == 10.0
    # when a 4th row arrives
    q.put(item("d"))
    decision = q.poll(0.0)
    # then a batch of the largest preferred size leaves at once
    assert names(decision.batch) == ["a", "b", "c", "d"]
    assert (len(q), q.rows) == (0, 0)


def test_preferred_size_cuts_a_larger_batch_and_the_remainder_stays() -> None:
    # given max 8, largest preferred size 4, and 6 rows waiting
    q = queue(max_batch_size=8, max_queue_delay=10.0, preferred=(4,))
    for i in range(6):
        q.put(item(f"r{i}"))
    # when polled before the window ends
    decision = q.poll(0.0)
    # then exactly 4 leave at once and 2 remain
    assert names(decision.batch) == ["r0", "r1", "r2", "r3"]
    assert (len(q), q.rows) == (2, 2)


def test_window_expiry_cuts_to_the_largest_preferred_size_that_fits() -> None:
    # given max 8, preferred 2 and 4, and 3 single rows (4 cannot be formed)
    q = queue(max_batch_size=8, max_queue_delay=1.0, preferred=(2, 4))
    for n in "abc":
        q.put(item(n))
    # when the window expires
    decision = q.poll(1.0)
    # then the batch is cut to 2 and the third row stays
    assert names(decision.batch) == ["a", "b"]
    assert (len(q), q.rows) == (1, 1)
    # and the remainder, whose window is already over, leaves alone on the next poll
    decision = q.poll(1.0)
    assert names(decision.batch) == ["c"]
    assert (len(q), q.rows) == (0, 0)


def test_window_expiry_below_every_preferred_size_sends_what_there_is() -> None:
    # given preferred sizes 4 and 8 and a single row
    q = queue(max_batch_size=8, max_queue_delay=1.0, preferred=(4, 8))
    q.put(item("a"))
    # when the window expires
    decision = q.poll(1.0)
    # then the row leaves anyway
    assert names(decision.batch) == ["a"]


def test_a_full_batch_is_cut_to_the_largest_preferred_size() -> None:
    # given max 4 with preferred size 3 and 4 rows waiting
    q = queue(max_batch_size=4, max_queue_delay=10.0, preferred=(3,))
    for n in "abcd":
        q.put(item(n))
    # when polled
    decision = q.poll(0.0)
    # then 3 leave (the preferred size), 1 stays
    assert names(decision.batch) == ["a", "b", "c"]
    assert (len(q), q.rows) == (1, 1)


def test_preferred_cut_never_exceeds_the_target_with_multi_row_requests() -> None:
    # given preferred size 4 and requests of 3 and 2 rows (5 rows: the 4 can be "formed" by count)
    q = queue(max_batch_size=8, max_queue_delay=10.0, preferred=(4,))
    q.put(item("three", 3))
    q.put(item("two", 2))
    # when polled
    decision = q.poll(0.0)
    # then only the first leaves: adding the second would pass the preferred size
    assert names(decision.batch) == ["three"]
    assert (len(q), q.rows) == (1, 2)


# --- priorities and head-of-line ----------------------------------------------------------------


def test_lower_priority_number_goes_first_and_fifo_within_a_level() -> None:
    # given requests at three priority levels, put interleaved
    q = queue(max_batch_size=16, max_queue_delay=1.0)
    q.put(item("low1", priority=2))
    q.put(item("mid1", priority=1))
    q.put(item("high1", priority=0))
    q.put(item("low2", priority=2))
    q.put(item("high2", priority=0))
    q.put(item("mid2", priority=1))
    # when the window expires
    decision = q.poll(1.0)
    # then the batch is ordered by priority, then arrival
    assert names(decision.batch) == ["high1", "high2", "mid1", "mid2", "low1", "low2"]


def test_high_priority_requests_take_the_seats_when_the_batch_is_limited() -> None:
    # given max 2 and a low-priority request queued before two high-priority ones
    q = queue(max_batch_size=2, max_queue_delay=1.0)
    q.put(item("low", priority=5))
    q.put(item("high1", priority=0))
    q.put(item("high2", priority=0))
    # when polled
    decision = q.poll(0.0)
    # then the high-priority pair leaves and the low-priority request waits
    assert names(decision.batch) == ["high1", "high2"]
    assert names(q.drain()) == ["low"]


def test_a_request_that_does_not_fit_stops_the_batch_and_it_leaves_at_once() -> None:
    # given max 4, a 2-row request then a 3-row request, long window
    q = queue(max_batch_size=4, max_queue_delay=10.0)
    q.put(item("two", 2))
    q.put(item("three", 3))
    # when polled long before the window ends
    decision = q.poll(0.0)
    # then the 2-row request leaves alone at once (more is waiting, no point holding it)
    assert names(decision.batch) == ["two"]
    assert (len(q), q.rows) == (1, 3)
    # and the 3-row request then waits for its window
    decision = q.poll(0.0)
    assert decision.batch == [] and decision.wake_at == 10.0


def test_a_non_fitting_request_is_not_skipped_for_a_smaller_later_one() -> None:
    # given max 4: 3 rows, then 2 rows (does not fit), then 1 row (would fit)
    q = queue(max_batch_size=4, max_queue_delay=10.0)
    q.put(item("three", 3))
    q.put(item("two", 2))
    q.put(item("one", 1))
    # when polled
    decision = q.poll(0.0)
    # then the batch stops at the first request that does not fit: order is kept
    assert names(decision.batch) == ["three"]
    assert names(q.drain()) == ["two", "one"]


# --- drain ----------------------------------------------------------------------------------------


def test_drain_returns_everything_in_order_and_resets_the_queue() -> None:
    # given requests at two levels, one with a near deadline
    q = queue(max_batch_size=8, max_queue_delay=10.0)
    q.put(item("b", 2, deadline=1.0))
    q.put(item("a", 1, priority=0))
    q.put(item("c", 3))
    # when drained
    drained = q.drain()
    # then every request comes back in priority then arrival order and the queue is empty
    assert names(drained) == ["a", "b", "c"]
    assert (len(q), q.rows) == (0, 0)
    assert q.poll(0.5) == Decision()
    assert q.drain() == []
    # and the drained request's deadline no longer shapes the wake time
    q.put(item("d", arrival=0.0))
    assert q.poll(0.5).wake_at == 10.0


def test_bookkeeping_after_every_operation() -> None:
    # given a queue of max 4
    q = queue(max_batch_size=4, max_queue_delay=1.0)
    steps: list[tuple[int, int]] = []
    # when requests are put, expire, leave and are drained
    q.put(item("a", 2, deadline=0.5))
    steps.append((len(q), q.rows))
    q.put(item("b", 1))
    steps.append((len(q), q.rows))
    q.put(item("c", 3))
    steps.append((len(q), q.rows))
    d = q.poll(0.5)  # a expires; b (1) + c (3) = 4: full, leaves
    steps.append((len(q), q.rows))
    q.put(item("d", 2, arrival=0.5))
    q.put(item("e", 1, arrival=0.5))
    steps.append((len(q), q.rows))
    q.drain()
    steps.append((len(q), q.rows))
    # then len and rows track each step
    assert names(d.expired) == ["a"] and names(d.batch) == ["b", "c"]
    assert steps == [(1, 2), (2, 3), (3, 6), (0, 0), (2, 3), (0, 0)]


# --- LatencyProfile --------------------------------------------------------------------------------


def test_empty_profile_predicts_zero() -> None:
    assert LatencyProfile().estimate(8) == 0.0


def test_profile_returns_measured_points_and_interpolates_between_them() -> None:
    # given measurements at 1, 4 and 8 rows
    profile = LatencyProfile({1: 1.0, 4: 2.5, 8: 4.5})
    # then measured sizes come back exactly
    assert profile.estimate(1) == 1.0
    assert profile.estimate(4) == 2.5
    assert profile.estimate(8) == 4.5
    # and sizes in between are linear between their neighbours
    assert profile.estimate(2) == pytest.approx(1.5)
    assert profile.estimate(3) == pytest.approx(2.0)
    assert profile.estimate(6) == pytest.approx(3.5)


def test_profile_below_the_smallest_size_uses_the_smallest() -> None:
    profile = LatencyProfile({2: 0.75, 4: 1.0})
    assert profile.estimate(1) == 0.75


def test_profile_extrapolates_linearly_past_the_largest_size() -> None:
    # given a largest measured size of 8 rows at 4.0 s
    profile = LatencyProfile({1: 1.0, 8: 4.0})
    # then 16 rows are predicted at twice that, 12 at 1.5 times
    assert profile.estimate(16) == pytest.approx(8.0)
    assert profile.estimate(12) == pytest.approx(6.0)


def test_observe_smooths_a_known_size_and_adds_a_new_one() -> None:
    # given a measurement at 4 rows and smoothing 0.25
    profile = LatencyProfile({1: 1.0, 4: 2.0}, smoothing=0.25)
    # when a 4-row batch is observed taking 4.0 s
    profile.observe(4, 4.0)
    # then the estimate moves a quarter of the way: 2.0 + 0.25 * (4.0 - 2.0)
    assert profile.estimate(4) == pytest.approx(2.5)
    # when a new size is observed, it is taken as measured and used for interpolation
    profile.observe(2, 1.25)
    assert profile.estimate(2) == pytest.approx(1.25)
    assert profile.estimate(3) == pytest.approx((1.25 + 2.5) / 2)
    assert profile.as_dict() == pytest.approx({1: 1.0, 2: 1.25, 4: 2.5})
    # and a new largest size becomes the extrapolation base
    profile.observe(16, 8.0)
    assert profile.estimate(32) == pytest.approx(16.0)


def test_observe_with_default_smoothing_is_an_exponential_average() -> None:
    profile = LatencyProfile({8: 1.0})
    for _ in range(3):
        profile.observe(8, 2.0)
    # 1.0 → 1.2 → 1.36 → 1.488
    assert profile.estimate(8) == pytest.approx(1.488)


def test_profile_as_dict_is_a_copy() -> None:
    measured = {1: 1.0}
    profile = LatencyProfile(measured)
    profile.as_dict()[1] = 99.0
    profile.observe(2, 2.0)
    assert profile.estimate(1) == 1.0
    assert measured == {1: 1.0}  # the caller's dict is not modified either


def test_queue_uses_a_latency_profile_as_its_compute_estimate() -> None:
    # given a profile predicting 1.0 s for 1 row and 2.0 s for 4 rows
    profile = LatencyProfile({1: 1.0, 4: 2.0})
    q = queue(max_batch_size=8, max_queue_delay=100.0, estimate=profile.estimate)
    q.put(item("a", deadline=10.0))
    # then one row must leave at 10 - 1
    assert q.poll(0.0).wake_at == pytest.approx(9.0)
    # and with 4 rows waiting, at 10 - 2
    q.put(item("b", 3, deadline=20.0))
    assert q.poll(0.0).wake_at == pytest.approx(8.0)


# --- property test: random arrivals and deadlines --------------------------------------------------


def _reference_candidates(waiting: list[Pending], limit: int) -> tuple[list[Pending], int, bool]:
    """Priority then FIFO, stopping at the first request that would not fit."""
    batch, rows = [], 0
    for p in waiting:
        if rows + p.rows > limit:
            return batch, rows, True
        batch.append(p)
        rows += p.rows
    return batch, rows, False


@pytest.mark.parametrize(
    ("seed", "max_batch_size", "delay", "max_queue_size", "preferred", "per_row"),
    [
        (0, 8, 0.004, 20, (), 0.0),
        (1, 8, 0.004, 12, (2, 4), 0.0005),
        (2, 16, 0.010, 40, (8,), 0.0002),
        (3, 4, 0.0, 6, (), 0.001),
        (4, 32, 0.002, 64, (4, 8, 16, 32), 0.0001),
    ],
)
def test_random_arrivals_keep_the_invariants(
    seed: int,
    max_batch_size: int,
    delay: float,
    max_queue_size: int,
    preferred: tuple[int, ...],
    per_row: float,
) -> None:
    # given a queue with a compute estimate and a random stream of arrivals, deadlines, priorities
    rng = np.random.default_rng(seed)
    config = BatchingConfig(max_batch_size, delay, max_queue_size, preferred)

    def estimate(rows: int) -> float:
        return per_row * rows

    q = BatchQueue(config, estimate)
    now = 0.0
    seq = 0
    accepted: dict[int, Pending] = {}
    batched: list[int] = []
    expired: list[int] = []
    evicted: list[int] = []
    done: set[int] = set()  # batched, expired or evicted: kept as it grows (rebuilding it per arrival is quadratic)
    refused_full = 0
    batches = 0

    for _ in range(400):
        # when some requests arrive (now and then a burst larger than the queue)...
        arrivals = int(rng.integers(0, 4)) if rng.random() > 0.05 else max_queue_size + 3
        for _ in range(arrivals):
            rows = int(rng.integers(1, max_batch_size + 1))
            deadline = INF if rng.random() < 0.2 else now + float(rng.uniform(0.0005, 0.03))
            p = Pending(seq, rows, now, deadline, int(rng.integers(0, 4)))
            limit = max(1, int(max_queue_size * tier_share(p.priority)))
            waiting = [a for i, a in accepted.items() if i not in done]
            lower = sorted((a for a in waiting if a.priority > p.priority), key=lambda a: (-a.priority, -a.payload))
            room_needed = len(q) - limit + 1
            try:
                out = q.put(p)
            except QueueFull:
                # then QueueFull is raised exactly when its tier's share is full and too little of a
                # lower tier waits to make room
                assert room_needed > 0 and len(lower) < room_needed
                refused_full += 1
            else:
                # and otherwise the newest of the lowest tiers make exactly the room needed
                assert [a.payload for a in out] == [a.payload for a in lower[: max(0, room_needed)]]
                evicted.extend(a.payload for a in out)
                done.update(a.payload for a in out)
                accepted[seq] = p
            seq += 1

        # ...and the policy is asked what leaves now
        waiting_before = sorted(
            (p for i, p in accepted.items() if i not in done), key=lambda p: (p.priority, p.payload)
        )
        decision = q.poll(now)

        # then expired requests are exactly those past their deadline, and none is batched
        assert sorted(p.payload for p in decision.expired) == sorted(
            p.payload for p in waiting_before if p.deadline <= now
        )
        live = [p for p in waiting_before if p.deadline > now]
        assert all(p.deadline > now for p in decision.batch)

        # and a batch leaves exactly when it is full, blocked, preferred-full or due
        candidates, rows, more_waiting = _reference_candidates(live, max_batch_size)
        if live:
            due_at = min(
                min(p.arrival for p in candidates) + delay, min(p.deadline for p in candidates) - estimate(rows)
            )
            should_leave = (
                rows >= max_batch_size or more_waiting or (bool(preferred) and rows >= preferred[-1]) or now >= due_at
            )
            assert bool(decision.batch) == should_leave
            if not decision.batch:
                # then the policy asks to be woken strictly later, and no later than it is due
                assert decision.wake_at is not None
                assert now < decision.wake_at <= due_at
                assert decision.wake_at <= min(p.deadline for p in live)
        else:
            assert decision.batch == [] and decision.wake_at is None

        # and the batch is the priority/FIFO prefix cut to the largest preferred size it fills
        batch_ids = [p.payload for p in decision.batch]
        if decision.batch:
            batches += 1
            fillable = [s for s in preferred if s <= rows]
            target = fillable[-1] if fillable else rows
            expected, total = [], 0
            for p in candidates:
                if expected and total + p.rows > target:
                    break
                expected.append(p.payload)
                total += p.rows
            assert batch_ids == expected
        assert sum(p.rows for p in decision.batch) <= max_batch_size

        batched.extend(batch_ids)
        expired.extend(p.payload for p in decision.expired)
        done.update(batch_ids)
        done.update(p.payload for p in decision.expired)

        # and the bookkeeping matches what is left
        left_out = set(batch_ids)
        left = [p for p in live if p.payload not in left_out]
        assert len(q) == len(left)
        assert q.rows == sum(p.rows for p in left)
        assert len(q) <= max_queue_size

        # time moves on: sometimes straight to the wake time the policy asked for
        if decision.wake_at is not None and rng.random() < 0.4:
            now = decision.wake_at
        else:
            now += float(rng.exponential(0.002))

    # finally every accepted request is accounted for exactly once
    remaining = [p.payload for p in q.drain()]
    outcomes = batched + expired + evicted + remaining
    assert sorted(outcomes) == sorted(accepted)
    assert len(outcomes) == len(set(outcomes))
    # and the run exercised batching, expiry, eviction and overflow
    assert batches > 0 and expired and evicted and refused_full > 0
