"""Usage counted on the inference path: a few dict operations per answer, drained into per-minute
aggregates that a background flusher hands to Celery (usage.tasks.record_usage).

Plain Python with an injected clock, no Django. A recorder belongs to one event loop: `record` and
`drain` run on it and never interleave, so there is no lock. Memory is bounded by `max_keys` distinct
(tenant, model, version, minute) cells between drains; an answer that would open one more is not
metered, and is counted in `overflowed` (exported as ferry_usage_unmetered_total) instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from usage.sketch import Sketch, bucket_of, to_json

DEFAULT_MAX_KEYS = 20_000

Key = tuple[int, str, int, int]  # tenant id, model name, version, minute (Unix seconds // 60)


@dataclass(slots=True)
class Cell:
    requests: int = 0
    errors_4xx: int = 0
    errors_5xx: int = 0
    items: int = 0
    compute_seconds: float = 0.0
    latency: Sketch = field(default_factory=dict)
    fell_back: int = 0  # refused here, answered by the model's fallback (whose cell counts the answer)


@dataclass(frozen=True, slots=True)
class Drained:
    cells: dict[Key, Cell]  # no longer touched by the recorder: safe to read on another thread
    overflowed: int  # answers not metered since the last drain because the cells were full

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.cells.values())

    def rows(self) -> list[dict]:
        """One JSON-ready row per cell: what usage.tasks.record_usage takes. Built off the event loop
        (20,000 cells take about 15 ms)."""
        return [
            {
                "tenant": tenant,
                "model": model,
                "version": version,
                "minute": minute,
                "requests": c.requests,
                "errors_4xx": c.errors_4xx,
                "errors_5xx": c.errors_5xx,
                "items": c.items,
                "compute_seconds": c.compute_seconds,
                "latency": to_json(c.latency),
                "fell_back": c.fell_back,
            }
            for (tenant, model, version, minute), c in self.cells.items()
        ]


class UsageRecorder:
    def __init__(self, clock: Callable[[], float] = time.time, *, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self._clock = clock  # wall clock: minutes are calendar minutes, comparable across processes
        self.max_keys = max_keys
        self._cells: dict[Key, Cell] = {}
        self.overflowed = 0

    def __len__(self) -> int:
        return len(self._cells)

    def record(
        self,
        tenant_id: int,
        model: str,
        version: int,
        status: int,
        items: int,
        compute_seconds: float,
        latency_seconds: float,
    ) -> None:
        """Count one answer. `items` and `compute_seconds` are the rows served and the request's share of
        its batch's device time (both 0 for an error); `latency_seconds` runs from arrival to answer."""
        cell = self._cell((tenant_id, model, version, int(self._clock() // 60)))
        if cell is None:
            return
        cell.requests += 1
        if status >= 500:
            cell.errors_5xx += 1
        elif status >= 400:
            cell.errors_4xx += 1
        cell.items += items
        cell.compute_seconds += compute_seconds
        bucket = bucket_of(latency_seconds)
        sketch = cell.latency
        sketch[bucket] = sketch.get(bucket, 0) + 1

    def fell_back(self, tenant_id: int, model: str, version: int) -> None:
        """Count a request this version refused that its model's fallback answered (the answer is the
        fallback's: `record` counts it there)."""
        cell = self._cell((tenant_id, model, version, int(self._clock() // 60)))
        if cell is not None:
            cell.fell_back += 1

    def _cell(self, key: Key) -> Cell | None:
        """The cell of `key`, opened if there is room; None (counted in `overflowed`) when there is not."""
        cell = self._cells.get(key)
        if cell is None:
            if len(self._cells) >= self.max_keys:
                self.overflowed += 1
                return None
            cell = self._cells[key] = Cell()
        return cell

    def drain(self) -> Drained:
        """Everything counted since the last drain, and start afresh: two swaps, whatever the size. The
        current minute is drained too: its later answers go in the next batch and the database adds up."""
        cells, self._cells = self._cells, {}
        overflowed, self.overflowed = self.overflowed, 0
        return Drained(cells, overflowed)
