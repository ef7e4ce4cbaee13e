"""The routing snapshot: everything the data plane needs, built by the control plane (`serving.publish`).

Gateways and nodes serve from the last snapshot they were handed and never query the database
per request; if the database goes away they keep serving on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.routing import NO_ROUTES, RouteTable
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.metrics import metrics
from serving.policies.batching import BatchingConfig

log = logging.getLogger(__name__)

# The platform's latency SLO (FERRY_LATENCY_BUDGET_MS), what a snapshot from a publisher that predates it gets.
DEFAULT_LATENCY_BUDGET_MS = 300


@dataclass(frozen=True, slots=True)
class PlacementEntry:
    """What placement knows of a version from the registry: its footprint and cold start (validation's, then
    what nodes measured, per accelerator type), its constraints, and what keeps it loaded."""

    memory_bytes: int = 0  # validation's measured footprint: the estimate before a node measures its own
    load_seconds: float = 0.0  # validation's load time (without the node's warm-up)
    measured: tuple[tuple[str, int, float], ...] = ()  # (accelerator, footprint bytes, cold start seconds)
    min_memory: int = 0
    accelerators: frozenset[str] = frozenset()  # empty: any
    pinned: bool = False
    min_replicas: int = 0
    unschedulable: str = ""  # the reason a node gave, as the registry holds it

    def on(self, accelerator: str) -> tuple[int, float] | None:
        """Footprint and cold start a node of `accelerator` measured, if one did."""
        for kind, footprint, cold_start in self.measured:
            if kind == accelerator:
                return footprint, cold_start
        return None


NO_PLACEMENT = PlacementEntry()


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
    placement: PlacementEntry = NO_PLACEMENT
    response_cache: bool = False  # `ModelVersion.response_cache`: repeats answered by the gateway's cache

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
class PipelineVersionEntry:
    """One graph of a pipeline (`serving.models.PipelineVersion`): its spec as registered
    (`serving.policies.pipeline`), the signature its check derived, and why it cannot run now, if it cannot
    (its check failed against the models as published)."""

    version: int
    spec: dict
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    broken: str = ""
    max_rows: int = 1  # the smallest max_batch_size of its steps' models, as last checked


@dataclass(frozen=True, slots=True)
class PipelineEntry:
    """A pipeline, served at /v2/models/{name}/infer like a model (`serving.dataplane.gateway.pipeline`)."""

    name: str
    description: str
    versions: dict[int, PipelineVersionEntry]
    latest: int  # the version unpinned requests run
    tenant_id: int | None = None
    visibility: str = "private"
    fallback: str | None = None  # a model with the pipeline's signature, for a call a step refused

    def visible_to(self, tenant_id: int | None) -> bool:
        if tenant_id is None or self.tenant_id is None or self.visibility == "public":
            return True
        return self.tenant_id == tenant_id


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """An API key as the data plane checks it: the HMAC of its secret, whose it is, what it may do."""

    digest: str
    tenant_id: int
    scopes: tuple[str, ...]
    expires_at: float | None  # epoch seconds; None: never


@dataclass(frozen=True, slots=True)
class TenantEntry:
    """A tenant's request-path quota (`tenants.models.Quota`), enforced by `serving.policies.quota`, and
    whether other tenants' shadows may keep samples of its requests
    (`serving.dataplane.gateway.shadow.may_keep_sample`)."""

    slug: str
    requests_per_second: float  # a float only where `serving.policies.quota.scaled` divided it
    burst: int
    max_in_flight: int
    monthly_requests: int
    priority: int  # admission tier, 1 runs first: a floor on the priority its requests may ask for
    share_shadow_samples: bool = False  # `Tenant.share_shadow_samples`
    share_response_cache: bool = False  # `Tenant.share_response_cache` (serving.dataplane.gateway.cache)
    latency_budget_ms: int | None = None  # `Quota.latency_budget_ms`: lowers the platform's; None: no lower


@dataclass(frozen=True, slots=True)
class RoutingSnapshot:
    serial: int
    built_at: float
    models: dict[str, ModelEntry] = field(default_factory=dict)
    keys: dict[str, KeyEntry] = field(default_factory=dict)  # by prefix; revoked keys are left out
    tenants: dict[int, TenantEntry] = field(default_factory=dict)  # by tenant id
    # The platform's latency budget (FERRY_LATENCY_BUDGET_MS), carried here rather than read from each
    # gateway's settings so every gateway of a deployment applies the one the control plane published.
    latency_budget_ms: int = DEFAULT_LATENCY_BUDGET_MS
    pipelines: dict[str, PipelineEntry] = field(default_factory=dict)  # by name; no model has the same

    def budget_ms(self, entry: VersionEntry, tenant_id: int | None = None) -> int:
        """The budget of a request of `entry` by `tenant_id`: the platform's, lowered by the version's
        `default_timeout_ms` and by the tenant's plan (`TenantEntry.latency_budget_ms`) where either is lower."""
        return version_budget_ms(entry, self.tenant_budget_ms(tenant_id))

    def tenant_budget_ms(self, tenant_id: int | None) -> int:
        """The platform's budget lowered by `tenant_id`'s plan (None: the data plane's own call), before any
        version's."""
        tenant = self.tenants.get(tenant_id) if tenant_id is not None else None
        return tenant_budget_ms(tenant, self.latency_budget_ms)

    def hosted_versions(self) -> list[VersionEntry]:
        return [v for m in self.models.values() for v in m.servable_versions()]


def version_budget_ms(entry: VersionEntry, platform_budget_ms: int = DEFAULT_LATENCY_BUDGET_MS) -> int:
    """The longest a request of `entry` may take: the platform's budget, or the version's `default_timeout_ms`
    where that is lower. A request without a deadline gets this one; a client's `timeout` may only shorten it
    (`Gateway._timeout`)."""
    return min(platform_budget_ms, entry.default_timeout_ms)


def tenant_budget_ms(tenant: TenantEntry | None, budget_ms: int) -> int:
    """`budget_ms` lowered by the tenant's plan where the plan sets a lower one: a plan may only lower it."""
    if tenant is None or tenant.latency_budget_ms is None:
        return budget_ms
    return min(budget_ms, tenant.latency_budget_ms)


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
        # Each is told, whatever another does: one that raises (a bug, logged and counted) must not leave the
        # ones after it on the snapshot before, the current one being already this.
        for callback in subscribers:
            try:
                callback(snapshot)
            except Exception:
                log.exception("a subscriber failed on snapshot %s", snapshot.serial)
                metrics.INTERNAL_ERRORS.labels("snapshot_subscriber").inc()


hub = SnapshotHub()
