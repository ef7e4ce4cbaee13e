"""The response cache: a repeat of an identical request to a version that opted in is answered by the gateway.

Triton's response cache, per version (`ModelVersion.response_cache`, carried in the snapshot as
`VersionEntry.response_cache`). The key is a hash of the version (its key and its artifact's sha256), the
input tensors' names, dtypes, shapes and bytes, the output names asked for, and the scope: the caller's tenant,
or one scope shared by the tenants that opted in (`TenantEntry.share_response_cache`) when every tenant may
see the model (a platform model or a public one). A tenant that did not opt in never reads nor fills another's
answers, and a private or shared model's answers are never shared at all.

Local to the gateway process: an LRU bounded in bytes (FERRY_RESPONSE_CACHE_BYTES), whose entries are the
output tensors (never an encoded reply: the reply carries the request's id and encoding). An optional Redis
tier (`RedisTier`, FERRY_RESPONSE_CACHE_REDIS_URL) is read on a local miss and written on a store, each entry
with a TTL; a Redis that is slow or down is a miss, never an error.

Invalidation: a snapshot in which a version is gone, retired, no longer servable, no longer opted in, has
another artifact, or whose model is no longer visible to every tenant drops that version's local entries
(`on_snapshot`). Redis entries need no sweep: the key holds the artifact's sha256 and the gateway asks Redis
only for a version the current snapshot lets it cache, so a stale one is never read, and its TTL ends it.

A hit skips admission, the queue and the device (the gateway returns before the transport) but has passed
the quota already; the caller's usage counts it as a request with no compute seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np
import redis
from prometheus_client import Counter, Gauge

from serving.dataplane import tracing
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub, TenantEntry, VersionEntry
from serving.dataplane.transport import redis_pipe
from serving.dataplane.transport.stream_codec import MalformedMessage, decode_reply, encode_success
from serving.dataplane.transport.transport import Outputs, Transport

log = logging.getLogger(__name__)

LOOKUPS = Counter(
    "ferry_response_cache_lookups",
    "Response cache look-ups of versions that opted in, by result (hit_local, hit_redis, miss)",
    ["model", "version", "result"],
)
STORED_BYTES = Gauge("ferry_response_cache_bytes", "Bytes of answers held by this gateway's response cache")
EVICTED = Counter("ferry_response_cache_evictions", "Answers dropped from the response cache, by why", ["reason"])
REDIS_ERRORS = Counter("ferry_response_cache_redis_errors", "Redis tier look-ups or stores that failed (a miss)")

ENTRY_OVERHEAD = 256  # bytes per entry besides its tensors: the key, the dict, the arrays' headers
SHARED = b"shared"


def public(model: ModelEntry) -> bool:
    """Whether every tenant may see `model`: only such a model's answers may be shared across tenants."""
    return model.tenant_id is None or model.visibility == "public"


def scope(model: ModelEntry, viewer: int | None, tenants: Mapping[int, TenantEntry]) -> bytes:
    """The partition a request's answer lives in: the shared one for a public model and a tenant that opted
    in, else the tenant's own."""
    if viewer is not None and public(model):
        tenant = tenants.get(viewer)
        if tenant is not None and tenant.share_response_cache:
            return SHARED
    return b"t%d" % viewer if viewer is not None else b"plane"


def request_key(
    entry: VersionEntry, inputs: Mapping[str, np.ndarray], outputs: tuple[str, ...] | None, partition: bytes
) -> bytes:
    """The cache key: a BLAKE2b digest of the version, the scope, the outputs asked for and each input's name,
    dtype, shape and bytes (in name order, each field length-prefixed so no two requests run together)."""
    h = hashlib.blake2b(digest_size=20)

    def field(data: bytes) -> None:
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    field(entry.key.encode())
    field(entry.artifact_sha256.encode())
    field(partition)
    field(b"\x00".join(o.encode() for o in outputs) if outputs is not None else b"\x01all")
    for name in sorted(inputs):
        array = inputs[name]
        field(name.encode())
        field(array.dtype.str.encode())
        field(b",".join(b"%d" % d for d in array.shape))
        field(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.digest()


class RedisTier:
    """The optional second tier: one Redis value per answer (`stream_codec`'s reply encoding, checked when read),
    with a TTL. Look-ups are bounded by `timeout_s`; any failure is a miss."""

    def __init__(self, url: str, *, ttl_s: float = 300.0, timeout_s: float = 0.05, max_entry_bytes: int = 1 << 20):
        self.url = url
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.timeout_s = timeout_s
        self.max_entry_bytes = max_entry_bytes
        self._client: redis.asyncio.Redis | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.max_writes = 64  # stores in flight at once; past it a store is skipped (the cache is best effort)

    @staticmethod
    def redis_key(version_key: str, key: bytes) -> str:
        return f"ferry:rcache:{{{version_key}}}:{key.hex()}"

    def _redis(self) -> redis.asyncio.Redis:
        if self._client is None:
            self._client = redis_pipe.client(self.url, name="ferry-response-cache")
        return self._client

    async def get(self, version_key: str, key: bytes) -> Outputs | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._redis().get(self.redis_key(version_key, key))
        except (TimeoutError, redis.RedisError, OSError):
            REDIS_ERRORS.inc()
            return None
        if raw is None:
            return None
        try:
            reply = decode_reply(raw)
        except MalformedMessage:
            REDIS_ERRORS.inc()
            return None
        return reply.outputs

    def put(self, version_key: str, key: bytes, outputs: Mapping[str, np.ndarray]) -> None:
        """Store in the background; never awaited by the request."""
        if len(self._writes) >= self.max_writes:
            return
        raw = encode_success(0, outputs, None)
        if len(raw) > self.max_entry_bytes:
            return
        task = asyncio.get_running_loop().create_task(self._set(self.redis_key(version_key, key), raw))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _set(self, name: str, raw: bytes) -> None:
        try:
            async with asyncio.timeout(1.0):
                await self._redis().set(name, raw, px=self.ttl_ms)
        except (TimeoutError, redis.RedisError, OSError):
            REDIS_ERRORS.inc()

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=1.0)
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class ResponseCache:
    """The gateway's local tier (an LRU bounded in bytes) and, optionally, the Redis tier behind it."""

    def __init__(self, max_bytes: int, *, redis_tier: RedisTier | None = None, max_entry_fraction: float = 0.125):
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        self.max_bytes = max_bytes
        self.max_entry_bytes = max(1, int(max_bytes * max_entry_fraction))  # one answer never takes the whole
        self.redis = redis_tier
        self.nbytes = 0
        # key -> (version key, outputs, bytes); most recently used last
        self._entries: OrderedDict[bytes, tuple[str, Outputs, int]] = OrderedDict()
        self._by_version: dict[str, set[bytes]] = {}
        # version key -> (artifact sha256, model visible to every tenant), for the versions the last snapshot allows
        self._valid: dict[str, tuple[str, bool]] = {}
        # Snapshots arrive on whichever thread published them; requests run on the event loop.
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def key_for(
        self,
        entry: VersionEntry,
        model: ModelEntry,
        inputs: Mapping[str, np.ndarray],
        outputs: tuple[str, ...] | None,
        viewer: int | None,
        tenants: Mapping[int, TenantEntry],
    ) -> bytes:
        return request_key(entry, inputs, outputs, scope(model, viewer, tenants))

    async def lookup(self, entry: VersionEntry, key: bytes) -> Outputs | None:
        """The cached answer to `key` of `entry` (local first, then Redis, which fills the local tier), counted."""
        found = self.get(key)
        if found is not None:
            LOOKUPS.labels(entry.model, str(entry.version), "hit_local").inc()
            return found
        if self.redis is not None:
            found = await self.redis.get(entry.key, key)
            if found is not None:
                self._store(entry, key, found)
                LOOKUPS.labels(entry.model, str(entry.version), "hit_redis").inc()
                return Outputs(found, 0.0)
        LOOKUPS.labels(entry.model, str(entry.version), "miss").inc()
        return None

    def get(self, key: bytes) -> Outputs | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries.move_to_end(key)
        return Outputs(found[1], 0.0)  # a hit used no device time

    def put(self, entry: VersionEntry, key: bytes, outputs: Mapping[str, np.ndarray]) -> None:
        """Keep the answer `outputs` of `entry` under `key`, here and (in the background) in Redis."""
        if self._store(entry, key, outputs) and self.redis is not None:
            self.redis.put(entry.key, key, outputs)

    def _store(self, entry: VersionEntry, key: bytes, outputs: Mapping[str, np.ndarray]) -> bool:
        size = ENTRY_OVERHEAD + sum(a.nbytes for a in outputs.values())
        if size > self.max_entry_bytes:
            EVICTED.labels("too_large").inc()
            return False
        kept = Outputs({name: _frozen(a) for name, a in outputs.items()}, 0.0)
        with self._lock:
            allowed = self._valid.get(entry.key)
            if allowed is None or allowed[0] != entry.artifact_sha256:
                return False  # a snapshot that dropped this version came in while it ran
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[2]
            self._entries[key] = (entry.key, kept, size)
            self._by_version.setdefault(entry.key, set()).add(key)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                victim, (version_key, _, victim_size) = self._entries.popitem(last=False)
                self._forget(victim, version_key, victim_size)
                EVICTED.labels("lru").inc()
            STORED_BYTES.set(self.nbytes)
        return True

    def _forget(self, key: bytes, version_key: str, size: int) -> None:
        self.nbytes -= size
        keys = self._by_version.get(version_key)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_version[version_key]

    def on_snapshot(self, snapshot: RoutingSnapshot) -> None:
        """Drop the entries of every version this snapshot does not let the cache answer for any more, and of
        every model no longer visible to every tenant (its shared entries must go; its tenants' own go with
        them, which is simpler than telling them apart for a change this rare)."""
        valid = {}
        for m in snapshot.models.values():
            for v in m.versions.values():
                if v.response_cache and v.servable:
                    valid[v.key] = (v.artifact_sha256, public(m))
        with self._lock:
            gone = [
                version_key
                for version_key in self._by_version
                if version_key not in valid
                or valid[version_key][0] != self._valid[version_key][0]
                or (self._valid[version_key][1] and not valid[version_key][1])
            ]
            self._valid = valid
            for version_key in gone:
                for key in list(self._by_version.get(version_key, ())):
                    old = self._entries.pop(key, None)
                    if old is not None:
                        self._forget(key, version_key, old[2])
                        EVICTED.labels("invalidated").inc()
            STORED_BYTES.set(self.nbytes)

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.close()


def _frozen(array: np.ndarray) -> np.ndarray:
    """A read-only array the cache can hand to every later caller: a copy unless it is read-only already."""
    if not array.flags.writeable:
        return array
    kept = np.array(array, copy=True)
    kept.flags.writeable = False
    return kept


class CachingTransport:
    """The gateway's transport with the cache in front: a request to a version that opted in is looked up first
    (a hit returns at once: no admission, no queue, no device, no stream), and a miss's answer is kept. Every
    other request goes straight through. The shadow mirror keeps the plain transport: a shadow computes."""

    def __init__(self, inner: Transport, cache: ResponseCache, hub: SnapshotHub) -> None:
        self.inner = inner
        self.cache = cache
        self.hub = hub
        if hub.current is not None:
            cache.on_snapshot(hub.current)
        hub.subscribe(cache.on_snapshot)

    def __getattr__(self, name: str) -> object:  # the wrapped transport's own API (start, close, outstanding...)
        return getattr(self.inner, name)

    async def infer(
        self,
        entry: VersionEntry,
        inputs: dict[str, np.ndarray],
        rows: int,
        deadline: float,
        priority: int,
        *,
        nbytes: int = 0,
        gone: Callable[[], bool] | None = None,
        tenant: int | None = None,
        outputs: tuple[str, ...] | None = None,
    ) -> dict[str, np.ndarray]:
        snapshot = self.hub.current
        model = snapshot.models.get(entry.model) if entry.response_cache and snapshot is not None else None
        if model is None:
            return await self.inner.infer(
                entry, inputs, rows, deadline, priority, nbytes=nbytes, gone=gone, tenant=tenant, outputs=outputs
            )
        key = self.cache.key_for(entry, model, inputs, outputs, tenant, snapshot.tenants)  # type: ignore[union-attr]
        with tracing.child("ferry.cache") as span:
            found = await self.cache.lookup(entry, key)
            if span is not None:
                span.set_attribute("ferry.cache.hit", found is not None)
        if found is not None:
            return found
        answer = await self.inner.infer(
            entry, inputs, rows, deadline, priority, nbytes=nbytes, gone=gone, tenant=tenant, outputs=outputs
        )
        self.cache.put(entry, key, answer)
        return answer
