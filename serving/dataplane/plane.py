"""This process's data plane: its gateway, its node, and the loops that keep them current.

`serving.wiring` builds one from the settings and installs it; the consumers find it with
`current()`. The loops that touch the database (the registry fingerprint, publishing a snapshot,
writing keys' last use) are callables the wiring hands in, so nothing here imports the ORM.
If the database is unreachable those loops log it and the last snapshot keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.conf import settings

from serving.dataplane.errors import ServingError, Unavailable
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.quota_gate import QuotaGate
from serving.dataplane.gateway.shadow import DROPPED as SHADOW_DROPPED
from serving.dataplane.gateway.shadow import Mirror, Pair
from serving.dataplane.gateway.snapshot import RoutingSnapshot, VersionEntry
from serving.dataplane.http.frontdoor import GATE
from serving.dataplane.http.frontdoor import LIMITS as frontdoor_limits
from serving.dataplane.metrics import metrics
from serving.dataplane.node.node import Node
from serving.dataplane.transport.fleet import FleetView
from serving.dataplane.transport.host_link import HostView
from serving.policies.shedding import smoothed_lag
from usage.flusher import UsageFlusher

log = logging.getLogger(__name__)

REFRESH_SECONDS = 2.0
LAG_SAMPLE_SECONDS = 0.05
KEY_USE_FLUSH_SECONDS = 5.0  # how often API keys' last_used_at is written, off the request path
# The repository extension's load/unload: its registry write (a transaction and a snapshot published) and the
# wait for this process's node to reconcile the change (a load included). Past either, 503 with Retry-After
# REGISTRY_RETRY_S: the change is idempotent, and a retry after a slow moment finds it made or makes it.
SET_LOADED_TIMEOUT_S = 30.0
RECONCILE_TIMEOUT_S = 300.0
REGISTRY_RETRY_S = 5


@dataclass
class DataPlane:
    gateway: Gateway
    # The embedded node; in distributed mode the fleet of node processes as Redis announces it; in a web process
    # of embedded mode with several, the node host's versions (transport.host_link).
    node: Node | FleetView | HostView
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
    # Shadow traffic: the gateway's mirror, and the control plane's side that compares and stores the pairs
    # it kept (on asgiref's thread), every FERRY_SHADOW_FLUSH_SECONDS.
    mirror: Mirror | None = None
    send_shadow: Callable[[list[Pair]], object] | None = None
    shadow_task: asyncio.Task[None] | None = None
    # The control plane's side, handed in by `serving.wiring` (each reads or writes the database, so
    # each runs on asgiref's thread): the registry's fingerprint, building and publishing a snapshot,
    # writing API keys' last_used_at.
    fingerprint: Callable[[], tuple] | None = None
    publish: Callable[[], object] | None = None
    record_key_use: Callable[[set[str]], None] | None = None
    # The repository extension's load/unload of a model (a registry write): model name, load or not;
    # returns the snapshot that carries the change, or raises ServingError with its status.
    set_loaded: Callable[[str, bool], RoutingSnapshot] | None = None
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

    async def wait_reconciled(self, serial: int, timeout: float = RECONCILE_TIMEOUT_S) -> None:
        async with asyncio.timeout(timeout):
            while self.node.reconciled_serial < serial:
                await asyncio.sleep(0.05)

    async def write_loaded(self, name: str, load: bool) -> RoutingSnapshot:
        """The repository extension's registry write (`set_loaded`, on asgiref's thread), within
        SET_LOADED_TIMEOUT_S: past it 503 with Retry-After (the database is slow or locked; the write may
        still land, and a retry is harmless). `set_loaded` itself answers an outage as 503 (`serving.wiring`)."""
        if self.set_loaded is None:
            raise Unavailable("this process cannot change what is loaded; use the control plane's API")
        bound = asyncio.timeout(SET_LOADED_TIMEOUT_S)
        try:
            async with bound:
                return await sync_to_async(self.set_loaded)(name, load)
        except TimeoutError:
            if not bound.expired():
                raise  # the write's own, not this bound's: not relabelled
            log.warning("%s of %s: the registry write took over %.0f s", _verb(load), name, SET_LOADED_TIMEOUT_S)
            raise Unavailable(
                f"the registry did not take the {_verb(load)} of model '{name}' within {SET_LOADED_TIMEOUT_S:.0f} s"
                " (the database is slow or locked); retry shortly",
                retry_after=REGISTRY_RETRY_S,
            ) from None

    async def wait_loaded(self, name: str, load: bool, serial: int) -> None:
        """Wait for this process's node to reconcile the snapshot `serial` of a load or unload, within
        RECONCILE_TIMEOUT_S: past it 503 with Retry-After (the change is recorded; the node is still at it)."""
        try:
            await self.wait_reconciled(serial, RECONCILE_TIMEOUT_S)
        except TimeoutError:
            log.warning("%s of %s: not reconciled within %.0f s", _verb(load), name, RECONCILE_TIMEOUT_S)
            raise Unavailable(
                f"the {_verb(load)} of model '{name}' is recorded but was not done within {RECONCILE_TIMEOUT_S:.0f} s;"
                " retry to wait for it again",
                retry_after=REGISTRY_RETRY_S,
            ) from None

    async def refresh_once(self) -> bool:
        """Rebuild and publish the snapshot if the registry changed. True when it did."""
        if self.fingerprint is None or self.publish is None:
            return False
        fingerprint = await sync_to_async(self.fingerprint)()
        if fingerprint == self._fingerprint:
            return False
        await sync_to_async(self.publish)()
        self._fingerprint = fingerprint
        return True

    async def _watch_loop_lag(self) -> None:
        ran, cpu = self.loop.time(), time.thread_time()  # this runs on the loop's thread: its CPU time
        while True:
            expected = self.loop.time() + LAG_SAMPLE_SECONDS
            await asyncio.sleep(LAG_SAMPLE_SECONDS)
            now, busy = self.loop.time(), time.thread_time()
            # The policy (serving.policies.shedding) smooths the lag and steers the front door's gate by it and
            # by the share of the tick the loop's thread ran.
            self.loop_lag = smoothed_lag(self.loop_lag, expected, now)
            metrics.LOOP_LAG.set(self.loop_lag)
            GATE.tick(
                self.loop_lag,
                settings.FERRY_LOOP_LAG_TARGET_MS / 1000,
                (busy - cpu) / max(now - ran, 1e-6),
                frontdoor_limits.max_frontend_wait_ms / 1000,
                settings.FERRY_FRONTEND_SOJOURN_TARGET_MS / 1000,
            )
            ran, cpu = now, busy

    def count_frontend_shed(self, url: bytes) -> None:
        """Count a request the front door's gate refused, under the version it would have gone to."""
        parts = url.split(b"?", 1)[0].decode("latin-1").split("/")  # /v2/models/NAME[/versions/V]/infer
        name = parts[3] if len(parts) > 3 else ""
        version = parts[5] if len(parts) > 6 and parts[4] == "versions" else None
        self.count_saturation_shed(name, version, None, 0.0)  # before authentication: count only

    def count_saturation_shed(
        self, name: str, version: str | None, viewer: int | None, waited: float
    ) -> VersionEntry | None:
        """Count a request refused because this process is saturated (at the front door or in its handler), under
        the version it would have gone to: its 503 and its shed, and, for the fleet's autoscaler, a request asked
        for (`count_refused`: a refusal for the front end's sake is still demand for the version). The version,
        None where the request routes nowhere.

        A name comes from the URL, before authentication at the front door: only a name the snapshot knows (a
        model or a pipeline, a bounded set) becomes a label; any other is counted under UNROUTED, so clients
        cannot grow the counter's children without bound. Looked up before routing: no exception raised and
        caught for each refusal of an unknown name."""
        snapshot = self.gateway.hub.current
        if snapshot is None or (name not in snapshot.models and name not in snapshot.pipelines):
            metrics.UNROUTED_FRONTEND_SHED.inc()
            return None
        try:
            entry = self.gateway.route(name, version, viewer)
        except ServingError:
            metrics.SHED.labels(name, "", "frontend", "0").inc()
            return None
        vm = metrics.for_version(entry.model, entry.version)
        vm.answered(503, waited)
        vm.shed("frontend", 0)
        self.gateway.transport.count_refused(entry.key)
        return entry

    async def flush_key_use(self) -> None:
        """Write last_used_at for the keys used since the last flush; on failure (database down) keep
        them for the next one."""
        if not self.used_keys or self.record_key_use is None:
            return
        used, self.used_keys = self.used_keys, set()
        try:
            await sync_to_async(self.record_key_use)(used)
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

    async def flush_shadow(self) -> int:
        """Hand the pairs the mirror kept since the last flush to the control plane; returns how many. Pairs
        whose send fails are lost (a sample, not an account) and counted."""
        if self.mirror is None or self.send_shadow is None:
            return 0
        pairs = self.mirror.drain()
        if not pairs:
            return 0
        try:
            await sync_to_async(self.send_shadow)(pairs)
        except Exception:
            for pair in pairs:
                SHADOW_DROPPED.labels(pair.item.candidate.model, str(pair.item.candidate.version), "uncompared").inc()
            raise
        return len(pairs)

    async def _flush_shadow_forever(self) -> None:
        while True:
            await asyncio.sleep(settings.FERRY_SHADOW_FLUSH_SECONDS)
            try:
                await self.flush_shadow()
            except Exception as exc:
                log.warning("sending shadow comparison failed, those pairs are lost: %s", exc)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh_once()
            except Exception as exc:  # the database may be down: keep serving the last snapshot
                log.warning("snapshot refresh failed, serving the last one: %s", exc)


def _verb(load: bool) -> str:
    return "load" if load else "unload"


_current: DataPlane | None = None


def current() -> DataPlane | None:
    return _current


def install(plane: DataPlane | None) -> DataPlane | None:
    """Make `plane` this process's data plane; returns the one it replaces."""
    global _current
    previous, _current = _current, plane
    return previous
