"""Shedding at the front door: what share of inference to refuse before any work is spent on it.

Plain Python, clock passed in: the data plane's lag ticker measures how late its event loop runs
(`smoothed_lag`, from when a timer was due and when it ran) and steers the `ShedGate` with it once a
tick; the front door's protocol asks the gate, once per inference request, whether to refuse it
(`shedding`). A refusal there costs a small fraction of a served request, which is what lets shedding
bring an overloaded event loop back. The gate is a proportional controller in the manner of PIE:
refusing all inference while the loop is late and none once it has caught up would swing between
overload and idling, so the share rises in proportion to how late the loop runs and falls slowly.
"""

from __future__ import annotations

import random
from collections.abc import Callable

# How much of a new lag sample moves the smoothed lag: one late tick (a collection, a burst of start-up work)
# does not shut the gate, while a backlog that lasts raises it within two or three ticks.
LAG_WEIGHT = 0.3


def smoothed_lag(previous: float, due: float, ran: float) -> float:
    """The loop's smoothed lag (seconds) after a timer due at `due` ran at `ran` (the same clock)."""
    return (1.0 - LAG_WEIGHT) * previous + LAG_WEIGHT * max(0.0, ran - due)


class ShedGate:
    """The share of inference requests the front door refuses (`drop`), steered by the loop's lag.

    The protocol counts the requests it begins in `seen`; `tick` reads and resets that count, so a
    late loop with too few requests to be their doing is not answered by refusing them. `draw` is
    the random source of the per-request decision (uniform on [0, 1)); a test passes its own.
    """

    # Requests per tick below which a late loop is not blamed on requests (a model loading, a collection):
    # refusing the few there are would not bring the loop back, only fail them.
    MIN_PRESSURE = 5
    MAX_DROP = 0.98  # never all: some requests keep measuring the way through

    def __init__(self, draw: Callable[[], float] = random.random) -> None:
        self.drop = 0.0
        self.seen = 0  # requests begun since the last tick (the protocol counts, `tick` reads and resets)
        self.draw = draw
        self.reason = ""  # why it refuses, for the answer's message; changes only when `drop` does

    @property
    def shedding(self) -> bool:
        """Whether to refuse the request at hand (a draw, so ask once per request)."""
        return self.drop > 0.0 and self.draw() < self.drop

    def steer(self, lag: float, target: float, requests: int | None = None) -> None:
        """One tick: raise the drop share while the loop runs later than `target` (seconds), in
        proportion to how much later, if `requests` (begun since the last tick) are enough to be the
        cause; lower it slowly once it runs well within it."""
        if target <= 0:
            raise ValueError(f"the lag target must be positive, not {target!r}")
        if lag > target and (requests is None or requests >= self.MIN_PRESSURE):
            self.drop = min(self.MAX_DROP, self.drop + 0.05 + 0.1 * (lag / target - 1.0))
        elif lag < target / 2 and self.drop:
            self.drop = max(0.0, self.drop - 0.02)
        if self.drop:
            self.reason = f"its event loop runs {lag * 1000:.0f} ms late; refusing {self.drop:.0%} of inference"

    def tick(self, lag: float, target: float) -> None:
        """The lag ticker's step: steer by `lag` with the requests seen since the last tick."""
        seen, self.seen = self.seen, 0
        self.steer(lag, target, seen)

    def reset(self) -> None:
        self.drop = 0.0
        self.seen = 0
