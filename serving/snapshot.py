"""The routing snapshot: everything the data plane needs, built from PostgreSQL by the control plane.

Gateways and nodes serve from the last snapshot they were handed and never query the database
per request; if the database goes away they keep serving on it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.routing import NO_ROUTES, RouteTable
from serving.batching import BatchingConfig
from serving.protocol import TensorSpec

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class VersionEntry:
    model: str
    version: int
    state: str
    loaded: bool
    artifact_sha256: str
    format: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    batching: BatchingConfig
    default_timeout_ms: int
    latency_profile: dict[int, float]  # batch size -> seconds
    failure_reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.model}:{self.version}"

    @property
    def servable(self) -> bool:
        return self.state == "ready" and self.loaded


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    task: str
    description: str
    fallback: str | None
    versions: dict[int, VersionEntry]
    tenant_id: int | None = None  # None: a platform model, visible to every tenant
    visibility: str = "public"  # private | shared | public
    shared_with: frozenset[int] = frozenset()
    routes: RouteTable = NO_ROUTES  # stable version, tenant pins, experiment arms, rollout weights

    def servable_versions(self) -> list[VersionEntry]:
        return [v for _, v in sorted(self.versions.items()) if v.servable]

    def visible_to(self, tenant_id: int | None) -> bool:
        """Whether a caller of `tenant_id` may see this model; None is the data plane itself (metrics)."""
        if tenant_id is None or self.tenant_id is None or self.visibility == "public":
            return True
        if self.tenant_id == tenant_id:
            return True
        return self.visibility == "shared" and tenant_id in self.shared_with


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """An API key as the data plane checks it: the HMAC of its secret, whose it is, what it may do."""

    digest: str
    tenant_id: int
    scopes: tuple[str, ...]
    expires_at: float | None  # epoch seconds; None: never


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """A tenant's request-path quota (`tenants.models.Quota`), enforced by `serving.quota`."""

    slug: str
    requests_per_second: float  # a float only where `serving.quota.scaled` divided it
    burst: int
    max_in_flight: int
    monthly_requests: int
    priority: int  # admission tier, 1 runs first: a floor on the priority its requests may ask for


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    serial: int
    built_at: float
    models: dict[str, ModelEntry] = field(default_factory=dict)
    keys: dict[str, KeyEntry] = field(default_factory=dict)  # by prefix; revoked keys are left out
    tenants: dict[int, TenantEntry] = field(default_factory=dict)  # by tenant id

    def hosted_versions(self) -> list[VersionEntry]:
        return [v for m in self.models.values() for v in m.servable_versions()]


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
    from serving.models import Model, State
    from tenants.models import ApiKey, Quota, Tenant

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
            slug=t.slug, requests_per_second=q.requests_per_second, burst=q.burst,
            max_in_flight=q.max_in_flight, monthly_requests=q.monthly_requests, priority=q.priority,
        )
    serial = next(_serial) if serial is None else serial
    return RoutingSnapshot(serial=serial, built_at=time.time(), models=models, keys=keys, tenants=tenants)


class SnapshotHub:
    """Holds the current snapshot in this process and tells subscribers when it changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: RoutingSnapshot | None = None
        self._subscribers: list[Callable[[RoutingSnapshot], None]] = []

    def subscribe(self, callback: Callable[[RoutingSnapshot], None]) -> None:
        with self._lock:
            self._subscribers.append(callback)

    def unsubscribe(self, callback: Callable[[RoutingSnapshot], None]) -> None:
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def set(self, snapshot: RoutingSnapshot) -> None:
        with self._lock:
            if self.current is not None and snapshot.serial <= self.current.serial:
                return
            self.current = snapshot
            subscribers = list(self._subscribers)
        for callback in subscribers:
            callback(snapshot)


hub = SnapshotHub()


def publish_snapshot() -> RoutingSnapshot:
    """Build from the registry and hand to this process; with Redis, to every gateway and node too."""
    from django.conf import settings

    if not settings.REDIS_URL:
        snapshot = build_snapshot()
        hub.set(snapshot)
        return snapshot
    from serving.snapshot_redis import RedisSnapshotStore

    store = RedisSnapshotStore(settings.REDIS_URL)
    try:
        # The serial before the read: whichever snapshot carries a higher serial read the registry later.
        snapshot = build_snapshot(store.next_serial())
        if store.publish(snapshot):
            hub.set(snapshot)
    finally:
        store.close()
    return snapshot
