"""How busy a node's device has been lately, and how much work it did: shares of the last WINDOW_SECONDS.

The node hands each device call's time to `BusyMeter.add` as it finishes (the device thread measured it), a
call that failed included: the device was occupied all the same. The heartbeat reads `fraction` once a second.
Time is kept in one-second buckets, so memory stays fixed however many batches run, and a batch that spans a
bucket boundary is split across both.

Busy time says little of a batching device: batch-one requests back to back read 100% busy on a model whose
batch of 32 takes twice as long as one. `WorkMeter` counts the work instead, with the simulator's function
(`serving.policies.utilisation`): each answered batch's rows (a whole batch's, or a bisected half's) are worth
their version's best-batch seconds, and work utilisation is those seconds over the window's. The reference is
the version's profile of the device's own seconds (`Hosted.compute`), never the admission profile, which adds
the event loop's hand-back: priced by that, a row would be worth more than the device spent on it, and work
could read above busy time. So work is never capped: a share above the busy share is a reference that
under-prices the device now (a warm-up measured faster than it runs), and shows rather than reads 100%.
It also counts rows and work seconds per version (for /metrics) and keeps a short history of both shares,
one sample per SAMPLE_SECONDS, for the fleet page.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from serving.policies.utilisation import Estimate, best_row_seconds

WINDOW_SECONDS = 10
SAMPLE_SECONDS = 10  # one history sample per window: the shares of consecutive windows
HISTORY_SAMPLES = 60  # ten minutes of them


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
        self._spread(began, seconds, 1.0)

    def _spread(self, began: float, seconds: float, rate: float) -> None:
        """Count `rate` seconds per second over [began, began + seconds], bucket by bucket."""
        end = began + max(0.0, seconds)
        at = began
        while at < end:
            second = math.floor(at)
            upto = min(end, second + 1.0)
            slot = second % len(self._busy)
            if self._second[slot] != second:
                self._second[slot], self._busy[slot] = second, 0.0
            self._busy[slot] += (upto - at) * rate
            at = upto

    def fraction(self, now: float | None = None) -> float:
        """Busy seconds over the last `window` seconds, divided by them (by the meter's age while younger); at
        most 1, which one device thread can exceed only by the buckets' rounding."""
        return max(0.0, min(1.0, self._share(now)))

    def _share(self, now: float | None) -> float:
        """The counted seconds of the last `window` seconds over them (the meter's age while younger), unclamped."""
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
        return total / span


class WorkMeter(BusyMeter):
    """Work utilisation of the last `window` seconds: the rows served, each at its version's best-batch seconds,
    over the seconds the device was powered (the window; the meter's age while younger). Not capped at 1."""

    def __init__(
        self, busy: BusyMeter | None = None, window: int = WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(window, clock)
        self._of = busy  # the busy meter sampled beside this one into the history
        self.rows: dict[str, int] = {}  # version key -> rows served
        self.work_seconds: dict[str, float] = {}  # version key -> those rows' best-batch seconds
        self._best: dict[str, tuple[int, float]] = {}  # version key -> (second computed, best row seconds)
        self._history: deque[tuple[float, float, float]] = deque(maxlen=HISTORY_SAMPLES)  # (at, busy, work)
        self._sampled = self._since

    def batch(self, key: str, rows: int, began: float, seconds: float, estimate: Estimate, max_batch_size: int) -> None:
        """An answered batch of `rows` of version `key` that began at `began` and computed for `seconds`, the
        version's profile being `estimate` (the device's own seconds per batch size) up to `max_batch_size`."""
        second = math.floor(began)
        cached = self._best.get(key)
        if cached is None or cached[0] != second:  # the node refines a profile as it serves: once a second
            cached = self._best[key] = (second, best_row_seconds(estimate, max_batch_size))
        work = rows * cached[1]
        self.rows[key] = self.rows.get(key, 0) + rows
        self.work_seconds[key] = self.work_seconds.get(key, 0.0) + work
        span = max(seconds, 1e-6)  # the work is spread over the batch's own time, as busy time is
        self._spread(began, span, work / span)

    def fraction(self, now: float | None = None) -> float:
        """The work seconds of the last `window` seconds over them, as counted: above 1, or above the busy share,
        the reference under-prices the device, and that shows (see the module's docstring)."""
        return max(0.0, self._share(now))

    def forget(self, keys: set[str] | frozenset[str]) -> None:
        """Drop the per-version counts of versions gone for good (deleted), so /metrics and memory keep none."""
        for key in keys:
            self.rows.pop(key, None)
            self.work_seconds.pop(key, None)
            self._best.pop(key, None)

    def history(self, now: float | None = None) -> list[tuple[float, float, float]]:
        """(seconds ago, busy share, work utilisation) per SAMPLE_SECONDS, oldest first; sampled when asked
        (the heartbeat asks every second), so a node that is never asked keeps nothing."""
        now = self._clock() if now is None else now
        if now - self._sampled >= SAMPLE_SECONDS:
            busy = self._of.fraction(now) if self._of is not None else 0.0
            self._history.append((now, round(busy, 4), round(self.fraction(now), 4)))
            self._sampled = now
        return [(round(now - at, 1), busy, work) for at, busy, work in self._history]
