"""The node host of embedded mode with several web processes (`manage.py nodehost`, started by `serve --workers N`).

It owns the embedded `Node` (its batchers, device thread and sandboxed runtimes) and every tenant's quota,
and answers the web processes over a Unix socket (`serving.dataplane.transport.host_frames`):

- INFER: a version's key and a `stream_codec` request; `Node.infer` decides admission and runs it, and the
  answer is the codec's success or error, so a refusal is the node's own `Shed`.
- STATUS: the serial it reconciled, the versions it holds hot, those it can load and is loading, and why it
  could not load some (no room, a failure).
- QUOTA / QUOTA_RELEASE: `InProcessQuota` over every web process's requests; a lease per admitted request,
  freed on release, when its web process's connection closes, or after `lease_s` (FERRY_QUOTA_LEASE_S, as a
  Redis lease expires): a lease its web process never released (a release lost, a bug) holds its tenant's
  in-flight slot that long at most.
- REFRESH: read the registry now (a web process changed it) and answer once what it names is loaded.
- FLEET: its node and that node's record of the last hour, for the fleet page of the web processes.
- CANCEL: the client of an INFER left; the node drops it unrun at its turn (answered 499), as for a client of
  its own. A web process whose connection closes cancels all of its requests so.

The socket lives in the data directory with mode 0600: the web processes are its only peers. The sandboxed
runtimes cannot reach it (they see no data directory).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgpack
from django.conf import settings

from serving.dataplane import tracing
from serving.dataplane.errors import DeadlineExceeded, ServingError
from serving.dataplane.metrics import metrics
from serving.dataplane.node import announce
from serving.dataplane.node.node import Node
from serving.dataplane.transport import fleet_events
from serving.dataplane.transport import host_frames as frames
from serving.dataplane.transport.stream_codec import MalformedMessage, decode_request, encode_error, encode_success
from serving.policies.quota import InProcessQuota

log = logging.getLogger(__name__)

EVENTS_SHOWN = 200  # as many as the fleet page lists
LEASE_SWEEP_MAX_S = 5.0  # expired leases are looked for at most this often (and at least 4 times per lease_s)


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """A tenant's limits as a web process sent them (`serving.policies.quota.Limits`)."""

    requests_per_second: float
    burst: int
    max_in_flight: int
    monthly_requests: int


class NodeHost:
    def __init__(
        self,
        node: Node,
        quota: InProcessQuota,
        *,
        refresh: Callable[[], Awaitable[int]],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        lease_s: float | None = None,  # None: FERRY_QUOTA_LEASE_S
    ) -> None:
        self.node = node
        self.quota = quota
        self.refresh = refresh
        self._clock = clock
        self._wall = wall
        self._leases = itertools.count(1)
        # Leases handed out and not released, by web connection, with the tenant and when each expires: a web
        # process that dies gives its tenants' in-flight slots back when its connection closes, and a lease never
        # released expires after `lease_s`.
        self._held: dict[int, dict[str, tuple[int, float]]] = {}
        self.lease_s = float(settings.FERRY_QUOTA_LEASE_S if lease_s is None else lease_s)
        self._sweep_every = min(LEASE_SWEEP_MAX_S, self.lease_s / 4)
        self._next_sweep = clock() + self._sweep_every
        self._conns = itertools.count(1)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._protos: set[frames.FrameProtocol] = set()
        self.counts = {"served": 0, "refused": 0, "malformed": 0, "errors": 0}
        # (connection, request id) -> set when that request's client left (CANCEL): the node drops it unrun
        self._gone: dict[tuple[int, int], asyncio.Event] = {}

    async def start(self, path: str) -> None:
        if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)  # a host that died left it
        old = os.umask(0o177)
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(self._connection, path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)

    def _connection(self) -> frames.FrameProtocol:
        conn = next(self._conns)
        self._held[conn] = {}
        proto: frames.FrameProtocol

        def on_frame(kind: int, rid: int, payload: bytes) -> None:
            self._on_frame(proto, conn, kind, rid, payload)

        def on_lost(exc: Exception | None) -> None:
            self._protos.discard(proto)
            for tenant, _ in self._held.pop(conn, {}).values():
                self.quota.release(tenant)
            # the web process went away, and its clients with it: what of theirs still waits is dropped unrun
            for (of, _), gone in self._gone.items():
                if of == conn:
                    gone.set()

        proto = frames.FrameProtocol(on_frame, on_lost)
        self._protos.add(proto)
        return proto

    def _on_frame(self, proto: frames.FrameProtocol, conn: int, kind: int, rid: int, payload: bytes) -> None:
        if kind == frames.INFER:
            task = asyncio.get_running_loop().create_task(self._infer(proto, conn, rid, payload))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif kind == frames.CANCEL:
            left = self._gone.get((conn, rid))
            if left is not None:  # else answered already, or never sent
                left.set()
        elif kind == frames.QUOTA:
            self._admit(proto, conn, rid, payload)
        elif kind == frames.QUOTA_RELEASE:
            self._release(conn, payload)
        elif kind == frames.STATUS:
            proto.send(frames.STATUS_REPLY, rid, msgpack.packb(self.status()))
        elif kind == frames.FLEET:
            proto.send(frames.FLEET_REPLY, rid, msgpack.packb(self.fleet()))
        elif kind == frames.REFRESH:
            task = asyncio.get_running_loop().create_task(self._refresh(proto, rid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            self.counts["malformed"] += 1
            proto.send(frames.BAD_FRAME, rid, f"unknown frame kind {kind}".encode())

    def status(self) -> dict:
        node = self.node
        return {
            "serial": node.reconciled_serial,
            "hot": sorted(node.hosted),
            "ready": sorted(node.packing.cold),  # cold here: a request loads it
            "loading": sorted(node.packing.loading),
            "no_room": dict(node.packing.no_room),
            "failures": {k: f.reason for k, f in node.failures.items()},
        }

    def fleet(self) -> dict:
        """What the web processes' fleet page shows of this host: its node as a heartbeat would announce it, and
        the node's loads, evictions and failures of the last hour (the newest EVENTS_SHOWN)."""
        now = self._wall()
        name = announce.process_name()
        since = now - fleet_events.WINDOW_SECONDS
        record = [e for e in list(self.node.packing.events) if e.at >= since][-EVENTS_SHOWN:]
        return {
            "info": announce.describe(self.node, name, now).to_doc(),
            "events": [(name, e.at, e.kind, e.key, e.detail) for e in record],
        }

    async def _infer(self, proto: frames.FrameProtocol, conn: int, rid: int, payload: bytes) -> None:
        key, sep, raw = payload.partition(b"\0")
        try:
            if not sep:
                raise MalformedMessage("an inference frame starts with the version's key")
            request = decode_request(raw)
        except MalformedMessage as exc:
            self.counts["malformed"] += 1
            metrics.INTERNAL_ERRORS.labels("host_request").inc()
            log.error("malformed inference frame: %s", exc)
            proto.send(frames.BAD_FRAME, rid, str(exc).encode())
            return
        name = key.decode(errors="replace")
        left = request.deadline - self._wall()
        gone = self._gone[(conn, rid)] = asyncio.Event()  # set by a CANCEL from the web process
        # The web process's trace goes on here, as on a node of distributed mode (node_process): this host's part
        # of the request (admission, queue, batch, device) is one span under the web process's request span.
        span = None
        if request.trace is not None and tracing.ENABLED:
            parent = tracing.from_carrier(request.trace)
            span = tracing.start_request("ferry.node", parent, kind=tracing.CONSUMER, **{"ferry.version": name})
        with tracing.active(span, tracing.answered):
            try:
                if left <= 0:
                    raise DeadlineExceeded("deadline passed on the way to the node host")
                outputs = await self.node.infer(
                    name,
                    request.inputs,
                    request.rows,
                    self._clock() + left,
                    request.priority,
                    nbytes=len(raw),
                    gone=gone.is_set,
                )
                with tracing.child("ferry.reply"):
                    answer = encode_success(0, outputs, request.outputs)
                self.counts["served"] += 1
                status = 200
            except ServingError as exc:
                answer = encode_error(0, exc)
                self.counts["refused"] += 1
                status = exc.status
            except Exception:
                self.counts["errors"] += 1
                metrics.INTERNAL_ERRORS.labels("node_host").inc()
                log.exception("inference on %s failed unexpectedly", name)
                answer = encode_error(0, ServingError("internal error on the node host; it logged it"))
                status = 500
            finally:
                self._gone.pop((conn, rid), None)
            if span is not None:
                tracing.answered(span, status)
        proto.send(frames.REPLY, rid, answer)

    def _admit(self, proto: frames.FrameProtocol, conn: int, rid: int, payload: bytes) -> None:
        try:
            tenant, rps, burst, in_flight, monthly, debt, debt_age, share = msgpack.unpackb(payload)
            limits = QuotaLimits(float(rps), int(burst), int(in_flight), int(monthly))
            debt_age, share = float(debt_age), float(share)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            self.counts["malformed"] += 1
            proto.send(frames.BAD_FRAME, rid, f"malformed quota frame: {exc}".encode())
            return
        now = self._clock()
        if now >= self._next_sweep:
            self.expire_leases(now)
        if debt:  # admitted by a web process on its own while this host did not answer
            self.quota.charge(int(tenant), int(debt), limits, age=debt_age, share=share)
        decision = self.quota.admit(int(tenant), limits)
        lease = ""
        if decision.admitted:
            lease = str(next(self._leases))
            self._held.setdefault(conn, {})[lease] = (int(tenant), now + self.lease_s)
        proto.send(
            frames.QUOTA_REPLY,
            rid,
            msgpack.packb(
                [
                    decision.admitted,
                    decision.reason,
                    decision.limit,
                    decision.remaining,
                    decision.reset,
                    decision.retry_after,
                    lease,
                ]
            ),
        )

    def _release(self, conn: int, payload: bytes) -> None:
        try:
            leases = msgpack.unpackb(payload)
        except (ValueError, msgpack.UnpackException):
            self.counts["malformed"] += 1
            return
        held = self._held.get(conn, {})
        for item in leases if isinstance(leases, list) else ():
            if isinstance(item, list) and len(item) == 2:
                lease = held.pop(str(item[1]), None)
                if lease is not None:  # else released already, or expired
                    self.quota.release(lease[0])

    def expire_leases(self, now: float) -> int:
        """Free the leases held past `lease_s` (their in-flight slots), as Redis expires its own; how many. Run
        from the quota decisions every `_sweep_every` at most: a pass over what is held, in flight or leaked."""
        self._next_sweep = now + self._sweep_every
        expired = 0
        for held in self._held.values():
            stale = [lease for lease, (_, expires) in held.items() if expires <= now]
            for lease in stale:
                tenant, _ = held.pop(lease)
                self.quota.release(tenant)
            expired += len(stale)
        if expired:
            metrics.QUOTA_LEASES_EXPIRED.inc(expired)
            log.warning(
                "freed %d in-flight leases no web process released within %.0f s (FERRY_QUOTA_LEASE_S)",
                expired,
                self.lease_s,
            )
        return expired

    async def _refresh(self, proto: frames.FrameProtocol, rid: int) -> None:
        try:
            serial = await self.refresh()
        except Exception as exc:  # the database may be down: the web process's load then waits in vain
            log.warning("refreshing the registry for a web process failed: %s", exc)
            proto.send(frames.BAD_FRAME, rid, f"refresh failed: {exc}".encode())
            return
        proto.send(frames.REFRESH_REPLY, rid, msgpack.packb(serial))

    async def close(self) -> None:
        """Stop listening and drop every connection: the web processes answer 503 at once, not at deadlines."""
        if self._server is not None:
            self._server.close()
        for proto in list(self._protos):
            proto.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
