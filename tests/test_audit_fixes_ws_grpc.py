"""A node's metrics port (serving.dataplane.metrics.node_metrics) against clients that send nothing, drip their
request or never read the answer: each connection's whole exchange has one deadline, so such a connection is
dropped instead of pinning its thread for ever, and the connections served at once are capped, one more answered
503 without a thread. The WebSocket and gRPC fixes of the same audit are tested beside their features
(tests/test_websocket.py, tests/test_grpc.py)."""

from __future__ import annotations

import http.client
import select
import socket
import time

import orjson
from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

from serving.dataplane.metrics import node_metrics

HANG_S = 60.0  # a wait longer than this has hung: not a timing assertion
DEADLINE_S = 2.0  # the servers' deadline below
DRIP_S = 0.1  # a byte this often: each read waits far less than DEADLINE_S, so only an overall deadline ends it
DRIP_FOR_S = 30.0  # 15 deadlines: a connection still open after this is held for as long as it drips


def read_to_end(sock: socket.socket) -> bytes:
    """What the server sent until it closed the connection."""
    sock.settimeout(HANG_S)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_silent_connections_are_dropped_and_capped() -> None:
    # given a metrics port serving two connections at once, each socket operation bounded at 3 s
    server = node_metrics.serve_registry(lambda: None, 0, "127.0.0.1", max_connections=2, timeout=3.0)
    port = server.server_port
    try:
        # when two clients connect and send nothing, and a third comes
        silent = [socket.create_connection(("127.0.0.1", port), timeout=HANG_S) for _ in range(2)]
        third = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
        # then the third is answered 503 at once, as JSON with a retry hint, without being read
        answer = read_to_end(third)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 503") and b"Retry-After: 1" in head, answer
        assert "connection limit" in orjson.loads(body)["error"]
        third.close()
        # and the silent ones are closed by the server once their read has waited its 3 s, unanswered
        for sock in silent:
            assert read_to_end(sock) == b""
            sock.close()
        # after which a scrape is served
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            assert response.status == 200 and b"# HELP" in response.read()
        finally:
            conn.close()
    finally:
        server.shutdown()
        server.server_close()


def dripped_until_closed(sock: socket.socket) -> bool:
    """Send a byte every DRIP_S for DRIP_FOR_S; whether the server closed the connection meanwhile."""
    stop = time.monotonic() + DRIP_FOR_S
    while time.monotonic() < stop:
        readable, _, _ = select.select([sock], [], [], DRIP_S)
        try:
            if readable:
                return sock.recv(65536) == b""  # the server answers nothing to a request still coming
            sock.send(b"a")
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def scrape_when_free(port: int) -> tuple[int, bytes]:
    """A scrape once the port has a free slot (503 until then: a closed connection's thread releases its slot
    just after the close is seen); (status, body)."""
    stop = time.monotonic() + HANG_S
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
        try:
            conn.request("GET", "/metrics")
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 503 or time.monotonic() > stop:
            return response.status, body
        time.sleep(DRIP_S)


def test_a_dripping_client_is_dropped_at_the_connection_deadline() -> None:
    # given a metrics port serving one connection at a time, each connection's exchange bounded at 2 s in all
    server = node_metrics.serve_registry(lambda: None, 0, "127.0.0.1", max_connections=1, timeout=DEADLINE_S)
    port = server.server_port
    try:
        # when a client sends its request's headers a byte every 0.1 s, never ending them
        drip = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
        drip.sendall(b"GET /metrics HTTP/1.1\r\nHost: node\r\nX-Drip: ")
        # then the server closes it at the deadline, long before the drip schedule runs out
        closed = dripped_until_closed(drip)
        drip.close()
        assert closed, f"a client dripping a byte every {DRIP_S} s held its connection for {DRIP_FOR_S} s"
        # and its slot, the only one, serves a scrape
        status, body = scrape_when_free(port)
        assert status == 200 and b"# HELP" in body
    finally:
        server.shutdown()
        server.server_close()


LARGE = 32 * 1024 * 1024  # more than the kernel's socket buffers between the server and a client hold


class Padding:
    """A family whose one sample carries a LARGE label, so an answer cannot fit the socket buffers."""

    def collect(self) -> list[GaugeMetricFamily]:
        family = GaugeMetricFamily("ferry_test_padding", "An answer larger than the socket buffers", labels=["pad"])
        family.add_metric(["x" * LARGE], 1)
        return [family]


def test_a_client_that_never_reads_the_answer_is_dropped_at_the_connection_deadline() -> None:
    # given a metrics port serving one connection at a time, bounded at 2 s, whose answer outgrows the buffers
    padding = Padding()
    REGISTRY.register(padding)
    server = node_metrics.serve_registry(lambda: None, 0, "127.0.0.1", max_connections=1, timeout=DEADLINE_S)
    port = server.server_port
    stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # when a client with a small receive window asks and never reads
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.settimeout(HANG_S)
        stuck.connect(("127.0.0.1", port))
        stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: node\r\n\r\n")
        readable, _, _ = select.select([stuck], [], [], HANG_S)
        assert readable, "no answer started"  # its thread has the one slot and is writing the answer
        # then the server gives up on it at the deadline: the slot serves another scrape, in full
        status, body = scrape_when_free(port)
        assert status == 200 and len(body) > LARGE
    finally:
        stuck.close()
        server.shutdown()
        server.server_close()
        REGISTRY.unregister(padding)
