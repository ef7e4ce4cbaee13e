"""What a gateway process has sent to remote nodes and not had answered, per version, and the checks before a
send: the same for the Redis streams (`streams`) and the node host's socket (`host_link`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from serving.dataplane.errors import DeadlineExceeded, ServingError, Shed
from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.metrics import metrics


@dataclass(slots=True)
class Outstanding:
    items: int = 0
    nbytes: int = 0


def check_sendable(entry: VersionEntry, deadline: float, now: float, gone: Callable[[], bool] | None) -> None:
    """504 when the deadline passed before the send, 499 when the client left: either is never sent."""
    if deadline <= now:
        metrics.DEADLINES.labels(entry.model, str(entry.version), "unsent").inc()
        raise DeadlineExceeded("request deadline passed before it was sent")
    if gone is not None and gone():
        raise ServingError("the client closed the connection", status=499)


def held_for(
    table: dict[str, Outstanding], entry: VersionEntry, nbytes: int, max_bytes: int, priority: int, who: str
) -> Outstanding:
    """The version's count in `table`, or `Shed` (queue_full, Retry-After 1) when one more request of `nbytes`
    would pass the version's max_queue_size or `max_bytes`. The caller adds the request once it is sent."""
    key = entry.key
    held = table.get(key)
    if held is None:
        held = table[key] = Outstanding()
    if held.items >= entry.batching.max_queue_size or held.nbytes + nbytes > max_bytes:
        metrics.GATEWAY_REFUSALS.labels(entry.model, str(entry.version), "queue_full").inc()
        raise Shed(
            f"{key}: {who} holds {held.items} requests ({held.nbytes} bytes) for it already",
            reason="queue_full",
            tier=priority,
            retry_after=1,
        )
    return held
