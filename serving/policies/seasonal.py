"""A version's arrival rate by time of day (or of any period), learnt from past periods, for the
autoscaler's forecast.

Plain Python, no Django, time passed in. The period (a day: 86,400 s) is cut into `buckets`; each
bucket keeps the rate seen in it, smoothed across periods (the newest period weighs `gamma`), so a
one-off day fades by `1 - gamma` a period. A bucket is folded in when the next one begins, and only if
it was observed for at least half its width (a version registered mid-bucket, a gap in the ticks).
Read between bucket centres by linear interpolation, cyclically.

`ratio(here, there)` is how much busier the profile says time `there` is than time `here`:
multiplicative seasonality, so a day busier than the profile's days scales with it. None until both
sides have `min_periods` periods behind them, or where the profile says nothing arrives `here`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SeasonalProfile:
    period: float
    buckets: int
    gamma: float = 0.5
    min_periods: int = 1
    rates: list[float] = field(default_factory=list)  # per bucket: requests a second, smoothed over periods
    seen: list[int] = field(default_factory=list)  # per bucket: periods folded in
    current: int | None = None  # the bucket being observed, counted from time 0 (not modulo the period)
    count: int = 0  # its arrivals so far
    seconds: float = 0.0  # and the seconds of it observed
    # Buckets folded in since this object was made, so a reader can tell its answers may have changed (a cache
    # key, not the profile: a restored copy starts at 0 and equals the original).
    folds: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.period <= 0 or self.buckets < 2:
            raise ValueError("a season needs a positive period and at least two buckets")
        if not 0.0 < self.gamma <= 1.0 or self.min_periods < 1:
            raise ValueError("need 0 < gamma <= 1 and min_periods >= 1")
        if not self.rates:
            self.rates = [0.0] * self.buckets
            self.seen = [0] * self.buckets
        if len(self.rates) != self.buckets or len(self.seen) != self.buckets:
            raise ValueError("rates and seen must hold one entry per bucket")

    @property
    def width(self) -> float:
        return self.period / self.buckets

    def add(self, start: float, end: float, arrivals: int) -> None:
        """An interval's arrivals, counted in the bucket of its middle (intervals are ticks, far shorter
        than a bucket). One longer than a bucket (the ticks paused) would smear its arrivals over the buckets
        it spans: it is left out, and the bucket it ended in is not folded in."""
        if end - start > self.width:
            self._fold()
            self.current, self.count, self.seconds = None, 0, 0.0
            return
        bucket = math.floor((start + end) / 2 / self.width)
        if bucket != self.current:
            self._fold()
            self.current, self.count, self.seconds = bucket, 0, 0.0
        self.count += arrivals
        self.seconds += end - start

    def _fold(self) -> None:
        if self.current is None or self.seconds < self.width / 2:
            return
        i = self.current % self.buckets
        rate = self.count / self.seconds
        self.rates[i] = rate if not self.seen[i] else self.rates[i] + self.gamma * (rate - self.rates[i])
        self.seen[i] += 1
        self.folds += 1

    def at(self, t: float) -> float | None:
        """The profile's rate at time `t`, None where a bucket it needs has too few periods behind it."""
        x = (t % self.period) / self.width - 0.5
        lo = math.floor(x)
        a, b = lo % self.buckets, (lo + 1) % self.buckets
        if self.seen[a] < self.min_periods or self.seen[b] < self.min_periods:
            return None
        return self.rates[a] + (x - lo) * (self.rates[b] - self.rates[a])

    def ratio(self, here: float, there: float) -> float | None:
        now, ahead = self.at(here), self.at(there)
        if now is None or ahead is None or now <= 0:
            return None
        return ahead / now

    def peak_ratio(self, here: float, start: float, end: float) -> float | None:
        """The largest `ratio(here, t)` for t from `start` to `end`, read at both ends and every bucket between:
        the busiest the profile expects that span to be, against `here`."""
        best: float | None = None
        t = start
        while True:
            r = self.ratio(here, min(t, end))
            if r is not None and (best is None or r > best):
                best = r
            if t >= end:
                return best
            t += self.width

    def export(self) -> dict[str, Any]:
        return {
            "period": self.period,
            "buckets": self.buckets,
            "rates": list(self.rates),
            "seen": list(self.seen),
            "current": self.current,
            "count": self.count,
            "seconds": self.seconds,
        }

    def fresh(self) -> SeasonalProfile:
        """An empty profile with these settings."""
        return SeasonalProfile(self.period, self.buckets, self.gamma, self.min_periods)

    def restored(self, state: Mapping[str, Any]) -> SeasonalProfile:
        """The profile `export` gave, with these settings; an empty one where it was cut to another period or
        bucket count."""
        if float(state["period"]) != self.period or int(state["buckets"]) != self.buckets:
            return self.fresh()
        return SeasonalProfile(
            self.period,
            self.buckets,
            self.gamma,
            self.min_periods,
            [float(r) for r in state["rates"]],
            [int(s) for s in state["seen"]],
            None if state["current"] is None else int(state["current"]),
            int(state["count"]),
            float(state["seconds"]),
        )
