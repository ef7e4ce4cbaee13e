"""The placement reconciler: desired replicas per version, turned into load and unload tasks on the nodes.

A version's desired replicas are max(min_replicas, desired_replicas or 0). A version whose desired is 0 is
not placed: every node serves it, loading it on demand within its budget (the node's packing). A version
whose desired is above 0 is placed by `serving.policies.placement.place` over the live fleet (the nodes'
heartbeats in Redis): its replicas go to the nodes the plan picks, as `serving.node.load` tasks on each
node's own queue, and the nodes that hold more than desired get `serving.node.unload` (never below desired:
the plan keeps the replicas already there first). Once a live node holds a version by assignment, the
nodes it is not assigned to stop serving it (`NodeProcess.hosted_keys`). What the plan cannot place is
marked unschedulable on the version, with the reason.

Scale-in consolidates (`serving.policies.placement.consolidate`, the function the fleet simulator
consolidates through): a node whose placed replicas have planned on under `CONSOLIDATE_BELOW` of its compute
for `FERRY_CONSOLIDATE_HOLD_SECONDS` is emptied onto others, make before break. A move sends a load to the
target and is recorded in Redis (`MOVES_KEY`); while the copy loads the version is planned with one replica
more, so neither copy is scaled in; once the target's heartbeat shows the copy hot, the source's copy ranks
last and the placement scales it in (a `serving.node.unload`, which drains first). At most
`FERRY_CONSOLIDATE_MOVES` are in flight; a node's quiet-since time is kept in Redis too (`QUIET_KEY`).

Relief (`serving.policies.placement.relieve`, the simulator's too) comes first: a node whose placed replicas, at
the device shares the autoscaler last sized them for (`LOAD_KEY`), plan on more than all of its compute sheds
replicas onto nodes with room, as the same make-before-break moves, at most `FERRY_RELIEVE_MOVES` in flight.

`reconcile()` is one step, run by the Celery task `serving.tasks.reconcile_placements` on a beat schedule
and whenever a version's desired state changes (`serving.tasks.request_reconcile`); the task hands it the
sender of node tasks (`serving.node_tasks.send_plan`), so this module imports no task. It is idempotent: a
task sent and not yet done is recorded in Redis (`PENDING_KEY`) until the node's heartbeat shows its
outcome, so the next step does not send it again; and two steps at once do not both act (a lock in Redis, `LOCK_KEY`,
owned by a token: a step renews it before each of its writes and stops, writing nothing more, once it is no longer
its own, so a step that outlived the lock never acts beside the next one).
A step reads the pending records before the heartbeats (see `reconcile`): the node clears a record only after
the heartbeat that shows its outcome, so in that order no finished task is missed by both reads.

`plan()` is the pure part (no Django, no Redis), unit-tested on its own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import redis
from django.conf import settings
from django.utils import timezone
from redis.exceptions import LockError, LockNotOwnedError
from redis.lock import Lock

from serving import replicas
from serving.dataplane.transport import fleet
from serving.models import ModelVersion
from serving.policies.placement import (
    CONSOLIDATE_BELOW,
    CONSOLIDATE_HOLD,
    CONSOLIDATE_MOVES,
    MAX_LOAD,
    RELIEVE_ABOVE,
    RELIEVE_MOVES,
    Move,
    NodeState,
    Placement,
    Resident,
    VersionSpec,
    consolidate,
    place,
    relieve,
)
from serving.publish import publish_snapshot

log = logging.getLogger(__name__)

LOCK_KEY = "ferry:placement:lock"
PENDING_KEY = "ferry:placement:pending"  # field "<op>|<node>|<version key>" -> epoch seconds it lapses
# field <version key> -> the device share one replica plans on (`placement.replica_load`), as the autoscaler's
# last tick sized it (autoscaling.tick); a version without one is placed by memory alone.
LOAD_KEY = "ferry:placement:load"
MOVES_KEY = "ferry:placement:moves"  # field "<version key>|<source>|<target>" -> epoch seconds it started
QUIET_KEY = "ferry:placement:quiet"  # field <node> -> epoch seconds since its planned load is under the threshold
# A move whose copy is not hot on its target by then is given up (the load's expiry, its deadline, and slack).
MOVE_TIMEOUT_SECONDS = 600.0
# A step's lock lapses this long after its last renewal (a reconciler killed mid-step frees it by then); the task's
# time limit (serving.tasks.reconcile_placements, CELERY_TASK_ANNOTATIONS) ends a step before it would.
LOCK_SECONDS = 30
REASON_PREFIX = "placement: "  # what this module writes into unschedulable_reason (nodes write their own)


@dataclass(frozen=True, slots=True)
class Pending:
    op: str  # load | unload
    node: str
    key: str

    @property
    def field(self) -> str:
        return f"{self.op}|{self.node}|{self.key}"

    @classmethod
    def parse(cls, raw: str) -> Pending:
        op, node, key = raw.split("|", 2)
        return cls(op, node, key)


@dataclass(frozen=True)
class Plan:
    loads: list[tuple[str, str]] = field(default_factory=list)  # (node, version key)
    unloads: list[tuple[str, str]] = field(default_factory=list)  # scaled in: unload there now
    releases: list[tuple[str, str]] = field(default_factory=list)  # desired 0 now: no longer kept there
    unschedulable: dict[str, str] = field(default_factory=dict)  # version key -> why
    placed: dict[str, tuple[str, ...]] = field(default_factory=dict)  # version key -> nodes holding it after
    moves: list[Move] = field(default_factory=list)  # consolidation moves in flight after this step (new ones too)
    quiet: dict[str, float] = field(default_factory=dict)  # node -> since when it is quiet, for the next step


@dataclass(frozen=True, slots=True)
class Consolidating:
    """The settings of a step's moves: consolidation's (`placement.consolidate`; `moves` 0 turns it off) and
    relief's (`placement.relieve`; `relieve_moves` 0 turns it off). Each bounds all moves in flight, of
    either kind, so consolidation waits while relief is under way."""

    moves: int = CONSOLIDATE_MOVES
    hold: float = CONSOLIDATE_HOLD
    below: float = CONSOLIDATE_BELOW
    relieve_moves: int = RELIEVE_MOVES
    relieve_above: float = RELIEVE_ABOVE


def holdings(nodes: Sequence[fleet.NodeInfo], pending: Sequence[Pending]) -> dict[str, set[str]]:
    """Per node, the versions it holds by assignment: those its heartbeat says, plus loads sent to it and not
    yet done, less unloads sent and not yet done."""
    held = {n.name: set(n.assigned) for n in nodes}
    for p in pending:
        if p.node in held:
            (held[p.node].add if p.op == "load" else held[p.node].discard)(p.key)
    return held


def plan(
    wants: Mapping[str, int],
    specs: Mapping[str, VersionSpec],
    nodes: Sequence[fleet.NodeInfo],
    pending: Sequence[Pending] = (),
    *,
    now: float = 0.0,
    moves: Sequence[Move] = (),
    quiet: Mapping[str, float] | None = None,
    consolidating: Consolidating | None = None,
) -> Plan:
    """What to do so that each version in `wants` (key -> desired replicas) has that many replicas on the
    live `nodes`. Versions hot on a node without an assignment (loaded there on demand) count as replicas
    already in place: assigning them there costs no load. `moves` are the consolidation moves in flight (the
    last step's `Plan.moves`), `quiet` the last step's `Plan.quiet`; `consolidating` None: no consolidation."""
    held = holdings(nodes, pending)
    live = {n.name: n for n in nodes}
    desired = {k: count for k, count in wants.items() if count > 0 and k in specs}
    # Moves in flight: over when the old copy went, given up when the new one did (or never came); made when the
    # new copy is hot on its target, and then the old one is scaled in; else still loading. The old copy ranks
    # last: made, it is the one scaled in; loading, it is the first to go if the version scales in meanwhile
    # (which empties the device the move was for), unless it is the last copy hot. Fleet.remove ranks the same.
    hot_copies: dict[str, int] = {}
    for n in nodes:
        for key in held[n.name] & n.hot - n.loading:
            hot_copies[key] = hot_copies.get(key, 0) + 1
    loading: list[Move] = []
    leaving: set[tuple[str, str]] = set()
    for m in moves:
        if m.source not in live or m.target not in live or m.key not in desired or m.key not in held[m.source]:
            continue
        if m.key not in held[m.target] or m.key in live[m.target].failures:
            continue
        if m.key in live[m.target].hot and m.key not in live[m.target].loading:
            leaving.add((m.source, m.key))
        elif now - m.started <= MOVE_TIMEOUT_SECONDS:
            if hot_copies.get(m.key, 0) > 1:
                leaving.add((m.source, m.key))
            loading.append(m)
    states = []
    for n in nodes:
        hot = {}
        for key in n.hot | held[n.name]:
            spec = specs.get(key)
            if spec is not None:
                # Scale-in drops the lowest first: a move's old copy, an assigned copy still loading, an
                # on-demand copy, and an assigned one loaded last (the simulator's Fleet.remove ranks the same).
                if (n.name, key) in leaving:
                    rank = 0.5
                elif key in held[n.name]:
                    rank = 2.0 if key in n.hot and key not in n.loading else 1.5
                else:
                    rank = 1.0
                hot[key] = Resident(spec, last_used=rank)
        states.append(NodeState(n.name, n.accelerator, n.memory_budget, hot, warm=n.warm, memory_total=n.memory_total))
    # While a move's copy loads, the version has one replica more: neither copy is scaled in meanwhile.
    counts = dict(desired)
    for m in loading:
        counts[m.key] += 1
    placement = place(counts, specs, states, now=now, max_load=MAX_LOAD)
    result = Plan(unschedulable={k: u.reason for k, u in placement.unschedulable.items()}, placed=placement.assignments)
    failures = {n.name: n.failures for n in nodes}
    for key, names in placement.assignments.items():
        for name in names:
            if key in held[name]:
                continue
            failed = failures[name].get(key)
            if failed:  # not sent again until the node forgets it (the version changes): never a silent retry loop
                result.unschedulable.setdefault(key, f"{key} failed to load on {name}: {failed}")
                continue
            result.loads.append((name, key))
    for name, keys in placement.evictions.items():
        # Only scale-in of assigned replicas: LRU evictions to make room are the node's own, at load time.
        result.unloads.extend((name, key) for key in keys if key in desired and key in held[name])
    for name, keys in held.items():
        result.releases.extend((name, key) for key in sorted(keys) if key not in desired)
    result.moves.extend(loading)
    if consolidating is not None and (consolidating.moves > 0 or consolidating.relieve_moves > 0):
        _move(result, placement, states, specs, failures, consolidating, quiet or {}, now)
    return result


def _move(
    result: Plan,
    placement: Placement,
    states: Sequence[NodeState],
    specs: Mapping[str, VersionSpec],
    failures: Mapping[str, Mapping[str, str]],
    settings_: Consolidating,
    quiet: Mapping[str, float],
    now: float,
) -> None:
    """Relief, then consolidation, moves over the fleet as this step leaves it (its loads made, its evictions
    gone): each new move is a load on its target, recorded in `result.moves` so that the next steps make it,
    then break it."""
    placed: dict[str, set[str]] = {s.name: set() for s in states}
    for key, names in placement.assignments.items():
        for name in names:
            placed[name].add(key)
    after = []
    for s in states:
        hot = {k: r for k, r in s.hot.items() if k not in placement.evictions.get(s.name, ())}
        hot.update({k: Resident(specs[k], now) for k in placement.loads.get(s.name, ())})
        after.append(NodeState(s.name, s.accelerator, s.memory_budget, hot, s.warm, s.memory_total))
    relief: tuple[Move, ...] = ()
    if settings_.relieve_moves > 0:
        relief = relieve(
            after,
            now=now,
            moving=result.moves,
            placed=placed,
            above=settings_.relieve_above,
            max_load=MAX_LOAD,
            max_moves=settings_.relieve_moves,
        )
    _start_moves(result, relief, failures)
    if settings_.moves <= 0:
        return
    proposed = consolidate(
        after,
        now=now,
        quiet=quiet,
        moving=result.moves,
        placed=placed,
        below=settings_.below,
        hold=settings_.hold,
        max_moves=settings_.moves,
        max_load=MAX_LOAD,
    )
    result.quiet.update(proposed.quiet)
    _start_moves(result, proposed.moves, failures)


def _start_moves(result: Plan, moves: Sequence[Move], failures: Mapping[str, Mapping[str, str]]) -> None:
    for move in moves:
        if move.key in failures.get(move.target, {}):
            continue  # never a silent retry of a load that failed there
        result.loads.append((move.target, move.key))
        result.moves.append(move)


# -- the step, on the registry and the fleet ----------------------------------------------------------


def read_fleet(client: redis.Redis) -> list[fleet.NodeInfo]:
    """The live nodes (`fleet.read_fleet`, on a synchronous client)."""
    names = sorted(n.decode() for n in client.smembers(fleet.NODES_KEY))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(fleet.node_key(name))
    nodes = []
    for name, raw in zip(names, pipe.execute() if names else [], strict=True):
        if not raw:
            continue
        try:
            nodes.append(fleet.NodeInfo.from_hash(raw))
        except (TypeError, ValueError) as exc:
            log.warning("node %s wrote a heartbeat the reconciler cannot read: %s", name, exc)
    return nodes


def read_pending(client: redis.Redis, now: float) -> list[Pending]:
    found, lapsed = [], []
    for raw, until in client.hgetall(PENDING_KEY).items():
        (lapsed if float(until) < now else found).append(raw.decode())
    if lapsed:
        client.hdel(PENDING_KEY, *lapsed)
    return [Pending.parse(raw) for raw in found]


def clear_pending(pending_field: str, url: str | None = None) -> None:
    """A node task is done and the node's heartbeat says how: the reconciler reads it from there now."""
    client = redis.Redis.from_url(url or settings.REDIS_URL)
    try:
        client.hdel(PENDING_KEY, pending_field)
    finally:
        client.close()


def read_loads(client: redis.Redis) -> dict[str, float]:
    """Each version's planned device share per replica, as the autoscaler last wrote it (LOAD_KEY)."""
    return {k.decode(): float(v) for k, v in client.hgetall(LOAD_KEY).items()}


def read_moves(client: redis.Redis) -> tuple[list[Move], dict[str, float]]:
    """The consolidation moves in flight (MOVES_KEY) and each node's quiet-since time (QUIET_KEY)."""
    moves = []
    for raw, started in client.hgetall(MOVES_KEY).items():
        key, source, target = raw.decode().rsplit("|", 2)
        moves.append(Move(key, source, target, float(started)))
    quiet = {k.decode(): float(v) for k, v in client.hgetall(QUIET_KEY).items()}
    return moves, quiet


def write_moves(client: redis.Redis, result: Plan) -> None:
    """What the next step reads back with `read_moves`: this step's moves in flight and quiet times, replacing
    the last step's (under the step's lock, so no other step writes meanwhile)."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(MOVES_KEY, QUIET_KEY)
    if result.moves:
        pipe.hset(MOVES_KEY, mapping={f"{m.key}|{m.source}|{m.target}": m.started for m in result.moves})
    if result.quiet:
        pipe.hset(QUIET_KEY, mapping=result.quiet)
    pipe.execute()


def consolidating_from_settings() -> Consolidating:
    return Consolidating(
        moves=settings.FERRY_CONSOLIDATE_MOVES,
        hold=float(settings.FERRY_CONSOLIDATE_HOLD_SECONDS),
        relieve_moves=settings.FERRY_RELIEVE_MOVES,
    )


def spec_of(version: object, load: float = 0.0) -> VersionSpec:
    """A version as placement sees it; its footprint the largest any accelerator type measured, else what
    validation measured; `load` its replica's planned device share (0: not known)."""
    measured = [
        m.get("memory_bytes", 0) for m in (version.placement_measurements or {}).values() if isinstance(m, dict)
    ]
    footprint = max(measured, default=0) or version.memory_bytes or 0
    return VersionSpec(
        version.key,
        footprint,
        min_memory=version.min_memory_bytes,
        accelerators=frozenset(version.accelerators),
        pinned=version.pinned,
        stable=version.model.stable_version == version.version,
        min_replicas=version.min_replicas,
        load=load,
    )


def desired_replicas(version: object) -> int:
    return max(version.min_replicas, version.desired_replicas or 0)


@dataclass
class Outcome:
    skipped: str = ""
    plan: Plan | None = None
    nodes: int = 0


def reconcile(
    *,
    send: Callable[[redis.Redis, Plan, float], None],
    url: str | None = None,
    now: float | None = None,
    consolidating: Consolidating | None = None,
) -> Outcome:
    """One reconciler step (see the module's docstring). `send` records and sends the plan's node tasks
    (`serving.node_tasks.send_plan`); `url` is the Redis of the fleet (default REDIS_URL); `consolidating`
    the consolidation's settings (default FERRY_CONSOLIDATE_MOVES and FERRY_CONSOLIDATE_HOLD_SECONDS)."""
    url = url or settings.REDIS_URL
    if not url:
        return Outcome(skipped="embedded mode: the in-process node serves every version")
    now = time.time() if now is None else now
    client = redis.Redis.from_url(url)
    lock = client.lock(LOCK_KEY, timeout=LOCK_SECONDS)
    try:
        if not lock.acquire(blocking=False):
            return Outcome(skipped="another reconciler step is running")
        try:
            return _step(client, lock, send, now, consolidating or consolidating_from_settings())
        except LockNotOwnedError:
            log.warning("placement: this step's lock lapsed; it stops writing, and the next step acts")
            return Outcome(skipped="the step's lock lapsed: it stopped before its next write")
        finally:
            with contextlib.suppress(LockError):  # lapsed: it is no longer this step's to release
                lock.release()
    finally:
        client.close()


def _step(
    client: redis.Redis,
    lock: Lock,
    send: Callable[[redis.Redis, Plan, float], None],
    now: float,
    consolidating: Consolidating,
) -> Outcome:
    """Read, plan, write. Each write phase first renews the lock (`Lock.reacquire`, LockNotOwnedError once it is
    another's): past the lock's expiry a second step may have read the same heartbeats and be acting on them."""
    # Pending before the fleet, never the other way round: a node writes the heartbeat that shows a
    # task's outcome before it clears the task's record (`serving.node_tasks`), so a record already
    # gone here is an outcome the fleet read after it shows. Read fleet first, a task that finished
    # between the two reads is in neither: the step would load it again, or count a replica just
    # unloaded as still there and unload another, below the desired count.
    pending = read_pending(client, now)
    nodes = read_fleet(client)
    versions = list(ModelVersion.objects.servable().filter(loaded=True))
    loads = read_loads(client)
    specs = {v.key: spec_of(v, loads.get(v.key, 0.0)) for v in versions}
    wants = {v.key: desired_replicas(v) for v in versions}
    moves, quiet = read_moves(client)
    result = plan(wants, specs, nodes, pending, now=now, moves=moves, quiet=quiet, consolidating=consolidating)
    lock.reacquire()
    write_moves(client, result)  # before the loads go: a move's outcome may come back before send returns
    send(client, result, now)
    lock.reacquire()
    if _mark_unschedulable(versions, result):
        publish_snapshot()  # once for the step: the snapshot carries each version's reason

    # The records after this step's sends, read in the same order for the same reason.
    pending = read_pending(client, now)
    nodes = read_fleet(client)
    lock.reacquire()
    replicas.record(nodes, {v.key: v for v in versions}, holdings(nodes, pending))
    return Outcome(plan=result, nodes=len(nodes))


def _mark_unschedulable(versions: list, result: Plan) -> bool:
    """Write why a version could not be placed; clear what this module wrote once it is placed. A node's own
    verdict (it can never fit that node) is the node's to clear, when it loads. True when any reason changed."""
    changed = False
    for version in versions:
        why = result.unschedulable.get(version.key)
        reason = f"{REASON_PREFIX}{why}"[:2000] if why else ""
        ours = version.unschedulable_reason.startswith(REASON_PREFIX)
        if (why and version.unschedulable_reason != reason) or (not why and ours):
            # update(), not save(): a save republishes the whole snapshot per version (serving.signals); the step
            # publishes once. updated_at moves all the same, for the other processes' registry fingerprint.
            ModelVersion.objects.filter(pk=version.pk).update(unschedulable_reason=reason, updated_at=timezone.now())
            changed = True
    return changed
