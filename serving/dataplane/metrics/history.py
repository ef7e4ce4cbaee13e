"""The last hour of one version in this process, minute by minute, for the console's model page: the latency
of its answers, failures included (usage.sketch buckets, so p50 and p99 come out as the usage reports compute
them), the sizes of the batches it ran, and its answers by kind (served, passed to the fallback, shed, error).

Bounded: at most `minutes` buckets per version, each a few small dicts (at most 161 latency buckets, 9 batch
bins, 4 kinds). Fed by `metrics.VersionMetrics` from the calls that already count these, on the event loop's
thread (answers, kinds) and the device thread (batches): each thread writes its own dicts, with no lock, as
`metrics.SaturationWindow` does. At a minute's turn both threads may start a bucket for it; readers merge
buckets by minute, so a duplicate costs nothing but a slot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from usage import sketch

BATCH_BINS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # a batch of n rows falls in the first bin >= n (the last: more)
# Every answer is one of these: served by the version asked, by its fallback, shed (a 503 that protected the
# latency of admitted work), or an error (any other failure: a timeout, a refusal, a client's bad request).
KINDS = ("served", "fallback", "shed", "error")


def batch_bin(rows: int) -> int:
    for edge in BATCH_BINS:
        if rows <= edge:
            return edge
    return BATCH_BINS[-1]


@dataclass
class Minute:
    """One minute's counts. `latency` holds every answer's time; `errors` counts the answers other than a 200."""

    start: int  # the minute, as seconds since the epoch // 60
    latency: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    batches: dict[int, int] = field(default_factory=dict)

    def to_doc(self) -> dict:
        """As another web process reads it (`from_doc`; JSON turns the int keys into strings)."""
        return {
            "start": self.start,
            "latency": self.latency,
            "errors": self.errors,
            "kinds": self.kinds,
            "batches": self.batches,
        }

    @classmethod
    def from_doc(cls, doc: dict) -> Minute:
        return cls(
            int(doc["start"]),
            {int(k): int(v) for k, v in doc["latency"].items()},
            int(doc["errors"]),
            {str(k): int(v) for k, v in doc["kinds"].items()},
            {int(k): int(v) for k, v in doc["batches"].items()},
        )

    def add(self, other: Minute) -> None:
        sketch.merge(self.latency, other.latency)
        self.errors += other.errors
        for kind, n in other.kinds.items():
            self.kinds[kind] = self.kinds.get(kind, 0) + n
        for edge, n in other.batches.items():
            self.batches[edge] = self.batches.get(edge, 0) + n


class HourHistory:
    def __init__(self, minutes: int = 60, clock: Callable[[], float] = time.time) -> None:
        if minutes < 1:
            raise ValueError("minutes must be at least 1")
        self.minutes = minutes
        self._clock = clock
        self._since = clock()
        # Two buckets a minute at most (see the module's docstring), so 2 x minutes keeps the hour.
        self._buckets: deque[Minute] = deque(maxlen=2 * minutes)

    def _current(self) -> Minute:
        start = int(self._clock() // 60)
        buckets = self._buckets
        if not buckets or buckets[-1].start != start:
            buckets.append(Minute(start))
        return buckets[-1]

    def answered(self, seconds: float, ok: bool) -> None:
        bucket = self._current()
        index = sketch.bucket_of(seconds)
        bucket.latency[index] = bucket.latency.get(index, 0) + 1
        if not ok:
            bucket.errors += 1

    def mark(self, kind: str) -> None:
        bucket = self._current()
        bucket.kinds[kind] = bucket.kinds.get(kind, 0) + 1

    def batch(self, rows: int) -> None:
        bucket = self._current()
        edge = batch_bin(rows)
        bucket.batches[edge] = bucket.batches.get(edge, 0) + 1

    def idle(self) -> bool:
        """Whether the whole window (begun since this history was made) has passed without a count."""
        now = self._clock()
        if now - self._since < self.minutes * 60:
            return False
        buckets = self._buckets
        return not buckets or buckets[-1].start < int(now // 60) - self.minutes + 1

    def last_hour(self) -> list[Minute]:
        """The minutes of the window that saw anything, oldest first, each a copy merged by minute."""
        since = int(self._clock() // 60) - self.minutes + 1
        merged: dict[int, Minute] = {}
        for bucket in list(self._buckets):
            if bucket.start >= since:
                into = merged.setdefault(bucket.start, Minute(bucket.start))
                # Copies of the dicts first: a writer thread may be adding to them now.
                into.add(
                    Minute(
                        bucket.start,
                        dict(bucket.latency),
                        bucket.errors,
                        dict(bucket.kinds),
                        dict(bucket.batches),
                    )
                )
        return [merged[start] for start in sorted(merged)]
