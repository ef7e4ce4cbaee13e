"""Moves a process's metered usage to Celery, off the inference path.

Each flush drains the recorder into a batch with a fresh id and sends every batch still waiting, oldest
first. A batch that fails to send (broker or, in embedded mode, database down) stays and goes again
with the same id at the next flush, so the task's idempotence keeps a retry from counting twice. The
outbox is bounded: past `max_pending` batches the oldest is dropped and its requests are counted as
unmetered, like the recorder's own overflow.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Awaitable, Callable

from prometheus_client import Counter

from usage.recorder import Drained, UsageRecorder

UNMETERED = Counter(
    "ferry_usage_unmetered",
    "Answers left out of usage: recorder full, or their batch dropped while unsendable",
    ["reason"],
)
BATCHES = Counter("ferry_usage_batches", "Usage batches handed to Celery, by outcome", ["outcome"])

# Called with a batch id and the drained cells; builds the rows and queues the task (off the event loop).
Send = Callable[[str, Drained], Awaitable[object]]


class UsageFlusher:
    def __init__(self, recorder: UsageRecorder, send: Send, *, max_pending: int = 60) -> None:
        self.recorder = recorder
        self._send = send
        self.pending: deque[tuple[str, Drained]] = deque()
        self.max_pending = max_pending

    def drain(self) -> None:
        """Move what the recorder counted into the outbox (synchronous: no await between the two)."""
        drained = self.recorder.drain()
        if drained.overflowed:
            UNMETERED.labels("recorder_full").inc(drained.overflowed)
        if not drained.cells:
            return
        self.pending.append((uuid.uuid4().hex, drained))
        while len(self.pending) > self.max_pending:
            _, dropped = self.pending.popleft()
            UNMETERED.labels("outbox_full").inc(dropped.requests)
            BATCHES.labels("dropped").inc()

    async def flush(self) -> int:
        """Drain, then send what waits; returns the batches sent. Raises the first send failure, keeping
        that batch and the ones after it for the next flush."""
        self.drain()
        sent = 0
        while self.pending:
            batch_id, drained = self.pending[0]
            try:
                await self._send(batch_id, drained)
            except Exception:
                BATCHES.labels("failed").inc()
                raise
            self.pending.popleft()
            BATCHES.labels("sent").inc()
            sent += 1
        return sent
