"""Counters and histograms the request path writes on every answer, at a tenth of prometheus_client's cost.

prometheus_client's `Histogram.observe` checks observability, walks the buckets in Python and takes a
lock per bucket and per sum: about 150 bytecodes, twice per request here (queue wait and total time),
plus some 50 per counter increment. The request path runs on one event loop whose Python work is the
server's ceiling, so these families keep a child's counts in plain lists under one uncontended lock
(a bisect finds the bucket in C) and turn them into Prometheus samples only when `/metrics` is read.
The exposition is prometheus_client's own (`HistogramMetricFamily`, `CounterMetricFamily`): the
same names, labels, buckets, `_count`, `_sum` and `_total` as the classes they replace.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric


class CounterChild:
    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()  # several event loops share a child in tests and tools
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        with self._lock:
            self.value += amount


class HistogramChild:
    __slots__ = ("_lock", "bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._lock = threading.Lock()
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # Prometheus buckets are "less than or equal": the first bound >= amount is bisect_left's index.
        with self._lock:
            self.counts[bisect_left(self.bounds, amount)] += 1
            self.sum += amount

    def snapshot(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self.counts), self.sum


class _Family:
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], register: bool) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        self._lock = threading.Lock()
        if register:
            REGISTRY.register(self)

    def _child(self, values: tuple[str, ...]) -> object:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
        child = self._children.get(values)
        if child is None:
            if not all(type(v) is str for v in values):
                raise TypeError(f"{self.name}: label values must be strings, got {values}")
            with self._lock:
                child = self._children.setdefault(values, self._new())
        return child

    def _new(self) -> object:
        raise NotImplementedError

    def _items(self) -> list[tuple[tuple[str, ...], object]]:
        with self._lock:
            return list(self._children.items())

    def describe(self) -> list[Metric]:
        return []  # children appear at any time; the registry collects to learn the names


class CounterFamily(_Family):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, register: bool = True):
        super().__init__(name.removesuffix("_total"), documentation, labelnames, register)

    def _new(self) -> CounterChild:
        return CounterChild()

    def labels(self, *values: str) -> CounterChild:
        return self._child(values)  # type: ignore[return-value]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._items():
            family.add_metric(list(values), child.value)  # type: ignore[attr-defined]
        yield family


class HistogramFamily(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        register: bool = True,
    ) -> None:
        bounds = tuple(float(b) for b in buckets if not math.isinf(b))
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("buckets must be increasing")
        self.bounds = bounds
        super().__init__(name, documentation, labelnames, register)

    def _new(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def labels(self, *values: str) -> HistogramChild:
        return self._child(values)  # type: ignore[return-value]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [_le(b) for b in self.bounds] + ["+Inf"]
        for values, child in self._items():
            counts, total = child.snapshot()  # type: ignore[attr-defined]
            cumulative, running = [], 0
            for le, n in zip(les, counts, strict=True):
                running += n
                cumulative.append((le, running))
            family.add_metric(list(values), cumulative, total)
        yield family


def _le(bound: float) -> str:
    # As prometheus_client writes them (floatToGoString): 0.005, 1.0, 2.5.
    return repr(float(bound))
