"""Admission at the gateway in distributed mode, against the real Redis (FERRY_TEST_REDIS_URL): a node's
`LoadPublisher` writes what `Node.infer`'s admission reads, a gateway's `LoadView` reads it back and decides
with the same `serving.policies.admission` functions before a request enters its stream; stale or missing
documents admit; a refusal goes to the model's fallback through `Gateway.serve`, as an embedded node's does.
(Whole processes: tests/test_streams_processes.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Iterator

import numpy as np
import pytest
import redis

from rollout.routing import RouteTable
from serving.dataplane.errors import Shed
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.request import Inference
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub
from serving.dataplane.node.load_publisher import LoadPublisher
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_process import Facts, NodeProcess
from serving.dataplane.transport import fleet, redis_pipe
from serving.dataplane.transport.load_view import (
    LEVELS,
    LoadView,
    NodeLoad,
    VersionState,
    decode_load,
    encode_load,
    load_key,
)
from serving.dataplane.transport.stream_codec import (
    FIELD,
    REPLIES,
    StreamRequest,
    decode_reply,
    encode_request,
    request_stream,
    unpack_replies,
)
from serving.dataplane.transport.streams import RedisStreamsTransport
from serving.policies import admission
from tests.test_admission import Clock, StandIn, admitted_to_a, busy_beside_quick, host, queued, rows
from tests.test_streams_processes import clear
from tests.test_streams_transport import entry

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def info(name: str, *, hot: frozenset[str] = frozenset()) -> fleet.NodeInfo:
    return fleet.NodeInfo(name, "i", "h", 1, "cpu", "cpu", 0, 0, 0, 0, {}, 0.0, 0.0, 1, ready=hot, hot=hot)


class Wall:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(REDIS_URL)
    clear(c)
    yield c
    clear(c)
    c.close()


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    clock = Clock()
    n = Node(artifact_path=lambda sha: None, device="cpu", clock=clock, max_queue_bytes=10_000)  # type: ignore[arg-type]
    n.clock = clock  # type: ignore[attr-defined]
    yield n
    for hosted in n.hosted.values():
        hosted.batcher.queue.drain()
    n._device_pool.shutdown(wait=False)
    n._load_pool.shutdown(wait=False)


async def view_of(nodes: list[fleet.NodeInfo], clock: Clock, wall: Wall) -> LoadView:
    view = LoadView(REDIS_URL, lambda: nodes, clock=clock, wall=wall)
    view._client = redis_pipe.client(REDIS_URL)  # no background loop: each test refreshes when it means to
    await view.refresh_once()
    await view.refresh_once()  # the second read has the streams' lengths of the versions the first found
    return view


def test_a_load_document_round_trips_and_a_foreign_one_is_refused() -> None:
    state = VersionState("a:1", list(range(LEVELS)), 3, 8, {1: 0.01, 8: 0.02}, [0.0] * LEVELS)
    load = decode_load(encode_load(NodeLoad("n1", 12.5, 0.25, {"a:1": state})))
    assert (load.node, load.at, load.in_flight) == ("n1", 12.5, 0.25)
    back = load.versions["a:1"]
    assert (back.ahead, back.held, back.max_batch, back.profile) == (list(range(LEVELS)), 3, 8, {1: 0.01, 8: 0.02})
    assert back.estimate(4) == pytest.approx(0.01 + 3 / 7 * 0.01)
    # and what is on the device: the versions with a batch there, what is left of the running one, each window
    state.window = 0.005
    on = decode_load(encode_load(NodeLoad("n1", 12.5, 0.25, {"a:1": state}, frozenset({"a:1"}), 0.125)))
    assert (on.handed, on.running_left, on.versions["a:1"].window) == (frozenset({"a:1"}), 0.125, 0.005)
    # and a document of an older node, without them, reads as nothing known on the device
    older = decode_load(
        b'{"node": "n", "at": 1, "in_flight": 0, "versions": [["a:1", %s, 0, 8, [[1, 0.01]], %s]]}'
        % (str([0] * LEVELS).encode(), str([0.0] * LEVELS).encode())
    )
    assert (older.handed, older.running_left, older.versions["a:1"].window) == (frozenset(), 0.0, 0.0)
    for raw in (
        b"{}",
        b"not json",
        b'{"node": "n", "at": 1, "in_flight": 0, "versions": [["a:1", [1], 0, 8, [], []]]}',
    ):
        with pytest.raises(ValueError):
            decode_load(raw)


@contextlib.asynccontextmanager
async def published_backlog(node: Node) -> AsyncIterator[tuple[Clock, Wall, LoadView]]:
    """A node with 40 rows queued on version `a:1`, whose batch of 8 takes 0.4 s (2 s of work), its load
    published as `n1`, and a gateway's view of it: (the node's clock, the wall clock, the view)."""
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.4)
    tasks = await queued(node, "a", 40)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 40, clock=clock, wall=wall)
    await publisher.publish_once()
    view = await view_of([info("n1", hot=frozenset({"a:1"}))], clock, wall)
    try:
        yield clock, wall, view
    finally:
        for t in tasks:
            t.cancel()
        await view.close()
        await publisher.client.aclose()


async def test_the_gateway_refuses_on_the_published_backlog_as_the_node_would(node: Node, client: redis.Redis) -> None:
    # given a node with 40 rows queued on a version whose batch of 8 takes 0.4 s: 2 s of work, published
    async with published_backlog(node) as (clock, wall, view):
        assert client.pttl(load_key("n1")) > 0  # a node that stops publishing leaves nothing behind for long
        # when a request with 1 s left arrives at the gateway
        with pytest.raises(Shed) as at_gateway:
            view.admit("a:1", 1, clock.now + 1.0, 1)
        # then it is refused there as the node refuses it: the same reason, the same Retry-After (the 2 s drain)
        with pytest.raises(Shed) as at_node:
            await node.infer("a:1", rows(1), 1, clock.now + 1.0, 1)
        assert (at_gateway.value.reason, at_gateway.value.retry_after) == ("deadline", 2.0)
        assert (at_node.value.reason, at_node.value.retry_after) == ("deadline", 2.0)
        assert "refused at the gateway" in at_gateway.value.message
        # and one whose deadline the backlog fits is admitted
        view.admit("a:1", 1, clock.now + 10.0, 1)
        assert (view.counts["refused"], view.counts["admitted"]) == (1, 1)
        # and a lower tier is held to its share of the budget, as on the node: tier 3 gets half of 80% of 5 s
        with pytest.raises(Shed) as tier:
            view.admit("a:1", 1, clock.now + 5.0, 3)
        assert tier.value.reason == "tier"

        # when the document is older than the view trusts (the node stopped publishing, or is slow to)
        wall.now += 1.5
        # then the view knows nothing: admitted, and the node decides
        view.admit("a:1", 1, clock.now + 1.0, 1)
        assert view.counts["unknown"] == 1


async def test_the_gateway_learns_what_its_admitted_requests_really_took(node: Node, client: redis.Redis) -> None:
    # given a node with 40 rows queued on a version whose batch of 8 takes 0.4 s (2 s of work), published
    async with published_backlog(node) as (clock, _, view):
        # when a request with 3.5 s left is admitted on the estimate (2.4 s: the backlog and its own batch; it
        # fits 80% of 3.5 s)
        estimated = view.admit("a:1", 1, clock.now + 3.5, 1)
        assert estimated == pytest.approx(2.4)
        # and the requests it admits take half as long again as estimated, from this gateway's admission to their
        # answer (the streams both ways, the node's read-ahead, this process's hand-back: none in the estimate)
        for _ in range(admission.CALIBRATION_MIN_SAMPLES):
            view.observe("a:1", estimated, 1.5 * estimated)
        clock.now += admission.CALIBRATION_REFRESH_S
        # then the same request is refused: its estimate, corrected by what this gateway saw, no longer fits
        with pytest.raises(Shed) as refused:
            view.admit("a:1", 1, clock.now + 3.5, 1)
        assert refused.value.reason == "deadline" and "refused at the gateway" in refused.value.message
        # and one with time for the corrected estimate is admitted
        assert view.admit("a:1", 1, clock.now + 5.0, 1) > 0.0
        # and what it learnt is this version's alone (a fallback beside it keeps its own)
        assert set(view.calibrations) == {"a:1"}


async def test_a_version_nothing_arrives_for_takes_no_turn_at_the_gateway_or_on_the_node(
    node: Node,
    client: redis.Redis,  # noqa: ARG001
) -> None:
    # given a node with nothing queued: version a just admitted at 2 device seconds a second (a full batch
    # 0.4 s) beside a quiet b (0.01 s), and c, hosted but asked nothing, whose full batch takes 0.5 s
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.4)
    host(node, "b", 0.01)
    host(node, "c", 0.5)
    admitted_to_a(node, 1, 2.0)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 0, clock=clock, wall=wall)
    await publisher.publish_once()
    view = await view_of([info("n1", hot=frozenset({"a:1", "b:1", "c:1"}))], clock, wall)
    try:
        # when a request for b with 0.6 s left arrives (0.48 s of headroom) / then both admit it: a batch of a's
        # runs before it (0.41 s), and none of c's, for which nothing arrives (counted, 0.91 s: refused, as
        # every request of a fallback beside its saturated primary was on a node hosting idle models)
        view.admit("b:1", 1, clock.now + 0.6, 1)
        admitted = asyncio.ensure_future(node.infer("b:1", rows(1), 1, clock.now + 0.6, 1))
        await asyncio.sleep(0)
        assert len(node.hosted["b:1"].batcher.queue) == 1
        admitted.cancel()
        # and once work arrives for c too, its batch counts on both sides: refused
        node.hosted["c:1"].share.add(1, 1.0, clock.now)
        node.device_share.add(1, 1.0, clock.now)
        clock.now += 0.2  # past the node's re-read of which versions are asked (FULL_BATCHES_S)
        await publisher.publish_once()
        await view.refresh_once()
        with pytest.raises(Shed) as at_gateway:
            view.admit("b:1", 1, clock.now + 0.6, 1)
        with pytest.raises(Shed) as at_node:
            await node.infer("b:1", rows(1), 1, clock.now + 0.6, 1)
        assert at_gateway.value.reason == at_node.value.reason == "deadline"
    finally:
        await view.close()
        await publisher.client.aclose()


async def test_the_batch_on_the_device_is_published_and_read_as_the_node_reads_it(
    node: Node,
    client: redis.Redis,  # noqa: ARG001
) -> None:
    # given a's 0.4 s batch on the device for 0.1 s already, a full batch more of a's queued and 2 device seconds
    # a second arriving for it, beside a quick b with a 5 ms window (test_admission's node test, published)
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    waiting = await busy_beside_quick(node, entry("b"))
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 0, clock=clock, wall=wall)
    await publisher.publish_once()
    view = await view_of([info("n1", hot=frozenset({"a:1", "b:1"}))], clock, wall)
    try:
        # when b gets a request with 0.45 s left / then the gateway admits it as the node does: b's batch is
        # handed before a's ends, and a's next runs after it
        view.admit("b:1", 1, clock.now + 0.45, 1)
        ok = asyncio.ensure_future(node.infer("b:1", rows(1), 1, clock.now + 0.45, 1))
        await asyncio.sleep(0)
        assert len(node.hosted["b:1"].batcher.queue) == 1
        ok.cancel()
        # and once a's batch is about to end, both refuse it: a's next may go first
        node._running_since = clock.now - 0.399
        await publisher.publish_once()
        await view.refresh_once()
        with pytest.raises(Shed):
            view.admit("b:1", 1, clock.now + 0.45, 1)
        with pytest.raises(Shed):
            await node.infer("b:1", rows(1), 1, clock.now + 0.45, 1)
    finally:
        for t in waiting:
            t.cancel()
        node._device_work.clear()
        node._handed.clear()
        node._running_since = None
        await view.close()
        await publisher.client.aclose()


async def test_the_work_arriving_for_another_version_counts_at_the_gateway_as_on_the_node(
    node: Node,
    client: redis.Redis,  # noqa: ARG001
) -> None:
    # given a node with nothing queued, but version a just admitted at 2 device seconds a second beside b
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.4)
    host(node, "b", 0.01)
    admitted_to_a(node, 1, 2.0)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 0, clock=clock, wall=wall)
    await publisher.publish_once()
    view = await view_of([info("n1", hot=frozenset({"a:1", "b:1"}))], clock, wall)
    try:
        # when a request for b with 0.3 s left arrives / then the gateway refuses it as the node does: a batch
        # of a's arrives and runs first
        with pytest.raises(Shed) as at_gateway:
            view.admit("b:1", 1, clock.now + 0.3, 1)
        with pytest.raises(Shed) as at_node:
            await node.infer("b:1", rows(1), 1, clock.now + 0.3, 1)
        assert at_gateway.value.reason == at_node.value.reason == "deadline"
        # and one with 0.6 s left is admitted by both
        view.admit("b:1", 1, clock.now + 0.6, 1)
        admitted = asyncio.ensure_future(node.infer("b:1", rows(1), 1, clock.now + 0.6, 1))
        await asyncio.sleep(0)
        assert len(node.hosted["b:1"].batcher.queue) == 1
        admitted.cancel()
    finally:
        await view.close()
        await publisher.client.aclose()


async def test_unread_stream_entries_and_this_gateway_s_sends_count_as_queued(node: Node, client: redis.Redis) -> None:
    # given a node with nothing queued on a version whose batch of 8 takes 0.1 s
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.1)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 0, clock=clock, wall=wall)
    await publisher.publish_once()
    view = await view_of([info("n1", hot=frozenset({"a:1"}))], clock, wall)
    try:
        view.admit("a:1", 1, clock.now + 0.5, 1)  # nothing ahead of it
        view.settled("a:1", 1, None)  # (its XADD failed: nothing of this gateway's is on its way)
        # when 80 requests wait unread in the stream (1 s of work: more than 80% of 0.5 s)
        for _ in range(80):
            client.xadd(request_stream("a:1"), {FIELD: b"x"})
        await view.refresh_once()
        # then a request with 0.5 s left is refused before it joins them
        with pytest.raises(Shed) as refused:
            view.admit("a:1", 1, clock.now + 0.5, 1)
        assert refused.value.retry_after == 1.0
        assert view.lengths["a:1"] == 80

        # when they are gone, but this gateway is sending as many, whose XADDs have not come back
        client.delete(request_stream("a:1"))
        await view.refresh_once()
        view.admit("a:1", 1, clock.now + 0.5, 1)
        for _ in range(80):
            view.admit("a:1", 1, clock.now + 30.0, 1)
        # then those count as queued
        with pytest.raises(Shed):
            view.admit("a:1", 1, clock.now + 0.5, 1)
        # and once their XADDs come back, the length their replies carry stands for them (the last says 81)
        for n in range(81):  # the one admitted before them, then the 80
            view.settled("a:1", 1, 1 + n)
        assert view._sent["a:1"].rows == 0 and view.lengths["a:1"] == 81
        with pytest.raises(Shed):
            view.admit("a:1", 1, clock.now + 0.5, 1)
        # until a read shows the stream empty (the node answered them)
        await view.refresh_once()
        view.admit("a:1", 1, clock.now + 0.5, 1)
    finally:
        await view.close()
        await publisher.client.aclose()


async def test_a_node_hot_for_the_version_without_a_document_leaves_the_view_unknown(
    node: Node,
    client: redis.Redis,  # noqa: ARG001
) -> None:
    # given a node whose document shows a long backlog, and a second node serving the same version hot that
    # publishes nothing (an older release, or its document expired)
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.4)
    tasks = await queued(node, "a", 40)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 40, clock=clock, wall=wall)
    await publisher.publish_once()
    hot = frozenset({"a:1"})
    view = await view_of([info("n1", hot=hot), info("n2", hot=hot)], clock, wall)
    try:
        # then the gateway cannot tell the second is busy too: admitted, the node decides
        view.admit("a:1", 1, clock.now + 1.0, 1)
        assert view.counts == {"refused": 0, "admitted": 0, "unknown": 1}
        # and a version no document names is unknown as well
        view.admit("b:1", 1, clock.now + 0.001, 1)
        assert view.counts["unknown"] == 2
    finally:
        for t in tasks:
            t.cancel()
        await view.close()
        await publisher.client.aclose()


def busy_document(key: str, *, rows_queued: int, per_batch: float, max_batch: int = 4) -> bytes:
    """A node's document holding `rows_queued` rows of `key`, a batch taking `per_batch` seconds: as published now."""
    state = VersionState(
        key, [rows_queued] * LEVELS, rows_queued, max_batch, {1: per_batch, max_batch: per_batch}, [0.0] * LEVELS
    )
    return encode_load(NodeLoad("busy", time.time(), 0.0, {key: state}))


@pytest.fixture
async def streams(client: redis.Redis) -> AsyncIterator[tuple[NodeProcess, RedisStreamsTransport, LoadView]]:
    """A node process serving f:1 (the fallback) from its stream, and a gateway transport admitting on a view."""
    node = Node(artifact_path=lambda sha: None, device="cpu")  # type: ignore[arg-type]
    node.host(entry("f", max_batch=4), StandIn(), {1: 0.001, 4: 0.001})
    process = NodeProcess(node, REDIS_URL, Facts("unit", "cpu", "cpu", 0, 1 << 30, 1 << 30))
    await process.claim_name()
    await process.ensure_groups()
    process.serve()
    await process.load.publish_once()
    # a second node, holding m:1 with 40 rows queued of 0.4 s batches of 4: 4 s of work
    client.set(load_key("busy"), busy_document("m:1", rows_queued=40, per_batch=0.4), px=5000)
    nodes = [info("unit", hot=frozenset({"f:1"})), info("busy", hot=frozenset({"m:1"}))]
    view = LoadView(REDIS_URL, lambda: nodes, stale_s=60)  # staleness is another test's: a busy machine is slow
    view._client = redis_pipe.client(REDIS_URL)
    await view.refresh_once()
    await view.refresh_once()
    transport = RedisStreamsTransport(REDIS_URL)
    transport.admission = view
    await transport.start()
    async with asyncio.timeout(10):
        while not transport.connected:
            await asyncio.sleep(0.01)
    try:
        yield process, transport, view
    finally:
        await transport.close()
        await view.close()
        await process.stop(drain_seconds=1)


def gateway_for(transport: RedisStreamsTransport, fallback: str | None) -> Gateway:
    m = dataclasses.replace(entry("m", max_batch=4), default_timeout_ms=1000)
    f = dataclasses.replace(entry("f", max_batch=4), default_timeout_ms=1000)
    hub = SnapshotHub()
    hub.set(
        RoutingSnapshot(
            serial=1,
            built_at=0.0,
            models={
                "m": ModelEntry("m", "", "", fallback, {1: m}, routes=RouteTable(stable=1)),
                "f": ModelEntry("f", "", "", None, {1: f}, routes=RouteTable(stable=1)),
            },
        )
    )
    return Gateway(hub, transport)


async def test_a_refusal_at_the_gateway_takes_the_fallback_before_the_stream(streams, client: redis.Redis) -> None:  # noqa: ANN001
    process, transport, view = streams
    # when a request for m arrives, whose node's backlog is past its 1 s budget, and m falls back to f
    served = await gateway_for(transport, "f").serve(Inference("m", None, None, inputs=rows(1), rows=1))
    # then f's node answers it, and m's stream never saw it
    assert served.fell_back and served.entry.key == "f:1"
    assert served.outputs["scores"].shape == (1, 2)
    assert client.xlen(request_stream("m:1")) == 0
    assert view.counts["refused"] == 1 and view.counts["admitted"] == 1
    assert process.counts["served"] == 1
    # and the fallback's XADD told the view its stream's length (one entry: this one), and nothing is on its way
    assert view.lengths["f:1"] == 1 and view._sent["f:1"].rows == 0


async def test_without_a_fallback_the_refusal_is_a_503_with_retry_after_from_the_drain(
    streams, client: redis.Redis
) -> None:  # noqa: ANN001
    _, transport, _ = streams
    with pytest.raises(Shed) as refused:
        await gateway_for(transport, None).serve(Inference("m", None, None, inputs=rows(1), rows=1))
    assert (refused.value.status, refused.value.retry_after) == (503, 4.0)  # 10 batches of 0.4 s
    assert client.xlen(request_stream("m:1")) == 0


async def test_the_node_answers_an_entry_past_its_deadline_504_rather_than_dropping_it_silently(
    streams,  # noqa: ANN001
    client: redis.Redis,
) -> None:
    process, _, _ = streams
    # given an entry whose caller's deadline passed while it waited in the stream
    reply_to = b"ferry:reply:test-expired"
    client.xadd(reply_to, {b"hello": b"1"})
    stale = StreamRequest(7, reply_to, time.time() - 1, None, 1, 1, {"input": np.zeros((1, 4), np.float32)}, None)
    client.xadd(request_stream("f:1"), {FIELD: encode_request(stale)})
    # when the node reads it, then it is never run, and answered 504 on its gateway's reply stream
    replies: list = []
    async with asyncio.timeout(10):
        while not replies:
            await asyncio.sleep(0.02)
            answer = client.xread({reply_to: "0-0"}, count=100)
            replies = [
                decode_reply(r)
                for _, entries in answer
                for _, f in entries
                if REPLIES in f
                for r in unpack_replies(f[REPLIES])
            ]
    assert [(r.id, r.error.status) for r in replies] == [(7, 504)]
    assert process.counts["expired"] == 1 and process.counts["served"] == 0


async def test_a_node_that_stops_publishing_is_lost_and_its_version_refused_before_the_stream(
    node: Node, client: redis.Redis
) -> None:
    # given the one node consuming a:1, publishing (nothing queued), and a view reading every 0.1 s of its clock
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.01)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n1", held=lambda key: 0, clock=clock, wall=wall)
    await publisher.publish_once()
    view = await view_of([info("n1", hot=frozenset({"a:1"}))], clock, wall)

    async def read(*, publish: bool, reads: int = 1) -> None:
        for _ in range(reads):
            clock.now += 0.1
            wall.now += 0.1
            if publish:
                await publisher.publish_once()
            await view.refresh_once()

    try:
        await read(publish=True, reads=6)
        view.admit("a:1", 1, clock.now + 0.3, 1)
        # when it stops publishing (killed: its heartbeat lives 3 s more), and the request this gateway added to
        # its stream gets no answer, 0.4 s of reads is not yet lost
        view.settled("a:1", 1, 1)
        await read(publish=False, reads=4)
        view.admit("a:1", 1, clock.now + 0.3, 1)
        assert view.counts == {"refused": 0, "admitted": 2, "unknown": 0}
        # but past 0.5 s it is: refused at the gateway, Retry-After the heartbeat's time left plus the cold start
        await read(publish=False, reads=2)
        with pytest.raises(Shed) as lost:
            view.admit("a:1", 1, clock.now + 0.3, 1, cold_start_s=1.2)
        assert (lost.value.reason, lost.value.retry_after) == ("node_lost", 4.0)  # ceil(3 - 0.6 + 1.2)
        assert "refused at the gateway" in lost.value.message and view.counts["refused"] == 1

        # when it is this gateway that stalls (no read for 1 s), it judges no one: admitted on the document
        clock.now += 1.0
        view.admit("a:1", 1, clock.now + 0.3, 1)
        # and the first read after its stall starts the silence again
        await read(publish=False)
        view.admit("a:1", 1, clock.now + 0.3, 1)
        await read(publish=False, reads=3)
        view.admit("a:1", 1, clock.now + 0.3, 1)
        assert view.counts == {"refused": 1, "admitted": 5, "unknown": 0}
        # until 0.5 s of fresh reads pass again; and a document gone with its TTL is as silent
        await read(publish=False, reads=2)
        client.delete(load_key("n1"))
        await read(publish=False)
        with pytest.raises(Shed):
            view.admit("a:1", 1, clock.now + 0.3, 1)

        # when it publishes again, it serves again
        await read(publish=True)
        view.admit("a:1", 1, clock.now + 0.3, 1)
        assert view.counts == {"refused": 2, "admitted": 6, "unknown": 0}
        # and when it answers this gateway's requests, a silence of its document alone (a loop stalled by a cold
        # load) is no refusal: unknown (its document is left out), admitted, the node decides
        view.answered("a:1")
        await read(publish=False, reads=6)
        view.admit("a:1", 1, clock.now + 0.3, 1)
        assert view.counts == {"refused": 2, "admitted": 6, "unknown": 1}
    finally:
        await view.close()
        await publisher.client.aclose()


async def test_a_lost_node_leaves_the_version_to_the_live_ones_and_one_never_seen_is_never_judged(
    node: Node, client: redis.Redis
) -> None:
    # given a:1 consumed by a silent node whose last document shows a long backlog, and by a live idle one
    clock, wall = node.clock, Wall()  # type: ignore[attr-defined]
    host(node, "a", 0.01)
    publisher = LoadPublisher(node, redis_pipe.client(REDIS_URL), "n2", held=lambda key: 0, clock=clock, wall=wall)
    silent = dataclasses.replace(decode_load(busy_document("a:1", rows_queued=400, per_batch=0.4)), node="n1")
    silent.at = wall.now
    client.set(load_key("n1"), encode_load(silent), px=60_000)
    await publisher.publish_once()
    hot = frozenset({"a:1"})
    nodes = [info("n1", hot=hot), info("n2", hot=hot)]
    view = await view_of(nodes, clock, wall)
    try:
        for _ in range(6):
            clock.now += 0.1
            wall.now += 0.1
            await publisher.publish_once()
            await view.refresh_once()
        # then the live node takes it: admitted on its document, not refused for the lost one
        assert set(view.lost()) == {"n1"}
        view.admit("a:1", 1, clock.now + 0.3, 1)
        assert view.counts == {"refused": 0, "admitted": 1, "unknown": 0}
        # and when the other consumer is a node this view never saw publish (an older release), nothing is judged
        # of it: unknown, admitted, the node decides
        nodes[1] = info("n3", hot=hot)
        await view.refresh_once()
        view.admit("a:1", 1, clock.now + 0.3, 1)
        assert view.counts == {"refused": 0, "admitted": 1, "unknown": 1}
    finally:
        await view.close()
        await publisher.client.aclose()


async def test_a_version_whose_only_node_is_lost_falls_back_before_its_stream(streams, client: redis.Redis) -> None:  # noqa: ANN001
    from prometheus_client import REGISTRY

    process, transport, _ = streams
    # given m:1's only node silent (its document as last published), and f:1's node publishing, read by a view
    # whose reads are 0.1 s apart on its clock
    nodes = [info("unit", hot=frozenset({"f:1"})), info("busy", hot=frozenset({"m:1"}))]
    client.set(load_key("busy"), busy_document("m:1", rows_queued=0, per_batch=0.001), px=60_000)
    clock = Clock()
    clock.now = time.monotonic() - 1.0  # behind the gateway's clock after the reads below: no deadline looks past
    view = LoadView(REDIS_URL, lambda: nodes, clock=clock)
    view._client = redis_pipe.client(REDIS_URL)
    transport.admission = view
    labels = {"model": "m", "version": "1", "reason": "node_lost"}
    before = REGISTRY.get_sample_value("ferry_gateway_refusals_total", labels) or 0.0
    try:
        view.settled("m:1", 1, 1)  # a request this gateway added to m's stream, never answered
        for _ in range(7):
            clock.now += 0.1
            await process.load.publish_once()
            await view.refresh_once()
        assert set(view.lost()) == {"busy"}
        # when a request for m arrives, then f's node answers it, and m's stream never saw it
        served = await gateway_for(transport, "f").serve(Inference("m", None, None, inputs=rows(1), rows=1))
        assert served.fell_back and served.entry.key == "f:1"
        assert client.xlen(request_stream("m:1")) == 0
        # and without a fallback the answer is a quick 503 with Retry-After, counted as the gateway's refusal
        with pytest.raises(Shed) as refused:
            await gateway_for(transport, None).serve(Inference("m", None, None, inputs=rows(1), rows=1))
        assert (refused.value.status, refused.value.reason) == (503, "node_lost")
        assert refused.value.retry_after is not None and refused.value.retry_after >= 1
        assert REGISTRY.get_sample_value("ferry_gateway_refusals_total", labels) == before + 2
        assert client.xlen(request_stream("m:1")) == 0
    finally:
        await view.close()
