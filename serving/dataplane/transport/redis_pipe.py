"""Redis commands from many coroutines, sent as one pipeline per turn of the event loop.

The gateway's XADDs and the node's replies come in bursts (a batch finishes, its requests answer
together): one round trip for the burst instead of one per request, and one connection, not a
pool that grows with concurrency. Each command still gets its own result or exception. A turn with one
command sends it alone: a pipeline of one costs more CPU than the command (`bench.quota_cost`).
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 0.5
COMMAND_TIMEOUT_S = 2.0


def client(url: str, *, socket_timeout: float = COMMAND_TIMEOUT_S, name: str | None = None) -> aioredis.Redis:
    """A client that fails fast: no retries (redis-py retries with backoff by default, which turns a Redis
    outage into requests hanging seconds per command), short timeouts. The loops above retry themselves."""
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 0),
        client_name=name,
    )


class Pipe:
    """A caller may stop waiting for its command's future (cancel it: a deadline); the command is then left out of
    a batch not yet sent, and its result dropped from one sent already, never another's.

    `retry_once`: send a batch again, once, when its connection failed. For idempotent work only (a node's
    replies: a second copy of a reply is ignored, XACK and XDEL are idempotent): a command may have reached
    Redis before its connection broke."""

    def __init__(self, redis_client: aioredis.Redis, *, retry_once: bool = False) -> None:
        self.client = redis_client
        self.retry_once = retry_once
        self._pending: list[tuple[tuple, asyncio.Future | None]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="ferry-redis-pipe")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for _, future in self._pending:
            if future is not None and not future.done():
                future.set_exception(ConnectionError("closed"))
        self._pending.clear()

    def send(self, *args: object, wait: bool = True) -> asyncio.Future | None:
        """Queue a command for the next pipeline; returns a future of its result (None with wait=False:
        fire and forget, errors only logged)."""
        future = asyncio.get_running_loop().create_future() if wait else None
        self._pending.append((args, future))
        self._wake.set()
        return future

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            # A command whose caller gave up waiting (its deadline: `future` cancelled) before its batch left is
            # not sent at all; one given up later has its result skipped below. Either way every other command
            # keeps its own result.
            batch = [(args, future) for args, future in batch if future is None or not future.cancelled()]
            if not batch:
                continue
            try:
                results = await self._execute(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection: every command of the batch failed
                for _, future in batch:
                    if future is not None and not future.done():
                        future.set_exception(exc)
                if all(future is None for _, future in batch):
                    log.warning("redis pipeline of %d commands failed: %s", len(batch), exc)
                continue
            for (args, future), result in zip(batch, results, strict=True):
                if future is None:
                    if isinstance(result, Exception):
                        log.warning("redis %s failed: %s", args[0], result)
                elif not future.done():
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)

    async def _execute(self, batch: list[tuple[tuple, asyncio.Future | None]]) -> list:
        for attempt in (1, 2):
            try:
                return await self._send(batch)
            except (ConnectionError, OSError, aioredis.ConnectionError) as exc:
                # A pooled connection that died in an outage fails its first use; the pool opens a new one.
                if attempt == 2 or not self.retry_once:
                    raise
                log.info("redis pipeline failed (%s); sending it again on a new connection", exc)
        raise AssertionError("unreachable")

    async def _send(self, batch: list[tuple[tuple, asyncio.Future | None]]) -> list:
        """One try: each command's result, or its own error; a failed connection raises."""
        if len(batch) == 1:  # a quiet moment's one command: a pipeline's bookkeeping costs more than it saves
            try:
                return [await self.client.execute_command(*batch[0][0])]
            except aioredis.ConnectionError:
                raise
            except aioredis.RedisError as exc:  # the command's own error, as a pipeline reports it
                return [exc]
        pipe = self.client.pipeline(transaction=False)
        for args, _ in batch:
            pipe.execute_command(*args)
        return await pipe.execute(raise_on_error=False)

    async def reset(self) -> None:
        """Drop the pooled connections (after an outage), so the next batch does not fail on a dead one."""
        await self.client.connection_pool.disconnect()
