"""Work utilisation: the rows a device served over the rows it could have served at its best batch size.

Busy time over powered time says little of a batching device: at low load it runs small batches back to
back and looks busy, each batch paying the profile's fixed cost. Work utilisation counts the work instead:
a row of a version whose best batch size b* (the largest throughput b / t(b) for b up to its largest batch)
takes t(b*) / b* seconds of the device is worth that many seconds, whatever batch it actually ran in, and

    work utilisation = sum over the rows served of their best-batch seconds / the device's powered seconds.

One version alone on a device at full batches reads its busy share; a device at 30% of its capacity reads
30%, where busy time may read 97%. Plain Python, no Django: the simulator, the node's /metrics and the fleet
page compute it from a profile, the rows served and the powered time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

Estimate = Callable[[int], float]  # compute seconds per batch size (LatencyProfile.estimate)


def best_row_seconds(estimate: Estimate, max_batch_size: int) -> float:
    """Device seconds one row takes at the profile's best batch size (b up to `max_batch_size`)."""
    if max_batch_size < 1:
        raise ValueError("max_batch_size must be at least 1")
    best = min(estimate(b) / b for b in range(1, max_batch_size + 1))
    if best <= 0:
        raise ValueError("a profile's batches must take time")
    return best


def work_seconds(estimate: Estimate, max_batch_size: int, rows: int | float) -> float:
    """The device seconds `rows` would have taken at the best batch size."""
    if rows < 0:
        raise ValueError("rows must not be negative")
    return rows * best_row_seconds(estimate, max_batch_size)


def work_utilisation(estimate: Estimate, max_batch_size: int, rows: int | float, powered_seconds: float) -> float:
    """Rows served over the rows the device could serve at its best batch size in `powered_seconds`."""
    if powered_seconds <= 0:
        return 0.0
    return work_seconds(estimate, max_batch_size, rows) / powered_seconds


def device_work_utilisation(served: Iterable[tuple[Estimate, int, int | float]], powered_seconds: float) -> float:
    """The same for a device several versions share: `served` holds (estimate, max_batch_size, rows) per version."""
    if powered_seconds <= 0:
        return 0.0
    return sum(work_seconds(estimate, top, rows) for estimate, top, rows in served) / powered_seconds
