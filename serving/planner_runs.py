"""The planner's simulation checks as a request runs them: bounded in number, time, and by the client.

A check runs in a thread of its own (the simulator is plain Python: it would hold the event loop) with a
`sim.budget.Budget`: FERRY_PLANNER_DEADLINE_S of wall time, and a cancel flag the request sets when it
is cancelled (Django cancels an async view whose client sent http.disconnect). The loop looks at both
every few hundred events, so an abandoned check ends within those events instead of running to its end.

At most FERRY_PLANNER_MAX_SIMULATIONS run at once in a process and one per user. A slot is given back
when the thread ends, not when the request does: a cancelled check holds its slot until its loop has
stopped, so checks cannot pile up behind clients that left.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any

from prometheus_client import Counter

from sim.budget import Budget, Stopped
from sim.planner import Check, WhatIf, simulate

# outcome: complete, deadline, cancelled, error
CHECKS = Counter("ferry_planner_simulations", "Planner simulation checks run, by how they ended", ["outcome"])


class Busy(Exception):
    """No slot for the check: 429 (the user's own check runs) or 503 (the process runs its maximum)."""

    def __init__(self, status: int, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = max(1, math.ceil(retry_after))


class Slots:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: set[int] = set()

    def take(self, user_id: int, limit: int, retry_after: float) -> None:
        with self._lock:
            if user_id in self._users:
                raise Busy(429, "a simulation check of yours is still running; wait for it", retry_after)
            if len(self._users) >= limit:
                raise Busy(503, f"this server runs {limit} simulation checks at once; retry shortly", retry_after)
            self._users.add(user_id)

    def give(self, user_id: int) -> None:
        with self._lock:
            self._users.discard(user_id)

    def running(self) -> int:
        with self._lock:
            return len(self._users)


SLOTS = Slots()


async def check(what: WhatIf, *, user_id: int, deadline_s: float, limit: int, plot: bool = True) -> Check:
    """The simulation check (`sim.planner.simulate`: its runs, their points, the plot when `plot`); Busy without a
    slot, `Stopped` past the deadline (or cancelled) during its first run, and OutOfRange for a what-if too large
    to simulate. Cancelling the awaiting task stops the run."""
    SLOTS.take(user_id, limit, deadline_s)
    cancelled = threading.Event()
    budget = Budget(deadline_s, cancelled=cancelled)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Check] = loop.create_future()
    try:
        threading.Thread(
            target=_run, args=(what, budget, user_id, loop, done, plot), name="planner-check", daemon=True
        ).start()
    except BaseException:
        SLOTS.give(user_id)
        raise
    try:
        return await done
    except asyncio.CancelledError:  # the client left: its check stops at its loop's next look
        cancelled.set()
        raise


def _run(
    what: WhatIf, budget: Budget, user_id: int, loop: asyncio.AbstractEventLoop, done: asyncio.Future, plot: bool
) -> None:
    outcome = "error"
    try:
        result: Any = simulate(what, budget, plot=plot)
        outcome = "complete" if result.stopped is None else result.stopped
    except Stopped as exc:
        result, outcome = exc, exc.reason
    except Exception as exc:  # noqa: BLE001 - handed to the request, which answers or logs it
        result = exc
    finally:
        SLOTS.give(user_id)
        CHECKS.labels(outcome).inc()
    try:
        loop.call_soon_threadsafe(_settle, done, result)
    except RuntimeError:  # the loop closed meanwhile: nobody waits for the answer
        pass


def _settle(done: asyncio.Future, result: Any) -> None:
    if done.done():  # cancelled: the request is gone
        return
    if isinstance(result, BaseException):
        done.set_exception(result)
    else:
        done.set_result(result)
