"""The node's side of packing: what it knows of the versions it may serve beyond the ones loaded now.

A node holds in its memory budget the versions it serves hot; the others it may serve stay cold
(registered and loadable, never loaded here or evicted) until a request asks for one. The decisions are
`serving.policies.placement`'s (fit, LRU eviction); this module keeps the state they need on a node:
- footprints and cold starts measured here (a cold start is the whole load: evictions, reading the
  artifact, warm-up), and the estimates used before one is measured: what another node of the same
  accelerator type reported to the registry, else that of another version of the same artifact here,
  else validation's load time plus the warm-up the profile implies (pessimistic: validation is often a
  process's first load), else the mean of the cold starts measured here;
- the loads in progress that requests wait on (`Ticket`), so a second request for the same cold
  version joins the first load instead of starting another;
- the versions found unschedulable, with the constraints they were judged on, so a version that can
  never fit is refused at once and tried again only when its artifact or constraints change;
- a bounded record of loads, evictions and refusals, and the reports sent back to the registry through a
  callable the control plane hands in (this package never imports the ORM).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from serving.dataplane.gateway.snapshot import RoutingSnapshot, VersionEntry
from serving.policies.placement import VersionSpec

log = logging.getLogger(__name__)

DEFAULT_COLD_START = 2.0  # seconds, for a version nothing is known of yet
WARMUP_REPEATS = 4  # the node's profile runs each warm-up size once, then three times


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a node tells the registry after a load, or when a version cannot fit it."""

    model: str
    version: int
    accelerator: str
    memory_bytes: int = 0
    cold_start: float = 0.0
    unschedulable: str = ""  # the reason, when the version can never fit this node


@dataclass(frozen=True, slots=True)
class Event:
    at: float  # epoch seconds
    kind: str  # load | evict | unschedulable | no_room | load_failed
    key: str
    detail: str = ""


@dataclass(slots=True)
class Ticket:
    """A load requests wait on: its expected cold start, and when it began (None while it waits its turn)."""

    task: asyncio.Task[object]
    cold_start: float
    started: float | None = None
    # Requests waiting on it. Once it is hosted they count as its work in flight until each resumes, so a
    # load queued behind it cannot evict it before they reach its queue.
    waiters: int = 0
    hosted: object | None = None  # what it loaded (node.Hosted), holding the waiters' work

    def left(self, now: float) -> float:
        if self.started is None:
            return self.cold_start
        return max(0.0, self.cold_start - (now - self.started))


def constraints(entry: VersionEntry) -> tuple:
    """What an unschedulable verdict depends on besides the node: a change to any of it earns a new try."""
    p = entry.placement
    return entry.artifact_sha256, p.min_memory, p.accelerators


class Packing:
    def __init__(
        self,
        accelerator: str,
        warmup_sizes: Callable[[VersionEntry], list[int]],
        *,
        report: Callable[[LoadReport], Awaitable[object]] | None = None,
        events: int = 500,
    ) -> None:
        self.accelerator = accelerator
        self._warmup_sizes = warmup_sizes  # the batch sizes a load profiles (node.warmup_sizes)
        self.cold: dict[str, VersionEntry] = {}  # may be served, not loaded: a request loads it
        self.loading: dict[str, Ticket] = {}
        self.unschedulable: dict[str, tuple[tuple, str]] = {}  # key -> (constraints judged on, reason)
        self.no_room: dict[str, str] = {}  # key -> why its last load found no room (what must stay held it)
        self.measured: dict[str, tuple[int, float]] = {}  # key -> (footprint, cold start) on this node
        self.by_artifact: dict[str, float] = {}  # sha256 -> the last cold start of any version of it here
        self.stable: frozenset[str] = frozenset()  # the models' stable versions, by key
        # Replicas the placement reconciler put here: kept like pinned ones, so on-demand loads never evict them.
        self.assigned: set[str] = set()
        self.events: deque[Event] = deque(maxlen=events)
        self.listeners: list[Callable[[Event], None]] = []  # told of each event (the fleet page's publisher)
        self.evictions = 0
        self.loads = 0
        self._report = report
        self._sending: set[asyncio.Task[object]] = set()

    def update(self, snapshot: RoutingSnapshot, desired: dict[str, VersionEntry]) -> None:
        """A new snapshot: which versions are stable, and forget what may no longer be served."""
        self.stable = frozenset(
            f"{m.name}:{m.routes.stable}" for m in snapshot.models.values() if m.routes.stable is not None
        )
        for key in [k for k in self.cold if k not in desired]:
            del self.cold[key]
        for key in self.cold:
            self.cold[key] = desired[key]  # its newest settings
        for key in [
            k for k, (judged, _) in self.unschedulable.items() if k not in desired or judged != constraints(desired[k])
        ]:
            del self.unschedulable[key]

    # -- estimates -----------------------------------------------------------------------------

    def footprint(self, entry: VersionEntry) -> int:
        here = self.measured.get(entry.key)
        if here is not None:
            return here[0]
        reported = entry.placement.on(self.accelerator)
        return reported[0] if reported is not None else entry.placement.memory_bytes

    def cold_start(self, entry: VersionEntry) -> float:
        here = self.measured.get(entry.key)
        if here is not None:
            return here[1]
        reported = entry.placement.on(self.accelerator)
        if reported is not None and reported[1] > 0:
            return reported[1]
        same = self.by_artifact.get(entry.artifact_sha256)
        if same is not None:  # another version of the same bytes, loaded here
            return same
        if entry.placement.load_seconds > 0:
            profile = entry.latency_profile
            warmup = sum(profile.get(size, 0.0) for size in self._warmup_sizes(entry)) * WARMUP_REPEATS
            return entry.placement.load_seconds + warmup
        if self.measured:
            return sum(c for _, c in self.measured.values()) / len(self.measured)
        return DEFAULT_COLD_START

    def measure(self, entry: VersionEntry, footprint: int, cold_start: float) -> None:
        self.measured[entry.key] = (footprint, cold_start)
        self.by_artifact[entry.artifact_sha256] = cold_start

    def spec(self, entry: VersionEntry, footprint: int | None = None) -> VersionSpec:
        p = entry.placement
        return VersionSpec(
            entry.key,
            self.footprint(entry) if footprint is None else footprint,
            min_memory=p.min_memory,
            accelerators=p.accelerators,
            pinned=p.pinned or entry.key in self.assigned,
            stable=entry.key in self.stable,
            min_replicas=p.min_replicas,
        )

    def refused(self, entry: VersionEntry) -> str | None:
        """The reason `entry` can never fit this node, if it was judged so on its current constraints."""
        found = self.unschedulable.get(entry.key)
        if found is not None and found[0] == constraints(entry):
            return found[1]
        return None

    def remaining(self, now: float, key: str | None = None) -> float:
        """Seconds until the load of `key` ends: loads run one at a time, in the order requests queued them
        (the load lock is first come, first served), so what is left of the ones ahead, then its own. With
        no `key`, until every queued load ends."""
        total = 0.0
        for queued, ticket in self.loading.items():
            total += ticket.left(now)
            if queued == key:
                break
        return total

    # -- records -------------------------------------------------------------------------------

    def record(self, kind: str, key: str, detail: str = "") -> None:
        event = Event(time.time(), kind, key, detail)
        self.events.append(event)
        if kind == "evict":
            self.evictions += 1
        elif kind == "load":
            self.loads += 1
        for listener in self.listeners:
            listener(event)

    def send(self, report: LoadReport) -> None:
        """Tell the registry, off the event loop's path; a failure (database down) is logged, not retried:
        the next load measures again."""
        if self._report is None:
            return
        task = asyncio.get_running_loop().create_task(self._send(report))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, report: LoadReport) -> None:
        try:
            await self._report(report)  # type: ignore[misc]
        except Exception as exc:
            log.warning("reporting %s:%s to the registry failed: %s", report.model, report.version, exc)
