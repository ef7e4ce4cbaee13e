"""The node host's socket (embedded mode with several web processes), in one process: a real `NodeHost` on a
Unix socket in the test's directory and a real `HostLink`. What a broken or hostile peer sends is answered,
never a crash of the host; quotas are counted once for every web process; a web process that goes away gives
its in-flight slots back. tests/test_node_host_processes.py runs `serve --workers 2` itself."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import msgpack
import pytest

from serving.dataplane.errors import ServingError
from serving.dataplane.node import announce
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_host import NodeHost
from serving.dataplane.transport import host_frames as frames
from serving.dataplane.transport.host_link import HostLink, HostLost, HostQuota, HostTransport, HostView
from serving.policies.quota import IN_FLIGHT, RATE, InProcessQuota
from tests.test_admission import StandIn, entry, rows
from tests.test_packing_node import digits


class Limits:
    requests_per_second, burst, max_in_flight, monthly_requests = 1.0, 3, 2, 1000


async def _host(tmp_path: Path, **kwargs: object) -> tuple[NodeHost, str]:
    """A node host on a socket in `tmp_path`; `kwargs` are NodeHost's."""
    node = Node(artifact_path=lambda key: tmp_path / key, device="cpu")
    refreshed = []

    async def refresh() -> int:
        refreshed.append(1)
        return len(refreshed)

    host = NodeHost(node, InProcessQuota(), refresh=refresh, **kwargs)  # type: ignore[arg-type]
    path = str(tmp_path / "node.sock")
    await host.start(path)
    return host, path


async def _link(path: str) -> HostLink:
    link = HostLink(path)
    link.start()
    await asyncio.wait_for(link.connected.wait(), 5)
    return link


def test_the_socket_is_the_owners_only(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        try:
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        finally:
            await host.close()

    asyncio.run(go())


def test_malformed_frames_are_answered_not_fatal(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        link = await _link(path)
        try:
            kind, payload = await link.call(frames.INFER, b"no key separator")
            assert kind == frames.BAD_FRAME and b"key" in payload
            kind, payload = await link.call(frames.INFER, b"digits:1\0not msgpack")
            assert kind == frames.BAD_FRAME
            kind, payload = await link.call(99, b"")
            assert kind == frames.BAD_FRAME and b"unknown frame kind" in payload
            kind, payload = await link.call(frames.QUOTA, msgpack.packb(["a", "b"]))
            assert kind == frames.BAD_FRAME
            assert host.counts["malformed"] == 4
            # Still serving: a status answers after all of them.
            view = HostView(link)
            await view.refresh_once()
            assert view.host_serial == 0 and not view.routable("digits:1")
        finally:
            await link.close()
            await host.close()

    asyncio.run(go())


def test_a_frame_longer_than_the_bound_drops_the_connection(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        try:
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(frames.HEAD.pack(frames.MAX_FRAME_BYTES + 1, frames.INFER, 1))
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the host
            writer.close()
            link = await _link(path)  # the host itself serves on
            await HostView(link).refresh_once()
            await link.close()
        finally:
            await host.close()

    asyncio.run(go())


def test_the_quota_is_counted_once_for_every_web_process_and_freed_when_one_leaves(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        web_a, web_b = await _link(path), await _link(path)
        try:
            a, b = HostQuota(web_a), HostQuota(web_b)
            first, lease_a = await a.admit(7, Limits())  # type: ignore[arg-type]
            second, _ = await b.admit(7, Limits())  # type: ignore[arg-type]
            third, _ = await a.admit(7, Limits())  # type: ignore[arg-type]
            assert first.admitted and second.admitted
            assert not third.admitted and third.reason == IN_FLIGHT  # max_in_flight 2, across both
            await a.release_many([(7, lease_a)])
            await asyncio.sleep(0.05)
            assert host.quota.in_flight(7) == 1
            await web_b.close()  # web process b went away with its request in flight
            await asyncio.sleep(0.1)
            assert host.quota.in_flight(7) == 0
            # A web process's own decisions while the host did not answer are charged at its next call.
            charged, lease = await a.admit(8, Limits(), debt=2)  # type: ignore[arg-type]
            assert charged.admitted and charged.remaining == 0  # burst 3: 2 charged, this one the last
            await a.release_many([(8, lease)])
            refused, _ = await a.admit(8, Limits())  # type: ignore[arg-type]
            assert not refused.admitted and refused.reason == RATE
        finally:
            await web_a.close()
            await host.close()

    asyncio.run(go())


def test_requests_on_a_lost_link_are_answered_503_with_retry_after(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        link = await _link(path)
        try:
            _, waiting = link.send(frames.REFRESH, b"")
            await host.close()  # as a host that exits: its connections drop
            with pytest.raises(HostLost) as lost:
                await asyncio.wait_for(waiting, 5)
            assert lost.value.status == 503 and lost.value.retry_after == 1
            with pytest.raises(ServingError) as refused:
                link.send(frames.STATUS, b"")
            assert refused.value.status == 503
        finally:
            await link.close()

    asyncio.run(go())


class Slow(StandIn):
    """A stand-in runtime whose batches take 0.3 s on the device thread, counting the rows it ran."""

    ran: int = 0

    def run(self, requests):  # noqa: ANN001, ANN201
        time.sleep(0.3)
        self.ran += len(requests)
        return super().run(requests)


async def _queued(host: NodeHost, key: str, n: int) -> None:
    for _ in range(300):
        if host.node.queue_depth(key) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{n} requests never waited in {key}'s queue")


def test_a_request_whose_client_left_is_dropped_unrun_on_the_host(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        link = await _link(path)
        runtime = Slow()
        # given a version on the host whose batches of one take 0.3 s, one running and one waiting behind it
        host.node.host(entry("slow", max_batch=1), runtime, {1: 0.3})
        transport = HostTransport(link)
        loop = asyncio.get_running_loop()
        try:
            running = asyncio.ensure_future(transport.infer(entry("slow"), rows(1), 1, loop.time() + 2.0, 1))
            await asyncio.sleep(0.05)
            left = asyncio.Event()
            waiting = asyncio.ensure_future(
                transport.infer(entry("slow"), rows(1), 1, loop.time() + 2.0, 1, gone=left.is_set)
            )
            await _queued(host, "slow:1", 1)
            # when the waiting one's client leaves
            left.set()
            # then the host drops it unrun at its turn, long before its deadline: 499 (never sent on)
            with pytest.raises(ServingError) as dropped:
                await asyncio.wait_for(waiting, 1.0)
            assert dropped.value.status == 499
            # while the one whose client stayed is answered, and was the only one run
            assert (await running)["scores"].shape == (1, 2)
            assert runtime.ran == 1 and not host._gone
        finally:
            await link.close()
            await host.close()

    asyncio.run(go())


def test_the_requests_of_a_web_process_that_went_away_are_dropped_unrun(tmp_path: Path) -> None:
    async def go() -> None:
        host, path = await _host(tmp_path)
        stays, leaves = await _link(path), await _link(path)
        runtime = Slow()
        host.node.host(entry("slow", max_batch=1), runtime, {1: 0.3})
        loop = asyncio.get_running_loop()
        try:
            # given a request of one web process running on the host, and one of another waiting behind it
            running = asyncio.ensure_future(HostTransport(stays).infer(entry("slow"), rows(1), 1, loop.time() + 2.0, 1))
            await asyncio.sleep(0.05)
            waiting = asyncio.ensure_future(
                HostTransport(leaves).infer(entry("slow"), rows(1), 1, loop.time() + 2.0, 1)
            )
            await _queued(host, "slow:1", 1)
            # when the second web process's connection closes
            await leaves.close()
            with pytest.raises(HostLost):
                await waiting
            # then its request is dropped unrun at its turn, and the first is answered
            assert (await running)["scores"].shape == (1, 2)
            await asyncio.sleep(0.6)  # its turn came as the first was answered: run, it would be done by now
            assert runtime.ran == 1
            assert not host._gone
        finally:
            await stays.close()
            await host.close()

    asyncio.run(go())


def test_the_fleet_page_is_told_what_the_hosts_node_holds_and_did(tmp_path: Path, model_files) -> None:  # noqa: ANN001
    # given a host whose node loaded a version
    async def go() -> None:
        node = Node(artifact_path=lambda sha: model_files.digits, device="cpu", memory_budget=10**9)
        hosted = await node.load(digits("one"))
        assert hosted is not None

        async def refresh() -> int:
            return 0

        host = NodeHost(node, InProcessQuota(), refresh=refresh)
        path = str(tmp_path / "node.sock")
        await host.start(path)
        link = await _link(path)
        try:
            # when a web process asks it, for its fleet page
            info, events = await HostView(link).fleet()
            # then it hears the host's node as a heartbeat would announce it, and the node's record
            assert info.name == announce.process_name() and info.pid == os.getpid()
            assert info.memory_budget == 10**9 and info.memory_used == hosted.runtime.memory_bytes > 0
            assert info.resident == {"one:1": {"tier": "hot", "bytes": hosted.runtime.memory_bytes}}
            assert [(e.node, e.kind, e.key) for e in events] == [(info.name, "load", "one:1")]
            # and its status says what the repository index reads of a node's packing (before, a version not
            # hot on the host made the index and the fleet page answer 500: the view had no packing)
            view = HostView(link)
            await view.refresh_once()
            assert view.is_ready("one:1") and view.packing.cold == frozenset()
            view.update({"hot": ["one:1"], "ready": ["two:1"], "loading": ["two:1"], "no_room": {"three:1": "full"}})
            assert view.packing.cold == {"two:1"} and view.packing.loading == {"two:1"}
            assert view.packing.no_room == {"three:1": "full"}
        finally:
            await link.close()
            await host.close()
            await node.close()

    asyncio.run(go())
