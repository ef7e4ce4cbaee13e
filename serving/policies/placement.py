"""Placement: which versions a node holds in its memory budget, and which nodes get a version's replicas.

Plain Python, no Django, time passed in: the in-process node, the placement reconciler and the fleet
simulator call the same functions.

- `fit(spec, node, now=...)`: does one version fit one node now, and if only after evictions, which.
  Evicted are idle versions, least recently used first; never a pinned version, a stable version with
  minimum replicas, or a version with work in flight. A version that cannot fit the node even empty
  (its accelerator type not allowed, the node's memory under its minimum, a footprint over the budget)
  gets a permanent refusal naming the constraint; one blocked only by what must stay gets a transient
  refusal with the bytes it is short, so a caller can tell "never here" from "not now".
- Compute: a version's spec may carry `load`, the share of a device's compute one replica is planned to take
  (`replica_load`: its share of the version's rate at what its batches cost at that rate; 0 when unknown). A
  node whose residents' loads plus the new one's would pass `max_load` (1.0 by default: all of it) refuses it,
  transiently (`COMPUTE`), so two hot replicas are not stacked on one device that memory alone would allow.
  The placement reconciler and the fleet simulator both place through this check.
- `place(desired, specs, nodes, now=...)`: nodes for each version's desired replicas. Replicas already
  hot stay where they are; new ones go by best fit by memory among allowed accelerator types, preferring
  a node where the artifact is warm (in host memory, so the load skips the disk), then one that needs no
  eviction, then the tightest fit. Versions are placed pinned first, then largest first (best fit
  decreasing), so large versions are not left without a hole. What cannot be placed comes back as
  unschedulable with the reason. A version the plan wants fewer replicas of loses its least recently
  used idle ones (of equals, the one on the node holding the fewest versions, so nodes empty); one the
  plan does not mention stays where it is hot, but may be evicted (LRU, when idle and not kept) to make
  room for what the plan wants.
- `nodes_wanted(desired, specs, node_types)`: nodes wanted per accelerator type for the desired replicas,
  by first fit decreasing with one replica of a version per node: the demand an autoscaler reports to the
  cluster's own autoscaler. Not a lower bound by memory alone: a bin that holds 0.6 of a node twice is
  two nodes.
- `consolidate(nodes, now=..., quiet=..., moving=...)`: make-before-break moves that empty the least-loaded
  devices onto others within memory and `MAX_LOAD` of their compute, so scale-in frees devices and not only
  replicas: a device is emptied only after its planned load stayed under a threshold for a hold time, only
  when every replica on it has somewhere to go, and at most so many moves are in flight. The caller loads
  each move's copy on the target, and drains and unloads the source's once that copy is ready. The
  placement reconciler and the fleet simulator both consolidate through it.

Tiers: hot is on the device and uses the budget; warm is in host memory (it costs no device memory and
only shortens a load); cold is the node's disk cache, not modelled here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

ACCELERATOR = "accelerator"  # the node's accelerator type is not among the allowed
MIN_MEMORY = "min_memory"  # the node's memory is under the version's minimum
MEMORY = "memory"  # the footprint is over the node's whole budget
HELD = "held"  # it would fit, but what must stay (pinned, minimum replicas, in flight) holds the memory
COMPUTE = "compute"  # it would fit in memory, but the node's residents already plan on its compute
REPLICAS = "replicas"  # fewer eligible nodes than replicas wanted
PERMANENT = frozenset({ACCELERATOR, MIN_MEMORY, MEMORY})
# The share of a device's compute its replicas may plan on, as the reconciler and the simulator place (`max_load`)
# and consolidate: the rest absorbs what a forecast misses until the autoscaler's next replica is ready.
MAX_LOAD = 0.85


@dataclass(frozen=True, slots=True)
class VersionSpec:
    """One version as placement sees it: footprint, constraints and the flags that keep it loaded."""

    key: str
    footprint: int  # measured bytes on the device (an estimate before the first load)
    min_memory: int = 0  # a node's device memory must be at least this (activations, not only weights)
    accelerators: frozenset[str] = frozenset()  # allowed accelerator types; empty: any
    pinned: bool = False
    stable: bool = False
    min_replicas: int = 0
    load: float = 0.0  # device seconds a second one replica is planned to take (`replica_load`); 0: not known

    def __post_init__(self) -> None:
        if self.footprint < 0 or self.min_memory < 0 or self.min_replicas < 0 or self.load < 0:
            raise ValueError("footprint, min_memory, min_replicas and load must not be negative")

    @property
    def kept(self) -> bool:
        """Never evicted to make room: pinned, or the stable version of a model that asks for replicas."""
        return self.pinned or (self.stable and self.min_replicas > 0)


@dataclass(frozen=True, slots=True)
class Resident:
    """A version hot on a node: when it last served and how much of its work is in flight."""

    spec: VersionSpec
    last_used: float
    in_flight: int = 0

    @property
    def evictable(self) -> bool:
        return not self.spec.kept and self.in_flight == 0


@dataclass(frozen=True, slots=True)
class NodeState:
    name: str
    accelerator: str
    memory_budget: int  # bytes this node may fill with versions
    hot: Mapping[str, Resident] = field(default_factory=dict)  # by version key
    warm: frozenset[str] = frozenset()  # version keys whose artifacts sit in host memory
    memory_total: int | None = None  # the device's memory, for minimum-memory constraints; None: the budget

    @property
    def used(self) -> int:
        return sum(r.spec.footprint for r in self.hot.values())

    @property
    def free(self) -> int:
        return self.memory_budget - self.used

    @property
    def load(self) -> float:
        """Device seconds a second its residents are planned to take."""
        return sum(r.spec.load for r in self.hot.values())

    @property
    def device_memory(self) -> int:
        return self.memory_budget if self.memory_total is None else self.memory_total


@dataclass(frozen=True, slots=True)
class Fit:
    fits: bool
    evict: tuple[str, ...] = ()  # keys to evict first, least recently used first
    constraint: str = ""  # when it does not fit: one of ACCELERATOR, MIN_MEMORY, MEMORY, HELD
    short_bytes: int = 0  # memory missing even after every allowed eviction
    reason: str = ""

    @property
    def permanent(self) -> bool:
        """The node can never take it, whatever leaves: retrying here is pointless."""
        return self.constraint in PERMANENT


def _mib(n: int) -> str:
    """Bytes for a reason a person reads: 512 B, 96.0 KiB, 1.5 MiB, 2.0 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_constraints(spec: VersionSpec, node: NodeState) -> Fit | None:
    """The permanent refusal for this node, or None when an empty node of its kind could hold it."""
    if spec.accelerators and node.accelerator not in spec.accelerators:
        allowed = ", ".join(sorted(spec.accelerators))
        return Fit(
            False,
            constraint=ACCELERATOR,
            reason=f"{spec.key} runs only on {allowed}; node {node.name} is {node.accelerator}",
        )
    if node.device_memory < spec.min_memory:
        short = spec.min_memory - node.device_memory
        return Fit(
            False,
            constraint=MIN_MEMORY,
            short_bytes=short,
            reason=f"{spec.key} needs a device of at least {_mib(spec.min_memory)}; node {node.name} has"
            f" {_mib(node.device_memory)} ({_mib(short)} short)",
        )
    if spec.footprint > node.memory_budget:
        short = spec.footprint - node.memory_budget
        return Fit(
            False,
            constraint=MEMORY,
            short_bytes=short,
            reason=f"{spec.key} needs {_mib(spec.footprint)}, over node {node.name}'s whole budget of"
            f" {_mib(node.memory_budget)} ({_mib(short)} short)",
        )
    return None


def replica_load(rate: float, estimate: Callable[[int], float], max_batch_size: int, window: float = 0.0) -> float:
    """Device seconds a second one replica serving `rate` requests a second takes: its batches hold what gathers
    over one batch window and a batch of one (at most `max_batch_size`), each paying the profile's cost, so a
    quiet version packed beside others pays its fixed cost per small batch. A window of 0 (not known) plans on
    the smallest batches, the safe side."""
    if rate <= 0:
        return 0.0
    rows = min(max(1, round(rate * (window + estimate(1)))), max_batch_size)
    return rate * estimate(rows) / rows


def fit(
    spec: VersionSpec,
    node: NodeState,
    *,
    now: float = 0.0,
    min_idle: float = 0.0,
    keep: Iterable[str] = (),
    max_load: float = 1.0,
) -> Fit:
    """Whether `spec` fits `node` now, and which idle versions to evict (LRU) if it fits only after that.

    A resident used less than `min_idle` seconds before `now` is not evicted (it is about to be used
    again; evicting it would thrash), nor is any key in `keep` (what a caller has just placed there). A node
    whose residents' planned loads and this one's pass `max_load` refuses it (`COMPUTE`, transient).
    """
    refused = check_constraints(spec, node)
    if refused is not None:
        return refused
    if spec.key in node.hot:
        return Fit(True)
    # An empty node takes any load: a replica alone on its device is the scaling policy's to multiply.
    if spec.load > 0 and node.hot and node.load + spec.load > max_load + 1e-9:
        return Fit(
            False,
            constraint=COMPUTE,
            reason=f"{spec.key} plans on {spec.load:.0%} of a device; node {node.name}'s residents already plan on"
            f" {node.load:.0%} of its {max_load:.0%}",
        )
    free = node.free
    if spec.footprint <= free:
        return Fit(True)
    keep = set(keep)
    candidates = sorted(
        (r for key, r in node.hot.items() if r.evictable and key not in keep and now - r.last_used >= min_idle),
        key=lambda r: (r.last_used, r.spec.key),
    )
    evict: list[str] = []
    for resident in candidates:
        evict.append(resident.spec.key)
        free += resident.spec.footprint
        if spec.footprint <= free:
            return Fit(True, tuple(evict))
    short = spec.footprint - free
    # Counted, never named: this reason reaches the version's own tenant (the fleet page, the repository index,
    # a 503), and the versions holding the memory may be other tenants' private ones.
    held = sum(1 for key in node.hot if key not in evict)
    return Fit(
        False,
        constraint=HELD,
        short_bytes=short,
        reason=f"{spec.key} needs {_mib(spec.footprint)}; node {node.name} is {_mib(short)} short after"
        f" evicting every idle version ({_held_by(held)})",
    )


def _held_by(n: int) -> str:
    """What holds the memory a refused version is short of, as a count (see `fit`)."""
    if n == 0:
        return "held by nothing"
    return f"held by {n} other version{'' if n == 1 else 's'} that must stay"


@dataclass(frozen=True, slots=True)
class Unschedulable:
    key: str
    constraint: str
    reason: str
    short_bytes: int = 0
    placed: int = 0  # replicas that did find a node
    wanted: int = 0

    @property
    def permanent(self) -> bool:
        return self.constraint in PERMANENT


@dataclass(frozen=True, slots=True)
class Placement:
    assignments: dict[str, tuple[str, ...]]  # version key -> node names holding its replicas (kept and new)
    loads: dict[str, tuple[str, ...]]  # node -> version keys to load there
    evictions: dict[str, tuple[str, ...]]  # node -> version keys to unload first (LRU, or scaled in)
    unschedulable: dict[str, Unschedulable]


@dataclass
class _Bin:
    """A node while the plan fills it."""

    state: NodeState
    hot: dict[str, Resident]
    keep: set[str] = field(default_factory=set)
    loads: list[str] = field(default_factory=list)
    evictions: list[str] = field(default_factory=list)

    def view(self) -> NodeState:
        return NodeState(
            self.state.name,
            self.state.accelerator,
            self.state.memory_budget,
            self.hot,
            self.state.warm,
            self.state.memory_total,
        )


def place(
    desired: Mapping[str, int],
    specs: Mapping[str, VersionSpec],
    nodes: Sequence[NodeState],
    *,
    now: float = 0.0,
    min_idle: float = 0.0,
    max_load: float = 1.0,
) -> Placement:
    """Nodes for the desired replicas of each version (key -> count); see the module's docstring."""
    bins = {n.name: _Bin(n, dict(n.hot)) for n in nodes}
    if len(bins) != len(nodes):
        raise ValueError("node names must be unique")
    for key in desired:
        if key not in specs:
            raise ValueError(f"no spec for {key}")
    assignments: dict[str, list[str]] = {}
    # Replicas already hot stay (most recently used first); extras beyond the desired count are scaled in.
    for key in desired:
        # Least recently used go first; of equals, the one on the node holding the fewest versions, so scale-in
        # empties nodes (the reconciler's and the simulator's scale-in both come through here).
        holders = sorted(
            (b for b in bins.values() if key in b.hot),
            key=lambda b: (-b.hot[key].last_used, -len(b.hot), b.state.name),
        )
        kept = holders[: max(0, desired[key])]
        assignments[key] = [b.state.name for b in kept]
        for b in kept:
            b.keep.add(key)
            # What the plan wants serves now: a later placement may not evict it.
            b.hot[key] = Resident(specs[key], b.hot[key].last_used, b.hot[key].in_flight)
        for b in holders[len(kept) :]:
            # Not `evictable`: a kept version (stable, with a minimum) is kept from eviction by others, but the
            # desired count already covers its minimum, so its replicas above that count may go.
            if b.hot[key].in_flight == 0:
                del b.hot[key]
                b.evictions.append(key)
    unschedulable: dict[str, Unschedulable] = {}
    order = sorted(desired, key=lambda k: (not specs[k].pinned, -specs[k].footprint, k))
    for key in order:
        spec = specs[key]
        want = max(0, desired[key])
        last: Fit | None = None
        while len(assignments[key]) < want:
            candidates = [b for b in bins.values() if b.state.name not in assignments[key]]
            choice = _best(spec, candidates, now, min_idle, max_load)
            if isinstance(choice, Fit) or choice is None:
                last = choice
                break
            target, verdict = choice
            for victim in verdict.evict:
                del target.hot[victim]
                target.evictions.append(victim)
            target.hot[key] = Resident(spec, now)
            target.keep.add(key)
            target.loads.append(key)
            assignments[key].append(target.state.name)
        placed = len(assignments[key])
        if placed < want:
            unschedulable[key] = _refusal(spec, nodes, last, placed, want)
    return Placement(
        {k: tuple(v) for k, v in assignments.items()},
        {name: tuple(b.loads) for name, b in bins.items() if b.loads},
        {name: tuple(b.evictions) for name, b in bins.items() if b.evictions},
        unschedulable,
    )


def _best(
    spec: VersionSpec, bins: list[_Bin], now: float, min_idle: float, max_load: float = 1.0
) -> tuple[_Bin, Fit] | Fit | None:
    """The best bin for one more replica; else the most telling refusal (a transient one over a permanent
    one, then the smallest shortfall); None when no node is left to try."""
    best: tuple[tuple[int, int, int, str], _Bin, Fit] | None = None
    refusal: Fit | None = None
    for b in bins:
        verdict = fit(spec, b.view(), now=now, min_idle=min_idle, keep=b.keep, max_load=max_load)
        if not verdict.fits:
            if refusal is None or (refusal.permanent, refusal.short_bytes) > (verdict.permanent, verdict.short_bytes):
                refusal = verdict
            continue
        freed = sum(b.hot[k].spec.footprint for k in verdict.evict)
        leftover = b.state.memory_budget - sum(r.spec.footprint for r in b.hot.values()) + freed - spec.footprint
        rank = (spec.key not in b.state.warm, len(verdict.evict), leftover, b.state.name)
        if best is None or rank < best[0]:
            best = (rank, b, verdict)
    if best is not None:
        return best[1], best[2]
    return refusal


def _refusal(spec: VersionSpec, nodes: Sequence[NodeState], last: Fit | None, placed: int, want: int) -> Unschedulable:
    if last is None:  # every eligible node already holds a replica
        eligible = sum(1 for n in nodes if check_constraints(spec, n) is None)
        return Unschedulable(
            spec.key,
            REPLICAS,
            f"{spec.key} wants {want} replicas, one per node; {eligible} eligible nodes",
            placed=placed,
            wanted=want,
        )
    return Unschedulable(spec.key, last.constraint, last.reason, last.short_bytes, placed, want)


def nodes_wanted(
    desired: Mapping[str, int],
    specs: Mapping[str, VersionSpec],
    node_types: Mapping[str, int],
    *,
    device_memory: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, str]]:
    """Nodes wanted per accelerator type to hold the desired replicas, and the versions no type can hold.

    `node_types` is each type's memory budget per node, in order of preference: a version allowed on
    several types goes to the first that can hold it. Replicas are packed first fit decreasing, one per
    node per version, so the count is what a packer needs, not only total memory over a node's.
    """
    chosen: dict[str, list[tuple[int, str, int]]] = {kind: [] for kind in node_types}
    impossible: dict[str, str] = {}
    for key, count in desired.items():
        spec = specs[key]
        if count <= 0:
            continue
        kind = next(
            (
                t
                for t, budget in node_types.items()
                if (not spec.accelerators or t in spec.accelerators)
                and spec.footprint <= budget
                and (device_memory or {}).get(t, budget) >= spec.min_memory
            ),
            None,
        )
        if kind is None:
            impossible[key] = f"{spec.key} fits no accelerator type on offer ({', '.join(node_types) or 'none'})"
            continue
        chosen[kind].append((spec.footprint, key, count))
    wanted: dict[str, int] = {}
    for kind, items in chosen.items():
        budget = node_types[kind]
        bins: list[tuple[int, set[str]]] = []  # (free bytes, versions in it)
        for footprint, key, count in sorted(items, key=lambda i: (-i[0], i[1])):
            for _ in range(count):
                for i, (free, held) in enumerate(bins):
                    if key not in held and footprint <= free:
                        held.add(key)
                        bins[i] = (free - footprint, held)
                        break
                else:
                    bins.append((budget - footprint, {key}))
        wanted[kind] = len(bins)
    return wanted, impossible


# -- consolidation: scale-in frees devices, not only replicas ----------------------------------------

CONSOLIDATE_BELOW = 0.5  # a device whose replicas plan on less than this share of it is a candidate to empty
CONSOLIDATE_HOLD = 300.0  # seconds a device stays under CONSOLIDATE_BELOW before its replicas move
CONSOLIDATE_MOVES = 2  # moves in flight at once, fleet-wide
CONSOLIDATE_TRIES = 16  # candidate devices a step tries to empty at most (bounds its cost on a large fleet)


@dataclass(frozen=True, slots=True)
class Move:
    """One replica moving, make before break: load `key` on `target`; once that copy is ready, drain and unload
    the one on `source`. Until then both count, so the version never has fewer replicas than it wants."""

    key: str
    source: str
    target: str
    started: float = 0.0


@dataclass(frozen=True, slots=True)
class Consolidation:
    moves: tuple[Move, ...]  # to start now
    quiet: dict[str, float]  # node -> since when its planned load has been under `below`: the caller keeps it
    emptying: tuple[str, ...]  # nodes every placed replica of which is moving or planned to move away


def consolidate(
    nodes: Sequence[NodeState],
    *,
    now: float,
    quiet: Mapping[str, float],
    moving: Sequence[Move] = (),
    placed: Mapping[str, Iterable[str]] | None = None,
    below: float = CONSOLIDATE_BELOW,
    hold: float = CONSOLIDATE_HOLD,
    max_moves: int = CONSOLIDATE_MOVES,
    max_load: float = MAX_LOAD,
    tries: int = CONSOLIDATE_TRIES,
) -> Consolidation:
    """Moves that empty the least-loaded devices onto others, so the emptied ones can be powered off.

    `nodes` are the live (powered) nodes with every resident; `placed` names, per node, the residents that are
    placed replicas (what consolidation moves, and what keeps a device in use; default: every resident). The
    hysteresis: a node is a source only once its residents' planned load (`VersionSpec.load`) has stayed under
    `below` for `hold` seconds (`quiet`, the since-when per node that this step returns for the next), and at
    most `max_moves` moves are in flight at once (`moving`, the caller's moves not yet done). A source is
    started only when every replica it holds has a target now; sources already draining go first. A target
    is a node that holds placed replicas, is not being emptied, does not hold the version yet, and takes
    the replica within its memory (evicting only idle unplaced residents, `fit`) and within `max_load` of its
    compute; the fullest such node is picked, so load goes where load is. A node receiving a move is not a
    source, so nothing moves twice in one direction and back.
    """
    placed_by = {n.name: set(n.hot) if placed is None else set(placed.get(n.name, ())) & set(n.hot) for n in nodes}
    by_name = {n.name: n for n in nodes}
    loads = {n.name: sum(n.hot[k].spec.load for k in placed_by[n.name]) for n in nodes}
    new_quiet = {n.name: min(quiet.get(n.name, now), now) for n in nodes if placed_by[n.name] and loads[n.name] < below}
    moving = [m for m in moving if m.source in by_name and m.target in by_name]
    budget = max_moves - len(moving)
    draining = {m.source for m in moving}
    receiving = {m.target for m in moving}
    in_motion = {(m.source, m.key) for m in moving}
    if budget <= 0:
        return Consolidation((), new_quiet, tuple(sorted(draining)))
    # Targets as the step fills them: their residents, what must stay, and their planned load.
    hot = {n.name: dict(n.hot) for n in nodes}
    keep = {name: set(keys) for name, keys in placed_by.items()}
    sources = [
        n
        for n in nodes
        if n.name not in receiving
        and placed_by[n.name] - {k for s, k in in_motion if s == n.name}
        and (n.name in draining or (n.name in new_quiet and now - new_quiet[n.name] >= hold))
    ]
    sources.sort(key=lambda n: (n.name not in draining, loads[n.name], n.used, n.name))
    chosen: set[str] = set()
    targets_used: set[str] = set(receiving)
    moves: list[Move] = []
    for source in sources[: max(0, tries)]:
        if budget <= 0:
            break
        if source.name in targets_used:
            continue
        stay = sorted(
            (k for k in placed_by[source.name] if (source.name, k) not in in_motion),
            key=lambda k: (-source.hot[k].spec.footprint, k),
        )
        planned: list[tuple[str, str]] = []  # (key, target)
        added: dict[str, dict[str, Resident]] = {}
        for key in stay:  # largest first: they are the hardest to fit
            spec = source.hot[key].spec
            best: tuple[tuple[float, int, str], str] | None = None
            for target in nodes:
                name = target.name
                if name == source.name or name in chosen or name in draining or not placed_by[name]:
                    continue
                if key in hot[name] or key in added.get(name, {}):
                    continue  # one replica of a version per node
                view_hot = {**hot[name], **added.get(name, {})}
                view = NodeState(
                    name, target.accelerator, target.memory_budget, view_hot, target.warm, target.memory_total
                )
                verdict = fit(spec, view, now=now, keep=keep[name] | set(added.get(name, {})), max_load=max_load)
                if not verdict.fits:
                    continue
                load_after = sum(view_hot[k].spec.load for k in view_hot) + spec.load
                rank = (-load_after, view.free - spec.footprint, name)
                if best is None or rank < best[0]:
                    best = (rank, name)
            if best is None:
                break
            added.setdefault(best[1], {})[key] = Resident(spec, now)
            planned.append((key, best[1]))
        if len(planned) < len(stay):
            continue  # some replica of it fits nowhere now: moving the others would free nothing
        chosen.add(source.name)
        for key, target_name in planned[:budget]:
            moves.append(Move(key, source.name, target_name, now))
            hot[target_name][key] = Resident(source.hot[key].spec, now)
            keep[target_name].add(key)
            targets_used.add(target_name)
        budget -= min(budget, len(planned))
    emptying = draining | chosen
    return Consolidation(tuple(moves), new_quiet, tuple(sorted(emptying)))


# -- relief: co-located replicas that outgrew their device --------------------------------------------

RELIEVE_ABOVE = 1.0  # a device whose replicas plan on more than all of its compute is relieved
RELIEVE_MOVES = 16  # moves in flight at once, fleet-wide, that relief may bring the total to


def relieve(
    nodes: Sequence[NodeState],
    *,
    now: float,
    moving: Sequence[Move] = (),
    placed: Mapping[str, Iterable[str]] | None = None,
    above: float = RELIEVE_ABOVE,
    max_load: float = MAX_LOAD,
    max_moves: int = RELIEVE_MOVES,
) -> tuple[Move, ...]:
    """Make-before-break moves off devices whose placed replicas now plan on more than `above` of their compute.

    `place` checks a device's compute when a replica arrives, at the demand then; replicas that share a device
    and grow together (a ramp, a daily rush) pass it later, and nothing else would notice: each version's
    autoscaler sizes its replicas as if each had a device of its own. Each resident's `load` is its planned
    share at the demand it is sized for now (the autoscaler's forecast, one lead time ahead), so relief starts
    before the device saturates. From the most loaded device, its replicas move, largest load first (fewest
    moves), until what stays is within `max_load`; a replica alone on its device is the autoscaler's to
    multiply, not relief's. A target takes the replica within its memory (evicting only idle unplaced
    residents, `fit`) and within `max_load`; devices already serving go first, the least loaded (room for
    what is still growing), then empty ones (a caller offers those it may power). Replicas moving away
    (`moving`) no longer count on their source; at most `max_moves` moves, counting `moving`, are in flight.
    The placement reconciler and the fleet simulator both relieve through it, before they consolidate.
    """
    placed_by = {n.name: set(n.hot) if placed is None else set(placed.get(n.name, ())) & set(n.hot) for n in nodes}
    budget = max_moves - len(moving)
    if budget <= 0:
        return ()
    leaving = {(m.source, m.key) for m in moving}
    draining = {m.source for m in moving}
    staying = {n.name: {k for k in placed_by[n.name] if (n.name, k) not in leaving} for n in nodes}
    hot = {n.name: dict(n.hot) for n in nodes}
    keep = {name: set(keys) for name, keys in placed_by.items()}
    load = {n.name: sum(n.hot[k].spec.load for k in staying[n.name]) for n in nodes}
    moves: list[Move] = []
    sources = sorted(
        (n for n in nodes if load[n.name] > above + 1e-9 and len(staying[n.name]) > 1),
        key=lambda n: (-load[n.name], n.name),
    )
    relieved: set[str] = set()
    for source in sources:
        candidates = sorted(staying[source.name], key=lambda k: (-source.hot[k].spec.load, k))
        for key in candidates:
            if budget <= 0 or load[source.name] <= max_load + 1e-9 or len(staying[source.name]) <= 1:
                break
            spec = source.hot[key].spec
            best: tuple[tuple[bool, float, int, str], NodeState] | None = None
            for target in nodes:
                name = target.name
                if name == source.name or name in relieved or name in draining or key in hot[name]:
                    continue
                if load[name] > above + 1e-9:
                    continue  # overloaded itself: the next to be relieved, not a target
                view = NodeState(
                    name, target.accelerator, target.memory_budget, hot[name], target.warm, target.memory_total
                )
                if not fit(spec, view, now=now, keep=keep[name], max_load=max_load).fits:
                    continue
                rank = (not staying[name], load[name] + spec.load, -view.free, name)
                if best is None or rank < best[0]:
                    best = (rank, target)
            if best is None:
                continue  # a smaller replica may still fit somewhere
            target = best[1]
            moves.append(Move(key, source.name, target.name, now))
            budget -= 1
            hot[target.name][key] = Resident(spec, now)
            keep[target.name].add(key)
            staying[target.name].add(key)
            load[target.name] += spec.load
            staying[source.name].discard(key)
            load[source.name] -= spec.load
        relieved.add(source.name)
    return tuple(moves)
