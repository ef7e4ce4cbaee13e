"""Comparing a shadow's answers with the primary's, by the model's task kind. Plain Python and numpy, no
Django: the data plane's flush runs it on a worker thread, off the request path, and hands the per-minute
aggregates to `rollout.tasks.record_shadow`.

Per row of each mirrored request (its first output tensor, flattened per row):
- classification: the two top-1 classes agree or not (and count in the confusion matrix between the
  versions); the difference is the largest absolute difference between the two score vectors;
- regression: the difference is the largest absolute difference of an output element; the mean and
  max absolute difference are kept over every element; a row agrees when every element is within
  `REGRESSION_ATOL + REGRESSION_RTOL x |primary|`;
- embedding: cosine similarity; the difference is `1 - cosine`; a row agrees at `AGREE_COSINE` or above.
Differences go into the same log-spaced buckets as latencies (`usage.sketch`), so minutes and
processes merge by adding counts; a difference of zero falls in the lowest bucket (<= 1e-4).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from serving.dataplane.http.protocol import bf16_to_float32
from usage.sketch import _INV_LOG_GROWTH, FLOOR_SECONDS, TOP_INDEX, Sketch, to_json

if TYPE_CHECKING:
    from serving.dataplane.gateway.shadow import Pair
    from serving.dataplane.gateway.snapshot import VersionEntry

AGREE_COSINE = 0.99
REGRESSION_ATOL = 1e-3
REGRESSION_RTOL = 1e-2
SAMPLES_PER_FLUSH = 20  # disagreements kept per (model, baseline, candidate) and flush
MAX_SAMPLE_INPUT_BYTES = 16 * 1024  # a sample's inputs as JSON; larger ones are kept without them

Key = tuple[str, int, int, int]  # model, baseline version, candidate version, minute (Unix seconds // 60)


@dataclass(frozen=True, slots=True)
class Comparison:
    """One mirrored request's rows compared."""

    agree: np.ndarray  # bool per row
    difference: np.ndarray  # float per row, 0 when identical
    top1: tuple[np.ndarray, np.ndarray] | None = None  # classification: each version's class per row
    abs_sum: float = 0.0  # regression: sum and count of absolute element differences, their max
    abs_count: int = 0
    abs_max: float = 0.0
    similarity: np.ndarray | None = None  # embedding: cosine per row


def _rows(array: np.ndarray, rows: int) -> np.ndarray:
    return np.asarray(array, dtype=np.float64).reshape(rows, -1) if rows else np.zeros((0, 1))


def compare(task: str, primary: np.ndarray, shadow: np.ndarray) -> Comparison:
    """Compare two answers of the same rows; ValueError when their shapes differ."""
    if primary.shape != shadow.shape:
        raise ValueError(f"outputs of shape {tuple(primary.shape)} and {tuple(shadow.shape)} cannot be compared")
    rows = primary.shape[0] if primary.ndim else 1
    p, s = _rows(primary, rows), _rows(shadow, rows)
    delta = np.abs(p - s)
    if task == "classification":
        a, b = p.argmax(axis=1), s.argmax(axis=1)
        return Comparison(a == b, delta.max(axis=1), top1=(a, b))
    if task == "embedding":
        norms = np.linalg.norm(p, axis=1) * np.linalg.norm(s, axis=1)
        dots = (p * s).sum(axis=1)
        both_zero = (np.linalg.norm(p, axis=1) == 0) & (np.linalg.norm(s, axis=1) == 0)
        cosine = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), np.where(both_zero, 1.0, 0.0))
        cosine = np.clip(cosine, -1.0, 1.0)
        return Comparison(cosine >= AGREE_COSINE, 1.0 - cosine, similarity=cosine)
    # regression (and any kind without a rule of its own): element-wise absolute differences
    agree = (delta <= REGRESSION_ATOL + REGRESSION_RTOL * np.abs(p)).all(axis=1)
    return Comparison(
        agree,
        delta.max(axis=1),
        abs_sum=float(delta.sum()),
        abs_count=int(delta.size),
        abs_max=float(delta.max()) if delta.size else 0.0,
    )


@dataclass(slots=True)
class Cell:
    """One minute of one (model, baseline, candidate): what `rollout.models.ShadowMinute` stores."""

    task: str
    mirrored: int = 0  # mirrored requests answered by the shadow, failures included
    shadow_errors: int = 0  # of those, the shadow failed (status other than 200)
    incomparable: int = 0  # both answered, outputs of different shapes
    compared: int = 0  # rows compared
    agreed: int = 0
    abs_sum: float = 0.0
    abs_count: int = 0
    abs_max: float = 0.0
    similarity_sum: float = 0.0
    similarity_min: float | None = None
    difference: Sketch = field(default_factory=dict)
    confusion: dict[str, int] = field(default_factory=dict)  # "primary class,shadow class" -> rows
    # Device seconds per request of the pairs both sides answered (shadow.Pair says why not end to end).
    primary_latency: Sketch = field(default_factory=dict)
    shadow_latency: Sketch = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)  # the shadow's failures by status

    def add(self, comparison: Comparison) -> None:
        rows = int(comparison.agree.size)
        self.compared += rows
        self.agreed += int(comparison.agree.sum())
        _count(self.difference, comparison.difference)
        if comparison.top1 is not None and rows:
            confusion = self.confusion
            classes, counts = np.unique(np.stack(comparison.top1, axis=1), axis=0, return_counts=True)
            for (a, b), n in zip(classes.tolist(), counts.tolist(), strict=True):
                key = f"{a},{b}"
                confusion[key] = confusion.get(key, 0) + n
        if comparison.abs_count:
            self.abs_sum += comparison.abs_sum
            self.abs_count += comparison.abs_count
            self.abs_max = max(self.abs_max, comparison.abs_max)
        if comparison.similarity is not None and rows:
            self.similarity_sum += float(comparison.similarity.sum())
            low = float(comparison.similarity.min())
            self.similarity_min = low if self.similarity_min is None else min(self.similarity_min, low)

    def row(self, key: Key) -> dict[str, Any]:
        model, baseline, candidate, minute = key
        return {
            "model": model,
            "baseline": baseline,
            "candidate": candidate,
            "minute": minute,
            "task": self.task,
            "mirrored": self.mirrored,
            "shadow_errors": self.shadow_errors,
            "incomparable": self.incomparable,
            "compared": self.compared,
            "agreed": self.agreed,
            "abs_sum": self.abs_sum,
            "abs_count": self.abs_count,
            "abs_max": self.abs_max,
            "similarity_sum": self.similarity_sum,
            "similarity_min": self.similarity_min,
            "difference": to_json(self.difference),
            "confusion": dict(self.confusion),
            "primary_latency": to_json(self.primary_latency),
            "shadow_latency": to_json(self.shadow_latency),
            "statuses": dict(self.statuses),
        }


def buckets_of(values: np.ndarray) -> np.ndarray:
    """`usage.sketch.bucket_of` over an array at once."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        index = np.log(np.maximum(values, FLOOR_SECONDS) / FLOOR_SECONDS) * _INV_LOG_GROWTH
    index = np.where(values <= FLOOR_SECONDS, 0, np.nan_to_num(index, nan=0.0).astype(np.int64) + 1)
    return np.minimum(index, TOP_INDEX)


def _count(sketch: Sketch, values: np.ndarray) -> None:
    """Add each value of `values` to its bucket of `sketch`."""
    if not len(values):
        return
    buckets, counts = np.unique(buckets_of(values), return_counts=True)
    for b, n in zip(buckets.tolist(), counts.tolist(), strict=True):
        sketch[b] = sketch.get(b, 0) + n


def _bf16_names(version: VersionEntry) -> frozenset[str]:
    """The version's BF16 tensors, which travel as their bits (uint16): compared and kept as their values."""
    return frozenset(spec.name for spec in (*version.inputs, *version.outputs) if spec.datatype == "BF16")


def _values(array: np.ndarray, name: str, bf16: frozenset[str]) -> np.ndarray:
    return bf16_to_float32(array) if name in bf16 else array


def _json_floats(array: np.ndarray) -> list:
    """A tensor row as JSON numbers (non-finite values as strings, which JSON cannot carry)."""
    values = np.asarray(array).tolist()

    def clean(v: Any) -> Any:
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        return v

    return clean(values)


def _sample(pair: Pair, row: int | None, summary: str, difference: float | None) -> dict[str, Any]:
    item = pair.item
    bf16 = _bf16_names(item.baseline)
    inputs: dict[str, Any] | None = {
        name: _json_floats(_values(t[row] if row is not None and t.ndim else t, name, bf16))
        for name, t in item.inputs.items()
    }
    if len(repr(inputs)) > MAX_SAMPLE_INPUT_BYTES:
        inputs = None  # too large to keep; the summary and outputs remain
    out = next(iter(item.primary))
    primary = _values(item.primary[out], out, bf16)
    shadow = pair.shadow.get(out) if pair.shadow is not None else None
    shadow = None if shadow is None else _values(shadow, out, bf16)
    return {
        "model": item.baseline.model,
        "baseline": item.baseline.version,
        "candidate": item.candidate.version,
        "at": item.at,
        "summary": summary,
        "difference": difference,
        "inputs": inputs,
        "inputs_dropped": inputs is None,
        "output": out,
        "primary": _json_floats(primary[row] if row is not None and primary.ndim else primary),
        "shadow": None if shadow is None else _json_floats(shadow[row] if row is not None and shadow.ndim else shadow),
    }


def aggregate(pairs: Iterable[Pair]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Per-minute cells (JSON-ready rows) and a bounded sample of disagreements, from drained pairs. The
    rows of every pair of a cell are compared in one vectorised call (the flush holds the GIL while it
    computes, and the event loop shares it). Every pair counts in the cells; only pairs marked
    `keep_sample` (the mirror decided: the model's owner's traffic, or a tenant that shares its samples)
    can become samples, so no sample of any other tenant's request leaves this function."""
    cells: dict[Key, Cell] = {}
    latencies: dict[Key, tuple[list[float], list[float]]] = {}
    samples: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    groups: dict[tuple[Key, str, tuple[int, ...]], list[Pair]] = {}
    for pair in pairs:
        item = pair.item
        key = (item.baseline.model, item.baseline.version, item.candidate.version, int(item.at // 60))
        cell = cells.get(key)
        if cell is None:
            cell = cells[key] = Cell(item.task)
            latencies[key] = ([], [])
        cell.mirrored += 1
        if pair.shadow is not None and item.primary_compute > 0 and pair.shadow_compute > 0:
            # Like with like: both sides' device seconds for the same request, from runs that answered.
            latencies[key][0].append(item.primary_compute)
            latencies[key][1].append(pair.shadow_compute)
        kept = samples.setdefault(key[:3], [])
        if pair.shadow is None:
            cell.shadow_errors += 1
            status = str(pair.shadow_status)
            cell.statuses[status] = cell.statuses.get(status, 0) + 1
            if item.keep_sample and len(kept) < SAMPLES_PER_FLUSH:
                kept.append(_sample(pair, None, f"shadow failed ({pair.shadow_status}): {pair.error}"[:500], None))
            continue
        out = next(iter(item.primary))
        primary, shadow = item.primary[out], pair.shadow.get(out)
        if shadow is None or primary.shape != shadow.shape or not primary.ndim:
            cell.incomparable += 1
            if item.keep_sample and len(kept) < SAMPLES_PER_FLUSH:
                why = "no output" if shadow is None else f"shapes {tuple(primary.shape)} and {tuple(shadow.shape)}"
                kept.append(_sample(pair, None, f"incomparable: {why} {out!r}"[:500], None))
            continue
        groups.setdefault((key, out, tuple(primary.shape[1:])), []).append(pair)
    for (key, out, _), members in groups.items():
        task = cells[key].task
        bf16 = _bf16_names(members[0].item.baseline)
        primary = _values(np.concatenate([m.item.primary[out] for m in members]), out, bf16)
        shadow = _values(np.concatenate([m.shadow[out] for m in members]), out, bf16)  # type: ignore[index]
        comparison = compare(task, primary, shadow)
        cells[key].add(comparison)
        kept = samples[key[:3]]
        room = SAMPLES_PER_FLUSH - len(kept)
        if room > 0 and not comparison.agree.all():
            sizes = [m.item.primary[out].shape[0] for m in members]
            offsets = np.cumsum([0, *sizes])
            keepable = np.repeat([m.item.keep_sample for m in members], sizes)
            for row in np.flatnonzero(~comparison.agree & keepable)[:room].tolist():
                at = int(np.searchsorted(offsets, row, side="right")) - 1
                kept.append(
                    _sample(
                        members[at],
                        row - int(offsets[at]),
                        _summary(task, comparison, row),
                        float(comparison.difference[row]),
                    )
                )
    for key, (primary_compute, shadow_compute) in latencies.items():
        _count(cells[key].primary_latency, np.asarray(primary_compute))
        _count(cells[key].shadow_latency, np.asarray(shadow_compute))
    rows = [cell.row(key) for key, cell in cells.items()]
    return rows, [s for kept in samples.values() for s in kept]


def _summary(task: str, comparison: Comparison, row: int) -> str:
    if comparison.top1 is not None:
        return f"class {int(comparison.top1[0][row])} vs {int(comparison.top1[1][row])}"
    if comparison.similarity is not None:
        return f"cosine {float(comparison.similarity[row]):.4f}"
    return f"max |difference| {float(comparison.difference[row]):.4g}"
