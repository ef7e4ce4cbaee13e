"""The Redis Streams transport in one process, against the real Redis (FERRY_TEST_REDIS_URL): a gateway's
`RedisStreamsTransport` and a `NodeProcess` consuming for a `Node` with stand-in runtimes. What the node
answers reaches the gateway as the same error types; the gateway's bounds and deadlines hold with no node
at all; an entry past its deadline is never run. (Whole processes: tests/test_streams_processes.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import pytest
import redis

from autoscaling import observe
from serving.dataplane.errors import DeadlineExceeded, ModelFailed, Shed, Unavailable
from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_process import Facts, NodeProcess, parse_bytes, parse_labels
from serving.dataplane.node.runtime import RuntimeFailure
from serving.dataplane.transport import fleet, stream_bound
from serving.dataplane.transport.stream_codec import FIELD, GROUP, StreamRequest, encode_request, request_stream
from serving.dataplane.transport.streams import RedisStreamsTransport
from tests.conftest import free_port
from tests.test_admission import StandIn, rows
from tests.test_admission import entry as admission_entry
from tests.test_streams_processes import clear

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
LONG = 30.0  # seconds: a deadline no test waits for


def entry(name: str, *, max_batch: int = 4, queue: int = 100) -> VersionEntry:
    """test_admission's version, with a 2 ms batch window (its own is 10 s, for a batcher left stopped)."""
    version = admission_entry(name, max_batch=max_batch, queue=queue)
    return dataclasses.replace(version, batching=dataclasses.replace(version.batching, max_queue_delay=0.002))


@dataclass
class Recording(StandIn):
    """Records each batch's rows; a batch holding a row whose first value is negative fails."""

    calls: list[int] | None = None

    def run(self, requests):  # noqa: ANN001, ANN201
        self.calls = (self.calls or []) + [sum(r["input"].shape[0] for r in requests)]
        if any((r["input"][:, 0] < 0).any() for r in requests):
            raise RuntimeFailure("negative input")
        return super().run(requests)


@dataclass
class Served:
    process: NodeProcess
    transport: RedisStreamsTransport
    runtime: Recording
    client: redis.Redis


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)  # every ferry key of the test database: streams, fleet
    node = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    runtime = Recording()
    node.host(entry("m", max_batch=4), runtime, {1: 0.001, 4: 0.001})
    process = NodeProcess(node, REDIS_URL, Facts("unit", "cpu", "cpu", 0, 1 << 30, 1 << 30))
    await process.claim_name()
    await process.ensure_groups()
    process.serve()
    transport = RedisStreamsTransport(REDIS_URL)
    await transport.start()
    async with asyncio.timeout(10):
        while not transport.connected:
            await asyncio.sleep(0.01)
    try:
        yield Served(process, transport, runtime, client)
    finally:
        await transport.close()
        await process.stop(drain_seconds=1)
        clear(client)
        client.close()


def deadline(seconds: float = LONG) -> float:
    return time.monotonic() + seconds


async def test_a_request_round_trips_with_its_outputs_and_compute_share(served: Served) -> None:
    outputs = await served.transport.infer(
        entry("m", max_batch=4), rows(3), 3, deadline(), 1, tenant=7, outputs=("scores",)
    )
    assert outputs["scores"].shape == (3, 2) and outputs["scores"].dtype == np.float32
    assert outputs.compute_seconds >= 0.0
    assert served.runtime.calls == [3]
    assert served.transport.outstanding("m:1") == 0


async def test_the_node_s_errors_reach_the_gateway_as_the_same_types(served: Served) -> None:
    # given a request the model fails on and one too large for the node's batch size
    poison = rows(1)
    poison["input"][0, 0] = -1.0
    with pytest.raises(ModelFailed, match="negative input"):
        await served.transport.infer(entry("m", max_batch=4), poison, 1, deadline(), 1)
    # (the gateway refuses this itself before sending; a gateway on an older snapshot may not)
    with pytest.raises(Exception) as caught:
        await served.transport.infer(entry("m", max_batch=8), rows(6), 6, deadline(), 1)
    assert caught.value.status == 400 and "max_batch_size" in caught.value.message
    # and the node serves on
    assert (await served.transport.infer(entry("m", max_batch=4), rows(1), 1, deadline(), 1))["scores"].shape == (1, 2)


async def test_the_gateway_bounds_what_it_holds_per_version_and_answers_504_at_the_deadline(served: Served) -> None:
    # given a version no node reads (nothing will answer), whose queue holds two requests
    idle = entry("idle", queue=2)
    held = [asyncio.ensure_future(served.transport.infer(idle, rows(1), 1, deadline(0.5), 1)) for _ in range(2)]
    await asyncio.sleep(0)
    # when a third arrives, it is refused at once, with the queue_full reason and a Retry-After
    with pytest.raises(Shed) as caught:
        await served.transport.infer(idle, rows(1), 1, deadline(), 1)
    assert (caught.value.status, caught.value.reason, caught.value.retry_after) == (503, "queue_full", 1)
    # then the two held are answered 504 at their deadline, and the bound is free again
    results = await asyncio.gather(*held, return_exceptions=True)
    assert all(isinstance(r, DeadlineExceeded) for r in results), results
    assert served.transport.outstanding("idle:1") == 0
    # and the refusal reached the version's refusal counter within the gateway's next flush (every second), so
    # the autoscaler counts the request as asked for: two in the stream, one refused
    async with asyncio.timeout(10):
        while served.client.get(stream_bound.refused_key("idle:1")) is None:
            await asyncio.sleep(0.05)
    assert int(served.client.get(stream_bound.refused_key("idle:1"))) == 1
    assert observe.read_streams(served.client, ["idle:1"])["idle:1"].asked == 3


async def test_an_entry_past_its_deadline_is_never_run(served: Served) -> None:
    # given an entry whose caller's deadline passed while it waited in the stream
    stale = StreamRequest(1, served.transport.reply_to, time.time() - 1, None, 1, 1, rows(1), None)
    served.client.xadd(request_stream("m:1"), {FIELD: encode_request(stale)})
    # when the node reads it, it drops it unrun, and acknowledges and deletes it
    async with asyncio.timeout(10):
        while served.process.counts["expired"] < 1 or served.client.xlen(request_stream("m:1")):
            await asyncio.sleep(0.01)
    assert served.runtime.calls is None
    assert served.process.counts["served"] == 0


async def test_a_request_whose_client_left_is_never_sent(served: Served) -> None:
    with pytest.raises(Exception) as caught:
        await served.transport.infer(entry("m"), rows(1), 1, deadline(), 1, gone=lambda: True)
    assert caught.value.status == 499
    assert served.client.xlen(request_stream("m:1")) == 0 and served.runtime.calls is None


async def test_a_gateway_without_redis_refuses_at_once() -> None:
    transport = RedisStreamsTransport(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    await transport.start()
    try:
        with pytest.raises(Unavailable) as caught:
            await transport.infer(entry("m"), rows(1), 1, deadline(), 1)
        assert caught.value.retry_after == 1
    finally:
        await transport.close()


async def test_a_second_node_under_a_live_node_s_name_refuses_to_start(served: Served) -> None:
    # given the node "unit" heartbeating
    beating = asyncio.get_running_loop().create_task(
        served.process._every(fleet.HEARTBEAT_SECONDS, served.process.heartbeat_once, "heartbeat")
    )
    twin = NodeProcess(
        Node(artifact_path=lambda sha: None, device="cpu"),
        REDIS_URL,  # type: ignore[arg-type]
        Facts("unit", "cpu", "cpu", 0, 1 << 30, 1 << 30),
    )
    try:
        # when another process starts under its name, it waits out a heartbeat's TTL, then refuses
        with pytest.raises(RuntimeError, match="a live node named 'unit' exists"):
            await twin.claim_name()
        # and the live node's heartbeat is its own still
        assert (
            fleet.NodeInfo.from_hash(served.client.hgetall(fleet.node_key("unit"))).instance == served.process.instance
        )
    finally:
        beating.cancel()
        await twin.stop(drain_seconds=0)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("24GiB", 24 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("16 gib", 16 * 1024**3),
    ],
)
def test_runnode_reads_memory_sizes(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "lots", "24GiBs", "-1GiB", "1e9"])
def test_runnode_refuses_what_is_no_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(text)


def test_runnode_reads_labels() -> None:
    assert parse_labels(["zone=a,tier=gold", "pool = spot"]) == {"zone": "a", "tier": "gold", "pool": "spot"}
    with pytest.raises(ValueError, match="key=value"):
        parse_labels(["zone"])


async def test_a_cold_version_is_loaded_by_its_first_request_through_its_stream(model_files) -> None:  # noqa: ANN001
    from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot
    from tests.test_packing_node import digits

    # given a node process whose budget holds one digits model, serving two versions: one hot, one cold
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu", memory_budget=30_000)
    process = NodeProcess(node, REDIS_URL, Facts("packer", "cpu", "cpu", 0, 30_000, 30_000))
    hot, cold = digits("hot"), digits("cold")
    snapshot = RoutingSnapshot(
        serial=1, built_at=0.0, models={e.model: ModelEntry(e.model, "t", "", None, {1: e}) for e in (hot, cold)}
    )
    transport = RedisStreamsTransport(REDIS_URL)
    try:
        await process.claim_name()
        await process.reconcile(snapshot)
        process.serve()
        await transport.start()
        async with asyncio.timeout(10):
            while not transport.connected:
                await asyncio.sleep(0.01)
        info = process.info()
        assert (info.ready, info.hot) == ({"hot:1", "cold:1"}, {"hot:1"})
        # when a request for the cold version arrives through its stream
        outputs = await transport.infer(cold, rows_of_digits(), 1, deadline(), 1)
        # then the node loads it (evicting the idle one) and answers
        assert outputs["scores"].shape == (1, 10)
        assert process.info().hot == {"cold:1"}
    finally:
        await transport.close()
        await process.stop(drain_seconds=1)
        clear(client)
        client.close()


def rows_of_digits() -> dict[str, np.ndarray]:
    return {"input": np.zeros((1, 64), np.float32)}


async def test_a_node_leaves_a_cold_version_to_a_live_node_holding_it_and_announces_its_loads_at_once(
    model_files,
    monkeypatch,  # noqa: ANN001
) -> None:
    from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot
    from tests.test_packing_node import digits

    monkeypatch.setattr(fleet, "HEARTBEAT_SECONDS", 60.0)  # only a change of what it holds sends one now
    # given a node process whose budget holds one digits model, serving two versions: one hot, one cold
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    node = Node(artifact_path=lambda sha: model_files.digits, device="cpu", memory_budget=30_000)
    process = NodeProcess(node, REDIS_URL, Facts("packer", "cpu", "cpu", 0, 30_000, 30_000))
    hot, cold = digits("hot"), digits("cold")
    snapshot = RoutingSnapshot(
        serial=1, built_at=0.0, models={e.model: ModelEntry(e.model, "t", "", None, {1: e}) for e in (hot, cold)}
    )
    transport = RedisStreamsTransport(REDIS_URL)

    def announce(name: str, **held: frozenset[str]) -> None:
        other = dataclasses.replace(process.info(), name=name, instance=name, **held)
        client.hset(fleet.node_key(name), mapping=other.to_hash())
        client.expire(fleet.node_key(name), fleet.TTL_SECONDS)
        client.sadd(fleet.NODES_KEY, name)

    beat: asyncio.Task[None] | None = None
    try:
        await process.claim_name()
        await process.reconcile(snapshot)
        both = {request_stream("hot:1"), request_stream("cold:1")}
        assert set(process._readable()) == both
        # when another live node holds the cold version hot, or is loading it
        for held in ({"hot": frozenset({"cold:1"})}, {"loading": frozenset({"cold:1"})}):
            announce("other", **held)
            await process.watch_fleet_once()
            # then this node leaves its requests to that node, and keeps reading what it holds hot
            assert set(process._readable()) == {request_stream("hot:1")}, held
        # when a node holds hot what this node holds hot too, both read it
        announce("other", hot=frozenset({"hot:1"}))
        await process.watch_fleet_once()
        assert set(process._readable()) == both
        # when the other node is lost, this node takes the cold version's requests again
        client.delete(fleet.node_key("other"))
        await process.watch_fleet_once()
        assert set(process._readable()) == both

        # when a request loads the cold version here, the heartbeat says so at once, not at the next beat
        beat = asyncio.get_running_loop().create_task(process._heartbeat_forever())
        process.serve()
        await transport.start()
        async with asyncio.timeout(10):
            while not transport.connected:
                await asyncio.sleep(0.01)
        async with asyncio.timeout(10):
            while fleet.NodeInfo.from_hash(client.hgetall(fleet.node_key("packer"))).hot != {"hot:1"}:
                await asyncio.sleep(0.01)
        outputs = await transport.infer(cold, rows_of_digits(), 1, deadline(), 1)
        assert outputs["scores"].shape == (1, 10)
        async with asyncio.timeout(10):
            while (info := fleet.NodeInfo.from_hash(client.hgetall(fleet.node_key("packer")))).hot != {"cold:1"}:
                await asyncio.sleep(0.01)
        assert (info.counts["cold"], info.counts["loads"], info.counts["evictions"]) == (1, 2, 1), info.counts
    finally:
        if beat is not None:
            beat.cancel()
        await transport.close()
        await process.stop(drain_seconds=1)
        clear(client)
        client.close()


async def test_a_node_starts_though_redis_times_out_while_it_joins_and_after(monkeypatch) -> None:  # noqa: ANN001
    """Issue 19: on a loaded machine Redis stalled past the node's command timeout at start-up, and the node
    process exited with the TimeoutError. A failing command at start-up is retried, not the process's end."""
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    process = NodeProcess(
        Node(artifact_path=lambda sha: None, device="cpu"),  # type: ignore[arg-type]
        REDIS_URL,
        Facts("stalled", "cpu", "cpu", 0, 1 << 30, 1 << 30),
    )
    real = process.heartbeat_once
    calls = {"n": 0, "down": False}

    async def stalling() -> None:
        # the first heartbeat (joining) times out; the second (joining again) lands; then Redis stalls again
        calls["n"] += 1
        if calls["n"] == 1 or calls["down"]:
            raise redis.TimeoutError("Timeout reading from 127.0.0.1:6380")
        await real()
        if calls["n"] == 2:
            calls["down"] = True

    monkeypatch.setattr(process, "heartbeat_once", stalling)
    try:
        await process.start(first_snapshot_timeout=0.2)
        # then it started, in the fleet by the heartbeat that landed, and serving once Redis answers again
        assert calls["n"] >= 3 and client.exists(fleet.node_key("stalled"))
        calls["down"] = False
        seen = calls["n"]
        async with asyncio.timeout(LONG):
            while calls["n"] <= seen:
                await asyncio.sleep(0.05)
    finally:
        await process.stop(drain_seconds=1)
        clear(client)
        client.close()


async def test_a_consumer_group_whose_creation_failed_is_created_by_the_consumer_loop() -> None:
    """Issue 19: a node's reconcile could not create a version's group (Redis timed out on a loaded machine);
    the node logged that its consumer loop retries, but the loop read only grouped streams, so the version
    stayed unread, and not ready, until the next snapshot."""
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    node = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    node.host(entry("m", max_batch=4), Recording(), {1: 0.001, 4: 0.001})
    process = NodeProcess(node, REDIS_URL, Facts("ungrouped", "cpu", "cpu", 0, 1 << 30, 1 << 30))
    await process.claim_name()
    # given no group made for m (its creation failed), when the node serves
    process.serve()
    transport = RedisStreamsTransport(REDIS_URL)
    await transport.start()
    try:
        async with asyncio.timeout(10):
            while not transport.connected:
                await asyncio.sleep(0.01)
        # then a request for m is read and answered
        outputs = await transport.infer(entry("m", max_batch=4), rows(2), 2, deadline(), 1, outputs=("scores",))
        assert outputs["scores"].shape == (2, 2)
        assert "m:1" in process.info().ready
    finally:
        await transport.close()
        await process.stop(drain_seconds=1)
        clear(client)
        client.close()


async def test_a_request_read_by_a_node_its_version_moved_away_from_is_answered_by_the_node_holding_it() -> None:
    """A node reads ahead; a placement can move a version to another node between a read and its serve (the
    reconcile drops the version here meanwhile). Seen in the fleet validation: such a request was answered 503
    "not loaded on this node yet" while the other node served the version. It goes back to the stream instead."""
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    holder = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    runtime = Recording()
    holder.host(entry("m", max_batch=4), runtime, {1: 0.001, 4: 0.001})
    holding = NodeProcess(holder, REDIS_URL, Facts("holder", "cpu", "cpu", 0, 1 << 30, 1 << 30))
    leaver = NodeProcess(
        Node(artifact_path=lambda sha: None, device="cpu"),  # type: ignore[arg-type]
        REDIS_URL,
        Facts("leaver", "cpu", "cpu", 0, 1 << 30, 1 << 30),
    )
    transport = RedisStreamsTransport(REDIS_URL)
    stream = request_stream("m:1")
    try:
        await holding.claim_name()
        await holding.ensure_groups()
        await leaver.claim_name()
        leaver.serve()  # it reads nothing: it serves no version
        await transport.start()
        async with asyncio.timeout(10):
            while not transport.connected:
                await asyncio.sleep(0.01)
        # given a request of m that the leaving node read (its placement moved m to the holder since)
        asking = asyncio.ensure_future(transport.infer(entry("m", max_batch=4), rows(2), 2, deadline(), 1))
        async with asyncio.timeout(10):
            while not client.xlen(stream):
                await asyncio.sleep(0.01)
        size = int(client.get(stream + ":bytes"))
        [(_, [(entry_id, fields)])] = client.xreadgroup(GROUP, leaver.consumer, {stream: ">"}, count=1)
        leaver._elsewhere = frozenset({"m:1"})
        leaver._start("m:1", stream, entry_id, fields[FIELD])
        # then it goes back on the stream, bytes counted once, and nothing answers it yet
        async with asyncio.timeout(10):
            while leaver.counts["handed_back"] == 0 or client.xrange(stream)[0][0] == entry_id:
                await asyncio.sleep(0.01)
        assert client.xlen(stream) == 1 and int(client.get(stream + ":bytes")) == size
        assert not asking.done()
        # and the node holding m answers it
        holding.serve()
        outputs = await asyncio.wait_for(asking, 10)
        assert outputs["scores"].shape == (2, 2) and runtime.calls == [2]
        assert leaver.counts["handed_back"] == 1 and leaver.counts["served"] == 0
    finally:
        await transport.close()
        await leaver.stop(drain_seconds=1)
        await holding.stop(drain_seconds=1)
        clear(client)
        client.close()
