"""One autoscaler tick against the live system: observe, decide, write `desired_replicas`, ask for nodes.

The `Autoscaler`'s history (rates, trend, the cool-down's recommendations) lives in Redis, not in a
process: Celery beat hands each tick to whichever worker process is free, workers restart, and a
history kept in one process would be split between them or lost, and with it the cool-down that
holds a scale-in. A tick takes a lock (redis-py's `Lock`: SET NX with an expiry, owned by a token, released only
by its holder), reads the history, ticks, and writes it back; a tick that finds the lock held is skipped (the
next one comes in seconds). It renews the lock before its writes and before asking for nodes, and stops once the
lock is no longer its own: a tick that outlived its lock (a slow provider) never writes beside the next one.
Time is Redis' clock (TIME), so every worker ticks on the same one.

A change of a version's desired replicas is written with an audit entry (`version.scaled`, by the
system, with the demand and the reason) in the same transaction, and logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from django.conf import settings
from django.db import transaction
from redis.exceptions import LockError, LockNotOwnedError
from redis.lock import Lock

from autoscaling import observe
from autoscaling.models import ScalingPolicy
from autoscaling.providers import NodeProvider, Pool, ProviderError, pool_sizes, pools_from, scale_in_floor
from serving.dataplane.transport import fleet
from serving.models import ModelVersion, State
from serving.policies.autoscale import Autoscaler, Decision, Plan
from serving.policies.placement import replica_load
from serving.reconciler import LOAD_KEY, desired_replicas, holdings, read_fleet, read_pending, spec_of

log = logging.getLogger(__name__)

STATE_KEY = "ferry:autoscaler:state"
LOCK_KEY = "ferry:autoscaler:lock"
# A tick's lock lapses this long after its last renewal (a worker that dies holding it blocks ticks this long at
# most); the task's time limit (autoscaling.tasks.autoscale) ends a tick before it would.
LOCK_SECONDS = 60
STATE_TTL_SECONDS = 3600  # a history not written for this long is dropped (two seasons at least: `_tick`)


@dataclass
class TickReport:
    now: float
    plan: Plan | None = None
    changed: dict[str, tuple[int | None, int]] = field(default_factory=dict)  # key -> (before, after)
    nodes: dict[str, int] = field(default_factory=dict)  # nodes asked of the provider per pool
    skipped: dict[str, str] = field(default_factory=dict)  # key -> why it was not sized
    provider_error: str = ""


def run_tick(
    client: redis.Redis | None = None,
    *,
    provider: NodeProvider | None = None,
    pools: dict[str, Pool] | None = None,
    after_change: Callable[[], None] | None = None,
) -> TickReport | None:
    """Tick once; None when another tick holds the lock, or this one's lapsed before it was done."""
    client = client or redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
    lock = client.lock(LOCK_KEY, timeout=LOCK_SECONDS)
    if not lock.acquire(blocking=False):
        log.info("autoscaler: another tick is running; skipping this one")
        return None
    try:
        pools = pools if pools is not None else pools_from(settings.FERRY_NODE_POOLS)
        return _tick(client, lock, provider, pools, after_change)
    except LockNotOwnedError:
        log.warning("autoscaler: this tick's lock lapsed; it stops writing, and the next tick acts")
        return None
    finally:
        with contextlib.suppress(LockError):  # lapsed: it is no longer this tick's to release
            lock.release()


def _tick(
    client: redis.Redis,
    lock: Lock,
    provider: NodeProvider | None,
    pools: dict[str, Pool],
    after_change: Callable[[], None] | None,
) -> TickReport:
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    report = TickReport(now)
    nodes = read_fleet(client)
    node_memory = {kind: pool.memory_bytes for kind, pool in pools.items()}
    for node in nodes:  # a type no pool names is sized by the nodes that announce it
        node_memory.setdefault(node.accelerator, node.memory_budget)
        node_memory[node.accelerator] = max(node_memory[node.accelerator], node.memory_budget)

    targets = []
    policies = (
        ScalingPolicy.objects.filter(enabled=True, version__state=State.READY)
        .select_related("version__model")
        .order_by("version_id")
    )
    for policy in policies:
        version = policy.version
        key = f"{version.model.name}:{version.version}"
        kind = observe.pick_accelerator(policy, version, node_memory)
        if kind is None or kind not in node_memory:
            report.skipped[key] = f"no node pool or live node of accelerator type {kind!r}"
            continue
        try:
            target = observe.target_for(version, policy, kind, settings.FERRY_AUTOSCALE_SCHEDULING_DELAY_S)
        except ValueError as exc:
            report.skipped[key] = str(exc)
            continue
        if target.config.memory_bytes > node_memory[kind]:
            report.skipped[key] = f"one replica ({target.config.memory_bytes} bytes) does not fit a {kind} node"
            continue
        targets.append(target)
    for key, why in report.skipped.items():
        log.warning("autoscaler: %s is not sized: %s", key, why)

    scaler = Autoscaler(
        node_memory,
        short_window=settings.FERRY_AUTOSCALE_SHORT_WINDOW_S,
        long_window=settings.FERRY_AUTOSCALE_LONG_WINDOW_S,
        surge=float(settings.FERRY_AUTOSCALE_SURGE),
        season=float(settings.FERRY_AUTOSCALE_SEASON_S),
        season_buckets=settings.FERRY_AUTOSCALE_SEASON_BUCKETS,
        season_min_periods=settings.FERRY_AUTOSCALE_SEASON_MIN_PERIODS,
    )
    stored = client.get(STATE_KEY)
    if stored:
        scaler.restore_state(json.loads(stored))
    streams = observe.read_streams(client, [t.key for t in targets])
    plan = scaler.tick(now, observe.observe(targets, streams, nodes))
    lock.reacquire()  # LockNotOwnedError once another tick may have read the same history: this one writes nothing
    # The seasonal profile learns over days, so the history outlives a pause of the ticks by two periods (the rest
    # of it is windowed by time: an old history does no harm).
    ttl = max(STATE_TTL_SECONDS, int(2 * settings.FERRY_AUTOSCALE_SEASON_S))
    client.set(STATE_KEY, json.dumps(scaler.export_state()), ex=ttl)
    report.plan = plan
    _write_loads(client, targets, plan, max(60, 10 * settings.FERRY_AUTOSCALE_SECONDS))  # stale once ticks stop

    for target in targets:
        decision = plan.decisions[target.key]
        before = _write(target.pk, target.key, decision)
        if before is not False:
            report.changed[target.key] = (before, decision.replicas)
    if report.changed and after_change is not None:
        after_change()

    if provider is not None and pools:
        report.nodes = _pool_sizes(client, now, nodes, targets, pools)
        lock.reacquire()  # a provider may take a while to start nodes: another tick must not ask meanwhile
        try:
            provider.apply(report.nodes)
        except ProviderError as exc:  # the replicas are decided all the same; nodes are asked again next tick
            report.provider_error = str(exc)
            log.error("autoscaler: the node provider failed: %s", exc)
    return report


def _pool_sizes(
    client: redis.Redis, now: float, nodes: list[fleet.NodeInfo], targets: list[observe.Target], pools: dict[str, Pool]
) -> dict[str, int]:
    """Nodes per pool for what the placement reconciler will place: every placed version's desired replicas (its
    `wants`, with this tick's writes), not only the autoscaled ones', and the nodes holding assigned replicas kept."""
    pool_of = {t.key: t.accelerator for t in targets}
    specs, wants = {}, {}
    for version in ModelVersion.objects.servable().filter(loaded=True):
        spec = spec_of(version)
        if version.key in pool_of:  # sized on the pool it scales on, as its decision was
            spec = dataclasses.replace(spec, accelerators=frozenset({pool_of[version.key]}))
        specs[version.key], wants[version.key] = spec, desired_replicas(version)
    held = holdings(nodes, read_pending(client, now))
    accelerator = {n.name: n.accelerator for n in nodes}
    return pool_sizes(
        wants, specs, pools, scale_in_floor((name, accelerator[name]) for name, keys in held.items() if keys)
    )


def _write_loads(client: redis.Redis, targets: list, plan: Plan, ttl: int) -> None:
    """Each sized version's planned device share per replica, for the placement reconciler (LOAD_KEY): its
    share of the demand it was sized for, at what its batches cost at that rate (no batch window assumed: the
    smallest batches, the safe side). The simulator places with the same `placement.replica_load`."""
    loads = {}
    for target in targets:
        decision = plan.decisions[target.key]
        if decision.replicas > 0 and decision.reason != "no_data":
            rate = decision.demand / decision.replicas
            loads[target.key] = round(replica_load(rate, target.estimate.estimate, target.config.max_batch_size), 6)
    pipe = client.pipeline()
    pipe.delete(LOAD_KEY)
    if loads:
        pipe.hset(LOAD_KEY, mapping=loads)
        pipe.expire(LOAD_KEY, ttl)
    pipe.execute()


def _capacity(decision: Decision) -> dict[str, float | bool]:
    """One replica's capacity as the decision used it, and whether it was seen served rather than profiled."""
    if decision.capacity is None:
        return {}
    return {"capacity_per_s": round(decision.capacity.rate, 3), "capacity_observed": decision.capacity.observed}


def _write(pk: int, key: str, decision: Decision) -> int | None | bool:
    """Store a changed decision with its audit entry; the count before, or False when nothing changed."""
    from tenants import audit

    with transaction.atomic():
        version = (
            ModelVersion.objects.select_for_update(of=("self",)).select_related("model__tenant").filter(pk=pk).first()
        )
        if version is None or version.desired_replicas == decision.replicas:
            return False
        # Turned off since this tick read the policies: turning it off locks this row too (ScalingPolicy.release), so
        # this read, after the lock, sees it, and a write it would then clear is never made.
        if not ScalingPolicy.objects.filter(version_id=pk, enabled=True).exists():
            return False
        before = version.desired_replicas
        # update(): updated_at stays, so no routing snapshot is rebuilt for a scaling decision.
        ModelVersion.objects.filter(pk=pk).update(desired_replicas=decision.replicas)
        audit.record(
            None,
            "version.scaled",
            f"model {version.model.name} version {version.version}",
            tenant=version.model.tenant,
            before={"desired_replicas": before},
            after={
                "desired_replicas": decision.replicas,
                "reason": decision.reason,
                "demand_per_s": round(decision.demand, 3),
                "forecast_per_s": round(decision.forecast, 3),
                "short_rate_per_s": round(decision.short_rate, 3),
                **_capacity(decision),
            },
        )
    log.info(
        "autoscaler: %s desired replicas %s -> %d (%s; demand %.1f/s, forecast %.1f/s)",
        key,
        before,
        decision.replicas,
        decision.reason,
        decision.demand,
        decision.forecast,
    )
    return before
