"""A version's request stream is bounded in Redis, in bytes and in entries, whatever gateway adds to it
(`serving.dataplane.transport.stream_bound`), against the real Redis (FERRY_TEST_REDIS_URL)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from serving.dataplane.errors import DeadlineExceeded, Shed
from serving.dataplane.transport import stream_bound
from serving.dataplane.transport.stream_codec import FIELD, GROUP, StreamRequest, encode_request, request_stream
from serving.dataplane.transport.streams import RedisStreamsTransport
from tests.test_admission import rows
from tests.test_streams_processes import clear
from tests.test_streams_transport import REDIS_URL, Served, deadline, entry, served  # noqa: F401


def message(n: int = 1) -> bytes:
    return encode_request(StreamRequest(n, b"ferry:reply:t", time.time() + 30, None, 1, 1, rows(1), None))


@pytest.fixture
def client() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    yield client
    clear(client)
    client.close()


def add(client: redis.Redis, key: str, max_bytes: int, max_entries: int, body: bytes) -> list[int]:
    _, script, numkeys, *args = stream_bound.add_args(key, max_bytes, max_entries, FIELD, body)
    return client.eval(script, numkeys, *args)


def test_the_stream_refuses_past_its_bytes_and_its_entries_and_counts_exactly(client: redis.Redis) -> None:
    body = message()
    size = len(body)
    # given a byte bound of two and a half entries: two are added, the third refused, and nothing is added by it
    assert add(client, "v:1", size * 5 // 2, 100, body) == [1, 1, size]
    assert add(client, "v:1", size * 5 // 2, 100, body) == [1, 2, 2 * size]
    assert add(client, "v:1", size * 5 // 2, 100, body) == [0, 2, 2 * size]
    assert client.xlen(request_stream("v:1")) == 2
    assert int(client.get(stream_bound.bytes_key("v:1"))) == 2 * size
    # and an entry bound is exact, not trimmed: the entry past it is refused, none of the held ones dropped
    assert add(client, "v:1", 10**9, 2, body) == [0, 2, 2 * size]
    assert client.xlen(request_stream("v:1")) == 2
    # and each refusal is counted beside the stream, for the autoscaler's demand (autoscaling.observe)
    assert int(client.get(stream_bound.refused_key("v:1"))) == 2


def test_acknowledging_frees_the_bytes_once_even_if_sent_twice(client: redis.Redis) -> None:
    stream = request_stream("v:1")
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    bodies = [message(1), message(2), message(3)]
    for body in bodies:
        assert add(client, "v:1", 10**9, 100, body)[0] == 1
    taken = client.xreadgroup(GROUP, "node", {stream: ">"}, count=10)[0][1]
    answered = [(entry_id, len(fields[FIELD])) for entry_id, fields in taken[:2]]
    _, script, numkeys, *args = stream_bound.ack_args("v:1", GROUP, answered)
    # when the node's acknowledgement reaches Redis twice (a pipeline resent after its connection broke)
    assert client.eval(script, numkeys, *args) == len(bodies[0]) + len(bodies[1])
    assert client.eval(script, numkeys, *args) == 0
    # then the counter lost those two entries' bytes once: it holds the third's
    assert int(client.get(stream_bound.bytes_key("v:1"))) == len(bodies[2])
    assert client.xpending(stream, GROUP)["pending"] == 1
    # and once the stream is empty the counter is gone, whatever it said
    _, script, numkeys, *args = stream_bound.ack_args("v:1", GROUP, [(taken[2][0], 1)])
    client.eval(script, numkeys, *args)
    assert client.xlen(stream) == 0 and not client.exists(stream_bound.bytes_key("v:1"))


def test_a_counter_that_drifted_is_healed_by_an_empty_stream(client: redis.Redis) -> None:
    # given a counter left high by entries removed some other way (an operator's XTRIM), and an empty stream
    body = message()
    client.xgroup_create(request_stream("v:1"), GROUP, id="0", mkstream=True)
    client.set(stream_bound.bytes_key("v:1"), 10**9)
    # then the next request is added, and the counter holds just it
    assert add(client, "v:1", 10 * len(body), 100, body) == [1, 1, len(body)]


async def test_two_gateways_share_the_stream_s_byte_bound(client: redis.Redis) -> None:
    # given two gateways, each free to hold much more than the stream may, on a version no node reads
    size = len(message())  # about one request of rows(1): the encoding differs only in its deadline and id
    gateways = [RedisStreamsTransport(REDIS_URL, stream_bytes=size * 3 + size // 2) for _ in range(2)]
    for gateway in gateways:
        await gateway.start()
    try:
        async with asyncio.timeout(10):
            while not all(g.connected for g in gateways):
                await asyncio.sleep(0.01)
        idle = entry("idle", queue=100)
        held = [
            asyncio.ensure_future(gateways[i % 2].infer(idle, rows(1), 1, deadline(1.0), 1, nbytes=10))
            for i in range(3)
        ]
        async with asyncio.timeout(10):
            while client.xlen(request_stream("idle:1")) < 3:
                await asyncio.sleep(0.01)
        # when either gateway sends one more, the stream refuses it: 503 with Retry-After, at once
        for gateway in gateways:
            with pytest.raises(Shed) as caught:
                await gateway.infer(idle, rows(1), 1, deadline(), 1, nbytes=10)
            assert (caught.value.status, caught.value.retry_after) == (503, 1)
            assert "its stream holds 3 requests" in caught.value.message
        # and the three it holds are answered at their deadline, each once
        results = await asyncio.gather(*held, return_exceptions=True)
        assert all(isinstance(r, DeadlineExceeded) for r in results), results
    finally:
        for gateway in gateways:
            await gateway.close()


async def test_what_a_node_answered_leaves_the_stream_s_byte_count(served: Served) -> None:  # noqa: F811
    version = entry("m", max_batch=4)
    for _ in range(5):
        await served.transport.infer(version, rows(1), 1, deadline(), 1)
    async with asyncio.timeout(10):
        while served.client.xlen(request_stream("m:1")) or served.client.exists(stream_bound.bytes_key("m:1")):
            await asyncio.sleep(0.02)
