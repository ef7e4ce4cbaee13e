"""The fleet page's WebSocket (`/ws/fleet/`): the fleet, pushed every PUSH_SECONDS while a page watches, and
at once when a node publishes an event.

One `FleetFeed` per process reads the fleet (Redis, or the embedded node) once per push, however many pages
watch, and sends it through the channel layer to a group of this process's sockets; each socket narrows it to
what its user may see and sends it rendered. A group per process, not one for the cluster: every web process
with watchers runs its own feed, so a cluster-wide group would deliver each state once per such process.

Only sessions of viewers and up connect (the handshake is refused otherwise), and a socket whose user loses the
role (or is deactivated) is closed at the next check of what it may see.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from serving.dataplane.transport import fleet_events, redis_pipe
from serving.fleet_state import read_state, scoped
from serving.fleet_views import may_view, parts, visible_names

log = logging.getLogger(__name__)

PUSH_SECONDS = 1.0  # the heartbeat's pace: a node's row changes no faster
# New events are pushed at once, but at most this often: each push reads the fleet again (bench.fleet_page).
EVENT_PUSH_SECONDS = 0.5
RECHECK_SECONDS = 10.0  # how often a socket re-reads what its user may see
REFUSED = 4403


class FleetFeed:
    def __init__(self) -> None:
        self.group = f"ferry.fleet.{uuid.uuid4().hex}"
        self.watchers = 0
        self._task: asyncio.Task[None] | None = None

    async def join(self, layer: Any, channel: str) -> None:
        await layer.group_add(self.group, channel)
        self.watchers += 1
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._task = loop.create_task(self._run(layer), name="ferry-fleet-feed")

    async def leave(self, layer: Any, channel: str) -> None:
        await layer.group_discard(self.group, channel)
        self.watchers = max(0, self.watchers - 1)
        if self.watchers == 0 and self._task is not None:
            self._task.cancel()
            self._task = None

    async def push_once(self, layer: Any, client: Any) -> None:
        await layer.group_send(self.group, {"type": "fleet.state", "state": await read_state(client)})

    async def _run(self, layer: Any) -> None:
        """Push every PUSH_SECONDS, and sooner when the event stream grows (at most every EVENT_PUSH_SECONDS),
        so an eviction shows as it happens rather than at the next tick."""
        client = waiter = None
        if settings.REDIS_URL:
            client = redis_pipe.client(settings.REDIS_URL, name="ferry-fleet-feed")
            waiter = redis_pipe.client(
                settings.REDIS_URL,
                name="ferry-fleet-feed-events",
                socket_timeout=PUSH_SECONDS + redis_pipe.COMMAND_TIMEOUT_S,
            )
        failing = False
        last_id: bytes | str | None = None  # the newest event pushed: the state read at each push carries it
        try:
            while True:
                started = time.monotonic()
                try:
                    if waiter is not None and last_id is None:
                        newest = await waiter.xrevrange(fleet_events.STREAM, count=1)
                        last_id = newest[0][0] if newest else "0-0"
                    await self.push_once(layer, client)
                    if waiter is None or last_id is None:
                        await asyncio.sleep(PUSH_SECONDS)
                    else:
                        found = await waiter.xread(
                            {fleet_events.STREAM: last_id}, count=100, block=int(PUSH_SECONDS * 1000)
                        )
                        for _, entries in found or ():
                            last_id = entries[-1][0]
                        await asyncio.sleep(max(0.0, EVENT_PUSH_SECONDS - (time.monotonic() - started)))
                    failing = False
                except (redis.RedisError, OSError) as exc:
                    if not failing:
                        log.warning("reading the fleet for its page failed (%s); retrying", exc)
                    failing = True
                    await asyncio.sleep(PUSH_SECONDS)
        finally:
            for c in (client, waiter):
                if c is not None:
                    await c.aclose()


FEED = FleetFeed()


class FleetConsumer(AsyncJsonWebsocketConsumer):
    joined = False
    models: set[str] | None = None
    checked = 0.0

    async def connect(self) -> None:
        if not await self._allowed():
            await self.close(code=REFUSED)  # before accept: the handshake is refused (HTTP 403)
            return
        await self.accept()
        await FEED.join(self.channel_layer, self.channel_name)
        self.joined = True

    async def _allowed(self) -> bool:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            return False
        user = await database_sync_to_async(_fresh)(user)
        if user is None or not await database_sync_to_async(may_view)(user):
            return False
        self.models = await database_sync_to_async(visible_names)(user)
        self.checked = time.monotonic()
        return True

    async def disconnect(self, code: int) -> None:
        if self.joined:
            self.joined = False
            await FEED.leave(self.channel_layer, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The page sends nothing; whatever arrives is ignored."""

    async def fleet_state(self, message: dict[str, Any]) -> None:
        if time.monotonic() - self.checked > RECHECK_SECONDS and not await self._allowed():
            await self.close(code=REFUSED)
            return
        await self.send_json(_rendered(message["state"], self.models))


_RENDERED: dict[tuple[float, frozenset[str] | None], dict[str, Any]] = {}


def _rendered(state: dict[str, Any], models: set[str] | None) -> dict[str, Any]:
    """The push for sockets that see `models`: narrowed and rendered once per push and set of models, not once
    per socket (sockets of one tenant's people see the same)."""
    key = (state["at"], None if models is None else frozenset(models))
    found = _RENDERED.get(key)
    if found is None:
        if any(at != state["at"] for at, _ in _RENDERED):  # a new push: the old ones are not asked for again
            _RENDERED.clear()
        narrowed = scoped(state, models)
        found = _RENDERED[key] = {"type": "fleet", **narrowed, "html": parts(narrowed)}
    return found


def _fresh(user: Any) -> Any:
    """The user as the database holds it now (active, with current memberships), or None."""
    from django.contrib.auth import get_user_model

    return get_user_model().objects.filter(pk=user.pk, is_active=True).prefetch_related("memberships").first()
