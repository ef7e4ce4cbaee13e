"""The gateway's side of the Redis Streams transport (distributed mode).

Each request is one XADD to its version's stream (`stream_codec.request_stream`), read by the nodes
hosting the version through the stream's consumer group. The answer comes back on this process's
reply stream, where one reader task resolves the waiting futures by request id. Every accepted
request gets exactly one answer: the node's result or error, or 504 at its deadline, or 503 when
Redis is lost while it waits.

What this process has outstanding per version is bounded in requests (the version's
max_queue_size) and bytes (FERRY_MAX_QUEUE_BYTES): past either, 503 with Retry-After at once. The
version's stream, which every gateway adds to, is bounded in Redis (`stream_bound`): REQUEST_STREAM_MAXLEN
entries and FERRY_MAX_STREAM_BYTES bytes; past either, 503 with Retry-After too.

The reply stream lives as long as this process renews its TTL. Nodes reply with NOMKSTREAM, so a
reply to a gateway that died is dropped instead of leaving a stream behind.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import redis

from serving.dataplane import tracing
from serving.dataplane.errors import DeadlineExceeded, ServingError, Shed, Unavailable
from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.metrics import metrics
from serving.dataplane.transport import redis_pipe, stream_bound
from serving.dataplane.transport.outstanding import Outstanding, check_sendable, held_for
from serving.dataplane.transport.stream_codec import (
    FIELD,
    REPLIES,
    MalformedMessage,
    StreamRequest,
    decode_reply,
    encode_request,
    read_replies,
)

log = logging.getLogger(__name__)

REPLY_TTL_S = 30  # a dead gateway's reply stream disappears this long after its last renewal
RENEW_S = 1.0  # renewal, and re-creation after Redis lost its data
READ_BLOCK_MS = 1000
READ_COUNT = 512
REQUEST_STREAM_MAXLEN = 10_000  # exact (stream_bound.ADD refuses past it); nodes delete what they answered
RECONNECT_MAX_S = 1.0  # an outage is noticed, and its end too, within about this


class Admission(Protocol):
    def admit(self, key: str, rows: int, deadline: float, priority: int, *, cold_start_s: float = 0.0) -> float:
        """Raise `Shed` to refuse a request of `rows` rows for version `key` before it is sent (`cold_start_s`:
        the version's load time, for the Retry-After of a refusal that waits on a node to load it); else the
        estimate it was admitted on (0.0: none)."""
        ...

    def observe(self, key: str, estimated: float, took: float) -> None:
        """A request for `key` admitted on `estimated` seconds had its answer, or its deadline, `took` seconds
        later."""
        ...

    def settled(self, key: str, rows: int, length: int | None) -> None:
        """The XADD of an admitted request came back: the stream's `length` then (None: it failed)."""
        ...

    def answered(self, key: str) -> None:
        """A node answered a request of `key` (a result or an error)."""
        ...


def _cold_start(entry: VersionEntry) -> float:
    """The version's load time as the nodes measured it (their slowest accelerator), else validation's."""
    measured = [cold for _, _, cold in entry.placement.measured]
    return max(measured) if measured else entry.placement.load_seconds


@dataclass(slots=True)
class _Waiting:
    future: asyncio.Future
    key: str
    nbytes: int


class RedisStreamsTransport:
    def __init__(
        self,
        url: str,
        *,
        max_bytes: int = 64 * 1024**2,
        stream_bytes: int = 64 * 1024**2,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.url = url
        self.max_bytes = max_bytes  # per version, what this process holds waiting
        self.stream_bytes = stream_bytes  # per version, what its stream holds from every gateway (stream_bound)
        self._clock = clock
        self._wall = wall
        self.reply_to = f"ferry:reply:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}".encode()
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}
        self._outstanding: dict[str, Outstanding] = {}
        # False from a Redis error until the reply reader is connected again: requests are refused at once
        # rather than each spending a connection attempt.
        self.connected = False
        self._pipe: redis_pipe.Pipe | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.malformed_replies = 0
        # Admission before the stream (serving.dataplane.transport.load_view.LoadView); None admits everything.
        self.admission: Admission | None = None
        # Per version, requests refused here before the stream since the last flush to its refusal counter
        # (`stream_bound.refused_key`, every RENEW_S): the autoscaler's demand is what was asked, not admitted.
        self.refused: dict[str, int] = {}

    async def start(self) -> None:
        self._pipe = redis_pipe.Pipe(redis_pipe.client(self.url, name=f"ferry-gateway-{os.getpid()}"))
        self._pipe.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._read_replies(), name="ferry-replies"),
            loop.create_task(self._renew_forever(), name="ferry-reply-ttl"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Bounded: redis-py shields a command in flight from cancellation, and a blocked XREAD was seen to
        # outlive its BLOCK here (tests/test_streams_transport.py's cold-load test); shutdown must not wait on it.
        await asyncio.wait(self._tasks, timeout=READ_BLOCK_MS / 1000 + 1)
        self._fail_all(Unavailable("the gateway is shutting down", retry_after=1))
        if self._pipe is not None:
            await self._pipe.close()
            await self._pipe.client.aclose()

    # -- requests --------------------------------------------------------------------------

    def _observe(self, key: str, estimated: float, admitted_at: float) -> None:
        if estimated and self.admission is not None:
            self.admission.observe(key, estimated, self._clock() - admitted_at)

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
        if not self.connected or self._pipe is None:
            raise Unavailable("the request queue (Redis) is unreachable", retry_after=1)
        key = entry.key
        # A request refused here was asked for all the same: `count_refused` tells the autoscaler (the stream's
        # bound counts its own refusals, in its script).
        try:
            held = held_for(self._outstanding, entry, nbytes, self.max_bytes, priority, "this gateway")
        except Shed:
            self.count_refused(key)
            raise
        estimated = 0.0  # the estimate admitted on, which what the request then takes teaches (LoadView.observe)
        if self.admission is not None:  # the nodes' load as last published: refused here, never queued
            try:
                estimated = self.admission.admit(key, rows, deadline, priority, cold_start_s=_cold_start(entry))
            except Shed as refused:
                metrics.GATEWAY_REFUSALS.labels(entry.model, str(entry.version), refused.reason).inc()
                self.count_refused(key)
                raise
        request_id = next(self._ids)
        message = encode_request(
            StreamRequest(
                request_id,
                self.reply_to,
                self._wall() + (deadline - now),
                tenant,
                priority,
                rows,
                inputs,
                outputs,
                tracing.carrier() if tracing.ENABLED else None,
            )
        )
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = _Waiting(future, key, nbytes)
        held.items += 1
        held.nbytes += nbytes
        try:
            entries = None  # the stream's length as this XADD found it: every gateway's requests
            sent = False
            # One bound to the deadline for the XADD and the wait for the answer alike. Not only the socket's
            # timeout (COMMAND_TIMEOUT_S) bounds the XADD: the pipe sends one batch after another, and a slow Redis
            # would hold a 300 ms request for seconds. Giving up cancels this command's future only: the pipe leaves
            # it out of a batch not yet sent, and skips its result in one sent already (the XADD may then have
            # landed: its node finds it expired).
            async with asyncio.timeout(deadline - self._clock()):
                try:
                    added, entries, held_bytes = await self._pipe.send(
                        *stream_bound.add_args(key, self.stream_bytes, REQUEST_STREAM_MAXLEN, FIELD, message)
                    )
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    # The reader governs `connected`: it notices the same outage on its own connection, and
                    # it alone can say Redis is back.
                    log.debug("XADD to %s failed: %s", key, exc)
                    raise Unavailable("the request queue (Redis) is unreachable", retry_after=1) from None
                except redis.RedisError as exc:
                    log.error("XADD to %s refused: %s", key, exc)
                    metrics.INTERNAL_ERRORS.labels("stream_send").inc()
                    raise ServingError("the request queue refused the request; the gateway logged it") from None
                finally:
                    if self.admission is not None:  # the view's guess of the stream gives way to its length
                        self.admission.settled(key, rows, entries)
                if not added:  # the stream is full, from every gateway's requests: never sent
                    metrics.GATEWAY_REFUSALS.labels(entry.model, str(entry.version), "queue_full").inc()
                    raise Shed(
                        f"{key}: its stream holds {entries} requests ({held_bytes} bytes) already",
                        reason="queue_full",
                        tier=priority,
                        retry_after=1,
                    )
                sent = True
                outputs = await future
        except TimeoutError:
            if not sent:
                metrics.DEADLINES.labels(entry.model, str(entry.version), "send").inc()
                log.debug("XADD to %s outlived the request's deadline", key)
                raise DeadlineExceeded("request deadline exceeded while the request queue (Redis) took it") from None
            metrics.DEADLINES.labels(entry.model, str(entry.version), "gateway").inc()
            self._observe(key, estimated, now)
            raise DeadlineExceeded("request deadline exceeded") from None
        except DeadlineExceeded:
            metrics.DEADLINES.labels(entry.model, str(entry.version), "node").inc()
            self._observe(key, estimated, now)
            raise
        else:
            self._observe(key, estimated, now)
            return outputs
        finally:
            self._waiting.pop(request_id, None)
            held.items -= 1
            held.nbytes -= nbytes

    def outstanding(self, key: str) -> int:
        held = self._outstanding.get(key)
        return held.items if held else 0

    # -- replies ---------------------------------------------------------------------------

    def _resolve_entry(self, raw: bytes) -> None:
        """`_resolve_all`, and a bug in it logged and counted, never the end of the reader (every request after
        it would wait to its deadline)."""
        try:
            self._resolve_all(raw)
        except Exception:
            self.malformed_replies += 1
            metrics.INTERNAL_ERRORS.labels("stream_reply").inc()
            log.exception("reading a reply entry on %s failed", self.reply_to.decode())

    def _resolve_all(self, raw: bytes) -> None:
        entry = read_replies(raw)
        for request_id, reply in entry.replies:
            self._resolve(reply, request_id)
        if entry.damage is None:
            return
        # A bug or a version skew between processes: logged and counted. The replies that could be read were
        # delivered above; every other caller the entry names (its header, read apart from the replies) is
        # answered 500 now, never left to its deadline. Only damage inside the header itself, or past the damage in
        # an entry of the old framing (a node older than the header), leaves callers unnamed: 504 at their deadlines.
        self.malformed_replies += 1
        metrics.INTERNAL_ERRORS.labels("stream_reply").inc()
        unanswered = [i for i in entry.named if (w := self._waiting.get(i)) is not None and not w.future.done()]
        log.error(
            "malformed reply entry on %s (%d bytes): %s; %d replies read from it, %d more callers answered 500",
            self.reply_to.decode(),
            len(raw),
            entry.damage,
            len(entry.replies),
            len(unanswered),
        )
        for request_id in unanswered:
            self._waiting[request_id].future.set_exception(
                ServingError("malformed reply from the node; the gateway logged it")
            )

    def _resolve(self, raw: bytes, expected: int | None = None) -> None:
        """Deliver one encoded reply; `expected`: the request the entry's header says it answers (None: not said)."""
        try:
            reply = decode_reply(raw)
            if expected is not None and reply.id != expected:
                raise MalformedMessage(f"a reply to request {reply.id} where the entry says {expected}", reply.id)
        except MalformedMessage as exc:
            self.malformed_replies += 1
            metrics.INTERNAL_ERRORS.labels("stream_reply").inc()
            log.error("malformed reply on %s: %s", self.reply_to.decode(), exc)
            # Both the request the reply names and the one the header names, when they differ: neither can be
            # trusted with it, and neither caller is left to its deadline.
            for request_id in {exc.request_id, expected}:
                waiting = self._waiting.get(request_id) if request_id is not None else None
                if waiting is not None and not waiting.future.done():
                    waiting.future.set_exception(ServingError("malformed reply from the node; the gateway logged it"))
            return
        waiting = self._waiting.get(reply.id)
        if waiting is not None and self.admission is not None:
            self.admission.answered(waiting.key)  # a node reads the stream, even if this answer came late
        if waiting is None or waiting.future.done():
            return  # answered already (its deadline), or a second answer after a claim: the first one stands
        if reply.error is not None:
            waiting.future.set_exception(reply.error)
        else:
            waiting.future.set_result(reply.outputs)

    async def _read_replies(self) -> None:
        # A blocking read on its own connection, with a socket timeout past the block.
        client = redis_pipe.client(
            self.url,
            socket_timeout=READ_BLOCK_MS / 1000 + redis_pipe.COMMAND_TIMEOUT_S,
            name=f"ferry-replies-{os.getpid()}",
        )
        last = b"0-0"
        backoff = 0.05
        try:
            while True:
                try:
                    await self._ensure_reply_stream(client)
                    if not self.connected and self._pipe is not None:
                        await self._pipe.reset()  # its connection died with the outage
                        log.info("Redis reachable: accepting requests")
                    self.connected = True
                    backoff = 0.05
                    while True:
                        answer = await client.xread({self.reply_to: last}, count=READ_COUNT, block=READ_BLOCK_MS)
                        for _, entries in answer:
                            for entry_id, fields in entries:
                                last = entry_id
                                raw = fields.get(REPLIES)
                                if raw is not None:
                                    self._resolve_entry(raw)
                except asyncio.CancelledError:
                    raise
                except (redis.RedisError, OSError) as exc:
                    self._lost(exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RECONNECT_MAX_S)
        finally:
            await client.aclose()

    def _lost(self, exc: Exception) -> None:
        """Redis failed under us: refuse new requests until the reader reconnects, and answer the waiting
        ones now. Their replies may never come (a restarted Redis lost them), and 503 now is more useful to
        a caller than 504 later."""
        if self.connected:
            log.warning("lost Redis (%s): refusing requests until it is back", exc)
        self.connected = False
        self._fail_all(Unavailable("lost the connection to the request queue (Redis)", retry_after=1))

    def _fail_all(self, error: ServingError) -> None:
        for waiting in list(self._waiting.values()):
            if not waiting.future.done():
                waiting.future.set_exception(error)

    async def _ensure_reply_stream(self, client: redis.asyncio.Redis) -> None:
        """Create the reply stream if Redis does not hold it (first start, Redis restarted empty), and renew
        its TTL. The marker entry is what creates it: nodes never create a reply stream."""
        pipe = client.pipeline(transaction=False)
        pipe.expire(self.reply_to, REPLY_TTL_S)
        (renewed,) = await pipe.execute()
        if not renewed:
            pipe = client.pipeline(transaction=False)
            pipe.xadd(self.reply_to, {b"hello": b"1"}, maxlen=1000, approximate=True)
            pipe.expire(self.reply_to, REPLY_TTL_S)
            await pipe.execute()

    def count_refused(self, key: str) -> None:
        """A request for `key` refused before the stream: asked for all the same, so the autoscaler counts it."""
        self.refused[key] = self.refused.get(key, 0) + 1

    async def flush_refused(self, client: redis.asyncio.Redis) -> None:
        """Add the refusals counted since the last flush to their versions' counters in Redis; kept for the next
        flush when Redis cannot take them (a count may then arrive twice: a second's refusals, never a lost one)."""
        if not self.refused:
            return
        counts, self.refused = self.refused, {}
        pipe = client.pipeline(transaction=False)
        for key, n in counts.items():
            pipe.incrby(stream_bound.refused_key(key), n)
        try:
            await pipe.execute()
        except (redis.RedisError, OSError):
            for key, n in counts.items():
                self.refused[key] = self.refused.get(key, 0) + n
            raise

    async def _renew_forever(self) -> None:
        client = redis_pipe.client(self.url)
        try:
            while True:
                await asyncio.sleep(RENEW_S)
                try:
                    await self._ensure_reply_stream(client)
                    await self.flush_refused(client)
                except (redis.RedisError, OSError):
                    pass  # the reader notices and reconnects
        finally:
            await client.aclose()
