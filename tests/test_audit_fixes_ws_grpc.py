"""A node's metrics port (serving.dataplane.metrics.node_metrics) against clients that send nothing: each socket
operation has a deadline, so a silent connection is dropped instead of pinning its thread for ever, and the
connections served at once are capped, one more answered 503 without a thread. The WebSocket and gRPC fixes of
the same audit are tested beside their features (tests/test_websocket.py, tests/test_grpc.py)."""

from __future__ import annotations

import http.client
import socket

import orjson

from serving.dataplane.metrics import node_metrics

HANG_S = 60.0  # a wait longer than this has hung: not a timing assertion


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
