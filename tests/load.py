"""How busy the machine running the tests is, for waits whose deadlines catch a hang, not a slow machine.

The project's rule: no test may assume an idle CPU (2 cores shared by several engineers' tests and benches, a
load average of 20+ at times). A wait's deadline as written is for a machine with a core to spare; on a loaded
one it stretches with `slowness()`, bounded, so a hang still fails. What a test checks is never stretched."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

MAX_SLOWNESS = 10.0  # a wait's deadline stretches this much at most: a hang still fails, within the hour


def slowness() -> float:
    """How many times slower than an idle machine this one runs now: its 1-minute load average per core, at
    least 1 (the deadlines as written are for a machine with a core to spare), at most MAX_SLOWNESS."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_SLOWNESS, max(1.0, load / (os.cpu_count() or 1)))


def stretched(seconds: float) -> float:
    """`seconds` as written for an idle machine, stretched for this one's load now."""
    return seconds * slowness()


async def eventually(what: str, check: Callable[[], bool], timeout: float, poll: float = 0.01) -> None:
    """Await until `check()` holds, failing with `what` once `stretched(timeout)` seconds have passed."""
    limit = stretched(timeout)
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"{what} (not within {limit:.0f} s, load x{limit / timeout:.1f})"
        await asyncio.sleep(poll)
