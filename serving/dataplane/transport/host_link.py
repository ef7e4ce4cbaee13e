"""A web process's side of the node host (embedded mode with several web processes, `serve --workers N`).

The web processes parse HTTP, authenticate, route and meter; one node host (`manage.py nodehost`) holds the
models, batches and runs them, and keeps every tenant's quota. So the device's work and HTTP parsing are
never in one interpreter (one GIL), and parsing is spread over as many processes as there are cores.

- `HostLink`: one Unix-socket connection to the host, many requests at once (`host_frames`). When it
  is lost, every request waiting on it is answered 503 with Retry-After at once (the host is restarting
  or gone), and new ones are refused until it is back. It reconnects on its own.
- `HostTransport`: `Transport.infer` through the link. Requests use the codec of the Redis streams
  (`stream_codec`); the host's node decides admission as it does for an embedded one, so a refusal comes
  back as the node's `Shed` and the gateway falls back exactly as in one process.
- `HostView`: what the host holds ready, read every STATUS_SECONDS, in place of an embedded `Node`.
- `HostQuota`: the shared quota of `QuotaGate` (as `RedisQuota` is in distributed mode), decided in the
  host so that N web processes do not grant a tenant N times its limits.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable

import msgpack
import numpy as np

from serving.dataplane import tracing
from serving.dataplane.errors import DeadlineExceeded, ServingError, Unavailable
from serving.dataplane.gateway.snapshot import RoutingSnapshot, TenantEntry, VersionEntry
from serving.dataplane.metrics import metrics
from serving.dataplane.transport import host_frames as frames
from serving.dataplane.transport.fleet import FleetPacking, LoadFailure, NodeInfo, RemoteVersions
from serving.dataplane.transport.fleet_events import FleetEvent
from serving.dataplane.transport.outstanding import Outstanding, check_sendable, held_for
from serving.dataplane.transport.stream_codec import MalformedMessage, StreamRequest, decode_reply, encode_request
from serving.policies.quota import Decision

log = logging.getLogger(__name__)

STATUS_SECONDS = 0.1  # how stale "ready" may be here: a load on the host shows within about this
RECONNECT_MAX_S = 0.5
GONE_POLL_S = 0.05  # how often a request waiting on the host checks whether its client left
CONTROL_TIMEOUT_S = 5.0  # a status read or a quota decision; a refresh waits for the host's loads (REFRESH_TIMEOUT_S)
REFRESH_TIMEOUT_S = 300.0
# Calls whose caller gave up and whose answer must still be acted on when it comes (`HostLink.call`'s `late`):
# at most this many at once. Past it a late answer is dropped; the host's lease TTL frees what that leaves.
LATE_MAX = 4096


class HostLost(Unavailable):
    def __init__(self, message: str = "the node host is not connected (restarting?)") -> None:
        super().__init__(message, retry_after=1)


class HostLink:
    def __init__(self, path: str) -> None:
        self.path = path
        self.connected = asyncio.Event()
        self._proto: frames.FrameProtocol | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        # request id -> what to do with its answer should it come after its caller stopped waiting
        self._late: dict[int, Callable[[int, bytes], None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()

    @property
    def up(self) -> bool:
        return self._proto is not None and not self._proto.closed

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep_connected(), name="ferry-host-link")

    async def _keep_connected(self) -> None:
        backoff = 0.02
        warned = False
        loop = asyncio.get_running_loop()
        while True:
            try:
                _, proto = await loop.create_unix_connection(
                    lambda: frames.FrameProtocol(self._on_frame, self._on_lost), self.path
                )
            except OSError as exc:
                if not warned:
                    log.warning("node host at %s not reachable (%s); retrying", self.path, exc)
                    warned = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RECONNECT_MAX_S)
                continue
            if warned:
                log.info("node host at %s reachable again", self.path)
            warned, backoff = False, 0.02
            self._proto = proto
            self._lost.clear()
            self.connected.set()
            await self._lost.wait()

    def _on_lost(self, exc: Exception | None) -> None:
        self._proto = None
        self.connected.clear()
        self._lost.set()
        self._late.clear()  # the host gives back whatever it held for this connection
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(HostLost("lost the connection to the node host"))

    def _on_frame(self, kind: int, rid: int, payload: bytes) -> None:
        future = self._waiting.pop(rid, None)
        late = self._late.pop(rid, None) if self._late else None
        if future is not None and not future.done():
            future.set_result((kind, payload))  # its caller takes it, or hands it to `late` (`call`)
        elif late is not None:
            self._answer_late(late, kind, payload)

    @staticmethod
    def _answer_late(late: Callable[[int, bytes], None], kind: int, payload: bytes) -> None:
        try:
            late(kind, payload)
        except Exception:
            metrics.INTERNAL_ERRORS.labels("host_late_answer").inc()
            log.exception("acting on a late answer of the node host (frame kind %d) failed", kind)

    def send(
        self, kind: int, payload: bytes, *, late: Callable[[int, bytes], None] | None = None
    ) -> tuple[int, asyncio.Future[tuple[int, bytes]]]:
        """Send one request; its id and the future of its answer. HostLost when not connected. `late`: called
        with the answer should it come after the future was given up (cancelled)."""
        proto = self._proto
        if proto is None or proto.closed:
            raise HostLost()
        rid = next(self._ids) & 0xFFFFFFFF
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        if late is not None and len(self._late) < LATE_MAX:
            self._late[rid] = late
        proto.send(kind, rid, payload)
        return rid, future

    def forget(self, rid: int) -> None:
        self._waiting.pop(rid, None)

    def cancel(self, rid: int) -> None:
        """Tell the host the client of request `rid` left (dropped while not connected: the request went too)."""
        proto = self._proto
        if proto is not None and not proto.closed:
            proto.send(frames.CANCEL, rid, b"")

    def post(self, kind: int, payload: bytes) -> None:
        """Send a request that has no answer (dropped while not connected)."""
        proto = self._proto
        if proto is not None and not proto.closed:
            proto.send(kind, 0, payload)

    async def call(
        self,
        kind: int,
        payload: bytes,
        timeout: float = CONTROL_TIMEOUT_S,
        *,
        late: Callable[[int, bytes], None] | None = None,
    ) -> tuple[int, bytes]:
        """The host's answer, within `timeout`. `late`: what to do with the answer if this call stops waiting
        first (its timeout, or a caller's own that cancelled it) and the host answers all the same: an answer
        that carries a hold (a quota lease) must be handed back, not dropped."""
        rid, future = self.send(kind, payload, late=late)
        try:
            async with asyncio.timeout(timeout):
                answer = await future
        except BaseException:
            if late is not None and future.done() and not future.cancelled():
                self._late.pop(rid, None)
                if future.exception() is None:  # answered as the wait gave up: nobody took the answer
                    self._answer_late(late, *future.result())
            # else given up (cancelled): `_late` keeps `late` for the answer to come, or ran it if it came meanwhile
            raise
        finally:
            self.forget(rid)
        if late is not None:
            self._late.pop(rid, None)
        return answer

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._proto is not None:
            self._proto.close()


REPLY_TO = b"host"


def infer_payload(key: str, request: bytes) -> bytes:
    return key.encode() + b"\0" + request


class HostTransport:
    """`Transport.infer` through the node host. What this process has outstanding per version is bounded in
    requests (the version's max_queue_size) and bytes (`max_bytes`), as the streams transport bounds it."""

    def __init__(
        self,
        link: HostLink,
        *,
        max_bytes: int = 64 * 1024**2,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.max_bytes = max_bytes
        self._clock = clock
        self._wall = wall
        self._outstanding: dict[str, Outstanding] = {}

    def count_refused(self, key: str) -> None:
        """Nothing to count with: the node host is embedded mode's one node, no fleet autoscaler reads demand."""

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
        now = self._clock()
        check_sendable(entry, deadline, now, gone)
        key = entry.key
        held = held_for(self._outstanding, entry, nbytes, self.max_bytes, priority, "this web process")
        message = encode_request(
            StreamRequest(
                0,  # the frame's id is the request's; the codec's reply stream is the connection
                REPLY_TO,
                self._wall() + (deadline - now),
                tenant,
                priority,
                rows,
                inputs,
                outputs,
                tracing.carrier() if tracing.ENABLED else None,
            )
        )
        rid, future = self.link.send(frames.INFER, infer_payload(key, message))
        held.items += 1
        held.nbytes += nbytes
        try:
            try:
                async with asyncio.timeout(deadline - self._clock()):
                    if gone is None:
                        kind, payload = await future
                    else:
                        kind, payload = await self._answer_or_cancel(rid, future, gone)
            except TimeoutError:
                metrics.DEADLINES.labels(entry.model, str(entry.version), "gateway").inc()
                raise DeadlineExceeded("request deadline exceeded") from None
            if kind != frames.REPLY:
                metrics.INTERNAL_ERRORS.labels("host_reply").inc()
                log.error("the node host answered %s with %r", key, payload[:200])
                raise ServingError("the node host could not read the request; the gateway logged it")
            try:
                reply = decode_reply(payload)
            except MalformedMessage as exc:
                metrics.INTERNAL_ERRORS.labels("host_reply").inc()
                log.error("malformed reply from the node host for %s: %s", key, exc)
                raise ServingError("malformed reply from the node host; the gateway logged it") from None
            if reply.error is not None:
                if isinstance(reply.error, DeadlineExceeded):
                    metrics.DEADLINES.labels(entry.model, str(entry.version), "node").inc()
                raise reply.error
            assert reply.outputs is not None
            return reply.outputs
        finally:
            self.link.forget(rid)
            held.items -= 1
            held.nbytes -= nbytes

    async def _answer_or_cancel(
        self, rid: int, future: asyncio.Future[tuple[int, bytes]], gone: Callable[[], bool]
    ) -> tuple[int, bytes]:
        """The host's answer; meanwhile, every GONE_POLL_S, whether the client left, which the host then hears
        at once (CANCEL) and drops the request unrun at its turn, as an embedded node does for a client of its
        own. The answer still comes (499 when it was dropped) and is awaited: what this process holds for the
        version is released then. A timer, not a wait with a timeout: most answers come before the first
        check, and the timer costs a couple of microseconds a request where `asyncio.wait` cost six."""
        loop = asyncio.get_running_loop()

        def check() -> None:
            nonlocal timer
            if future.done():
                return
            if gone():
                self.link.cancel(rid)
            else:
                timer = loop.call_later(GONE_POLL_S, check)

        timer = loop.call_later(GONE_POLL_S, check)
        try:
            return await future
        finally:
            timer.cancel()

    def outstanding(self, key: str) -> int:
        held = self._outstanding.get(key)
        return held.items if held else 0


class HostView(RemoteVersions):
    """The node host's versions as a web process sees them, re-read every STATUS_SECONDS; the last view
    stays while the host is away (requests are refused meanwhile: the link is down)."""

    def __init__(self, link: HostLink) -> None:
        super().__init__()
        self.link = link
        self.host_serial = 0
        # What the repository index and the fleet page read of a node's packing (`Node.packing`); without it
        # they answered 500 for any version not hot on the host.
        self.packing = FleetPacking()
        # reconciled_serial: that of this process's latest snapshot the host has reconciled (see `reconcile`).
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._refresh_forever(), name="ferry-host-view")

    def update(self, doc: dict) -> None:
        self._hot = frozenset(doc.get("hot", ()))
        self._ready = frozenset(doc.get("ready", ())) | self._hot
        self.failures = {k: LoadFailure(r) for k, r in (doc.get("failures") or {}).items()}
        self.packing = FleetPacking(
            cold=self._ready - self._hot,
            loading=frozenset(doc.get("loading", ())) - self._hot,
            no_room=dict(doc.get("no_room") or {}),
        )
        self.host_serial = int(doc.get("serial", 0))

    async def refresh_once(self) -> None:
        kind, payload = await self.link.call(frames.STATUS, b"")
        if kind == frames.STATUS_REPLY:
            self.update(msgpack.unpackb(payload))

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.link.connected.wait()
                await self.refresh_once()
            except (ServingError, TimeoutError, ValueError) as exc:
                log.debug("reading the node host's status failed: %s", exc)
            await asyncio.sleep(STATUS_SECONDS)

    async def fleet(self) -> tuple[NodeInfo, list[FleetEvent]]:
        """The host's node and its record of the last hour, as the fleet page shows a node (asked each time:
        the page is read seldom, and the host's own view is the fresh one)."""
        kind, payload = await self.link.call(frames.FLEET, b"")
        if kind != frames.FLEET_REPLY:
            raise Unavailable(f"the node host answered the fleet's question with frame kind {kind}", retry_after=1)
        doc = msgpack.unpackb(payload)
        events = [FleetEvent(str(n), float(at), str(k), str(key), str(d)) for n, at, k, key, d in doc["events"]]
        return NodeInfo.from_doc(doc["info"]), events

    async def reconcile(self, snapshot: RoutingSnapshot) -> None:
        """This process saw the registry change (its own snapshot): the host reads the registry again, loads
        what it now names, and answers when it has; a repository load waits for that (`wait_reconciled`)."""
        await self.link.connected.wait()
        await self.link.call(frames.REFRESH, b"", timeout=REFRESH_TIMEOUT_S)
        await self.refresh_once()
        self.reconciled_serial = max(self.reconciled_serial, snapshot.serial)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.link.close()


class HostQuota:
    """`QuotaGate`'s shared limiter, decided in the node host (its `InProcessQuota`): the one place every
    web process's requests are counted. Raises HostLost (an OSError's place in `QuotaGate`: it then decides
    in this process with the limits divided by the number of web processes)."""

    def __init__(self, link: HostLink) -> None:
        self.link = link

    async def admit(
        self, tenant_id: int, limits: TenantEntry, debt: int = 0, *, debt_age: float = 0.0, share: float = 1.0
    ) -> tuple[Decision, str]:
        payload = msgpack.packb(
            [
                tenant_id,
                limits.requests_per_second,
                limits.burst,
                limits.max_in_flight,
                limits.monthly_requests,
                debt,
                debt_age,
                share,
            ]
        )
        try:
            kind, answer = await self.link.call(
                frames.QUOTA, payload, late=lambda kind, answer: self._late_decision(tenant_id, kind, answer)
            )
        except HostLost as exc:
            raise OSError(str(exc)) from None
        admitted, reason, limit, remaining, reset, retry_after, lease = msgpack.unpackb(answer)
        return Decision(bool(admitted), reason, limit, remaining, reset, retry_after), str(lease) if lease else ""

    def _late_decision(self, tenant_id: int, kind: int, answer: bytes) -> None:
        """The host's decision came after `QuotaGate` stopped waiting for it (FERRY_QUOTA_REDIS_TIMEOUT_MS) and
        decided in this process instead: the host counted the request in flight under a lease nobody holds, so
        it is given back at once. Kept, it would hold one of the tenant's in-flight slots until this process's
        connection closed, and enough slow moments would refuse the tenant for good."""
        if kind != frames.QUOTA_REPLY:
            return
        lease = msgpack.unpackb(answer)[6]
        if lease:
            metrics.QUOTA_LATE_LEASES.inc()
            self.link.post(frames.QUOTA_RELEASE, msgpack.packb([[tenant_id, str(lease)]]))

    async def release(self, tenant_id: int, lease: str) -> None:
        await self.release_many([(tenant_id, lease)])

    async def release_many(self, leases: list[tuple[int, str]]) -> None:
        self.link.post(frames.QUOTA_RELEASE, msgpack.packb([[t, lease] for t, lease in leases if lease]))

    async def close(self) -> None:
        """The link is the view's to close."""
