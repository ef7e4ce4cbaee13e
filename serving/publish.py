"""The control plane's side of the routing snapshot: build it from the registry and publish it.

The snapshot's types, and the hub each process holds its current one in, live in
`serving.dataplane.gateway.snapshot`: the data plane reads them and never this module.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from django.conf import settings

from rollout.routing import NO_ROUTES, RouteTable
from serving.dataplane.gateway.snapshot import (
    KeyEntry,
    ModelEntry,
    PlacementEntry,
    RoutingSnapshot,
    TenantEntry,
    VersionEntry,
    hub,
)
from serving.dataplane.gateway.snapshot_redis import RedisSnapshotStore
from serving.dataplane.http.protocol import TensorSpec
from serving.models import Model, State
from serving.pipelines import snapshot_entries
from serving.policies.batching import BatchingConfig
from tenants.models import ApiKey, Quota, Tenant

log = logging.getLogger(__name__)


_serial = itertools.count(1)


def version_entry(v: Any, model_name: str) -> VersionEntry:
    """The snapshot's view of one `serving.models.ModelVersion` row."""
    return VersionEntry(
        model=model_name,
        version=v.version,
        state=v.state,
        loaded=v.loaded,
        artifact_sha256=v.artifact_id,
        format=v.format,
        inputs=tuple(TensorSpec.from_dict(d) for d in v.inputs),
        outputs=tuple(TensorSpec.from_dict(d) for d in v.outputs),
        batching=BatchingConfig(
            max_batch_size=v.max_batch_size,
            max_queue_delay=v.max_queue_delay_ms / 1000.0,
            max_queue_size=v.max_queue_size,
            preferred_batch_sizes=tuple(v.preferred_batch_sizes or ()),
        ),
        default_timeout_ms=v.default_timeout_ms,
        latency_profile={int(k): float(s) for k, s in (v.latency_profile or {}).items()},
        failure_reason=v.failure_reason,
        placement=placement_entry(v),
        response_cache=v.response_cache,
    )


def placement_entry(v: Any) -> PlacementEntry:
    measured = []
    for kind, m in sorted((v.placement_measurements or {}).items()):
        if isinstance(m, dict):
            measured.append((str(kind), int(m.get("memory_bytes") or 0), float(m.get("cold_start_seconds") or 0.0)))
    return PlacementEntry(
        memory_bytes=int(v.memory_bytes or 0),
        load_seconds=float(v.load_seconds or 0.0),
        measured=tuple(measured),
        min_memory=int(v.min_memory_bytes or 0),
        accelerators=frozenset(str(a) for a in (v.accelerators or ())),
        pinned=bool(v.pinned),
        min_replicas=int(v.min_replicas or 0),
        unschedulable=v.unschedulable_reason,
    )


def unservable_entry(v: Any, model_name: str, reason: str) -> VersionEntry:
    """A row the snapshot cannot serve (its stored settings do not validate): listed with the reason,
    never routed to, so one bad row cannot take the other versions down with it."""
    return VersionEntry(
        model=model_name,
        version=v.version,
        state="failed",
        loaded=False,
        artifact_sha256=str(v.artifact_id),
        format=str(v.format),
        inputs=(),
        outputs=(),
        batching=BatchingConfig(max_batch_size=1, max_queue_delay=0.0, max_queue_size=1),
        default_timeout_ms=1,
        latency_profile={},
        failure_reason=f"unservable registry row: {reason}",
    )


def route_table(model: Any) -> RouteTable:
    """A `serving.models.Model` row's routing rules. Rules stored around validation (a raw update) that do
    not hold are dropped with an error logged, keeping the stable version, so the model still serves."""
    try:
        return model.route_table()
    except ValueError as exc:
        log.error("routing rules of %s dropped, serving its stable version only: %s", model.name, exc)
        stable = model.stable_version
        return RouteTable(stable=stable) if type(stable) is int and stable >= 1 else NO_ROUTES


def build_snapshot(serial: int | None = None) -> RoutingSnapshot:
    models: dict[str, ModelEntry] = {}
    queryset = Model.objects.select_related("fallback").prefetch_related("versions", "shared_with")
    for model in queryset:
        versions = {}
        for v in model.versions.all():
            if v.state == State.RETIRED:
                continue
            try:
                versions[v.version] = version_entry(v, model.name)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.error("%s:%s cannot be served: %s", model.name, v.version, exc)
                versions[v.version] = unservable_entry(v, model.name, str(exc))
        models[model.name] = ModelEntry(
            name=model.name,
            task=model.task,
            description=model.description,
            fallback=model.fallback.name if model.fallback else None,
            versions=versions,
            tenant_id=model.tenant_id,
            visibility=model.visibility,
            shared_with=frozenset(t.pk for t in model.shared_with.all()),
            routes=route_table(model),
        )
    keys = {
        k.prefix: KeyEntry(
            digest=k.digest,
            tenant_id=k.tenant_id,
            scopes=tuple(s for s in k.scopes if isinstance(s, str)) if isinstance(k.scopes, list) else (),
            expires_at=k.expires_at.timestamp() if k.expires_at is not None else None,
        )
        for k in ApiKey.objects.filter(revoked_at__isnull=True)
    }
    default = Quota()  # a tenant whose row is missing (created with a raw save) gets the defaults
    tenants = {}
    for t in Tenant.objects.select_related("quota"):
        q = getattr(t, "quota", None) or default
        tenants[t.pk] = TenantEntry(
            slug=t.slug,
            requests_per_second=q.requests_per_second,
            burst=q.burst,
            max_in_flight=q.max_in_flight,
            monthly_requests=q.monthly_requests,
            priority=q.priority,
            share_shadow_samples=t.share_shadow_samples,
            share_response_cache=t.share_response_cache,
            latency_budget_ms=q.latency_budget_ms,
        )
    serial = next(_serial) if serial is None else serial
    return RoutingSnapshot(
        serial=serial,
        built_at=time.time(),
        models=models,
        keys=keys,
        tenants=tenants,
        latency_budget_ms=settings.FERRY_LATENCY_BUDGET_MS,
        pipelines=snapshot_entries(models),
    )


def publish_snapshot() -> RoutingSnapshot:
    """Build from the registry and hand to this process; with Redis, to every gateway and node too."""
    if not settings.REDIS_URL:
        snapshot = build_snapshot()
        hub.set(snapshot)
        return snapshot

    store = RedisSnapshotStore(settings.REDIS_URL)
    try:
        # The serial before the read: whichever snapshot carries a higher serial read the registry later.
        snapshot = build_snapshot(store.next_serial())
        if store.publish(snapshot):
            hub.set(snapshot)
    finally:
        store.close()
    return snapshot
