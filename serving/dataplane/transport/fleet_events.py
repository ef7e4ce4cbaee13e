"""The fleet's recent events (loads, evictions, failures) in one capped Redis stream, for the fleet page.

A node's packing records each event (`serving.dataplane.node.packing.Packing.record`); `EventPublisher` takes them
from there and XADDs them to `ferry:fleet:events` off the request path: buffered (bounded; the oldest go first
when Redis is unreachable for long, counted), sent in one pipeline per turn. The stream is trimmed to about
MAXLEN entries; readers take the last hour (stream ids are Redis' clock in milliseconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

import orjson
import redis
import redis.asyncio as aioredis

from serving.dataplane.node.packing import Event
from serving.dataplane.transport import redis_pipe
from serving.dataplane.transport.fleet import TTL_SECONDS, NodeInfo

log = logging.getLogger(__name__)

STREAM = "ferry:fleet:events"
MAXLEN = 10_000  # approximate (MAXLEN ~): a busy fleet's hour may hold more; the page shows the newest
FIELD = b"e"
BUFFERED = 1_000
FLUSH_SECONDS = 0.2
WINDOW_SECONDS = 3600
KINDS = {  # kind -> how the page groups it
    "load": "load",
    "evict": "eviction",
    "load_failed": "failure",
    "unschedulable": "failure",
    "no_room": "failure",
    "lost": "failure",
}


@dataclass(frozen=True, slots=True)
class FleetEvent:
    node: str
    at: float  # epoch seconds, the node's clock
    kind: str  # Event.kind, or "lost" (a node's heartbeat expired)
    key: str  # model:version, "" for a node's own event
    detail: str = ""

    @property
    def group(self) -> str:
        return KINDS.get(self.kind, "other")

    def to_doc(self) -> dict[str, object]:
        # Not dataclasses.asdict: its deep copies were a quarter of reading the page's 200 events.
        return {
            "node": self.node,
            "at": self.at,
            "kind": self.kind,
            "key": self.key,
            "detail": self.detail,
            "group": self.group,
        }

    @classmethod
    def of(cls, node: str, event: Event) -> FleetEvent:
        return cls(node, event.at, event.kind, event.key, event.detail)


def encode(event: FleetEvent) -> bytes:
    return orjson.dumps((event.node, event.at, event.kind, event.key, event.detail))


def decode(raw: bytes) -> FleetEvent:
    node, at, kind, key, detail = orjson.loads(raw)
    return FleetEvent(str(node), float(at), str(kind), str(key), str(detail))


async def read_recent(client: aioredis.Redis, *, now: float, count: int = 200) -> list[FleetEvent]:
    """The newest `count` events of the last hour, newest first. An entry this process cannot read is skipped."""
    since = int((now - WINDOW_SECONDS) * 1000)
    events = []
    for _, fields in await client.xrevrange(STREAM, max="+", min=f"{since}-0", count=count):
        try:
            events.append(decode(fields[FIELD]))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("skipping a fleet event this process cannot read: %s", exc)
    return events


class EventPublisher:
    """Sends one node's events to the stream. `add` is a packing listener (on the node's loop, never blocks)."""

    def __init__(self, url: str, node: str, *, buffered: int = BUFFERED) -> None:
        self.node = node
        self._client = redis_pipe.client(url, name=f"ferry-fleet-events-{node}")
        self._buffer: deque[FleetEvent] = deque(maxlen=buffered)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.dropped = 0  # pushed out of a full buffer before they could be sent

    def add(self, event: Event) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1
        self._buffer.append(FleetEvent.of(self.node, event))
        self._wake.set()

    async def flush_once(self) -> int:
        """Send what is buffered; on a Redis error it stays buffered for the next turn. Returns events sent."""
        if not self._buffer:
            return 0
        batch = list(self._buffer)
        pipe = self._client.pipeline(transaction=False)
        for event in batch:
            pipe.xadd(STREAM, {FIELD: encode(event)}, maxlen=MAXLEN, approximate=True)
        await pipe.execute()
        for _ in batch:  # what was added meanwhile stays
            self._buffer.popleft()
        self.sent += len(batch)
        return len(batch)

    async def _run(self) -> None:
        failing = False
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush_once()
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("publishing fleet events failed (%s); keeping up to %d", exc, self._buffer.maxlen)
                failing = True
                self._wake.set()  # try again after the pause
            await asyncio.sleep(FLUSH_SECONDS)  # events of one burst go in one pipeline

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"ferry-fleet-events-{self.node}")

    async def close(self) -> None:
        """Stop, sending what is buffered once more (bounded by the client's timeouts)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.flush_once()
        except (redis.RedisError, OSError) as exc:
            log.warning("%d fleet events not published at shutdown: %s", len(self._buffer), exc)
        await self._client.aclose()


def lost_events(lost: list[NodeInfo], now: float) -> list[FleetEvent]:
    """A lost node (`fleet.read_lost`) as an event, at the moment its heartbeat expired."""
    return [
        FleetEvent(
            n.name,
            n.heartbeat_at + TTL_SECONDS,
            "lost",
            "",
            f"no heartbeat since {time.strftime('%H:%M:%S', time.gmtime(n.heartbeat_at))} UTC",
        )
        for n in lost
        if n.heartbeat_at + TTL_SECONDS <= now
    ]
