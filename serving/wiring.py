"""Wire this process's data plane from the settings: its gateway, its in-process node, and the loops.

Embedded mode runs all of it inside the web process. The refresh loop is the control plane's
periodic step in small: it rebuilds the snapshot when the registry changed (registrations from
another process such as `manage.py register_model` included) and tells the node to reconcile.
This module is the control plane's side (it reads the registry); `serving.dataplane.plane` is
what it builds, and it never imports the ORM.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import InterfaceError, OperationalError, connection, connections, transaction
from django.db.models import Count, Max
from django.utils import timezone

from rollout.shadow_compare import aggregate
from rollout.tasks import evaluate_rollouts, record_shadow
from serving import artifacts
from serving.actions import RegistrationError, set_loaded
from serving.api.errors import DB_UNAVAILABLE
from serving.dataplane import plane as planes
from serving.dataplane import tracing
from serving.dataplane.errors import ServingError, Unavailable
from serving.dataplane.gateway.cache import CachingTransport, RedisTier, ResponseCache
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.pipeline import stats as pipeline_stats
from serving.dataplane.gateway.quota_gate import QuotaGate
from serving.dataplane.gateway.quota_gate import from_settings as quota_gate_from_settings
from serving.dataplane.gateway.shadow import Mirror, Pair
from serving.dataplane.gateway.snapshot import RoutingSnapshot, hub
from serving.dataplane.gateway.snapshot_redis import follow
from serving.dataplane.http.frontdoor import GATE
from serving.dataplane.metrics import metrics, process_set
from serving.dataplane.node import runtime_process
from serving.dataplane.node.node import Node
from serving.dataplane.node.packing import LoadReport
from serving.dataplane.node.runtime import configure_torch_threads
from serving.dataplane.plane import REGISTRY_RETRY_S, DataPlane
from serving.dataplane.transport.fleet import FleetView
from serving.dataplane.transport.fleet_events import EventPublisher
from serving.dataplane.transport.host_link import HostLink, HostQuota, HostTransport, HostView
from serving.dataplane.transport.load_view import LoadView
from serving.dataplane.transport.streams import RedisStreamsTransport
from serving.dataplane.transport.transport import InProcessTransport
from serving.fleet_state import embedded_name
from serving.models import Model, ModelVersion, Pipeline
from serving.publish import publish_snapshot
from serving.reconciler import REASON_PREFIX as PLACEMENT_REASON
from tenants import audit
from tenants.keys import pepper_from
from tenants.models import ApiKey, Quota, Tenant
from usage.flusher import UsageFlusher
from usage.recorder import Drained, UsageRecorder
from usage.tasks import record_usage

log = logging.getLogger(__name__)


def _registry_fingerprint() -> tuple:
    versions = ModelVersion.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    models = Model.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    # A key created or revoked by another process (manage.py revoke_api_key) takes effect at the next
    # refresh; last_used_at is written with update(), which leaves updated_at (and this) alone.
    api_keys = ApiKey.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    # A quota approved in another process (the console, a Celery worker) is in force at the next refresh.
    quotas = Quota.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    # A tenant's shadow-sample opt-in changed in another process: Tenant has no updated_at, so the ids of
    # those opted in (a few) stand for it.
    sharing = tuple(Tenant.objects.filter(share_shadow_samples=True).order_by("pk").values_list("pk", flat=True))
    caching = tuple(Tenant.objects.filter(share_response_cache=True).order_by("pk").values_list("pk", flat=True))
    # A pipeline registered in another process: each version is a new row, and the pipeline's updated_at moves.
    pipelines = Pipeline.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    return (
        pipelines["n"],
        pipelines["t"],
        versions["n"],
        versions["t"],
        models["n"],
        models["t"],
        api_keys["n"],
        api_keys["t"],
        quotas["n"],
        quotas["t"],
        sharing,
        caching,
    )


def _set_loaded(name: str, loaded: bool) -> RoutingSnapshot:
    """`set_loaded` for the repository extension (on asgiref's thread): a refusal with its status, and the
    registry out of reach (the database down or locked, Redis down while publishing) 503 with Retry-After, as
    the control plane's API answers it (`serving.api.errors`): an outage, not a bug."""
    try:
        return set_loaded(model_name=name, loaded=loaded)
    except RegistrationError as exc:  # over the tenant's accelerator memory quota (429)
        raise ServingError(exc.message, status=exc.status) from None
    except (OperationalError, InterfaceError, redis.ConnectionError, redis.TimeoutError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("%s of %s: the registry is unavailable (%s)", "load" if loaded else "unload", name, first)
        if isinstance(exc, OperationalError | InterfaceError):
            DB_UNAVAILABLE.inc()
            if not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()  # a broken one: the next try opens a fresh one
        raise Unavailable(
            "the registry is unavailable; retry shortly (inference keeps serving)", retry_after=REGISTRY_RETRY_S
        ) from None


def _record_placement(report: LoadReport) -> None:
    """A node's measurements of a version it loaded (footprint and cold start on its accelerator type), or
    why it can never hold one. Measurements leave `updated_at` alone (no snapshot rebuild for each load);
    an unschedulable verdict, or its end, moves it, so the snapshot and the registry API carry the reason."""
    try:
        write_placement(report)
    finally:
        connection.close()  # on a pool thread (see start()), which no request cycle closes


def write_placement(report: LoadReport) -> None:
    with transaction.atomic():
        version = (
            ModelVersion.objects.select_for_update(of=("self",))
            .select_related("model__tenant")
            .filter(model__name=report.model, version=report.version)
            .first()
        )
        if version is None:
            return
        rows = ModelVersion.objects.filter(pk=version.pk)
        before = version.unschedulable_reason
        if report.unschedulable:
            after = report.unschedulable[:2000]
            rows.update(unschedulable_reason=after, updated_at=timezone.now())
        else:
            measured = dict(version.placement_measurements or {})
            measured[report.accelerator] = {
                "memory_bytes": report.memory_bytes,
                "cold_start_seconds": round(report.cold_start, 4),
            }
            # It loaded: what a node found unschedulable about it no longer holds. What the placement reconciler
            # found (too few nodes for its replicas) is the reconciler's to clear.
            after = before if before.startswith(PLACEMENT_REASON) else ""
            changes: dict = {"placement_measurements": measured}
            if before != after:
                changes.update(unschedulable_reason="", updated_at=timezone.now())
            rows.update(**changes)
        if after != before:  # a state change of the version, made by the system (a node)
            audit.record(
                None,
                "version.unschedulable" if after else "version.schedulable",
                f"model {report.model} version {report.version}",
                tenant=version.model.tenant,
                before={"unschedulable_reason": before},
                after={"unschedulable_reason": after},
            )


def _send_usage(batch_id: str, drained: Drained) -> None:
    # On asgiref's thread, not the event loop. Eager in embedded mode: the task writes the database here.
    record_usage.delay(batch_id, drained.rows())


def _send_shadow(pairs: list[Pair]) -> None:
    # On asgiref's thread: the comparison runs here, off the event loop, and the task stores it (eager in
    # embedded mode).
    rows, samples = aggregate(pairs)
    record_shadow.delay(uuid.uuid4().hex, rows, samples)


def _evaluate_rollouts() -> None:
    evaluate_rollouts()


async def _evaluate_rollouts_forever() -> None:
    """Embedded mode's stand-in for Celery beat's rollout evaluation (there is no beat without a broker)."""
    while True:
        await asyncio.sleep(settings.FERRY_ROLLOUT_EVALUATE_SECONDS)
        try:
            await sync_to_async(_evaluate_rollouts)()
        except Exception as exc:  # the database may be down: try again at the next tick
            log.warning("evaluating rollouts failed: %s", exc)


# Control-plane loops this process runs beside its data plane (embedded mode), cancelled by stop().
_control_tasks: list[asyncio.Task[None]] = []
# An embedded node's loads, evictions and failures, sent to the fleet's event stream when there is Redis.
_events: list[EventPublisher] = []


def _record_key_use(prefixes: set[str]) -> None:
    ApiKey.objects.filter(prefix__in=sorted(prefixes)).update(last_used_at=timezone.now())


async def start(service: str = "ferry-web") -> DataPlane:
    """Start this process's data plane: build the first snapshot and load what it names. `service`: the
    process's name in traces (the node host of `serve --workers N` is "ferry-node", as a `runnode` is)."""
    if planes.current() is not None:
        return planes.current()
    configure_torch_threads(settings.FERRY_TORCH_THREADS)
    runtime_process.warn_if_inline()
    tracing.configure(service=service)  # off unless the OTEL_* variables ask for traces
    recorder = UsageRecorder(max_keys=settings.FERRY_USAGE_MAX_KEYS)
    quota = quota_gate_from_settings()
    if settings.FERRY_NODE_SOCKET:
        node, transport, quota = await _node_host(quota)
    elif settings.REDIS_URL and not settings.FERRY_EMBEDDED_NODE:
        node, transport = await _remote_nodes()
    else:
        node = Node(
            artifact_path=artifacts.local_reader(),
            device=settings.FERRY_DEVICE,
            memory_budget=settings.FERRY_NODE_MEMORY_BYTES,
            max_queue_bytes=settings.FERRY_MAX_QUEUE_BYTES,
            admission=settings.FERRY_ADMISSION,
            accelerator=settings.FERRY_NODE_ACCELERATOR,
            max_queued_loads=settings.FERRY_MAX_QUEUED_LOADS,
            warm_budget=settings.FERRY_NODE_WARM_BYTES,
            mirror_share=settings.FERRY_SHADOW_DEVICE_PERCENT / 100,
            # Not on asgiref's one thread: a load reported while a snapshot is published from it would deadlock.
            report=sync_to_async(_record_placement, thread_sensitive=False),
        )
        transport = InProcessTransport(node)
        if settings.REDIS_URL:
            publisher = EventPublisher(settings.REDIS_URL, embedded_name())
            node.packing.listeners.append(publisher.add)
            publisher.start()
            _events.append(publisher)
    # Mirrors go only to a shadow that is loaded: a mirror never pays for a cold load.
    mirror = Mirror(
        transport,
        max_items=settings.FERRY_SHADOW_QUEUE_ITEMS,
        max_bytes=settings.FERRY_SHADOW_QUEUE_BYTES,
        workers=settings.FERRY_SHADOW_WORKERS,
        max_pairs=settings.FERRY_SHADOW_MAX_PAIRS,
        max_pair_bytes=settings.FERRY_SHADOW_MAX_PAIR_BYTES,
        ready=node.is_ready,
    )
    gateway = Gateway(
        hub,
        _with_cache(transport),
        fallback=settings.FERRY_ADMISSION,
        usage=recorder,
        ready=node.routable,
        mirror=mirror,
    )
    gateway.unready_reason = node.unready_reason
    plane = DataPlane(
        gateway=gateway,
        node=node,
        loop=asyncio.get_running_loop(),
        pepper=pepper_from(settings.SECRET_KEY),
        quota=quota,
        usage=UsageFlusher(recorder, sync_to_async(_send_usage)),
        fingerprint=_registry_fingerprint,
        publish=publish_snapshot,
        record_key_use=_record_key_use,
        set_loaded=_set_loaded,
        mirror=mirror,
        send_shadow=_send_shadow,
    )
    hub.subscribe(plane.on_snapshot)
    planes.install(plane)
    GATE.count = plane.count_frontend_shed
    plane.lag_watch = plane.loop.create_task(plane._watch_loop_lag())
    plane.key_flusher = plane.loop.create_task(plane._flush_key_use_forever())
    plane.usage_task = plane.loop.create_task(plane._flush_usage_forever())
    mirror.start()
    plane.shadow_task = plane.loop.create_task(plane._flush_shadow_forever())
    figures = {"versions": metrics.console_doc, "pipelines": pipeline_stats.docs}
    if (shared := process_set.install(settings.FERRY_METRICS_DIR, console=figures)) is not None:
        _control_tasks.append(plane.loop.create_task(shared.write_forever()))
    if settings.REDIS_URL:
        await _follow_redis(plane)
    else:
        try:
            await plane.refresh_once()
        except Exception as exc:
            log.error("no routing snapshot at start-up (database unreachable?): %s", exc)
        plane.refresher = plane.loop.create_task(plane._refresh_forever())
        if not isinstance(node, HostView):  # the node host evaluates them, once for every web process
            _control_tasks.append(plane.loop.create_task(_evaluate_rollouts_forever()))
    if hub.current is not None and isinstance(node, Node | HostView):
        await plane.wait_reconciled(hub.current.serial)
    # Everything built so far (Django, torch, loaded models) lives as long as the process: keep it
    # out of the collector's full passes, which otherwise stall the event loop for tens of ms.
    gc.collect()
    gc.freeze()
    return plane


def _with_cache(transport: InProcessTransport | RedisStreamsTransport | HostTransport) -> object:
    """The gateway's transport, behind the response cache unless FERRY_RESPONSE_CACHE_BYTES is 0."""
    if not settings.FERRY_RESPONSE_CACHE_BYTES:
        return transport
    tier = None
    if settings.FERRY_RESPONSE_CACHE_REDIS_URL:
        tier = RedisTier(
            settings.FERRY_RESPONSE_CACHE_REDIS_URL,
            ttl_s=settings.FERRY_RESPONSE_CACHE_REDIS_TTL_S,
            timeout_s=settings.FERRY_RESPONSE_CACHE_REDIS_TIMEOUT_MS / 1000,
        )
    return CachingTransport(transport, ResponseCache(settings.FERRY_RESPONSE_CACHE_BYTES, redis_tier=tier), hub)


async def _remote_nodes() -> tuple[FleetView, RedisStreamsTransport]:
    """Distributed mode without an embedded node: `manage.py runnode` processes serve, through Redis streams;
    the fleet they announce says which versions are ready on a live node."""
    fleet = FleetView(settings.REDIS_URL)
    fleet.start()
    transport = RedisStreamsTransport(
        settings.REDIS_URL, max_bytes=settings.FERRY_MAX_QUEUE_BYTES, stream_bytes=settings.FERRY_MAX_STREAM_BYTES
    )
    if settings.FERRY_ADMISSION:
        # Admission before the stream, on the load the nodes publish (off with admission, for contrast runs).
        transport.admission = LoadView(settings.REDIS_URL, lambda: fleet.nodes)
        transport.admission.start()
    await transport.start()
    return fleet, transport


async def _node_host(quota: QuotaGate | None) -> tuple[HostView, HostTransport, QuotaGate | None]:
    """A web process of embedded mode with several (`serve --workers N`): the node host beside it holds the
    models and the quotas; this process parses, authenticates, routes and meters."""
    link = HostLink(settings.FERRY_NODE_SOCKET)
    link.start()
    try:
        await asyncio.wait_for(link.connected.wait(), timeout=30)
    except TimeoutError:
        log.error("the node host at %s does not answer; starting without it", settings.FERRY_NODE_SOCKET)
    view = HostView(link)
    view.start()
    transport = HostTransport(link, max_bytes=settings.FERRY_MAX_QUEUE_BYTES)
    if quota is not None:
        # The host decides for every web process; while it does not answer, each decides alone on its share.
        quota = QuotaGate(
            shared=HostQuota(link),  # type: ignore[arg-type]
            gateways=settings.FERRY_QUOTA_GATEWAYS,
            timeout_s=settings.FERRY_QUOTA_REDIS_TIMEOUT_MS / 1000,
            control=quota.control,
        )
    return view, transport, quota


async def _follow_redis(plane: DataPlane) -> None:
    """Distributed mode: snapshots arrive through Redis; publish one from the registry if none exists yet."""
    fed = asyncio.Event()
    plane.refresher = plane.loop.create_task(follow(settings.REDIS_URL, hub, ready=fed))
    try:
        await asyncio.wait_for(fed.wait(), timeout=10)
    except TimeoutError:
        log.error("Redis at REDIS_URL does not answer; starting without a routing snapshot")
        return
    if hub.current is None:
        try:
            await sync_to_async(publish_snapshot)()
        except Exception as exc:
            log.error("no snapshot in Redis and the registry is unreachable: %s", exc)


async def stop() -> None:
    plane = planes.install(None)
    if plane is None:
        return
    hub.unsubscribe(plane.on_snapshot)
    GATE.reset()
    for task in (
        plane.refresher,
        plane.lag_watch,
        plane.key_flusher,
        plane.usage_task,
        plane.shadow_task,
        *_control_tasks,
    ):
        if task is not None:
            task.cancel()
    _control_tasks.clear()
    if (shared := process_set.current()) is not None:
        try:
            shared.write()  # what it counted since its last write stays counted after it exits
        except OSError as exc:
            log.warning("could not write this process's metrics at shutdown: %s", exc)
    if plane.mirror is not None:
        await plane.mirror.stop()
        try:
            await plane.flush_shadow()
        except Exception as exc:
            log.warning("sending shadow comparison at shutdown failed: %s", exc)
    try:
        await plane.flush_key_use()
    except Exception as exc:
        log.warning("recording API key use at shutdown failed: %s", exc)
    try:
        await plane.flush_usage()
    except Exception as exc:
        log.warning("sending usage at shutdown failed; %d batches lost: %s", len(plane.usage.pending), exc)
    if plane.quota is not None:
        await plane.quota.close()
    await plane.node.close()
    while _events:
        await _events.pop().close()
    transport = plane.gateway.transport
    if isinstance(transport, CachingTransport):
        await transport.cache.close()
        transport = transport.inner
    if isinstance(transport, RedisStreamsTransport):
        await transport.close()
        if isinstance(transport.admission, LoadView):
            await transport.admission.close()
    await asyncio.to_thread(tracing.shutdown)  # what is still queued is exported

    # The refresh loop's queries ran on asgiref's worker thread: close its connections there.
    await sync_to_async(connections.close_all)()
