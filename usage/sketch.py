"""A latency sketch that merges: counts in fixed, log-spaced buckets.

Every process and every minute uses the same buckets, so sketches from several gateways, or the minutes
of an hour, merge by adding counts bucket by bucket, and a percentile of the merge is as good as one of
the raw samples up to the bucket width. Buckets grow by 2**(1/8) (about 9%), so an estimate (the
bucket's geometric middle) is within about 4.5% of the true value between 0.1 ms and 100 s; below and
above, values fall into the end buckets. Plain Python, no Django: the inference path builds these.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

FLOOR_SECONDS = 1e-4
GROWTH = 2 ** (1 / 8)
TOP_INDEX = 160  # FLOOR * GROWTH**160 = 100 s; slower answers share the last bucket
_INV_LOG_GROWTH = 1 / math.log(GROWTH)

Sketch = dict[int, int]  # bucket index -> count; JSON stores the keys as strings


def bucket_of(seconds: float) -> int:
    if seconds <= FLOOR_SECONDS:
        return 0
    index = int(math.log(seconds / FLOOR_SECONDS) * _INV_LOG_GROWTH) + 1
    return index if index < TOP_INDEX else TOP_INDEX


def bucket_value(index: int) -> float:
    """The value a bucket stands for: the geometric middle of its bounds (the floor for bucket 0)."""
    if index <= 0:
        return FLOOR_SECONDS
    return FLOOR_SECONDS * GROWTH ** (index - 0.5)


def add(into: Sketch, seconds: float) -> None:
    """Count one value of `seconds` into `into`."""
    index = bucket_of(seconds)
    into[index] = into.get(index, 0) + 1


def merge(into: Sketch, other: Mapping[int | str, int]) -> Sketch:
    """Add `other` (int or JSON string keys) into `into`, and return it."""
    for index, count in other.items():
        key = int(index)
        into[key] = into.get(key, 0) + int(count)
    return into


def merged(sketches: Iterable[Mapping[int | str, int]]) -> Sketch:
    total: Sketch = {}
    for sketch in sketches:
        merge(total, sketch)
    return total


def quantile(sketch: Mapping[int | str, int], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) in seconds, or None for an empty sketch."""
    if not 0 < q <= 1:
        raise ValueError("q must lie in (0, 1]")
    items = sorted((int(k), int(v)) for k, v in sketch.items() if int(v) > 0)
    total = sum(count for _, count in items)
    if not total:
        return None
    rank = math.ceil(q * total)
    seen = 0
    for index, count in items:
        seen += count
        if seen >= rank:
            return bucket_value(index)
    return bucket_value(items[-1][0])


def to_json(sketch: Mapping[int, int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(sketch.items())}
