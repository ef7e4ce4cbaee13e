"""When a simulation must stop before its end: a wall-clock deadline and a cancel flag.

The event loop (`sim.engine.Simulation.run`) asks `exhausted()` every `every` events, so a check costs
one clock read per few hundred events, and a run stops within that many events of its deadline or of
being cancelled. The clock is injected (the console passes time.monotonic; a test may pass its own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DEADLINE, CANCELLED = "deadline", "cancelled"


class Stopped(Exception):
    """The run stopped before its end: why (DEADLINE or CANCELLED), how far the virtual clock got, and
    after how many events. Nothing of the run's totals is reported: they would describe a part of it."""

    def __init__(self, reason: str, simulated_s: float, duration_s: float, events: int) -> None:
        super().__init__(f"simulation stopped ({reason}) at {simulated_s:.3f} of {duration_s:.3f} simulated s")
        self.reason = reason
        self.simulated_s = simulated_s
        self.duration_s = duration_s
        self.events = events


class Budget:
    def __init__(
        self,
        seconds: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        cancelled: threading.Event | None = None,
        every: int = 256,
    ) -> None:
        self.clock = clock
        self.until = clock() + seconds
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.every = max(1, every)

    def exhausted(self) -> str | None:
        """CANCELLED, DEADLINE, or None while the run may go on."""
        if self.cancelled.is_set():
            return CANCELLED
        if self.clock() >= self.until:
            return DEADLINE
        return None
