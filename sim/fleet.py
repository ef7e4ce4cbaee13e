"""The simulated fleet: nodes (one accelerator each) hosting replicas, and the reconciler that moves
replica counts toward what the scaling policy wants.

Where a new replica goes is `serving.policies.placement.place`'s answer over the powered nodes of its
type, as the placement reconciler asks it: best fit by memory, and no node whose replicas would plan on
more than `max_device_load` of its compute (each replica's `load` is `placement.replica_load` of its share
of the demand it was sized for, the reconciler's too). When no powered node can take a replica, one more
node of the type is started, within the type's budget; past the budget the replica is unschedulable
(counted). Scale-in consolidates as the placement reconciler does, through the same
`placement.consolidate`: a device quiet for a while is emptied onto others, each replica make before break
(its new copy loads, with a cold start, and the old one goes once that is ready), so emptied devices power off.
Before it, relief (`placement.relieve`, as the reconciler relieves) moves replicas off a device whose co-located
replicas grew past it, make before break the same way. Nothing else moves a replica once placed: production does
not either. A version no policy scales (its family not autoscaled) has no minimum: where `place` finds room for a
new replica only by evicting it (idle, least recently used first), it is evicted, as a node makes room at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving.policies.placement import Move, NodeState, Resident, VersionSpec, consolidate, place, relieve
from sim.catalogue import SimVersion
from sim.scenario import NodeType, Scenario

GB = 2**30


@dataclass(eq=False, slots=True)
class Replica:
    version: SimVersion
    device: Device
    ready_at: float
    ready: bool = False
    removed: bool = False


@dataclass(eq=False)
class Device:
    name: str
    kind: NodeType
    hosted: list[Replica] = field(default_factory=list)
    busy_until: float = 0.0  # the end of the batch on the device; running while now is before it
    batch_version: SimVersion | None = None  # what that batch is of, and its rows (the rows in service)
    batch_rows: int = 0
    rr: int = 0  # round-robin position over hosted replicas
    ready_turn: float = 0.0
    wake_at: float = math.inf  # the live wake-up; a WAKE event at another time is stale
    on: bool = False
    on_since: float = 0.0
    on_seconds: float = 0.0
    busy_seconds: float = 0.0
    work_seconds: float = 0.0  # rows served x their version's best-batch seconds (serving.policies.utilisation)

    @property
    def memory_budget(self) -> int:
        return int(self.kind.memory_gb * GB)

    def refresh(self) -> None:
        """Recompute `ready_turn`, one full batch of every ready hosted version: the longest a device
        turn can take. Called whenever a replica here becomes ready or leaves."""
        self.ready_turn = sum(r.version.full_batch for r in self.hosted if r.ready)

    def state(self) -> NodeState:
        """The node as placement sees it: each replica here at its share of its version's demand, when its version
        last ran and what of it is queued or on a device (in flight: never evicted)."""
        hot = {
            r.version.key: Resident(
                spec_of(r.version, max(staying(r.version), 1)),
                r.version.last_used,
                r.version.queue.rows + r.version.in_service,
            )
            for r in self.hosted
        }
        return NodeState(self.name, self.kind.name, self.memory_budget, hot)


def staying(v: SimVersion) -> int:
    """Replicas of `v`, loading or ready; a consolidation move's second copy is not one of them."""
    return len(v.replicas) - v.moving


def spec_of(v: SimVersion, replicas: int) -> VersionSpec:
    """`v` as placement sees it with `replicas` sharing its demand. A simulated version is a stable one with a
    minimum replica, which placement never evicts (the reconciler alone scales it in), unless its family is not
    autoscaled: then it has no minimum, and placement may evict it when idle to make room."""
    return VersionSpec(
        v.key,
        v.memory_bytes,
        accelerators=frozenset({v.node.name}),
        stable=True,
        min_replicas=1 if v.family.autoscaled else 0,
        load=v.busy_share(v.demand / replicas),
    )


class Fleet:
    def __init__(self, scenario: Scenario) -> None:
        self.max_load = scenario.scaling.max_device_load
        scaling = scenario.scaling
        # From a decision to the load's start: the fleet's own delay where a twin measured it, else what is planned
        self.lead = scaling.scheduling_delay if scaling.placement_delay is None else scaling.placement_delay
        self.devices: dict[str, list[Device]] = {
            kind.name: [Device(f"{kind.name}-{i}", kind) for i in range(kind.nodes)] for kind in scenario.fleet
        }
        self.unschedulable = 0  # replicas wanted that found no node, summed over ticks
        self.cold_starts = 0
        self.events: list[tuple[float, Replica]] = []  # replicas started; the engine schedules their readiness
        scaling = scenario.scaling
        self.consolidation = (scaling.consolidate_below, scaling.consolidate_hold, scaling.consolidate_moves)
        self.relief = (scaling.relieve_above, scaling.relieve_moves)
        self.relieved = 0  # relief moves started
        self.quiet: dict[str, float] = {}  # device -> since when its load has been under the threshold
        self.moves: list[tuple[Move, Replica, Replica]] = []  # in flight: the move, its old copy, its new one
        self.moved = 0  # moves completed (the old copy unloaded once the new one was ready)
        # Replicas placement evicted to make room for another's load, with when: (at, replica). The engine answers
        # what waited for a version left with no replica ready, as at any unload.
        self.evicted: list[tuple[float, Replica]] = []

    def powered(self) -> list[Device]:
        return [d for ds in self.devices.values() for d in ds if d.on]

    def add(self, v: SimVersion, now: float, *, warm: bool = False) -> Replica | None:
        """Start one more replica of `v`; None when no node can take it."""
        pool = self.devices[v.node.name]
        placed = self._place(v, [d for d in pool if d.on], now)
        if placed is None:
            idle = next((d for d in pool if not d.on), None)
            if idle is None:
                self.unschedulable += 1
                return None
            self._power(idle, True, now)
            placed = self._place(v, [idle], now)
            if placed is None:  # footprint over a whole node: the scenario is wrong
                raise ValueError(f"{v.key} does not fit an empty {v.node.name} node")
        device, evict = placed
        for key in evict:  # idle versions without a minimum, least recently used first, as a node makes room
            victim = next(r for r in device.hosted if r.version.key == key)
            self.drop(victim, now, power_off=False)
            self.evicted.append((now, victim))
        return self._start(v, device, now, warm=warm)

    def _start(self, v: SimVersion, device: Device, now: float, *, warm: bool = False) -> Replica:
        ready_at = now if warm else now + self.lead + (v.load_s if v.load_s is not None else v.scaling.cold_start)
        replica = Replica(v, device, ready_at, ready=warm)
        device.hosted.append(replica)
        v.replicas.append(replica)
        if warm:
            v.ready_count += 1
            device.refresh()
        else:
            self.cold_starts += 1
            self.events.append((ready_at, replica))
        return replica

    def consolidation_step(self, now: float) -> None:
        """One consolidation step, as the placement reconciler takes it: break the moves whose new copy is ready
        (the old one drains: what it queued is the version's shared queue, which its other replicas serve), then
        start the moves `placement.consolidate` proposes over the powered devices."""
        below, hold, max_moves = self.consolidation
        still = []
        for move, old, new in self.moves:
            if old.removed or new.removed:  # scaled in meanwhile: whichever copy is left is a replica like any
                old.version.moving -= 1
            elif new.ready:
                old.version.moving -= 1
                self.drop(old, now)
                self.moved += 1
            else:
                still.append((move, old, new))
        self.moves = still
        self._relieve(now)
        if max_moves <= 0:
            return
        powered = self.powered()
        result = consolidate(
            [d.state() for d in powered],
            now=now,
            quiet=self.quiet,
            moving=[m for m, _, _ in self.moves],
            below=below,
            hold=hold,
            max_moves=max_moves,
            max_load=self.max_load,
        )
        self.quiet = result.quiet
        by_name = {d.name: d for d in powered}
        for move in result.moves:
            old = next(r for r in by_name[move.source].hosted if r.version.key == move.key)
            new = self._start(old.version, by_name[move.target], now)
            old.version.moving += 1
            self.moves.append((move, old, new))

    def _relieve(self, now: float) -> None:
        """Start the moves `placement.relieve` proposes: off powered devices whose replicas outgrew them, onto
        powered ones with room or, as the reconciler would onto a node the cluster's autoscaler adds, onto
        devices it powers on (offered as empty nodes, at most one per move it may start)."""
        above, max_moves = self.relief
        budget = max_moves - len(self.moves)
        if budget <= 0:
            return
        powered = self.powered()
        offered = [d for ds in self.devices.values() for d in [d for d in ds if not d.on][:budget]]
        candidates = powered + offered
        moves = relieve(
            [d.state() for d in candidates],
            now=now,
            moving=[m for m, _, _ in self.moves],
            above=above,
            max_load=self.max_load,
            max_moves=max_moves,
        )
        by_name = {d.name: d for d in candidates}
        for move in moves:
            old = next(r for r in by_name[move.source].hosted if r.version.key == move.key)
            target = by_name[move.target]
            self._power(target, True, now)
            new = self._start(old.version, target, now)
            old.version.moving += 1
            self.moves.append((move, old, new))
            self.relieved += 1

    def _place(self, v: SimVersion, candidates: list[Device], now: float) -> tuple[Device, list[str]] | None:
        """The node `place` picks for one more replica of `v`, among the candidates not holding one already (what
        `place` itself would keep rather than load: one replica of a version per node), and the versions it evicts
        there to make room."""
        nodes = [d.state() for d in candidates if all(r.version is not v for r in d.hosted)]
        if not nodes:
            return None
        spec = spec_of(v, staying(v) + 1)
        plan = place({v.key: 1}, {v.key: spec}, nodes, now=now, max_load=self.max_load)
        names = plan.loads and [name for name, keys in plan.loads.items() if v.key in keys]
        if not names:
            return None
        by_name = {d.name: d for d in candidates}
        return by_name[names[0]], list(plan.evictions.get(names[0], ()))

    def remove(self, v: SimVersion, now: float) -> Replica | None:
        """Scale `v` in by one, where `placement.place` scales in as the reconciler asks it (one replica fewer
        than it holds; a move's second copy counts, as the reconciler counts a move's copy while it loads): the
        lowest ranked goes, the old copy of a consolidation move (unless the last one ready), then a loading one
        (its cold start is wasted, not served), then a ready one; of equals, the one on the device holding the
        fewest versions."""
        if not v.replicas:
            return None
        # A move's old copy goes first unless it is the last one ready (its new copy still loading).
        leaving = {id(old) for _, old, new in self.moves if old.version is v and (new.ready or v.ready_count > 1)}
        nodes = []
        for r in v.replicas:
            state = r.device.state()
            rank = 0.5 if id(r) in leaving else 2.0 if r.ready else 1.5
            hot = {**state.hot, v.key: Resident(state.hot[v.key].spec, rank)}
            nodes.append(NodeState(state.name, state.accelerator, state.memory_budget, hot))
        spec = nodes[0].hot[v.key].spec
        plan = place({v.key: len(v.replicas) - 1}, {v.key: spec}, nodes, now=now, max_load=self.max_load)
        name = next(n for n, keys in plan.evictions.items() if v.key in keys)
        victim = next(r for r in v.replicas if r.device.name == name)
        self.drop(victim, now)
        return victim

    def drop(self, victim: Replica, now: float, *, power_off: bool = True) -> None:
        """Unload `victim`; its device powers off once empty and idle, unless `power_off` is False (an eviction,
        whose device takes another replica at once)."""
        v = victim.version
        v.replicas.remove(victim)
        victim.removed = True
        device = victim.device
        device.hosted.remove(victim)
        if victim.ready:
            v.ready_count -= 1
            device.refresh()
        if power_off and not device.hosted and device.busy_until <= now:
            self._power(device, False, now)

    def release_if_empty(self, device: Device, now: float) -> None:
        if device.on and not device.hosted and device.busy_until <= now:
            self._power(device, False, now)

    def _power(self, device: Device, on: bool, now: float) -> None:
        if on and not device.on:
            device.on, device.on_since = True, now
            device.busy_until = now
        elif not on and device.on:
            device.on = False
            device.on_seconds += now - device.on_since
            device.rr = 0

    def close(self, now: float) -> None:
        for ds in self.devices.values():
            for d in ds:
                if d.on:
                    d.on_seconds += now - d.on_since
                    d.on_since = now


def replicas_for(v: SimVersion, rate: float, target: float) -> int:
    """Replicas that serve `rate` at `target` of each one's capacity (at least one)."""
    return max(1, math.ceil(rate / (v.capacity.rate * target) - 0.01))
