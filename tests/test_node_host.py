"""The node host's socket (embedded mode with several web processes), in one process: a real `NodeHost` on a
Unix socket in the test's directory and a real `HostLink`. What a broken or hostile peer sends is answered,
never a crash of the host; quotas are counted once for every web process; a web process that goes away gives
its in-flight slots back. tests/test_node_host_processes.py runs `serve --workers 2` itself."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import msgpack
import pytest

from serving.dataplane.errors import ServingError
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_host import NodeHost
from serving.dataplane.transport import host_frames as frames
from serving.dataplane.transport.host_link import HostLink, HostLost, HostQuota, HostView
from serving.policies.quota import IN_FLIGHT, RATE, InProcessQuota


class Limits:
    requests_per_second, burst, max_in_flight, monthly_requests = 1.0, 3, 2, 1000


async def _host(tmp_path: Path) -> tuple[NodeHost, str]:
    node = Node(artifact_path=lambda key: tmp_path / key, device="cpu")
    refreshed = []

    async def refresh() -> int:
        refreshed.append(1)
        return len(refreshed)

    host = NodeHost(node, InProcessQuota(), refresh=refresh)
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
