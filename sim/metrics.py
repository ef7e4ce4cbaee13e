"""What a run measures, per time window and in total.

Latencies go into log-spaced histograms (2.3% wide bins, 0.1 ms to 100 s) per window, so percentiles
over time cost memory per window, not per request. A cohort of requests that arrived over [lo, hi]
and left in one batch at `end` counts as two halves at the latencies of its quartiles
(end - lo - (hi - lo) / 4 and end - lo - 3 (hi - lo) / 4): arrivals within a span are uniform given
their count (Poisson), and a span is at most one device turn. A piece holding its cohort's earliest
row (`first`) has that row at lo exactly, and only the others spread.

The engine's `_run` (it runs per batch) records each piece as four numbers in its window's `pieces`
(end - lo, hi - lo, first, rows); `flush` turns a window's pieces into samples with numpy.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

EDGES = np.geomspace(1e-4, 100.0, 601)
OUTCOMES = ("served", "fallback", "shed", "expired")


def percentile(hist: np.ndarray, q: float) -> float:
    """The q-quantile (0..1) of a histogram over EDGES, at the geometric middle of its bin; nan when empty."""
    total = hist.sum()
    if total <= 0:
        return float("nan")
    i = int(np.searchsorted(np.cumsum(hist), q * total))
    i = min(i, len(hist) - 1)
    return float(np.sqrt(EDGES[i] * EDGES[i + 1]))


def percentile_all(hist: np.ndarray, failed: float, q: float) -> float | None:
    """The q-quantile over every request, a refused or timed-out one counting as slower than any answer:
    None when that quantile falls among the failures (more than 1 - q of requests failed)."""
    answered = hist.sum()
    rank = q * (answered + failed)
    if rank > answered or answered <= 0:
        return None
    return percentile(hist, rank / answered)


class Window:
    __slots__ = ("pieces", "counts", "shed_reasons", "gauges")

    def __init__(self) -> None:
        self.pieces = array("d")  # per piece served: age at the end (end - lo), span (hi - lo), first, rows
        self.counts = dict.fromkeys(("arrived", *OUTCOMES), 0)
        self.shed_reasons: dict[str, int] = {}
        self.gauges: dict[str, list[float]] = {}


class Metrics:
    def __init__(self, window: float, duration: float) -> None:
        self.window = window
        self.n = int(np.ceil(duration / window)) + 1
        self.windows = [Window() for _ in range(self.n + 50)]  # the drain after the end lands past n
        self._last = len(self.windows) - 1
        self.hists = np.zeros((len(self.windows), len(EDGES) - 1))
        self._flushed = 0

    def at(self, t: float) -> Window:
        i = int(t / self.window)
        return self.windows[i if i < self._last else self._last]  # runs twice per batch: no min() call

    def arrived(self, t: float, k: int) -> None:
        self.at(t).counts["arrived"] += k

    def shed(self, t: float, k: int, reason: str) -> None:
        w = self.at(t)
        w.counts["shed"] += k
        w.shed_reasons[reason] = w.shed_reasons.get(reason, 0) + k

    def expired(self, t: float, lo: float, hi: float, k: int) -> None:
        self.at(t).counts["expired"] += k

    def gauge(self, t: float, name: str, value: float) -> None:
        self.at(t).gauges.setdefault(name, []).append(value)

    def flush(self, before: float) -> None:
        """Fold the latency samples of windows that ended before `before` into their histograms."""
        upto = len(self.windows) if before == float("inf") else min(int(before / self.window), len(self.windows))
        for i in range(self._flushed, upto):
            w = self.windows[i]
            if w.pieces:
                lat, weight = _samples(np.frombuffer(w.pieces, dtype=float).reshape(-1, 4))
                self.hists[i] += np.histogram(np.clip(lat, EDGES[0], EDGES[-1] * 0.999), EDGES, weights=weight)[0]
                w.pieces = array("d")
        self._flushed = max(self._flushed, upto)

    def totals(self) -> dict[str, int]:
        out = dict.fromkeys(("arrived", *OUTCOMES), 0)
        for w in self.windows:
            for key, value in w.counts.items():
                out[key] += value
        return out

    def shed_reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for w in self.windows:
            for key, value in w.shed_reasons.items():
                out[key] = out.get(key, 0) + value
        return dict(sorted(out.items()))

    def timeline(self, upto: float) -> list[dict[str, Any]]:
        rows = []
        for i in range(min(int(np.ceil(upto / self.window)), len(self.windows))):
            w = self.windows[i]
            answered = w.counts["served"] + w.counts["fallback"]
            offered = w.counts["arrived"]
            row: dict[str, Any] = {
                "t": (i + 1) * self.window,
                "rate": offered / self.window,
                "p50_ms": percentile(self.hists[i], 0.50) * 1000,
                "p99_ms": percentile(self.hists[i], 0.99) * 1000,
                "p99_all_ms": _ms(percentile_all(self.hists[i], w.counts["shed"] + w.counts["expired"], 0.99)),
                "shed_share": w.counts["shed"] / offered if offered else 0.0,
                "fallback_share": w.counts["fallback"] / offered if offered else 0.0,
                "expired_share": w.counts["expired"] / offered if offered else 0.0,
                "answered": answered,
            }
            for name, values in w.gauges.items():
                row[name] = float(np.mean(values))
            rows.append(row)
        return rows


def _samples(pieces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Latency samples and their weights from pieces (age, span, first, rows): the earliest row at its age
    with weight 1 where a piece holds it, and the piece's other rows as two halves at its quartiles."""
    age, span, first, rows = pieces.T
    quarter = span / 4
    half = (rows - first) / 2
    opened = first > 0
    lat = np.concatenate((age[opened], age - quarter, age - 3 * quarter))
    weight = np.concatenate((np.ones(int(opened.sum())), half, half))
    return lat, weight


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
