"""What one push of the fleet page costs a web process's event loop: `read_state` (the heartbeats, the last
heartbeats and the newest 200 events of a stream of 10,000) once per push, then per set of visible models
among the watching sockets the narrowing and the rendering of the page's sections. Two nodes of 50 versions
each; half the models visible.
It writes and then deletes `ferry:*` keys in the Redis database it is given: use a spare one.

    python -m bench.fleet_page [--redis redis://127.0.0.1:6379/2] [--pushes 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")


def main() -> None:
    import django

    django.setup()
    import redis

    from serving.dataplane.transport import fleet, fleet_events, redis_pipe
    from serving.dataplane.transport.fleet import NodeInfo
    from serving.dataplane.transport.fleet_events import FleetEvent
    from serving.fleet_state import read_state, scoped
    from serving.fleet_views import parts

    parser = argparse.ArgumentParser()
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/2")
    parser.add_argument("--pushes", type=int, default=50)
    args = parser.parse_args()
    client = redis.Redis.from_url(args.redis)

    def clear() -> None:
        keys = list(client.scan_iter("ferry:*"))
        if keys:
            client.delete(*keys)

    clear()
    now = time.time()
    for name in ("node-a", "node-b"):
        resident = {f"m{i}:1": {"tier": "hot", "bytes": 10_000 + i} for i in range(50)}
        info = NodeInfo(
            name=name,
            instance="bench",
            host="h",
            pid=1,
            device="cpu",
            accelerator="a10g",
            accelerator_count=1,
            memory_total=10**6,
            memory_budget=10**6,
            memory_used=500_000,
            labels={},
            started_at=now,
            heartbeat_at=now,
            serial=1,
            ready=frozenset(resident),
            hot=frozenset(resident),
            busy=0.3,
            resident=resident,
        )
        client.hset(fleet.node_key(name), mapping=info.to_hash())
        client.expire(fleet.node_key(name), 600)
        client.sadd(fleet.NODES_KEY, name)
        client.hset(fleet.SEEN_KEY, name, fleet.seen_entry(info))
        heartbeat = sum(len(v) for v in info.to_hash().values())
    pipe = client.pipeline()
    for i in range(10_000):
        pipe.xadd(
            fleet_events.STREAM,
            {
                fleet_events.FIELD: fleet_events.encode(
                    FleetEvent("node-a", now, "evict", f"m{i % 200}:1", "LRU: room for m1:1")
                )
            },
        )
    pipe.execute()

    async def pushes() -> tuple[list[float], list[float], list[float]]:
        """Wall time of a read (Redis round trips included, during which the loop serves others), and the CPU
        time of the read and of a rendering (what the event loop spends: it does nothing else meanwhile)."""
        reader = redis_pipe.client(args.redis)
        walls, reads, renders = [], [], []
        visible = {f"m{i}" for i in range(0, 200, 2)}
        try:
            for _ in range(args.pushes):
                started, cpu = time.perf_counter(), time.thread_time()
                state = await read_state(reader)
                walls.append(time.perf_counter() - started)
                reads.append(time.thread_time() - cpu)
                cpu = time.thread_time()
                parts(scoped(state, visible))
                renders.append(time.thread_time() - cpu)
        finally:
            await reader.aclose()
        return walls, reads, renders

    try:
        walls, reads, renders = asyncio.run(pushes())
    finally:
        clear()
    print(f"heartbeat of a node with 50 versions: {heartbeat} bytes")
    print(
        f"read_state (once per push and process): wall p50 {statistics.median(walls) * 1000:.1f} ms,"
        f" CPU p50 {statistics.median(reads) * 1000:.1f} ms"
    )
    print(f"scoped + rendered (per push and set of visible models): CPU p50 {statistics.median(renders) * 1000:.1f} ms")
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
