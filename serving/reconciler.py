"""The placement reconciler: desired replicas per version, turned into load and unload tasks on the nodes.

A version's desired replicas are max(min_replicas, desired_replicas or 0). A version whose desired is 0 is
not placed: every node serves it, loading it on demand within its budget (the node's packing). A version
whose desired is above 0 is placed by `serving.policies.placement.place` over the live fleet (the nodes'
heartbeats in Redis): its replicas go to the nodes the plan picks, as `serving.node.load` tasks on each
node's own queue, and the nodes that hold more than desired get `serving.node.unload` (never below desired:
the plan keeps the replicas already there first). Once a live node holds a version by assignment, the
nodes it is not assigned to stop serving it (`NodeProcess.hosted_keys`). What the plan cannot place is
marked unschedulable on the version, with the reason.

`reconcile()` is one step, run by the Celery task `serving.tasks.reconcile_placements` on a beat schedule
and whenever a version's desired state changes (`serving.tasks.request_reconcile`); the task hands it the
sender of node tasks (`serving.node_tasks.send_plan`), so this module imports no task. It is idempotent: a
task sent and not yet done is recorded in Redis (`PENDING_KEY`) until the node's heartbeat shows its
outcome, so the next step does not send it again; and two steps at once do not both act (a lock in Redis, `LOCK_KEY`).

`plan()` is the pure part (no Django, no Redis), unit-tested on its own.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import redis
from django.conf import settings

from serving import replicas
from serving.dataplane.transport import fleet
from serving.models import ModelVersion
from serving.policies.placement import NodeState, Resident, VersionSpec, place

log = logging.getLogger(__name__)

LOCK_KEY = "ferry:placement:lock"
PENDING_KEY = "ferry:placement:pending"  # field "<op>|<node>|<version key>" -> epoch seconds it lapses
# field <version key> -> the device share one replica plans on (`placement.replica_load`), as the autoscaler's
# last tick sized it (autoscaling.tick); a version without one is placed by memory alone.
LOAD_KEY = "ferry:placement:load"
LOCK_SECONDS = 30  # a step holds it this long at most (a reconciler killed mid-step frees it by then)
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
) -> Plan:
    """What to do so that each version in `wants` (key -> desired replicas) has that many replicas on the
    live `nodes`. Versions hot on a node without an assignment (loaded there on demand) count as replicas
    already in place: assigning them there costs no load."""
    held = holdings(nodes, pending)
    states = []
    for n in nodes:
        hot = {}
        for key in n.hot | held[n.name]:
            spec = specs.get(key)
            if spec is not None:  # by assignment first: the plan keeps those over on-demand copies
                hot[key] = Resident(spec, last_used=2.0 if key in held[n.name] else 1.0)
        states.append(NodeState(n.name, n.accelerator, n.memory_budget, hot, warm=n.warm, memory_total=n.memory_total))
    desired = {k: count for k, count in wants.items() if count > 0 and k in specs}
    placement = place(desired, specs, states, now=now)
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
    return result


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
    *, send: Callable[[redis.Redis, Plan, float], None], url: str | None = None, now: float | None = None
) -> Outcome:
    """One reconciler step (see the module's docstring). `send` records and sends the plan's node tasks
    (`serving.node_tasks.send_plan`); `url` is the Redis of the fleet (default REDIS_URL)."""
    url = url or settings.REDIS_URL
    if not url:
        return Outcome(skipped="embedded mode: the in-process node serves every version")
    now = time.time() if now is None else now
    client = redis.Redis.from_url(url)
    token = uuid.uuid4().hex
    try:
        if not client.set(LOCK_KEY, token, nx=True, ex=LOCK_SECONDS):
            return Outcome(skipped="another reconciler step is running")
        try:
            nodes = read_fleet(client)
            pending = read_pending(client, now)
            versions = list(ModelVersion.objects.servable().filter(loaded=True))
            loads = read_loads(client)
            specs = {v.key: spec_of(v, loads.get(v.key, 0.0)) for v in versions}
            wants = {v.key: desired_replicas(v) for v in versions}
            result = plan(wants, specs, nodes, pending, now=now)
            send(client, result, now)
            _mark_unschedulable(versions, wants, result)

            replicas.record(nodes, {v.key: v for v in versions}, holdings(nodes, read_pending(client, now)))
            return Outcome(plan=result, nodes=len(nodes))
        finally:
            client.eval(_UNLOCK, 1, LOCK_KEY, token)
    finally:
        client.close()


def _mark_unschedulable(versions: list, wants: Mapping[str, int], result: Plan) -> None:
    """Write why a version could not be placed; clear what this module wrote once it is placed. A node's own
    verdict (it can never fit that node) is the node's to clear, when it loads."""
    for version in versions:
        why = result.unschedulable.get(version.key)
        reason = f"{REASON_PREFIX}{why}"[:2000] if why else ""
        ours = version.unschedulable_reason.startswith(REASON_PREFIX)
        if (why and version.unschedulable_reason != reason) or (not why and ours):
            version.unschedulable_reason = reason
            version.save(update_fields=["unschedulable_reason", "updated_at"])  # republishes the snapshot


# KEYS: the lock; ARGV: this step's token.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
