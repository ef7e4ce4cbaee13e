"""Shedding at the front door: what share of inference to refuse before any work is spent on it.

Plain Python, clock passed in: the data plane's lag ticker measures how late its event loop runs
(`smoothed_lag`, from when a timer was due and when it ran) and how much of the time the loop's thread
was busy, and steers the `ShedGate` with them once a tick; the front door's protocol asks the gate, once
per inference request, whether to refuse it (`shedding`). A refusal there costs a small fraction of a
served request, which is what lets shedding bring an overloaded event loop back. The gate is a
proportional controller in the manner of PIE: refusing all inference while the loop is late and none once
it has caught up would swing between overload and idling, so the share rises in proportion to how late
the loop runs and falls slowly.

The lag is not the only sign. A loop can keep its timers on time and still spend most of its work on
requests that are refused after all: admission's 503 (the device cannot answer them within their
deadline) comes after the body was parsed, the key checked and the request routed, most of what an answer
costs. While the loop's thread is busy (BUSY: a third of the time) and more than REFUSED_TARGET of the
requests that passed the gate were refused so, the gate takes more of them itself, for a fraction of the
cost. Only a busy loop: a compute-bound model refuses much of its overload at admission while the loop
idles, and there refusing at the door would save nothing (and would refuse requests its fallback would
have answered). Of the requests past the gate, not of all begun: counted against all begun (tried in
d32fe60), the gate rose less, let more be refused dearly, and one process held at 3x answered a quarter
less in time.

And a request's wait before it is read (in the kernel, dated by its stamp) is bounded at the door, as
CoDel bounds a packet's: by the front end's bound (FERRY_MAX_FRONTEND_WAIT_MS) while the waits are a burst
draining, and by a short target (FERRY_FRONTEND_SOJOURN_TARGET_MS) while a queue stands. In a queue that
stands, every request read has waited about as long as the bound; at 150 ms it has half its budget left
and admission refuses much of it after all, at most of an answer's cost, where at the short target the
door refuses the excess cheaply and what it lets through has the budget to be answered.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

# How much of a new lag sample moves the smoothed lag: one late tick (a collection, a burst of start-up work)
# does not shut the gate, while a backlog that lasts raises it within two or three ticks.
LAG_WEIGHT = 0.3


def smoothed_lag(previous: float, due: float, ran: float) -> float:
    """The loop's smoothed lag (seconds) after a timer due at `due` ran at `ran` (the same clock)."""
    return (1.0 - LAG_WEIGHT) * previous + LAG_WEIGHT * max(0.0, ran - due)


class ShedGate:
    """The share of inference requests the front door refuses (`drop`), steered by the loop's lag and by
    the requests refused past it; and the bound on a request's wait before it is read (`wait_bound`).

    The protocol counts the requests it begins in `seen`, and the least wait of those it reads in
    `least_wait`; handlers count what they answer in `passed` and their refusals for want of capacity in
    `refused`. `tick` reads and resets the counts, so a late loop with too few requests to be their doing
    is not answered by refusing them. `draw` is the random source of the per-request decision
    (uniform on [0, 1)); a test passes its own.
    """

    # Requests per tick below which a late loop is not blamed on requests (a model loading, a collection):
    # refusing the few there are would not bring the loop back, only fail them.
    MIN_PRESSURE = 5
    MAX_DROP = 0.98  # never all: some requests keep measuring the way through

    # The share of requests past the gate that a busy loop may see refused after all before the gate takes
    # more of them; how fast the share refused at the gate follows the excess; and the busy share of the
    # loop's thread from which that counts.
    REFUSED_TARGET = 0.1
    REFUSED_GAIN = 0.1
    # 0.35, not a saturated loop's 0.9: beside a node host, each of two web processes ran 45-50% of the time
    # at 3x while the machine's two cores were full, and what their refusals cost was the device's.
    BUSY = 0.35
    # How much of the refused and passed counts a tick keeps: admission refuses in bursts (a batch's worth
    # at a time as a queue crosses its bound), which one tick's share would follow.
    REFUSED_MEMORY = 0.8
    STANDING_TICKS = 2  # ticks in a row whose requests all waited past the sojourn target: a queue stands

    def __init__(self, draw: Callable[[], float] = random.random) -> None:
        self.drop = 0.0
        self.seen = 0  # requests begun since the last tick (the protocol counts, `tick` reads and resets)
        self.passed = 0  # requests past the gate answered by a handler since the last tick (the protocol counts)
        self.refused = 0  # of those, the ones refused 503 for want of capacity (the handler counts)
        self._passed = 0.0  # the decayed sums `tick` keeps of the two
        self._refused = 0.0
        self.draw = draw
        self.reason = ""  # why it refuses, for the answer's message; changes only when `drop` does
        self._cause = ""  # what last raised `drop`
        # The least wait (seconds) of a request read since the last tick (the protocol keeps it), and the bound
        # on that wait the protocol applies now: `tick` lowers it to its sojourn target while a queue stands.
        self.least_wait = math.inf
        self.wait_bound = math.inf
        self.standing = 0  # ticks in a row whose every request waited past the sojourn target

    @property
    def shedding(self) -> bool:
        """Whether to refuse the request at hand (a draw, so ask once per request)."""
        return self.drop > 0.0 and self.draw() < self.drop

    def steer(
        self, lag: float, target: float, requests: int | None = None, *, refused: float = 0.0, busy: float = 0.0
    ) -> None:
        """One tick: raise the drop share while the loop runs later than `target` (seconds), in
        proportion to how much later, if `requests` (begun since the last tick) are enough to be the
        cause; or while its thread was `busy` (the share of the tick it ran) for BUSY or more and the
        share of requests past the gate `refused` for want of capacity exceeds REFUSED_TARGET, in
        proportion to the excess. Lower it slowly once the loop runs well within its target and neither
        holds."""
        if target <= 0:
            raise ValueError(f"the lag target must be positive, not {target!r}")
        wasted = busy >= self.BUSY and refused > self.REFUSED_TARGET
        if lag > target and (requests is None or requests >= self.MIN_PRESSURE):
            self.drop = min(self.MAX_DROP, self.drop + 0.05 + 0.1 * (lag / target - 1.0))
            self._cause = f"its event loop runs {lag * 1000:.0f} ms late"
        elif wasted:
            self.drop = min(self.MAX_DROP, self.drop + self.REFUSED_GAIN * (refused - self.REFUSED_TARGET))
            self._cause = f"{refused:.0%} of the inference it took was refused for want of capacity"
        elif lag < target / 2 and self.drop:
            self.drop = max(0.0, self.drop - 0.02)
        if self.drop:
            self.reason = f"{self._cause}; refusing {self.drop:.0%} of inference"

    def tick(
        self, lag: float, target: float, busy: float = 0.0, wait_bound: float = math.inf, sojourn: float = 0.0
    ) -> None:
        """The lag ticker's step: steer by `lag`, the loop's `busy` share since the last tick, the requests
        seen since then, and the share of those past the gate refused for want of capacity, recently; and
        set the bound on a request's wait before it is read: `wait_bound` (seconds; the front end's), or
        `sojourn` (CoDel's target; 0: none) while a queue stands before the read.

        CoDel's rule: when every request read in STANDING_TICKS ticks in a row (MIN_PRESSURE of them or
        more in each) waited past `sojourn`, the wait is not a burst draining but a queue that stands (in
        the kernel, for a loop that is behind), and each request that waited longer than `sojourn` is refused
        at the door; one request read within it ends that."""
        seen, self.seen = self.seen, 0
        memory = self.REFUSED_MEMORY
        self._passed = memory * self._passed + self.passed
        self._refused = memory * self._refused + self.refused
        self.passed = self.refused = 0
        refused = self._refused / self._passed if self._passed >= self.MIN_PRESSURE else 0.0
        self.steer(lag, target, seen, refused=refused, busy=busy)
        least, self.least_wait = self.least_wait, math.inf
        self.standing = self.standing + 1 if seen >= self.MIN_PRESSURE and 0 < sojourn < least else 0
        self.wait_bound = sojourn if self.standing >= self.STANDING_TICKS and sojourn < wait_bound else wait_bound

    def reset(self) -> None:
        self.drop = 0.0
        self.seen = self.passed = self.refused = self.standing = 0
        self._passed = self._refused = 0.0
        self.least_wait = self.wait_bound = math.inf
