"""The model page's last hour per version: the bounded minute store the data plane feeds, and its charts."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from serving.dataplane.metrics.history import BATCH_BINS, HourHistory, Minute, batch_bin
from serving.dataplane.metrics.metrics import LiveWindow, SaturationWindow
from serving.version_charts import _bin_label, _slots, answers_svg, latency_svg
from usage import sketch


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_minutes_keep_latency_kinds_and_batches_apart() -> None:
    # given a history at the start of a minute
    clock = Clock(600 * 60.0)
    hour = HourHistory(minutes=60, clock=clock)
    # when a minute sees two answers, an error, a fallback, a shed and two batches, and the next one answer
    hour.answered(0.004, True)
    hour.answered(0.030, True)
    hour.answered(0.5, False)
    for kind in ("served", "served", "fallback", "shed"):
        hour.mark(kind)
    hour.batch(1)
    hour.batch(12)
    clock.t += 60
    hour.answered(0.010, True)
    # then each minute holds its own counts, oldest first, the error's time among the latencies
    first, second = hour.last_hour()
    assert (first.start, second.start) == (600, 601)
    assert sum(first.latency.values()) == 3 and first.errors == 1
    assert sketch.quantile(first.latency, 1.0) == pytest.approx(0.5, rel=0.05)
    assert first.kinds == {"served": 2, "fallback": 1, "shed": 1}
    assert first.batches == {1: 1, 16: 1}
    assert sum(second.latency.values()) == 1 and second.kinds == {} and second.batches == {}


def test_the_window_forgets_minutes_older_than_an_hour_and_stays_bounded() -> None:
    clock = Clock(1000 * 60.0)
    hour = HourHistory(minutes=60, clock=clock)
    # when 200 minutes each see one answer
    for _ in range(200):
        hour.answered(0.01, True)
        clock.t += 60
    clock.t -= 60
    # then only the last 60 are reported, and no more than two buckets a minute are kept
    minutes = hour.last_hour()
    assert [m.start for m in minutes] == list(range(1140, 1200))
    assert len(hour._buckets) <= 120


def test_two_buckets_of_one_minute_merge() -> None:
    # given two buckets for the same minute (a thread started one while another did): they read as one
    clock = Clock(50 * 60.0)
    hour = HourHistory(clock=clock)
    hour.batch(3)
    hour._buckets.append(Minute(50, batches={4: 2}))
    (minute,) = hour.last_hour()
    assert minute.batches == {4: 3}


def test_batch_bins_and_their_labels() -> None:
    assert [batch_bin(n) for n in (1, 2, 3, 4, 5, 256, 257, 10_000)] == [1, 2, 4, 4, 8, 256, 256, 256]
    assert [_bin_label(i) for i in range(len(BATCH_BINS))] == [
        "1",
        "2",
        "3-4",
        "5-8",
        "9-16",
        "17-32",
        "33-64",
        "65-128",
        "129+",
    ]
    with pytest.raises(ValueError):
        HourHistory(minutes=0)


def test_the_live_windows_feed_the_hour() -> None:
    # given the console's live windows sharing one hour (as metrics.VersionMetrics wires them)
    hour = HourHistory()
    live, saturation = LiveWindow(hour=hour), SaturationWindow(hour=hour)
    # when they see an answer, a batch and a fallback
    live.request(0.02, True)
    live.batch(5)
    saturation.mark("fallback")
    # then the hour has them too
    (minute,) = hour.last_hour()
    assert sum(minute.latency.values()) == 1 and minute.batches == {8: 1} and minute.kinds == {"fallback": 1}


def test_charts_draw_a_point_per_minute_with_answers_and_stack_the_kinds() -> None:
    now = datetime.fromtimestamp(700 * 60, UTC)
    busy = Minute(699, latency={sketch.bucket_of(0.004): 9, sketch.bucket_of(0.05): 1}, kinds={"served": 8, "shed": 2})
    slots = _slots([busy], now, 60)
    assert len(slots) == 60 and slots[-2][1] is busy and slots[-1][1] is None
    latency = latency_svg(slots)
    assert latency.count('class="point p50"') == 1 and latency.count('class="point p99"') == 1
    answers = answers_svg(slots)
    assert answers.count('class="minute"') == 1
    assert 'class="served"' in answers and 'class="shed"' in answers and 'class="fallback"' not in answers
