"""How busy a node's device has been lately: the share of the last WINDOW_SECONDS it spent computing.

The node hands each batch's device time to `BusyMeter.add` as it finishes (the device thread measured it);
the heartbeat reads `fraction` once a second. Time is kept in one-second buckets, so memory stays fixed
however many batches run, and a batch that spans a bucket boundary is split across both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

WINDOW_SECONDS = 10


class BusyMeter:
    def __init__(self, window: int = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError("the window is at least one second")
        self.window = window
        self._clock = clock
        self._busy = [0.0] * (window + 1)  # seconds busy per whole second of the clock, a ring
        self._second = [-1] * (window + 1)  # which second each slot holds
        self._since = clock()  # a meter younger than its window divides by its age

    def add(self, began: float, seconds: float) -> None:
        """A batch that began at `began` (this meter's clock) and computed for `seconds`."""
        end = began + max(0.0, seconds)
        at = began
        while at < end:
            second = math.floor(at)
            upto = min(end, second + 1.0)
            slot = second % len(self._busy)
            if self._second[slot] != second:
                self._second[slot], self._busy[slot] = second, 0.0
            self._busy[slot] += upto - at
            at = upto

    def fraction(self, now: float | None = None) -> float:
        """Busy seconds over the last `window` seconds, divided by them (by the meter's age while younger)."""
        now = self._clock() if now is None else now
        start = now - self.window
        total = 0.0
        for slot, second in enumerate(self._second):
            if second < 0 or second + 1.0 <= start or second > now:
                continue
            # A bucket that straddles the window's start counts in proportion (work within it is spread evenly).
            share = min(1.0, (second + 1.0 - start)) if second < start else 1.0
            total += self._busy[slot] * share
        span = min(float(self.window), max(now - self._since, 1e-9))
        return max(0.0, min(1.0, total / span))
