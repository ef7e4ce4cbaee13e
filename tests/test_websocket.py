"""Inference over a WebSocket (/ws/v2/models/{name}/infer) against a live Ferry: answers by id, with and
without the binary layout, out of order; a fast sender slowed; the connection's limits; refusals.

The client is the `websockets` library's. Waits poll state with a deadline that only stops a hang.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import orjson
import pytest
from prometheus_client import REGISTRY
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, PayloadTooBig
from websockets.frames import Frame, Opcode

from serving.dataplane.http import frontdoor, websocket
from serving.dataplane.http.frontdoor import FIRST_MESSAGE_BYTES, _FirstMessageBound
from tenants import keys
from tenants.actions import revoke_key
from tenants.models import ApiKey
from tests.conftest import mint_key, register, tenant
from tests.test_inference_http import HELD, digits_request, infer, scores, wait_until

DEADLINE_S = 60.0  # a test that waits longer than this has hung
LENGTH = struct.Struct(">I")


@pytest.fixture(autouse=True)
def _no_shedding(settings) -> None:  # noqa: ANN001
    # This machine is shared: a late event loop would shed requests (tested in test_hardening_http.py).
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000


def url(server, model: str = "digits", query: str = "") -> str:  # noqa: ANN001
    return f"ws://127.0.0.1:{server.port}/ws/v2/models/{model}/infer{query}"


def keyed(server, key: str | None = None, model: str = "digits", **options: object) -> connect:  # noqa: ANN001
    """A connection with the key in Sec-WebSocket-Protocol (the server's own key by default)."""
    return connect(
        url(server, model),
        subprotocols=["ferry.v2", f"ferry.key.{key or server.key}"],
        compression=None,
        open_timeout=DEADLINE_S,
        **options,
    )


def json_message(rid: str, rows: np.ndarray, **extra: object) -> str:
    return orjson.dumps({"id": rid, **digits_request(rows), **extra}).decode()


def binary_message(rid: str, rows: np.ndarray, binary_output: bool) -> bytes:
    header = orjson.dumps(
        {
            "id": rid,
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(rows.shape),
                    "parameters": {"binary_data_size": rows.nbytes},
                }
            ],
            "parameters": {"binary_data_output": binary_output},
        }
    )
    return LENGTH.pack(len(header)) + header + rows.astype(np.float32).tobytes()


def answer_scores(frame: str | bytes) -> tuple[str, np.ndarray]:
    """(id, scores) of a successful answer, text (JSON) or binary (length, JSON header, tensor bytes)."""
    if isinstance(frame, str):
        answer = json.loads(frame)
        assert "error" not in answer, answer
        out = {o["name"]: o for o in answer["outputs"]}["scores"]
        return answer["id"], np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
    (length,) = LENGTH.unpack_from(frame)
    header = json.loads(frame[4 : 4 + length])
    (out,) = header["outputs"]
    data = frame[4 + length : 4 + length + out["parameters"]["binary_data_size"]]
    return header["id"], np.frombuffer(data, dtype=np.float32).reshape(out["shape"])


async def recv_json(ws: ClientConnection) -> dict:
    frame = await asyncio.wait_for(ws.recv(), DEADLINE_S)
    assert isinstance(frame, str), frame
    return json.loads(frame)


async def closed_with(ws: ClientConnection) -> tuple[int, list[dict]]:
    """Read until the server closes: (its close code, the frames it sent before)."""
    frames = []
    try:
        while True:
            frames.append(await recv_json(ws))
    except ConnectionClosed as closed:
        assert closed.rcvd is not None, "closed without a close frame"
        return closed.rcvd.code, frames


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def requests_counted(model: str, status: str) -> float:
    return REGISTRY.get_sample_value("ferry_requests_total", {"model": model, "version": "1", "status": status}) or 0.0


# -- answers -------------------------------------------------------------------------------------


def test_answers_by_id_with_and_without_the_binary_layout(digits_server, digits_samples, model_files) -> None:  # noqa: ANN001
    x, y = digits_samples
    n = 60
    # given what REST answers for the same rows
    expected = np.concatenate(
        [scores(infer(digits_server, "digits", digits_request(x[4 * i : 4 * i + 4]))) for i in range(n)]
    )
    before = requests_counted("digits", "200")

    async def run() -> dict[str, np.ndarray]:
        async with keyed(digits_server) as ws:
            assert ws.subprotocol == "ferry.v2"  # never the key
            # when JSON, binary-in/JSON-out and binary-in/binary-out messages go out without waiting
            for i in range(n):
                rows = x[4 * i : 4 * i + 4]
                kind = i % 3
                if kind == 0:
                    await ws.send(json_message(f"r{i}", rows))
                else:
                    await ws.send(binary_message(f"r{i}", rows, binary_output=kind == 2))
            answers = {}
            for _ in range(n):
                frame = await asyncio.wait_for(ws.recv(), DEADLINE_S)
                # then a binary answer comes exactly for the messages that asked for binary output
                rid, got = answer_scores(frame)
                assert isinstance(frame, bytes) == (int(rid[1:]) % 3 == 2), rid
                answers[rid] = got
            return answers

    answers = asyncio.run(run())
    # then every id is answered once, with REST's scores for its rows
    assert sorted(answers) == sorted(f"r{i}" for i in range(n))
    got = np.concatenate([answers[f"r{i}"] for i in range(n)])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # and as accurate as the model is
    accuracy = float((got.argmax(axis=1) == y[: 4 * n]).mean())
    assert accuracy >= model_files.digits_accuracy - 0.05, accuracy
    # and they were counted as REST's are: the same path
    assert requests_counted("digits", "200") - before == n


def test_first_message_key_and_answers_out_of_order(transactional_db, model_files, digits_samples, request) -> None:  # noqa: ANN001
    x, y = digits_samples
    # given a model whose batching window is 2 s long and whose batch is not full with one request
    register(model_files.digits, "held", **HELD)
    server = request.getfixturevalue("live_server")
    plane = server.plane()

    async def run() -> list[dict]:
        async with connect(url(server, "held"), compression=None) as ws:
            # when the key comes in the first message
            await ws.send(orjson.dumps({"authorization": f"Bearer {server.key}"}).decode())
            # and a request waits in the window while a second, malformed one follows it
            await ws.send(json_message("slow", x[:1]))
            await eventually(lambda: plane.node.queue_depth("held:1") == 1, "the first request in the queue")
            await ws.send(orjson.dumps({"id": "bad", "inputs": [{"name": "input", "datatype": "FP32"}]}).decode())
            await ws.send(orjson.dumps({"inputs": []}).decode())  # no id
            await ws.send(json_message("slow", x[1:2]))  # an id already in flight
            return [await recv_json(ws) for _ in range(4)]

    *refused, third = asyncio.run(run())
    # then the later ones are answered first, each by its id, with its status and OIP's error shape
    by_status = {(f["id"], f["status"]): f["error"] for f in refused}
    assert set(by_status) == {("bad", 400), (None, 400), ("slow", 409)}, refused
    assert "'id'" in by_status[(None, 400)] and "already in flight" in by_status[("slow", 409)]
    assert third["id"] == "slow" and int(np.argmax(third["outputs"][0]["data"])) == y[0], third


# -- bounds --------------------------------------------------------------------------------------


def test_a_sender_faster_than_its_reader_is_slowed(
    transactional_db, model_files, digits_samples, request, settings
) -> None:  # noqa: ANN001
    x, _ = digits_samples
    rows = np.resize(x, (256, 64)).astype(np.float32)
    # given a wide model whose batches wait 50 ms for more rows (a batch holds eight messages, so the four a
    # connection may have in flight never fill one: each waits out the window, and a fifth, sent meanwhile,
    # finds the connection at its bound however fast the model computes), and connections bounded at 4 messages
    # and 300 KiB in flight
    register(model_files.digits, "wide", max_batch_size=2048, max_queue_delay_ms=50)
    server = request.getfixturevalue("live_server")
    settings.FERRY_WS_MAX_IN_FLIGHT = 4
    settings.FERRY_WS_MAX_IN_FLIGHT_BYTES = 300 * 1024
    n = 300  # of 64 KiB each: more than the socket buffers on both sides hold
    expected = scores(infer(server, "wide", digits_request(rows)))
    websocket.STATS.peak_in_flight = websocket.STATS.peak_held_bytes = 0
    taken_before = REGISTRY.get_sample_value("ferry_ws_messages_total", {"frame": "binary"}) or 0.0

    async def run() -> tuple[float, int, dict]:
        # a client with small socket buffers that sends without reading
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
        async with keyed(server, model="wide", sock=sock, max_size=2**24) as ws:
            sent = 0

            async def sender() -> None:
                nonlocal sent
                for i in range(n):
                    await ws.send(binary_message(f"m{i}", rows, binary_output=True))
                    sent += 1

            sending = asyncio.create_task(sender())
            # when it has sent what it can: its own writes back up (the server stopped reading it)
            await eventually(
                lambda: sending.done() or ws.transport.get_write_buffer_size() > 0, "the client's writes backing up"
            )
            assert not sending.done(), "every message went out while the client read nothing"
            taken = (REGISTRY.get_sample_value("ferry_ws_messages_total", {"frame": "binary"}) or 0.0) - taken_before
            blocked_at = sent
            # and then it reads: every message is answered, by its id
            answers = {}
            for _ in range(n):
                rid, got = answer_scores(await asyncio.wait_for(ws.recv(), DEADLINE_S))
                answers[rid] = got
            await sending
            return taken, blocked_at, answers

    taken, blocked_at, answers = asyncio.run(run())
    # then the server took only part of what was sent before the sender was held
    assert taken < n and blocked_at < n, (taken, blocked_at)
    # and held no more than its bounds: 4 messages, and 300 KiB plus the one message it waits with
    assert websocket.STATS.peak_in_flight <= 4, websocket.STATS
    assert websocket.STATS.peak_held_bytes <= 300 * 1024, websocket.STATS
    assert websocket.STATS.read_stalls > 0
    assert sorted(answers) == sorted(f"m{i}" for i in range(n))
    for got in answers.values():
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_in_flight_bound_holds_one_at_a_time(transactional_db, model_files, digits_samples, request, settings) -> None:  # noqa: ANN001
    x, y = digits_samples
    # given one message in flight per connection, and a model that holds a request 2 s in its window
    register(model_files.digits, "held", **HELD)
    server = request.getfixturevalue("live_server")
    settings.FERRY_WS_MAX_IN_FLIGHT = 1
    plane = server.plane()
    depths = []

    async def run() -> list[str]:
        async with keyed(server, model="held") as ws:
            # when three requests go at once
            for i in range(3):
                await ws.send(json_message(f"q{i}", x[i : i + 1]))
            order = []
            for _ in range(3):
                depths.append(plane.node.queue_depth("held:1"))
                rid, got = answer_scores(await asyncio.wait_for(ws.recv(), DEADLINE_S))
                assert int(got.argmax()) == y[int(rid[1:])]
                order.append(rid)
            return order

    # then they are taken one at a time (the queue, which holds one, never refuses one) and answered in order
    assert asyncio.run(run()) == ["q0", "q1", "q2"]
    assert max(depths) <= 1


def test_message_size_and_idle(digits_server, digits_samples, settings) -> None:  # noqa: ANN001
    x, _ = digits_samples

    async def too_big_for_the_server() -> int:
        # a message over FERRY_MAX_INFER_BODY_BYTES as the server started: the socket refuses it unread
        async with keyed(digits_server) as ws:
            try:
                await ws.send(b"\0" * (8 * 1024 * 1024 + 5))
            except ConnectionClosed as closed:  # the refusal can come while the message is still going out
                assert closed.rcvd is not None
                return closed.rcvd.code
            code, _ = await closed_with(ws)
            return code

    assert asyncio.run(too_big_for_the_server()) == 1009

    async def per_message() -> tuple[int, list[dict]]:
        async with keyed(digits_server) as ws:
            await ws.send(json_message("big", x[:1], pad="x" * 70_000))  # over the bound this connection has
            return await closed_with(ws)

    settings.FERRY_MAX_INFER_BODY_BYTES = 64 * 1024
    code, frames = asyncio.run(per_message())
    # then a message over the bound the connection has, read all the same (the server's layer was started with
    # the larger one), is refused as the layer refuses one: close 1009, after an error frame with its id
    assert code == 1009 and [(f["id"], f["status"]) for f in frames] == [("big", 413)], (code, frames)

    async def idle() -> tuple[int, list[dict]]:
        async with keyed(digits_server) as ws:
            return await closed_with(ws)

    settings.FERRY_WS_IDLE_S = 1
    code, frames = asyncio.run(idle())
    # and a connection that sends nothing is closed 4408, saying why
    assert code == 4408 and frames[0]["status"] == 408 and "idle" in frames[0]["error"], (code, frames)


# -- refusals ------------------------------------------------------------------------------------


def handshake_refusal(coro_factory: Callable[[], connect]) -> tuple[int, dict]:
    async def run() -> tuple[int, dict]:
        with pytest.raises(InvalidStatus) as refused:
            async with coro_factory():
                pass
        response = refused.value.response
        return response.status_code, json.loads(response.body)

    return asyncio.run(run())


def test_bad_keys_foreign_models_and_keys_in_the_url_are_refused(digits_server, model_files) -> None:  # noqa: ANN001
    # given a private model of another tenant, and keys of this one
    other = tenant("other")
    register(model_files.digits, "theirs", owner=other, visibility="private")
    digits_server.refresh()

    # a bad key in the header: 401 at the handshake
    status, body = handshake_refusal(lambda: keyed(digits_server, key="fy_nope_nope"))
    assert status == 401 and "error" in body
    # a key without the infer scope: 403
    manager = mint_key(scopes=("manage",))
    status, body = handshake_refusal(lambda: keyed(digits_server, key=manager))
    assert status == 403 and "infer" in body["error"]
    # a key in the query string: refused, whatever it is
    status, body = handshake_refusal(
        lambda: connect(url(digits_server, query=f"?key={digits_server.key}"), compression=None)
    )
    assert status == 400 and "never in the URL" in body["error"]
    # a foreign tenant's private model: refused as an unknown one, revealing nothing
    status, theirs = handshake_refusal(lambda: keyed(digits_server, model="theirs"))
    status_unknown, unknown = handshake_refusal(lambda: keyed(digits_server, model="nothing-here"))
    assert status == status_unknown == 404
    assert theirs["error"].replace("theirs", "X") == unknown["error"].replace("nothing-here", "X")

    async def first_message(key: str, model: str = "digits") -> tuple[int, list[dict]]:
        async with connect(url(digits_server, model), compression=None) as ws:
            await ws.send(orjson.dumps({"authorization": f"Bearer {key}"}).decode())
            return await closed_with(ws)

    # the same in the first message: an error frame, then a close with 4000 + the status
    code, frames = asyncio.run(first_message("fy_nope_nope"))
    assert code == 4401 and frames[-1]["status"] == 401
    code, frames = asyncio.run(first_message(digits_server.key, "theirs"))
    assert code == 4404 and frames[-1]["status"] == 404 and "theirs" in frames[-1]["error"]

    async def not_a_key() -> tuple[int, list[dict]]:
        async with connect(url(digits_server), compression=None) as ws:
            await ws.send(json_message("r", np.zeros((1, 64), np.float32)))
            return await closed_with(ws)

    code, frames = asyncio.run(not_a_key())
    assert code == 4400 and "authorization" in frames[-1]["error"]

    # and no Origin check: an API client with a key is served from any page (docs/websocket.md)
    async def from_elsewhere() -> str:
        async with keyed(digits_server, origin="https://elsewhere.example") as ws:
            await ws.send(json_message("o", np.zeros((1, 64), np.float32)))
            return answer_scores(await asyncio.wait_for(ws.recv(), DEADLINE_S))[0]

    assert asyncio.run(from_elsewhere()) == "o"


def test_a_key_revoked_mid_connection_is_refused_at_its_next_message(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, y = digits_samples
    key = mint_key()
    row = ApiKey.objects.get(prefix=keys.split(key)[0])
    digits_server.refresh()

    async def run() -> tuple[str, int, list[dict]]:
        async with keyed(digits_server, key=key) as ws:
            # given an open connection whose key answers
            await ws.send(json_message("before", x[:1]))
            rid, got = answer_scores(await asyncio.wait_for(ws.recv(), DEADLINE_S))
            assert int(got.argmax()) == y[0]
            # when the key is revoked and the server has the new snapshot
            await asyncio.to_thread(revoke_key, key=row)
            await asyncio.to_thread(digits_server.refresh)
            await ws.send(json_message("after", x[:1]))
            code, frames = await closed_with(ws)
            return rid, code, frames

    rid, code, frames = asyncio.run(run())
    # then its next message is refused 401 by id, and the connection closed 4401
    assert rid == "before"
    assert frames[0]["id"] == "after" and frames[0]["status"] == 401, frames
    assert code == 4401


# -- a client that stops reading, and the first message's bound ----------------------------------


def raw_socket(server, model: str = "digits", key: str | None = None, rcvbuf: int = 0) -> socket.socket:  # noqa: ANN001
    """A connection upgraded by hand (the key in Sec-WebSocket-Protocol when given), its 101 read; nothing
    after it is read unless the test reads it."""
    sock = socket.socket()
    if rcvbuf:  # before connecting, so that the window it offers is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(DEADLINE_S)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(upgrade(server, model, key))
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)  # one byte at a time: nothing past the handshake's answer is taken off the socket
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def upgrade(server, model: str, key: str | None) -> bytes:  # noqa: ANN001
    protocol = f"Sec-WebSocket-Protocol: ferry.v2, ferry.key.{key}\r\n" if key else ""
    return (
        f"GET /ws/v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"{protocol}\r\n"
    ).encode()


def client_frame(data: bytes | str) -> bytes:
    """One masked client frame, text for a str."""
    if isinstance(data, str):
        return Frame(Opcode.TEXT, data.encode()).serialize(mask=True)
    return Frame(Opcode.BINARY, data).serialize(mask=True)


def closed_by_server(sock: socket.socket) -> bool:
    """Read (and drop) what the server sent until it closes: True once it has."""
    try:
        while sock.recv(1 << 20):
            pass
    except ConnectionResetError:
        pass
    return True


def closes(code: str) -> float:
    return REGISTRY.get_sample_value("ferry_ws_closes_total", {"code": code}) or 0.0


def test_a_client_that_stops_reading_holds_its_answers_bytes_and_is_dropped(
    transactional_db, model_files, digits_samples, request, settings
) -> None:  # noqa: ANN001
    x, _ = digits_samples
    rows = np.resize(x, (2048, 64)).astype(np.float32)  # 512 KiB a request, some 200 KB of JSON an answer
    # given a process whose budget of body bytes holds four such requests, connections of four messages in
    # flight, and sends that may wait 3 s for the socket to take them
    register(model_files.digits, "wide", max_batch_size=2048, max_queue_delay_ms=1)
    server = request.getfixturevalue("live_server")
    settings.FERRY_MAX_INFLIGHT_BODY_BYTES = 4 * (rows.nbytes + 1024)
    settings.FERRY_WS_MAX_IN_FLIGHT = 4
    settings.FERRY_BODY_TIMEOUT_S = 3
    connections, dropped = websocket.STATS.connections, closes("1006")

    # when a client sends requests and reads nothing of their answers (its receive buffer small, so that the
    # answers back up into the server's socket and then its sends)
    sock = raw_socket(server, "wide", server.key, rcvbuf=4096)

    def send_until_refused() -> None:
        try:
            for i in range(200):
                sock.sendall(client_frame(binary_message(f"m{i}", rows, binary_output=False)))
        except OSError:
            pass  # dropped

    # (an answer of these rows, as REST writes it; the socket's carries its id more)
    answer = len(infer(server, "wide", digits_request(rows)).body) + len(b'"id":"m0",')
    sender = threading.Thread(target=send_until_refused, daemon=True)
    sender.start()
    # then its answers wait on the socket, four messages in flight, holding their answers' bytes (on the
    # connection and in the process's budget) in place of their requests'
    wait_until(
        lambda: (
            websocket.STATS.in_flight == 4
            and abs(websocket.STATS.held_bytes - 4 * answer) < 4 * 8  # ids of 2 to 4 characters
            and frontdoor.held() == websocket.STATS.held_bytes
        ),
        "four answers waiting on a client that reads nothing, held in place of their requests",
    )
    # and REST is served meanwhile: the budget holds what they take, with room for more
    assert infer(server, "wide", digits_request(x[:1])).status == 200
    # and the connection is dropped once a send has waited 3 s: its messages end, the server forgets it
    wait_until(
        lambda: websocket.STATS.connections == connections and websocket.STATS.in_flight == 0,
        "the stalled connection dropped",
        DEADLINE_S,
    )
    assert websocket.STATS.held_bytes == 0 and frontdoor.held() == 0  # and every byte it held is given back
    assert closes("1006") - dropped == 1
    sock.settimeout(DEADLINE_S)
    assert closed_by_server(sock)
    sock.close()
    sender.join(DEADLINE_S)


def test_the_first_message_is_bounded_before_it_is_read(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples

    async def too_big_a_key_message() -> int:
        async with connect(url(digits_server), compression=None) as ws:
            await ws.send("{" + " " * 5000 + "}")
            code, _ = await closed_with(ws)
            return code

    # a first message over FIRST_MESSAGE_BYTES where the key is to come in it: refused unread (1009), not
    # read whole and then refused
    assert asyncio.run(too_big_a_key_message()) == 1009

    # while a request larger than that, right behind the key in the same write, is taken and answered
    big = json_message("big", x[:16])  # digits takes 16 rows at most
    assert len(big) > 4096
    sock = raw_socket(digits_server)
    sock.sendall(
        client_frame(orjson.dumps({"authorization": f"Bearer {digits_server.key}"}).decode()) + client_frame(big)
    )
    reply = b""
    while b'"outputs"' not in reply and b'"error"' not in reply:
        chunk = sock.recv(1 << 16)
        assert chunk, reply
        reply += chunk
    assert b'"id":"big"' in reply and b'"outputs"' in reply, reply[:300]
    sock.close()


def test_frames_before_the_accept_are_bounded_as_a_first_message() -> None:
    request = (
        b"GET /ws/v2/models/digits/infer HTTP/1.1\r\nHost: h\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    big = client_frame(b"\0" * (FIRST_MESSAGE_BYTES + 1))
    # a frame the client sends before the server has answered its handshake (which RFC 6455 forbids), over
    # FIRST_MESSAGE_BYTES: refused on its header, whatever the connection's bound
    early = _FirstMessageBound(max_size=8 * 1024 * 1024)
    early.receive_data(request + big[:14])
    assert isinstance(early.parser_exc, PayloadTooBig), early.parser_exc
    # once the application accepts, the connection's bound applies
    accepted = _FirstMessageBound(max_size=8 * 1024 * 1024)
    accepted.receive_data(request)
    accepted.accept_messages()
    accepted.receive_data(big)
    assert accepted.parser_exc is None and len(accepted.events_received()) == 2  # the request, the message
    # or, where it asked, after the first message: that one is held to the bound, the next is not
    kept = _FirstMessageBound(max_size=8 * 1024 * 1024)
    kept.keep_first = True
    kept.receive_data(request)
    kept.accept_messages()
    kept.receive_data(client_frame("{}") + big)
    assert kept.parser_exc is None and len(kept.events_received()) == 3
    refused = _FirstMessageBound(max_size=8 * 1024 * 1024)
    refused.keep_first = True
    refused.receive_data(request)
    refused.accept_messages()
    refused.receive_data(big[:14])
    assert isinstance(refused.parser_exc, PayloadTooBig), refused.parser_exc


def test_a_message_with_tritonclients_nan_and_infinity_tokens_is_read_as_rest_reads_it() -> None:
    # python-rapidjson (tritonclient's JSON) writes non-finite floats as these tokens; orjson alone refuses them.
    message = (
        b'{"id": "n1", "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2], "data": [NaN, -Infinity]}]}'
    )
    rid, body, length = websocket.parse_message(message, binary=False)
    assert (rid, body, length) == ("n1", message, None)
    with pytest.raises(websocket.BadMessage, match="malformed JSON"):
        websocket.parse_message(b'{"id": "n2", "inputs": [', binary=False)
