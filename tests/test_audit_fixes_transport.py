"""The data plane's transports where a wait gives up or a peer misbehaves: nothing held is leaked, no label or
task is left to clients' whims, and every caller gets its answer.

- The node host's quota (embedded mode with several web processes): a decision that comes after the web process
  stopped waiting gives its lease back at once, and a lease nobody releases expires (`FERRY_QUOTA_LEASE_S`).
  With real processes (`serve --workers 2`, the host stopped for a moment): tests/test_node_host_processes.py.
- The front door's refusals are labelled only with names the snapshot knows.
- Distributed mode's XADD is bounded by the request's deadline, not Redis' socket timeout, and a caller that
  gives up takes nothing from the pipe's other commands; a damaged reply entry answers every caller it holds at
  once (500 where its reply is damaged).
- The repository extension answers a registry outage, or a change not done in time, 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from pathlib import Path

import msgpack
import numpy as np
import pytest
import redis
from django.db import OperationalError

from serving import wiring
from serving.dataplane import plane as dataplane
from serving.dataplane.errors import DeadlineExceeded, ServingError
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.quota_gate import QuotaGate
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot, SnapshotHub, hub
from serving.dataplane.metrics import metrics
from serving.dataplane.node.node_host import NodeHost
from serving.dataplane.plane import DataPlane
from serving.dataplane.transport import host_frames as frames
from serving.dataplane.transport import redis_pipe
from serving.dataplane.transport.host_link import HostQuota
from serving.dataplane.transport.stream_codec import REPLIES, encode_error, encode_success, pack_replies
from serving.policies.quota import IN_FLIGHT
from tests.test_admission import rows
from tests.test_inference_http import assert_error, call
from tests.test_node_host import _host, _link
from tests.test_streams_transport import Served, deadline, entry, served  # noqa: F401  (the fixture)

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


class Limits:
    requests_per_second, burst, max_in_flight, monthly_requests = 1000.0, 1000, 4, 10**6


class TwoInFlight(Limits):
    max_in_flight = 2


def counter(child) -> float:  # noqa: ANN001
    return child._value.get()


def _slow_quota_replies(host: NodeHost, delay: float) -> None:
    """The host decides at once (and holds the lease), but its answer reaches the web process `delay` s later: a
    slow moment of the host's loop, or of the socket."""
    decide = host._admit
    loop = asyncio.get_running_loop()

    class Late:
        def __init__(self, proto: frames.FrameProtocol) -> None:
            self.proto = proto

        def send(self, kind: int, rid: int, payload: bytes) -> None:
            loop.call_later(delay, self.proto.send, kind, rid, payload)

    host._admit = lambda proto, conn, rid, payload: decide(Late(proto), conn, rid, payload)  # type: ignore[method-assign]


async def _until(check, what: str, seconds: float = 5.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.01)


# -- the node host's quota leases ------------------------------------------------------------------


def test_a_quota_decision_that_comes_after_the_web_process_gave_up_gives_its_lease_back(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        link = await _link(path)
        now = [1000.0]
        gate = QuotaGate(shared=HostQuota(link), timeout_s=0.05, retry_s=1.0, clock=lambda: now[0])  # type: ignore[arg-type]
        late_before = counter(metrics.QUOTA_LATE_LEASES)
        try:
            # given a host whose decisions reach the web process after its quota timeout (50 ms here)
            _slow_quota_replies(host, 0.2)
            # when the web process gives up on four of them, deciding in-process meanwhile
            tickets = await asyncio.gather(*(gate.admit(7, Limits()) for _ in range(4)))  # type: ignore[arg-type]
            assert all(t.lease is None for t in tickets)  # decided here, not by the host
            for ticket in tickets:
                gate.release(ticket)
            # then the host's leases, which it counted in flight, come back once its late answers arrive
            assert host.quota.in_flight(7) == 4
            await _until(lambda: host.quota.in_flight(7) == 0, "the late leases released")
            assert not host._held[next(iter(host._held))] and not link._late
            assert counter(metrics.QUOTA_LATE_LEASES) - late_before == 4
            # and once the host answers in time again, the tenant has its whole in-flight limit, not none of it
            host._admit = NodeHost._admit.__get__(host)  # type: ignore[method-assign]
            now[0] += 1.0  # past retry_s: the gate asks the host again
            again = [await gate.admit(7, Limits()) for _ in range(4)]  # type: ignore[arg-type]
            assert all(t.lease for t in again)  # the host's, to max_in_flight
            assert host.quota.in_flight(7) == 4
            for ticket in again:
                gate.release(ticket)
            await _until(lambda: host.quota.in_flight(7) == 0, "the leases released")
        finally:
            await link.close()
            await host.close()

    asyncio.run(go())


def test_an_answer_that_arrives_as_its_caller_gives_up_is_handed_to_late(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        link = await _link(path)
        seen: list[tuple[int, bytes]] = []
        try:
            # given a call waiting on the host, whose answer is delivered in the same turn its task is cancelled
            class Held:  # the request never reaches the host: the test delivers its answer
                closed = False

                def send(self, kind: int, rid: int, payload: bytes) -> None:
                    pass

            proto, link._proto = link._proto, Held()  # type: ignore[assignment]
            task = asyncio.ensure_future(link.call(frames.QUOTA, b"", late=lambda k, p: seen.append((k, p))))
            await asyncio.sleep(0)
            (rid,) = link._waiting
            link._proto = proto
            link._on_frame(frames.QUOTA_REPLY, rid, b"answer")  # the future has its result...
            task.cancel()  # ...and its caller gives up before it ran again
            with pytest.raises(asyncio.CancelledError):
                await task
            # then nobody took the answer but `late` (a lease in it would be given back)
            assert seen == [(frames.QUOTA_REPLY, b"answer")]
            assert not link._late and not link._waiting
            # and an answer that comes after the give-up goes to `late` too, once
            task = asyncio.ensure_future(link.call(frames.STATUS, b"", late=lambda k, p: seen.append((k, p))))
            await asyncio.sleep(0)
            (rid,) = link._waiting
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert rid in link._late
            link._on_frame(frames.STATUS_REPLY, rid, b"late")
            link._on_frame(frames.STATUS_REPLY, rid, b"twice")
            assert seen[1:] == [(frames.STATUS_REPLY, b"late")] and not link._late
        finally:
            await link.close()
            await host.close()

    asyncio.run(go())


def test_a_lease_no_web_process_releases_expires(tmp_path: Path) -> None:
    async def go() -> None:
        now = [1000.0]
        host, path = await _host(tmp_path, clock=lambda: now[0], lease_s=10.0)
        link = await _link(path)
        quota = HostQuota(link)
        expired_before = counter(metrics.QUOTA_LEASES_EXPIRED)
        try:
            # given two leases whose releases never came (lost, or a bug), at the tenant's in-flight limit
            for _ in range(2):
                decision, lease = await quota.admit(7, TwoInFlight())  # type: ignore[arg-type]
                assert decision.admitted and lease
            refused, _ = await quota.admit(7, TwoInFlight())  # type: ignore[arg-type]
            assert not refused.admitted and refused.reason == IN_FLIGHT
            # when lease_s passes / then the host frees them at its next decision, and admits again
            now[0] += 10.5
            decision, lease = await quota.admit(7, TwoInFlight())  # type: ignore[arg-type]
            assert decision.admitted
            assert host.quota.in_flight(7) == 1
            assert counter(metrics.QUOTA_LEASES_EXPIRED) - expired_before == 2
            # and a release that comes after its lease expired frees nothing twice
            await quota.release_many([(7, lease)])
            await _until(lambda: host.quota.in_flight(7) == 0, "the lease released")
            await quota.release_many([(7, lease)])
            await asyncio.sleep(0.05)
            assert host.quota.in_flight(7) == 0
        finally:
            await link.close()
            await host.close()

    asyncio.run(go())


# -- the front door's refusals -----------------------------------------------------------------


@pytest.fixture
def known_model_snapshot() -> RoutingSnapshot:
    model = ModelEntry(name="known-one", task="", description="", fallback=None, versions={})
    return RoutingSnapshot(serial=1, built_at=0.0, models={"known-one": model})


def test_a_refusal_is_labelled_only_with_a_name_the_snapshot_knows(known_model_snapshot: RoutingSnapshot) -> None:
    # given a gateway whose snapshot knows one model, with no version to serve
    snapshots = SnapshotHub()
    snapshots.set(known_model_snapshot)
    plane = DataPlane(gateway=Gateway(snapshots, transport=None), node=None, loop=None)  # type: ignore[arg-type]
    children = len(metrics.SHED._metrics)
    unrouted = counter(metrics.UNROUTED_FRONTEND_SHED)
    # when the front door refuses requests for 500 made-up names (before authentication)
    for i in range(500):
        plane.count_frontend_shed(f"/v2/models/made-up-{i}/versions/{i}/infer?x=1".encode())
    # then they are counted under one fixed label, and the counter has no child more
    assert len(metrics.SHED._metrics) == children
    assert counter(metrics.UNROUTED_FRONTEND_SHED) - unrouted == 500
    # while a name the snapshot knows (a model not servable now) keeps its own label
    plane.count_frontend_shed(b"/v2/models/known-one/infer")
    assert counter(metrics.SHED.labels("known-one", "", "frontend", "0")) == 1
    assert counter(metrics.UNROUTED_FRONTEND_SHED) - unrouted == 500


# -- distributed mode: the XADD's wait, the pipe, malformed replies -------------------------------


BLOCKED = f"ferry:test:audit:blocked:{os.getpid()}"  # a list nothing pushes to until the test does: BLPOP waits


async def test_a_command_given_up_is_left_out_and_every_other_keeps_its_own_answer() -> None:
    client = redis_pipe.client(REDIS_URL, socket_timeout=30)  # the BLPOP below waits on the test, not a timer
    other = redis_pipe.client(REDIS_URL)
    keys = [f"{BLOCKED}:{name}" for name in ("a", "b", "c")]
    await other.delete(BLOCKED, *keys)
    pipe = redis_pipe.Pipe(client)
    pipe.start()
    try:
        # given a batch Redis does not answer yet (a BLPOP on an empty list), one of whose callers gives up
        blocked = pipe.send("BLPOP", BLOCKED, 0)
        gives_up_in_flight = pipe.send("INCR", keys[0])
        await asyncio.sleep(0)  # the batch leaves
        # and commands queued behind it, one of whose callers gives up before its batch leaves
        gives_up = pipe.send("INCR", keys[1])
        stays = pipe.send("INCR", keys[2])
        for future in (gives_up, gives_up_in_flight):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await future
        # when Redis answers the batch
        await other.lpush(BLOCKED, "go")
        # then each remaining caller has its own answer, and the command given up before it left was never sent
        assert tuple(await blocked) == (BLOCKED.encode(), b"go")
        assert await stays == 1
        assert await other.get(keys[1]) is None
        assert await other.get(keys[0]) == b"1"  # it had left: Redis ran it, its answer went to nobody
        assert await pipe.send("INCR", keys[2]) == 2  # and the pipe goes on
    finally:
        await pipe.close()
        await other.delete(BLOCKED, *keys)
        await client.aclose()
        await other.aclose()


async def test_a_slow_redis_costs_a_request_its_deadline_not_the_socket_timeout(served: Served) -> None:  # noqa: F811
    transport = served.transport
    served.client.delete(BLOCKED)
    before = counter(metrics.DEADLINES.labels("m", "1", "send"))
    # given Redis not answering the gateway's pipe (a BLPOP ahead of the XADDs, as a slow Redis would)
    transport._pipe.send("BLPOP", BLOCKED, 0, wait=False)
    # when a request with a 300 ms deadline is sent
    with pytest.raises(DeadlineExceeded):
        await transport.infer(entry("m"), rows(1), 1, deadline(0.3), 1)
    # then it is answered 504 at its deadline (not 503 when the socket's timeout, 2 s, ends the wait), counted as
    # passed while being sent, and holds nothing
    assert counter(metrics.DEADLINES.labels("m", "1", "send")) - before == 1
    assert transport.outstanding("m:1") == 0 and not transport._waiting
    # and once Redis answers again, requests round-trip as before
    served.client.lpush(BLOCKED, "go")
    outputs = await transport.infer(entry("m"), rows(2), 2, deadline(), 1)
    assert outputs["scores"].shape == (2, 2)
    served.client.delete(BLOCKED)


async def test_a_damaged_reply_entry_answers_every_caller_it_holds_at_once(served: Served) -> None:  # noqa: F811
    transport = served.transport
    errors = metrics.INTERNAL_ERRORS.labels("stream_reply")
    before = counter(errors)
    idle = entry("idle")  # no node reads it: only the entries written below answer
    waiting = [asyncio.ensure_future(transport.infer(idle, rows(1), 1, deadline(20), 1)) for _ in range(4)]
    await _until(lambda: len(transport._waiting) == 4, "four requests sent")
    first, second, third, fourth = sorted(transport._waiting)
    # given a node's reply entry for three callers: the first's reply as it should be, the second's damaged, and the
    # entry cut short inside the third's
    good = encode_success(first, {"scores": np.zeros((1, 2), np.float32)}, None)
    last = encode_error(third, ServingError("refused", status=503))
    whole = pack_replies([first, second, third], [good, b"\xc1 not a reply", last])
    raw = whole[: len(whole) - len(last) // 2]
    # when it arrives on the gateway's reply stream
    served.client.xadd(transport.reply_to, {REPLIES: raw})
    # then the first caller has its result, and the other two 500 at once (not 504 at their deadlines), the bugs
    # logged and counted: the second's reply, and the entry
    outputs = await asyncio.wait_for(waiting[0], 5)
    assert outputs["scores"].shape == (1, 2)
    for damaged in waiting[1:3]:
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(damaged, 5)
        assert caught.value.status == 500 and "malformed" in caught.value.message
    assert counter(errors) - before == 2
    # and the reader reads on, the old framing too (a node from before the entry's header, in a rolling upgrade):
    # an error reply with a malformed shed field is answered, not the reader's end
    bad_shed = msgpack.unpackb(encode_error(fourth, ServingError("refused", status=503)))
    bad_shed["shed"] = ["deadline", "not a tier"]
    served.client.xadd(transport.reply_to, {REPLIES: msgpack.packb([msgpack.packb(bad_shed)])})
    with pytest.raises(ServingError) as caught:
        await asyncio.wait_for(waiting[3], 5)
    assert caught.value.status == 503
    assert not transport._tasks[0].done()


async def test_a_reply_the_entry_cannot_vouch_for_answers_its_callers_500_at_once(served: Served) -> None:  # noqa: F811
    transport = served.transport
    idle = entry("idle")
    waiting = [asyncio.ensure_future(transport.infer(idle, rows(1), 1, deadline(20), 1)) for _ in range(3)]
    await _until(lambda: len(transport._waiting) == 3, "three requests sent")
    first, second, third = sorted(transport._waiting)
    # given an entry read whole, but the first caller's reply unreadable (not even its id), and the second caller's
    # a reply that names the third caller
    stray = encode_success(third, {"scores": np.zeros((1, 2), np.float32)}, None)
    served.client.xadd(transport.reply_to, {REPLIES: pack_replies([first, second], [b"\xc1", stray])})
    # then all three are answered 500 at once: the first by the entry's header, and neither the second nor the third
    # is trusted with the stray reply
    for each in waiting:
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(each, 5)
        assert caught.value.status == 500 and "malformed" in caught.value.message


# -- the repository extension's load and unload --------------------------------------------------


def test_load_and_unload_answer_an_outage_or_a_slow_change_503_with_retry_after(digits_server, monkeypatch) -> None:  # noqa: ANN001
    path = "/v2/repository/models/digits/unload"
    # given the database out of reach, or locked (SQLite) / when a model is unloaded / then 503 with Retry-After
    for failure in (
        OperationalError("connection to server at 127.0.0.1, port 5432 failed: Connection refused"),
        OperationalError("database is locked"),
        redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused."),
    ):

        def unreachable(*, model_name: str, loaded: bool, failure: Exception = failure) -> RoutingSnapshot:
            raise failure

        monkeypatch.setattr(wiring, "set_loaded", unreachable)
        resp = call(digits_server, "POST", path, b"")
        assert_error(resp, 503, "registry is unavailable")
        assert resp.headers["retry-after"] == str(dataplane.REGISTRY_RETRY_S)

    # given a registry write that takes longer than its bound
    released = threading.Event()

    def stuck(*, model_name: str, loaded: bool) -> RoutingSnapshot:
        released.wait(5)
        raise AssertionError("not awaited past the bound")

    monkeypatch.setattr(wiring, "set_loaded", stuck)
    monkeypatch.setattr(dataplane, "SET_LOADED_TIMEOUT_S", 0.2)
    resp = call(digits_server, "POST", path, b"")
    released.set()
    assert_error(resp, 503, "did not take the unload", "within")
    assert resp.headers["retry-after"] == str(dataplane.REGISTRY_RETRY_S)

    # given a change recorded whose reconcile never finishes
    def recorded(*, model_name: str, loaded: bool) -> RoutingSnapshot:
        return dataclasses.replace(hub.current, serial=hub.current.serial + 10**9)

    monkeypatch.setattr(wiring, "set_loaded", recorded)
    monkeypatch.setattr(dataplane, "RECONCILE_TIMEOUT_S", 0.2)
    resp = call(digits_server, "POST", path, b"")
    assert_error(resp, 503, "recorded but was not done")
    assert resp.headers["retry-after"] == str(dataplane.REGISTRY_RETRY_S)

    # and a bug is still a 500, not relabelled
    def broken(*, model_name: str, loaded: bool) -> RoutingSnapshot:
        raise KeyError("a bug")

    monkeypatch.setattr(wiring, "set_loaded", broken)
    assert call(digits_server, "POST", path, b"").status == 500
