"""The data plane of this process: its gateway, its in-process node, and the snapshot refresh loop.

Embedded mode runs all of it inside the web process. The refresh loop is the control plane's
periodic step in small: it rebuilds the snapshot when the registry changed (registrations from
another process such as `manage.py register_model` included) and tells the node to reconcile.
If the database is unreachable the loop logs it and the last snapshot keeps serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings

from serving import artifacts, metrics
from serving.errors import ServingError
from serving.frontdoor import GATE
from serving.gateway import Gateway
from serving.node import Node
from serving.quota_gate import QuotaGate
from serving.quota_gate import from_settings as quota_gate_from_settings
from serving.runtime import configure_torch_threads
from serving.snapshot import RoutingSnapshot, hub, publish_snapshot
from serving.transport import InProcessTransport
from tenants.keys import pepper_from
from usage.flusher import UsageFlusher
from usage.recorder import Drained, UsageRecorder

log = logging.getLogger(__name__)

REFRESH_SECONDS = 2.0
LAG_SAMPLE_SECONDS = 0.05
KEY_USE_FLUSH_SECONDS = 5.0  # how often API keys' last_used_at is written, off the request path


@dataclass
class DataPlane:
    gateway: Gateway
    node: Node
    loop: asyncio.AbstractEventLoop
    refresher: asyncio.Task[None] | None = None
    lag_watch: asyncio.Task[None] | None = None
    # How late the event loop runs its callbacks: past FERRY_MAX_LOOP_LAG_MS the process is
    # saturated before requests even reach a queue, and new inference is refused at once.
    loop_lag: float = 0.0
    # The API key pepper, derived once from SECRET_KEY (tenants.keys.pepper_from).
    pepper: bytes = b""
    # Prefixes of the API keys used since the last flush of last_used_at (a set add per request).
    used_keys: set[str] = field(default_factory=set)
    key_flusher: asyncio.Task[None] | None = None
    # Per-tenant quotas on inference (None: FERRY_QUOTAS=false).
    quota: QuotaGate | None = None
    # Usage metered by the gateway, sent to Celery every FERRY_USAGE_FLUSH_SECONDS (usage.flusher).
    usage: UsageFlusher | None = None
    usage_task: asyncio.Task[None] | None = None
    _fingerprint: tuple | None = None
    _reconciling: asyncio.Task[None] | None = None
    _pending: RoutingSnapshot | None = None

    @property
    def ready(self) -> bool:
        return self.gateway.hub.current is not None and self.node.reconciled_serial > 0

    def on_snapshot(self, snapshot: RoutingSnapshot) -> None:
        """Hub callback; may come from any thread (a sync view that registered a model)."""
        self.loop.call_soon_threadsafe(self._schedule_reconcile, snapshot)

    def _schedule_reconcile(self, snapshot: RoutingSnapshot) -> None:
        self._pending = snapshot
        if self._reconciling is None or self._reconciling.done():
            self._reconciling = self.loop.create_task(self._reconcile_latest())

    async def _reconcile_latest(self) -> None:
        while self._pending is not None:
            snapshot, self._pending = self._pending, None
            try:
                await self.node.reconcile(snapshot)
            except Exception:
                log.exception("reconcile failed")

    async def wait_reconciled(self, serial: int, timeout: float = 300.0) -> None:
        async with asyncio.timeout(timeout):
            while self.node.reconciled_serial < serial:
                await asyncio.sleep(0.05)

    async def refresh_once(self) -> bool:
        """Rebuild and publish the snapshot if the registry changed. True when it did."""
        fingerprint = await sync_to_async(_registry_fingerprint)()
        if fingerprint == self._fingerprint:
            return False
        await sync_to_async(publish_snapshot)()
        self._fingerprint = fingerprint
        return True

    async def _watch_loop_lag(self) -> None:
        while True:
            expected = self.loop.time() + LAG_SAMPLE_SECONDS
            await asyncio.sleep(LAG_SAMPLE_SECONDS)
            lag = max(0.0, self.loop.time() - expected)
            # Smoothed over a few samples: one late tick (a collection, a burst of start-up work) does not
            # shut the gate, while a backlog that lasts raises it within two or three ticks.
            self.loop_lag = 0.7 * self.loop_lag + 0.3 * lag
            metrics.LOOP_LAG.set(self.loop_lag)
            seen, GATE.seen = GATE.seen, 0
            GATE.steer(self.loop_lag, settings.FERRY_LOOP_LAG_TARGET_MS / 1000, seen)

    def count_frontend_shed(self, url: bytes) -> None:
        """Count a request the front door's gate refused, under the version it would have gone to."""
        parts = url.split(b"?", 1)[0].decode("latin-1").split("/")  # /v2/models/NAME[/versions/V]/infer
        name = parts[3] if len(parts) > 3 else ""
        version = parts[5] if len(parts) > 6 and parts[4] == "versions" else None
        try:
            entry = self.gateway.route(name, version, None)  # before authentication: count only
        except ServingError:
            metrics.SHED.labels(name, "", "frontend", "0").inc()
            return
        vm = metrics.for_version(entry.model, entry.version)
        vm.answered(503, 0.0)
        vm.shed("frontend", 0)

    async def flush_key_use(self) -> None:
        """Write last_used_at for the keys used since the last flush; on failure (database down) keep
        them for the next one."""
        if not self.used_keys:
            return
        used, self.used_keys = self.used_keys, set()
        try:
            await sync_to_async(_record_key_use)(used)
        except Exception:
            self.used_keys |= used
            raise

    async def _flush_key_use_forever(self) -> None:
        while True:
            await asyncio.sleep(KEY_USE_FLUSH_SECONDS)
            try:
                await self.flush_key_use()
            except Exception as exc:
                log.warning("recording API key use failed, will retry: %s", exc)

    async def flush_usage(self) -> int:
        """Hand the usage counted since the last flush to Celery; returns the batches sent."""
        return await self.usage.flush() if self.usage is not None else 0

    async def _flush_usage_forever(self) -> None:
        while True:
            await asyncio.sleep(settings.FERRY_USAGE_FLUSH_SECONDS)
            try:
                await self.flush_usage()
            except Exception as exc:
                log.warning("sending usage failed, will retry: %s", exc)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh_once()
            except Exception as exc:  # the database may be down: keep serving the last snapshot
                log.warning("snapshot refresh failed, serving the last one: %s", exc)


def _registry_fingerprint() -> tuple:
    from django.db.models import Count, Max

    from serving.models import Model, ModelVersion
    from tenants.models import ApiKey, Quota

    versions = ModelVersion.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    models = Model.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    # A key created or revoked by another process (manage.py revoke_api_key) takes effect at the next
    # refresh; last_used_at is written with update(), which leaves updated_at (and this) alone.
    api_keys = ApiKey.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    # A quota approved in another process (the console, a Celery worker) is in force at the next refresh.
    quotas = Quota.objects.aggregate(n=Count("id"), t=Max("updated_at"))
    return (versions["n"], versions["t"], models["n"], models["t"], api_keys["n"], api_keys["t"],
            quotas["n"], quotas["t"])


def _send_usage(batch_id: str, drained: Drained) -> None:
    # On asgiref's thread, not the event loop. Eager in embedded mode: the task writes the database here.
    from usage.tasks import record_usage

    record_usage.delay(batch_id, drained.rows())


def _record_key_use(prefixes: set[str]) -> None:
    from django.utils import timezone

    from tenants.models import ApiKey

    ApiKey.objects.filter(prefix__in=sorted(prefixes)).update(last_used_at=timezone.now())


_current: DataPlane | None = None


def current() -> DataPlane | None:
    return _current


async def start() -> DataPlane:
    """Start this process's data plane: build the first snapshot and load what it names."""
    global _current
    if _current is not None:
        return _current
    configure_torch_threads(settings.FERRY_TORCH_THREADS)
    node = Node(
        artifact_path=artifacts.verified_path,
        device=settings.FERRY_DEVICE,
        memory_budget=settings.FERRY_NODE_MEMORY_BYTES,
        max_queue_bytes=settings.FERRY_MAX_QUEUE_BYTES,
        admission=settings.FERRY_ADMISSION,
    )
    recorder = UsageRecorder(max_keys=settings.FERRY_USAGE_MAX_KEYS)
    gateway = Gateway(hub, InProcessTransport(node), fallback=settings.FERRY_ADMISSION, usage=recorder,
                      ready=node.is_ready)
    plane = DataPlane(gateway=gateway, node=node, loop=asyncio.get_running_loop(),
                      pepper=pepper_from(settings.SECRET_KEY), quota=quota_gate_from_settings(),
                      usage=UsageFlusher(recorder, sync_to_async(_send_usage)))
    hub.subscribe(plane.on_snapshot)
    _current = plane
    GATE.count = plane.count_frontend_shed
    plane.lag_watch = plane.loop.create_task(plane._watch_loop_lag())
    plane.key_flusher = plane.loop.create_task(plane._flush_key_use_forever())
    plane.usage_task = plane.loop.create_task(plane._flush_usage_forever())
    if settings.REDIS_URL:
        await _follow_redis(plane)
    else:
        try:
            await plane.refresh_once()
        except Exception as exc:
            log.error("no routing snapshot at start-up (database unreachable?): %s", exc)
        plane.refresher = plane.loop.create_task(plane._refresh_forever())
    if hub.current is not None:
        await plane.wait_reconciled(hub.current.serial)
    # Everything built so far (Django, torch, loaded models) lives as long as the process: keep it
    # out of the collector's full passes, which otherwise stall the event loop for tens of ms.
    gc.collect()
    gc.freeze()
    return plane


async def _follow_redis(plane: DataPlane) -> None:
    """Distributed mode: snapshots arrive through Redis; publish one from the registry if none exists yet."""
    from serving.snapshot_redis import follow

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
    global _current
    plane, _current = _current, None
    if plane is None:
        return
    hub.unsubscribe(plane.on_snapshot)
    GATE.reset()
    for task in (plane.refresher, plane.lag_watch, plane.key_flusher, plane.usage_task):
        if task is not None:
            task.cancel()
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
    from django.db import connections

    # The refresh loop's queries ran on asgiref's worker thread: close its connections there.
    await sync_to_async(connections.close_all)()
