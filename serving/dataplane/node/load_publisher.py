"""A node process's load, published for the gateways' admission (`serving.dataplane.transport.load_view`).

Every PUBLISH_SECONDS one SET of `ferry:load:<node>` with a TTL: what `Node.infer`'s admission reads per
request (each hosted version's queued rows per priority level, its largest batch, its latency profile, the
device share of higher tiers, its batch window; the device's in-flight remainder, the versions with a batch on
it and what is left of the one running), and the stream entries the node holds per version, so a gateway can
tell the stream's unread entries from those already here. A few hundred bytes per version; no round trip
waited on by a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio as aioredis

from serving.dataplane.node.node import Node
from serving.dataplane.transport.load_view import LEVELS, TTL_MS, NodeLoad, VersionState, encode_load, load_key


class LoadPublisher:
    def __init__(
        self,
        node: Node,
        client: aioredis.Redis,
        name: str,
        *,
        held: Callable[[str], int],
        clock: Callable[[], float] = time.monotonic,  # the node's
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.node = node
        self.client = client
        self.name = name
        self.held = held  # stream entries this node process holds for a version (queued, loading, running)
        self._clock = clock
        self._wall = wall
        self.published = 0

    def load(self) -> NodeLoad:
        node = self.node
        now = self._clock()
        versions = {}
        for key, hosted in node.hosted.items():
            queue = hosted.batcher.queue
            versions[key] = VersionState(
                key,
                [queue.rows_ahead(p) for p in range(LEVELS)] if queue.rows else [0] * LEVELS,
                self.held(key),
                hosted.entry.batching.max_batch_size,
                hosted.profile.points(),
                [hosted.share.higher_than(p, now) for p in range(LEVELS)],
                window=hosted.entry.batching.max_queue_delay,
            )
        return NodeLoad(
            self.name,
            self._wall(),
            node.in_flight_seconds(now),
            versions,
            handed=node.handed_keys(),
            running_left=node.running_left_seconds(now),
        )

    async def publish_once(self) -> None:
        await self.client.set(load_key(self.name), encode_load(self.load()), px=TTL_MS)
        self.published += 1
