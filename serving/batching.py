"""Dynamic batching policy: plain Python, no Django, no asyncio, time passed in.

A ferry leaves when it is full or when its timetable says so. `BatchQueue.poll(now)` decides, for
one model version, which waiting requests leave now, which have missed their deadline, and when
to ask again. The node's async driver (`serving.batcher`) and the fleet simulator both call it.

Rules, with Triton's parameter names:
- a batch leaves at once when it holds `max_batch_size` rows (or the largest of the
  `preferred_batch_sizes` can be formed);
- otherwise it leaves when `max_queue_delay` has passed since its oldest request arrived, or when
  the earliest deadline in it, less the predicted compute time for its size, is reached;
- requests whose deadline has passed are handed back as expired and never run;
- at most `max_queue_size` requests wait; one more is refused with `QueueFull`.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The version's queue holds `max_queue_size` requests already."""


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_size: int
    max_queue_delay: float  # seconds
    max_queue_size: int
    preferred_batch_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_queue_delay < 0:
            raise ValueError("max_queue_delay must not be negative")
        if self.max_queue_size < 1:
            raise ValueError("max_queue_size must be at least 1")
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ValueError(f"preferred batch size {size} is outside 1..max_batch_size")
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(self.preferred_batch_sizes))))


@dataclass(slots=True)
class Pending:
    """One waiting request: `rows` along the batch dimension, times on the policy's clock."""

    payload: Any
    rows: int
    arrival: float
    deadline: float
    priority: int = 1  # lower runs first


@dataclass(slots=True)
class Decision:
    batch: list[Pending] = field(default_factory=list)
    expired: list[Pending] = field(default_factory=list)
    wake_at: float | None = None  # ask again then; None: nothing waits, sleep until an arrival


class LatencyProfile:
    """Predicted compute seconds per batch size: measured at warm-up, refined by observation."""

    def __init__(self, measured: dict[int, float] | None = None, smoothing: float = 0.2) -> None:
        self._points: dict[int, float] = dict(measured or {})
        self._smoothing = smoothing
        self._sizes: list[int] = sorted(self._points)

    def observe(self, rows: int, seconds: float) -> None:
        old = self._points.get(rows)
        if old is None:
            self._points[rows] = seconds
            bisect.insort(self._sizes, rows)
        else:
            self._points[rows] = old + self._smoothing * (seconds - old)

    def estimate(self, rows: int) -> float:
        sizes = self._sizes
        if not sizes:
            return 0.0
        i = bisect.bisect_left(sizes, rows)
        if i < len(sizes) and sizes[i] == rows:
            return self._points[rows]
        if i == 0:
            return self._points[sizes[0]]
        if i == len(sizes):
            # Past the largest measured size, time grows at most linearly with rows.
            top = sizes[-1]
            return self._points[top] * rows / top
        lo, hi = sizes[i - 1], sizes[i]
        frac = (rows - lo) / (hi - lo)
        return self._points[lo] + frac * (self._points[hi] - self._points[lo])

    def as_dict(self) -> dict[int, float]:
        return dict(self._points)


class BatchQueue:
    """The waiting requests of one model version and the decision of when a batch leaves."""

    def __init__(
        self, config: BatchingConfig, compute_estimate: Callable[[int], float] | None = None
    ) -> None:
        self.config = config
        self._estimate = compute_estimate or (lambda rows: 0.0)
        self._levels: dict[int, deque[Pending]] = {}
        self._order: list[int] = []  # priority levels present, ascending
        self._count = 0
        self._rows = 0
        # Earliest deadline of anything queued (a lower bound once items leave): a full sweep for
        # expired requests runs only when this is reached, so a healthy queue never pays for it.
        self._next_expiry = float("inf")

    def __len__(self) -> int:
        return self._count

    @property
    def rows(self) -> int:
        return self._rows

    def put(self, item: Pending) -> None:
        if item.rows < 1 or item.rows > self.config.max_batch_size:
            raise ValueError(f"a request of {item.rows} rows cannot fit max_batch_size {self.config.max_batch_size}")
        if self._count >= self.config.max_queue_size:
            raise QueueFull(f"queue holds {self._count} requests (max_queue_size)")
        level = self._levels.get(item.priority)
        if level is None:
            level = self._levels[item.priority] = deque()
            bisect.insort(self._order, item.priority)
        level.append(item)
        self._count += 1
        self._rows += item.rows
        if item.deadline < self._next_expiry:
            self._next_expiry = item.deadline

    def drain(self) -> list[Pending]:
        """Remove and return everything waiting (shutdown, unload)."""
        items = [item for p in self._order for item in self._levels[p]]
        self._levels.clear()
        self._order.clear()
        self._count = self._rows = 0
        self._next_expiry = float("inf")
        return items

    def poll(self, now: float) -> Decision:
        decision = Decision()
        if now >= self._next_expiry:
            decision.expired = self._sweep_expired(now)
        if not self._count:
            return decision

        batch, rows, more_waiting = self._candidates()
        config = self.config
        target = self._preferred_target(rows)
        if rows >= config.max_batch_size or more_waiting or (
            config.preferred_batch_sizes and rows >= config.preferred_batch_sizes[-1]
        ):
            decision.batch = self._take(batch, target)
            return decision

        oldest_arrival = min(item.arrival for item in batch)
        earliest_deadline = min(item.deadline for item in batch)
        fire_at = min(oldest_arrival + config.max_queue_delay, earliest_deadline - self._estimate(rows))
        if now >= fire_at:
            decision.batch = self._take(batch, target)
            return decision
        decision.wake_at = min(fire_at, self._next_expiry)
        return decision

    def _candidates(self) -> tuple[list[Pending], int, bool]:
        """The next batch in priority then arrival order, stopping at the first that would not fit."""
        limit = self.config.max_batch_size
        batch: list[Pending] = []
        rows = 0
        for priority in self._order:
            for item in self._levels[priority]:
                if rows + item.rows > limit:
                    return batch, rows, True
                batch.append(item)
                rows += item.rows
        return batch, rows, False

    def _preferred_target(self, rows: int) -> int:
        """Largest preferred size that `rows` can fill; all rows when none can be formed."""
        preferred = self.config.preferred_batch_sizes
        i = bisect.bisect_right(preferred, rows)
        return preferred[i - 1] if i else rows

    def _take(self, batch: Sequence[Pending], target_rows: int) -> list[Pending]:
        taken: list[Pending] = []
        rows = 0
        for item in batch:
            if rows + item.rows > target_rows and taken:
                break
            taken.append(item)
            rows += item.rows
        self._remove(taken)
        return taken

    def _remove(self, items: Iterable[Pending]) -> None:
        # Items always leave from the front of their level, in order.
        for item in items:
            level = self._levels[item.priority]
            level.popleft()
            self._count -= 1
            self._rows -= item.rows
            if not level:
                del self._levels[item.priority]
                self._order.remove(item.priority)
        if not self._count:
            self._next_expiry = float("inf")

    def _sweep_expired(self, now: float) -> list[Pending]:
        expired: list[Pending] = []
        next_expiry = float("inf")
        for priority in list(self._order):
            kept: deque[Pending] = deque()
            for item in self._levels[priority]:
                if item.deadline <= now:
                    expired.append(item)
                    self._count -= 1
                    self._rows -= item.rows
                else:
                    kept.append(item)
                    next_expiry = min(next_expiry, item.deadline)
            if kept:
                self._levels[priority] = kept
            else:
                del self._levels[priority]
                self._order.remove(priority)
        self._next_expiry = next_expiry
        return expired
