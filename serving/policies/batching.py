"""Dynamic batching policy: plain Python, no Django, no asyncio, time passed in.

A ferry leaves when it is full or when its timetable says so. `BatchQueue.poll(now)` decides, for
one model version, which waiting requests leave now, which have missed their deadline, and when
to ask again. The node's async driver (`serving.dataplane.node.batcher`) and the fleet simulator both call it.

Rules, with Triton's parameter names:
- a batch leaves at once when it holds `max_batch_size` rows (or the largest of the
  `preferred_batch_sizes` can be formed);
- otherwise it leaves when `max_queue_delay` has passed since its oldest request arrived, or when
  the earliest deadline in it, less the predicted compute time for its size, is reached;
- requests whose deadline has passed are handed back as expired and never run;
- at most `max_queue_size` requests (and `max_bytes` of input) wait; one more is refused with
  `QueueFull`, unless queued work of a lower priority tier can be evicted to make room;
- requests whose callers went away are dropped when their turn comes, never run.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Batches of a version one node holds at most, queued or running, before it stops reading the version's stream
# (`serving.dataplane.node.node_process`): what it holds then is its own, and the rest waits in the stream for
# whichever node has room, so a busy node never hoards what an idle one could serve.
READ_AHEAD = 2


def untaken(waiting: int, replicas: int, max_batch_size: int) -> int:
    """Of `waiting` requests for a version (queued or running), those its `replicas` reading ahead by READ_AHEAD
    batches each have not taken: a stream's backlog, as the autoscaler's observation has it (the simulator, whose
    replicas share one queue, counts it so)."""
    return max(0, waiting - replicas * READ_AHEAD * max_batch_size)


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
    nbytes: int = 0  # input bytes held while it waits


@dataclass(slots=True)
class Decision:
    batch: list[Pending] = field(default_factory=list)
    expired: list[Pending] = field(default_factory=list)
    dropped: list[Pending] = field(default_factory=list)  # abandoned by their callers; never run
    wake_at: float | None = None  # ask again then; None: nothing waits, sleep until an arrival


class LatencyProfile:
    """Predicted compute seconds per batch size: measured at warm-up, refined by observation."""

    def __init__(self, measured: dict[int, float] | None = None, smoothing: float = 0.2) -> None:
        self._points: dict[int, float] = dict(measured or {})
        self._smoothing = smoothing
        self._sizes: list[int] = sorted(self._points)

    def points(self) -> dict[int, float]:
        """Seconds per batch size, as measured and refined so far (a copy)."""
        return dict(self._points)

    def observe(self, rows: int, seconds: float) -> None:
        old = self._points.get(rows)
        if old is None:
            self._points[rows] = seconds
            bisect.insort(self._sizes, rows)
        else:
            self._points[rows] = old + self._smoothing * (seconds - old)

    def estimate(self, rows: int) -> float:
        exact = self._points.get(rows)  # the usual case: a size measured at warm-up or seen since
        if exact is not None:
            return exact
        sizes = self._sizes
        if not sizes:
            return 0.0
        i = bisect.bisect_left(sizes, rows)
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
    """The waiting requests of one model version and the decision of when a batch leaves.

    Bounded in requests (`max_queue_size`) and in bytes (`max_bytes`). Lower tiers (higher
    `priority` numbers) may fill only a share of either bound (`tier_share`), and when a request
    finds no room, queued work of a strictly lower tier is evicted, newest first, to make it:
    `put` returns the evicted requests so the caller answers them.
    """

    def __init__(
        self,
        config: BatchingConfig,
        compute_estimate: Callable[[int], float] | None = None,
        *,
        max_bytes: float = float("inf"),
        abandoned: Callable[[Pending], bool] | None = None,
    ) -> None:
        self.config = config
        self.max_bytes = max_bytes
        self._estimate = compute_estimate or (lambda rows: 0.0)
        self._abandoned = abandoned  # None: no caller goes away (the simulator), nothing to ask per request
        self._limits: dict[int, tuple[int, float]] = {}  # per priority: (count, bytes) it may fill
        self._levels: dict[int, deque[Pending]] = {}
        self._level_rows: dict[int, int] = {}
        # Priority levels seen, ascending. A level stays when it empties (most batches empty the queue, and
        # dropping and re-creating the level cost more than the batch's own bookkeeping); loops pass it over.
        self._order: list[int] = []
        self._count = 0
        self.rows = 0  # rows waiting (read per request by admission: a plain attribute, not a property)
        self._bytes = 0
        # Earliest deadline of anything queued (a lower bound once items leave): a full sweep for
        # expired requests runs only when this is reached, so a healthy queue never pays for it.
        self._next_expiry = float("inf")

    def __len__(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    def rows_ahead(self, priority: int) -> int:
        """Rows that leave before a new request of this priority: its level and every higher one."""
        if len(self._order) == 1 and self._order[0] <= priority:
            return self.rows
        return sum(self._level_rows[p] for p in self._order if p <= priority)

    def oldest_arrival(self, priority: int) -> float | None:
        """When the oldest request of `priority` or a higher tier still waiting arrived; None when none waits.
        (Each level is in arrival order.)"""
        oldest = None
        for p in self._order:
            if p > priority:
                break
            level = self._levels[p]
            if not level:
                continue
            arrival = level[0].arrival
            if oldest is None or arrival < oldest:
                oldest = arrival
        return oldest

    def put(self, item: Pending) -> list[Pending]:
        """Queue `item`; returns lower-tier requests evicted to make room (answer them 503).

        Raises `ValueError` when the item can never fit a batch, `QueueFull` when there is no room
        for its tier and nothing of a lower tier to evict."""
        config = self.config
        if item.rows < 1 or item.rows > config.max_batch_size:
            raise ValueError(f"a request of {item.rows} rows cannot fit max_batch_size {config.max_batch_size}")
        limits = self._limits.get(item.priority)
        if limits is None:
            share = tier_share(item.priority)
            limits = self._limits[item.priority] = (max(1, int(config.max_queue_size * share)), self.max_bytes * share)
        count_limit, bytes_limit = limits
        if item.nbytes > bytes_limit:
            raise QueueFull(f"request of {item.nbytes} bytes exceeds the queue's {bytes_limit:.0f} byte bound")
        evicted: list[Pending] = []
        if self._count >= count_limit or self._bytes + item.nbytes > bytes_limit:
            evicted = self._evict_below(item.priority, count_limit, bytes_limit - item.nbytes)
            if self._count >= count_limit or self._bytes + item.nbytes > bytes_limit:
                self._restore(evicted)
                if self._count >= count_limit:
                    raise QueueFull(
                        f"queue full: {self._count} requests wait (max_queue_size {config.max_queue_size},"
                        f" of which priority {item.priority} may fill {count_limit})"
                    )
                raise QueueFull(
                    f"queue full: {self._bytes} bytes wait (bound {self.max_bytes:.0f} bytes,"
                    f" of which priority {item.priority} may fill {bytes_limit:.0f})"
                )
        self._append(item)
        return evicted

    def _append(self, item: Pending) -> None:
        level = self._levels.get(item.priority)
        if level is None:
            level = self._levels[item.priority] = deque()
            self._level_rows[item.priority] = 0
            bisect.insort(self._order, item.priority)
        level.append(item)
        self._level_rows[item.priority] += item.rows
        self._count += 1
        self.rows += item.rows
        self._bytes += item.nbytes
        if item.deadline < self._next_expiry:
            self._next_expiry = item.deadline

    def _evict_below(self, priority: int, count_limit: int, bytes_limit: float) -> list[Pending]:
        """Remove the newest requests of tiers below `priority` until the bounds leave room."""
        evicted: list[Pending] = []
        for level_priority in reversed(list(self._order)):
            if level_priority <= priority:
                break
            level = self._levels[level_priority]
            while level and (self._count >= count_limit or self._bytes > bytes_limit):
                victim = level.pop()
                self._forget(victim)
                evicted.append(victim)
            if self._count < count_limit and self._bytes <= bytes_limit:
                break
        return evicted

    def _restore(self, items: list[Pending]) -> None:
        # Eviction could not make enough room: put the victims back where they were (newest last).
        for item in reversed(items):
            self._append(item)

    def _forget(self, item: Pending) -> None:
        self._count -= 1
        self.rows -= item.rows
        self._bytes -= item.nbytes
        self._level_rows[item.priority] -= item.rows

    def _empty_level(self, priority: int) -> None:
        self._levels[priority].clear()
        self._level_rows[priority] = 0

    def reconfigure(self, config: BatchingConfig) -> list[Pending]:
        """Apply new batching settings; returns queued requests that can no longer fit a batch,
        for the caller to answer (everything else stays queued and is served under the new settings)."""
        self.config = config
        self._limits.clear()
        misfits: list[Pending] = []
        for priority in list(self._order):
            level = self._levels[priority]
            if all(item.rows <= config.max_batch_size for item in level):
                continue
            kept: deque[Pending] = deque()
            for item in level:
                if item.rows > config.max_batch_size:
                    self._forget(item)
                    misfits.append(item)
                else:
                    kept.append(item)
            if kept:
                self._levels[priority] = kept
            else:
                self._empty_level(priority)
        if not self._count:
            self._next_expiry = float("inf")
        return misfits

    def drain(self) -> list[Pending]:
        """Remove and return everything waiting (shutdown, unload)."""
        items = [item for p in self._order for item in self._levels[p]]
        self._levels.clear()
        self._level_rows.clear()
        self._order.clear()
        self._count = self.rows = self._bytes = 0
        self._next_expiry = float("inf")
        return items

    def poll(self, now: float) -> Decision:
        expired = self._sweep_expired(now) if now >= self._next_expiry else []
        if not self._count:
            return Decision([], expired)
        config = self.config
        limit = config.max_batch_size
        abandoned = self._abandoned
        # The next batch in priority then arrival order, stopping at the first request that would not fit;
        # requests their callers abandoned are passed over (and dropped when the batch is taken).
        rows = 0
        oldest = earliest = float("inf")  # of the batch: first arrival, first deadline
        more_waiting = False
        for priority in self._order:
            for item in self._levels[priority]:
                if abandoned is not None and abandoned(item):
                    continue
                if rows + item.rows > limit:
                    more_waiting = True
                    break
                rows += item.rows
                if item.arrival < oldest:
                    oldest = item.arrival
                if item.deadline < earliest:
                    earliest = item.deadline
            if more_waiting:
                break
        dropped: list[Pending] = []
        if not rows:  # everything waiting was abandoned by its caller
            self._take(0, dropped)
            return Decision([], expired, dropped)
        preferred = config.preferred_batch_sizes
        if not (rows >= limit or more_waiting or (preferred and rows >= preferred[-1])):
            fire_at = oldest + config.max_queue_delay
            latest_start = earliest - self._estimate(rows)
            if latest_start < fire_at:
                fire_at = latest_start
            if now < fire_at:
                return Decision([], expired, dropped, min(fire_at, self._next_expiry))
        target = self._preferred_target(rows) if preferred else rows
        return Decision(self._take(target, dropped), expired, dropped)

    def _preferred_target(self, rows: int) -> int:
        """Largest preferred size that `rows` can fill; all rows when none can be formed."""
        preferred = self.config.preferred_batch_sizes
        i = bisect.bisect_right(preferred, rows)
        return preferred[i - 1] if i else rows

    def _take(self, target_rows: int, dropped: list[Pending]) -> list[Pending]:
        """Pop the batch from the front of the levels, in the order `poll` walked them."""
        abandoned = self._abandoned
        taken: list[Pending] = []
        rows = 0
        for priority in self._order:  # levels stay when they empty, so the list does not change under the walk
            level = self._levels[priority]
            # What leaves this level, summed here and forgotten once (not per item: this runs per batch).
            gone_rows = gone_bytes = gone_count = 0
            while level:
                item = level[0]
                if abandoned is not None and abandoned(item):
                    level.popleft()
                    dropped.append(item)
                elif not target_rows or (taken and rows + item.rows > target_rows):
                    break
                else:
                    level.popleft()
                    taken.append(item)
                    rows += item.rows
                gone_rows += item.rows
                gone_bytes += item.nbytes
                gone_count += 1
            self._count -= gone_count
            self.rows -= gone_rows
            self._bytes -= gone_bytes
            self._level_rows[priority] -= gone_rows
            if level:
                break
        if not self._count:
            self._next_expiry = float("inf")
        return taken

    def _sweep_expired(self, now: float) -> list[Pending]:
        expired: list[Pending] = []
        next_expiry = float("inf")
        for priority in list(self._order):
            kept: deque[Pending] = deque()
            for item in self._levels[priority]:
                if item.deadline <= now:
                    expired.append(item)
                    self._forget(item)
                else:
                    kept.append(item)
                    next_expiry = min(next_expiry, item.deadline)
            if kept:
                self._levels[priority] = kept
            else:
                self._empty_level(priority)
        self._next_expiry = next_expiry
        return expired


# Mirrored (shadow) requests: below every tier a caller may ask for (the gateway caps callers' levels
# under it), with the smallest share, so they are refused before any caller's request as a backlog grows.
SHADOW_PRIORITY = 10


def tier_share(priority: int) -> float:
    """The share of a queue's bounds that a priority tier may fill: tier 1 (and 0) all of it,
    tier 2 three quarters, lower tiers half, mirrored requests a quarter. So under pressure the lowest
    tiers are refused first, and the room they leave is what higher tiers queue into."""
    if priority <= 1:
        return 1.0
    if priority == 2:
        return 0.75
    if priority >= SHADOW_PRIORITY:
        return 0.25
    return 0.5
