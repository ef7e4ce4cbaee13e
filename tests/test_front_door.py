"""The front door (serving.dataplane.http.frontdoor) over real sockets against a live server: body bounds before
Django reads a byte, the whole-request read deadline, the in-flight body budget, and the JSON answer
at the connection limit.

No timing assertions: every wait has a generous upper bound that only stops a hang. The live server
is asked for by name (request.getfixturevalue) as elsewhere: pytest-django treats a `live_server`
argument as its own.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import orjson
import pytest
from django.contrib.auth.models import User

from serving.dataplane.http.frontdoor import GATE, _ReceivedAt
from tenants.models import Membership, Role, Tenant
from tests.conftest import DIGITS_IO, register
from tests.test_inference_http import (
    Resp,
    assert_error,
    call,
    digits_request,
    grew,
    infer,
    metrics,
    sample,
    scores,
    wait_until,
)

TIMEOUT = 60  # seconds one exchange may take before the test fails instead of hanging
MiB = 1024 * 1024
UPLOAD = "/api/models/{name}/versions/"


# -- helpers -------------------------------------------------------------------------------------


@dataclass
class DjangoSeen:
    """What reached Django: body bytes its handler received per path, and the requests it went on to
    serve (request_started fires once the body is read, before middleware and views)."""

    received: dict[str, int] = field(default_factory=dict)
    started: list[dict] = field(default_factory=list)

    def started_paths(self) -> list[str]:
        return [scope["path"] for scope in self.started]


@pytest.fixture
def django_seen(monkeypatch) -> DjangoSeen:  # noqa: ANN001
    from django.core.handlers.asgi import ASGIHandler
    from django.core.signals import request_started

    seen = DjangoSeen()
    original = ASGIHandler.handle

    async def handle(self, scope, receive, send):  # noqa: ANN001, ANN202
        path = scope["path"]
        seen.received.setdefault(path, 0)

        async def counted():  # noqa: ANN202
            message = await receive()
            seen.received[path] += len(message.get("body", b""))
            return message

        await original(self, scope, counted, send)

    def on_started(sender, scope=None, **kwargs) -> None:  # noqa: ANN001
        if scope is not None:
            seen.started.append(scope)

    monkeypatch.setattr(ASGIHandler, "handle", handle)
    request_started.connect(on_started, weak=False, dispatch_uid="test_front_door")
    yield seen
    request_started.disconnect(dispatch_uid="test_front_door")


def read_response(sock: socket.socket) -> Resp:
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return Resp(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())


def exchange(port: int, head: bytes, chunks: Iterable[bytes] = ()) -> Resp:
    """Send a head and body chunks on a fresh connection, then read the answer. The server may answer
    and close before the body is all sent: the answer is still there to read."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        try:
            sock.sendall(head)
            for chunk in chunks:
                sock.sendall(chunk)
        except OSError:
            pass
        return read_response(sock)


def head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunked(data: bytes, size: int = 64 * 1024) -> Iterable[bytes]:
    for start in range(0, len(data), size):
        part = data[start : start + size]
        yield b"%x\r\n" % len(part) + part + b"\r\n"
    yield b"0\r\n\r\n"


def multipart(artifact: bytes, **fields: str) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="artifact"; filename="model.pt"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n".encode()
        + artifact
        + b"\r\n"
    )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def upload_form(artifact: bytes) -> tuple[bytes, str]:
    return multipart(
        artifact,
        format="torchscript",
        inputs=json.dumps(DIGITS_IO["inputs"]),
        outputs=json.dumps(DIGITS_IO["outputs"]),
        max_batch_size="2",
    )


def trickle(port: int, data: bytes, prefix: bytes = b"", every: float = 0.1, give_up_s: float = 30.0):  # noqa: ANN201
    """Send `prefix` at once, then `data` one byte per `every` seconds, reading whatever comes back.
    Returns (reply, bytes of `data` sent, whether the server closed the connection)."""
    sent, reply, closed = 0, b"", False
    give_up = time.monotonic() + give_up_s
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(prefix)
        try:
            while time.monotonic() < give_up:
                readable, _, _ = select.select([sock], [], [], every)
                if readable:
                    chunk = sock.recv(65536)
                    if not chunk:
                        closed = True
                        break
                    reply += chunk
                elif sent < len(data):
                    sock.sendall(data[sent : sent + 1])
                    sent += 1
        except (ConnectionResetError, BrokenPipeError):
            closed = True
    return reply, sent, closed


def parse(reply: bytes) -> Resp:
    assert reply, "the server sent no answer"
    head_bytes, _, body = reply.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return Resp(int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body)


def make_user(name: str, role: str | None, password: str = "not-a-secret-1") -> User:
    tenant, _ = Tenant.objects.get_or_create(name="Acme", slug="acme")
    user = User.objects.create_user(name, f"{name}@example.org", password)
    if role is not None:
        Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


def credentials(user: User, how: str) -> dict[str, str]:
    """Headers that authenticate `user` the way a real client would: a session (with the CSRF pair
    DRF asks of session users) or HTTP Basic."""
    import base64

    from django.conf import settings
    from django.test import Client

    if how == "basic":
        token = base64.b64encode(f"{user.username}:not-a-secret-1".encode()).decode()
        return {"Authorization": f"Basic {token}"}
    client = Client()
    client.force_login(user)
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    csrf = "a" * 32
    return {
        "Cookie": f"{settings.SESSION_COOKIE_NAME}={session}; {settings.CSRF_COOKIE_NAME}={csrf}",
        "X-CSRFToken": csrf,
    }


@pytest.fixture
def fast_hashing(settings) -> None:  # noqa: ANN001
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


# -- body bounds (Django side) -------------------------------------------------------------------


def test_oversized_login_post_is_413_before_django_reads_it(transactional_db, django_seen, request) -> None:  # noqa: ANN001
    server = request.getfixturevalue("live_server")
    # given an anonymous client posting a 5 MiB body to the login form
    body = b"username=x&password=" + b"y" * (5 * MiB)
    resp = exchange(
        server.port,
        head(
            "POST", "/login/", {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": str(len(body))}
        ),
        [body],
    )
    # then it is refused 413 as JSON naming the bound
    assert_error(resp, 413, str(1 * MiB))
    # and Django never received a byte of it, let alone spooled it or ran a view
    assert "/login/" not in django_seen.received
    assert "/login/" not in django_seen.started_paths()
    # while a small form post still reaches Django (which answers it: here a CSRF failure)
    small = exchange(
        server.port,
        head("POST", "/login/", {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": "3"}),
        [b"a=b"],
    )
    assert small.status == 403
    assert django_seen.received["/login/"] == 3


def test_chunked_body_past_the_bound_is_413_and_never_served(transactional_db, django_seen, request) -> None:  # noqa: ANN001
    server = request.getfixturevalue("live_server")
    # given a 3 MiB body sent chunked, with no Content-Length to refuse it by
    body = b"a=" + b"b" * (3 * MiB)
    resp = exchange(
        server.port,
        head("POST", "/login/", {"Content-Type": "application/x-www-form-urlencoded", "Transfer-Encoding": "chunked"}),
        chunked(body),
    )
    # when it streams past the 1 MiB bound / then 413 as JSON
    assert_error(resp, 413, "exceeds")
    # and Django got no more than the bound before being told the client was gone, and served nothing
    assert django_seen.received.get("/login/", 0) <= 1 * MiB
    assert "/login/" not in django_seen.started_paths()


def test_anonymous_upload_past_the_form_bound_is_413_unread(transactional_db, django_seen, request) -> None:  # noqa: ANN001
    server = request.getfixturevalue("live_server")
    from serving.models import Model

    # given an anonymous multipart upload of 2 MiB, declared and then chunked
    form, content_type = upload_form(b"\0" * (2 * MiB))
    path = UPLOAD.format(name="digits")
    declared = exchange(
        server.port, head("POST", path, {"Content-Type": content_type, "Content-Length": str(len(form))}), [form]
    )
    streamed = exchange(
        server.port, head("POST", path, {"Content-Type": content_type, "Transfer-Encoding": "chunked"}), chunked(form)
    )
    # then both are refused 413, saying what a bigger upload needs
    for resp in (declared, streamed):
        assert_error(resp, 413, "engineer")
    # and Django served neither, nor read more than the form bound of either
    assert path not in django_seen.started_paths()
    assert django_seen.received.get(path, 0) <= 1 * MiB
    assert not Model.objects.exists()


@pytest.mark.parametrize("how", ["session", "basic"])
def test_engineer_upload_past_the_form_bound_is_served(  # noqa: ANN001
    transactional_db, fast_hashing, settings, model_files, django_seen, request, how: str
) -> None:
    # given a form bound below the artifact's size, an engineer and a viewer
    artifact = model_files.digits.read_bytes()
    settings.FERRY_MAX_FORM_BODY_BYTES = 4096
    assert len(artifact) > 4096
    engineer, viewer = make_user("bob", Role.ENGINEER), make_user("charlie", Role.VIEWER)
    server = request.getfixturevalue("live_server")
    form, content_type = upload_form(artifact)
    path = UPLOAD.format(name="digits")

    def post(user: User) -> Resp:
        return exchange(
            server.port,
            head(
                "POST", path, {"Content-Type": content_type, "Content-Length": str(len(form)), **credentials(user, how)}
            ),
            [form],
        )

    # when the viewer uploads it / then 413 before Django reads it: the bigger bound is an engineer's
    assert_error(post(viewer), 413, "engineer")
    assert path not in django_seen.received
    # when the engineer uploads it / then it is created (and validated: the model is real)
    created = post(engineer)
    assert created.status == 201, created.body
    assert created.json()["version"] == 1
    assert django_seen.received[path] == len(form)


def test_engineer_upload_past_the_artifact_limit_is_413(  # noqa: ANN001
    transactional_db, fast_hashing, settings, django_seen, request
) -> None:
    from serving.api.views import FORM_OVERHEAD

    # given a small artifact limit and an engineer
    settings.FERRY_MAX_ARTIFACT_BYTES = 8192
    settings.FERRY_MAX_FORM_BODY_BYTES = 4096
    engineer = make_user("bob", Role.ENGINEER)
    server = request.getfixturevalue("live_server")
    form, content_type = upload_form(b"\0" * (8192 + FORM_OVERHEAD + 1024))
    path = UPLOAD.format(name="digits")
    auth = credentials(engineer, "basic")
    # when the engineer declares a bigger upload / then 413 at once, naming the artifact limit
    declared = exchange(
        server.port,
        head("POST", path, {"Content-Type": content_type, "Content-Length": str(len(form)), **auth}),
        [form],
    )
    assert_error(declared, 413, "artifact exceeds the 8192 byte limit")
    assert path not in django_seen.received
    # when it streams one chunked / then 413 once it passes the limit, and Django serves nothing
    streamed = exchange(
        server.port,
        head("POST", path, {"Content-Type": content_type, "Transfer-Encoding": "chunked", **auth}),
        chunked(form, 4096),
    )
    assert_error(streamed, 413, "artifact exceeds the 8192 byte limit")
    assert path not in django_seen.started_paths()
    assert django_seen.received.get(path, 0) <= 8192 + FORM_OVERHEAD


# -- the read deadline ---------------------------------------------------------------------------


def test_trickling_head_is_answered_408_and_closed(transactional_db, settings, request) -> None:  # noqa: ANN001
    server = request.getfixturevalue("live_server")
    # given a read deadline of 1 s and a client sending its request head one byte at a time
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    request_head = head("GET", "/login/", {"X-Padding": "p" * 200})
    reply, sent, closed = trickle(server.port, request_head)
    # then the server answers 408 as JSON before the head is complete, and closes the connection
    assert sent < len(request_head)
    assert_error(parse(reply), 408, "not received within 1 s")
    assert closed


def test_trickling_inference_body_is_answered_408(digits_server, settings) -> None:  # noqa: ANN001
    # given a read deadline of 1 s (the consumer's per-chunk timeout is 30 s and is reset by every byte)
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    body = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}]})
    prefix = head(
        "POST",
        "/v2/models/digits/infer",
        {
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Authorization": f"Bearer {digits_server.key}",
        },
    )
    # when the body comes one byte at a time
    reply, sent, closed = trickle(digits_server.port, body, prefix=prefix)
    # then 408 as JSON before the body is complete, and the connection is closed
    assert sent < len(body)
    assert_error(parse(reply), 408, "not received within 1 s")
    assert closed
    # and the server still serves
    assert infer(digits_server, "digits", body).status == 200


def test_silent_connection_is_closed(transactional_db, settings, request) -> None:  # noqa: ANN001
    server = request.getfixturevalue("live_server")
    # given a read deadline of 1 s / when a client connects and sends nothing
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as sock:
        # then the server closes the connection (no request began, so there is nothing to answer)
        try:
            data = sock.recv(1024)
        except ConnectionResetError:
            data = b""
    assert data == b""


@pytest.mark.parametrize("how", ["session", "basic"])
def test_engineer_upload_gets_the_upload_deadline(  # noqa: ANN001
    transactional_db, fast_hashing, settings, model_files, request, how: str
) -> None:
    # given a read deadline of 1 s, 60 s for an engineer's upload, an engineer and a viewer
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    settings.FERRY_UPLOAD_READ_TIMEOUT_S = 60
    engineer, viewer = make_user("bob", Role.ENGINEER), make_user("charlie", Role.VIEWER)
    server = request.getfixturevalue("live_server")
    form, content_type = upload_form(model_files.digits.read_bytes())
    path = UPLOAD.format(name="digits")

    def slow_post(user: User) -> Resp:
        def body() -> Iterable[bytes]:
            yield form[: len(form) // 2]
            time.sleep(2)  # past the 1 s deadline, well within the upload's
            yield form[len(form) // 2 :]

        return exchange(
            server.port,
            head(
                "POST", path, {"Content-Type": content_type, "Content-Length": str(len(form)), **credentials(user, how)}
            ),
            body(),
        )

    # when the engineer's upload takes longer than the plain deadline / then it is created
    created = slow_post(engineer)
    assert created.status == 201, created.body
    # when the viewer's does / then 408: the longer deadline is an engineer's
    assert_error(slow_post(viewer), 408, "not received within 1 s")


def test_deadline_bounds_reading_not_answering(transactional_db, settings, model_files, request) -> None:  # noqa: ANN001
    # given a read deadline of 1 s and a model whose batching window holds a lone request for 2 s
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    register(model_files.digits, "slow", max_batch_size=8, max_queue_delay_ms=2000, default_timeout_ms=20_000)
    server = request.getfixturevalue("live_server")
    zeros = np.zeros((1, 64), np.float32)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        # when a request is read at once but answered after the deadline / then it is answered 200
        for _ in range(2):
            conn.request(
                "POST",
                "/v2/models/slow/infer",
                body=orjson.dumps(digits_request(zeros)),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"},
            )
            resp = conn.getresponse()
            answer = Resp(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
            assert scores(answer).shape == (1, 10)
            # and the same connection serves the next request, however long after the first it comes
            time.sleep(1.5)
    finally:
        conn.close()


def test_busy_keep_alive_connection_outlives_the_deadline(transactional_db, settings, request) -> None:  # noqa: ANN001
    # given a read deadline of 1 s
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 1
    server = request.getfixturevalue("live_server")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        conn.request("GET", "/v2/health/live")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        # when one connection sends request after request for well over the deadline
        until = time.monotonic() + 2.5
        while time.monotonic() < until:
            conn.request("GET", "/v2/health/live")
            resp = conn.getresponse()
            resp.read()
            # then each is answered, on that same connection (each request has its own deadline)
            assert resp.status == 200
            assert conn.sock is sock
    finally:
        conn.close()


def test_first_byte_time_is_in_the_scope(transactional_db, django_seen, request) -> None:  # noqa: ANN001
    server = request.getfixturevalue("live_server")
    # when a request is served
    before = time.monotonic()
    assert call(server, "GET", "/login/").status == 200
    after = time.monotonic()
    # then its scope carries when its first byte was read, on the process's monotonic clock
    (scope,) = [s for s in django_seen.started if s["path"] == "/login/"]
    assert before - 0.005 <= scope["ferry.first_byte"] <= after  # the kernel stamps bytes to its tick (4 ms)


# -- the in-flight body budget and the connection limit -------------------------------------------


def test_body_budget_answers_503_then_recovers(digits_server, settings) -> None:  # noqa: ANN001
    # given a process budget of 256 KiB of request bodies
    settings.FERRY_MAX_INFLIGHT_BODY_BYTES = 256 * 1024
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 60
    good = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * 64}]})
    body = good[:-1] + b" " * (200 * 1024) + b"}"  # 200 KiB of valid JSON
    held = 150 * 1024

    def gauge() -> float:
        return sample(metrics(digits_server), "ferry_frontdoor_inflight_body_bytes") or 0.0

    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as first:
        # and a first request that has sent 150 KiB of its body and is still sending
        first.sendall(
            head(
                "POST",
                "/v2/models/digits/infer",
                {
                    "Content-Type": "application/json",
                    "Content-Length": str(len(body)),
                    "Authorization": f"Bearer {digits_server.key}",
                },
            )
        )
        first.sendall(body[:held])
        wait_until(lambda: gauge() >= held, "the server holding the first body", deadline_s=15)
        # when a second 200 KiB body arrives / then 503 as JSON with Retry-After
        second = infer(digits_server, "digits", body)
        assert_error(second, 503, "bytes of request bodies")
        assert int(second.headers["retry-after"]) >= 1
        # and once the refused request has let go of its bytes, the first, completed, is served
        wait_until(lambda: gauge() <= held, "the refused body released", deadline_s=15)
        first.sendall(body[held:])
        assert read_response(first).status == 200
    # and once it is done its bytes are released: the same body is served
    wait_until(lambda: gauge() == 0, "the budget released", deadline_s=15)
    assert infer(digits_server, "digits", body).status == 200


def test_connection_limit_answer_is_json(transactional_db, settings, request) -> None:  # noqa: ANN001
    # given a server limited to 2 concurrent connections, one of them held open (keep-alive)
    settings.FERRY_MAX_CONCURRENCY = 2
    server = request.getfixturevalue("live_server")
    held = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        held.request("GET", "/v2/health/live")
        resp = held.getresponse()
        resp.read()
        assert resp.status == 200
        # when another connection asks / then 503 as JSON with Retry-After, not uvicorn's plain text
        refused = call(server, "GET", "/v2", auth=None)
        assert_error(refused, 503, "limit")
        assert int(refused.headers["retry-after"]) >= 1
        # while the probes are answered past the limit: a busy process is neither restarted nor taken out of service
        for probe in ("/v2/health/live", "/v2/health/ready"):
            assert call(server, "GET", probe, auth=None).status == 200, probe
    finally:
        held.close()
    # and once the held connection is gone, requests are served again
    wait_until(lambda: call(server, "GET", "/v2", auth=None).status == 200, "a slot", deadline_s=15)


def test_bytes_that_are_not_http_get_a_json_400(transactional_db, request) -> None:  # noqa: ANN001
    # given a client that sends garbage instead of a request line / then a JSON 400 and a closed connection
    import json
    import socket

    server = request.getfixturevalue("live_server")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower()
    assert "malformed HTTP request" in json.loads(body)["error"]


def test_the_shed_gate_answers_inference_in_the_protocol_and_keeps_the_connection(  # noqa: ANN001
    digits_server, digits_samples, settings
) -> None:
    # The consumer's own saturation check (a late loop, or a request that waited past FERRY_MAX_FRONTEND_WAIT_MS
    # before its handler) is another refusal, tested in its own tests: on a loaded machine it refused the request
    # this test expects served once the gate opens (CI, 2026-12-03), so it is lifted here.
    settings.FERRY_MAX_LOOP_LAG_MS = settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    x, _ = digits_samples
    body = json.dumps(digits_request(x[:1]))
    before = metrics(digits_server)
    conn = http.client.HTTPConnection("127.0.0.1", digits_server.port, timeout=30)
    try:
        # given a gate refusing every inference request (as if the loop were far behind), and no lag ticker
        # steering it meanwhile: on a loaded machine a tick re-armed it after the reset below, and with the
        # draw held at 0 any share refused the request meant to be served
        GATE.tick = lambda lag, target: None  # type: ignore[method-assign]
        GATE.drop = 1.0
        GATE.draw = lambda: 0.0
        # when inference comes / then 503 JSON with Retry-After, and health is untouched
        conn.request(
            "POST",
            "/v2/models/digits/infer",
            body,
            {"Content-Type": "application/json", "Authorization": f"Bearer {digits_server.key}"},
        )
        refused = conn.getresponse()
        payload = json.loads(refused.read())
        assert refused.status == 503 and refused.getheader("retry-after") == "1"
        assert "server saturated" in payload["error"]
        conn.request("GET", "/v2/health/live")
        live = conn.getresponse()
        live.read()
        assert live.status == 200
        # and when the gate opens, the same keep-alive connection is served
        GATE.reset()
        conn.request(
            "POST",
            "/v2/models/digits/infer",
            body,
            {"Content-Type": "application/json", "Authorization": f"Bearer {digits_server.key}"},
        )
        served = conn.getresponse()
        answer = served.read()
        assert served.status == 200, answer
    finally:
        import random

        del GATE.tick  # the class's own again
        GATE.reset()
        GATE.draw = random.random
        conn.close()
    # and the refusal was counted under the version it would have gone to
    after = metrics(digits_server)
    assert grew(before, after, "ferry_requests_total", model="digits", version="1", status="503") == 1
    assert grew(before, after, "ferry_shed_total", model="digits", version="1", reason="frontend", tier="0") == 1


# -- the lean response head (LeanCycle) ----------------------------------------------------------


def raw_heads(reply: bytes) -> list[tuple[str, list[tuple[str, str]], bytes]]:
    """Split raw bytes holding consecutive responses (each with content-length) into (status line,
    header pairs in order, body)."""
    out = []
    while reply:
        head_bytes, _, rest = reply.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        pairs = [tuple(line.split(": ", 1)) for line in lines[1:]]
        length = int(dict((k.lower(), v) for k, v in pairs).get("content-length", "0"))
        out.append((lines[0], pairs, rest[:length]))
        reply = rest[length:]
    return out


def test_inference_answers_keep_their_heads_on_one_keep_alive_connection(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:1]))
    request = (
        head(
            "POST",
            "/v2/models/digits/infer",
            {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {digits_server.key}",
                "Content-Length": str(len(body)),
            },
        )
        + body
    )
    bad = (
        head(
            "POST",
            "/v2/models/digits/infer",
            {"Content-Type": "application/json", "Authorization": f"Bearer {digits_server.key}", "Content-Length": "2"},
        )
        + b"{]"
    )
    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as sock:
        # given three requests pipelined on one connection: served, malformed, served
        sock.sendall(request + bad + request)
        reply = b""
        while len(raw_heads(reply)) < 3 or len(raw_heads(reply)[-1][2]) < int(
            dict(raw_heads(reply)[-1][1])["content-length"]
        ):
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            reply += chunk
    answers = raw_heads(reply)
    # then each answer is a well-formed head: the status, uvicorn's date and server, every header once
    assert [a[0] for a in answers] == ["HTTP/1.1 200 OK", "HTTP/1.1 400 Bad Request", "HTTP/1.1 200 OK"]
    for _, pairs, payload in answers:
        names = [k.lower() for k, _ in pairs]
        assert len(names) == len(set(names)), names
        assert {"date", "server", "content-type", "content-length"} <= set(names)
        assert "connection" not in names  # kept alive
        assert int(dict(pairs)["content-length"]) == len(payload)
        orjson.loads(payload)
    served = dict(answers[0][1])
    assert served["x-ferry-model-version"] == "1" and "ratelimit-remaining" in served


def test_inference_answer_to_a_closing_client_says_connection_close(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:1]))
    reply = exchange(
        digits_server.port,
        head(
            "POST",
            "/v2/models/digits/infer",
            {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {digits_server.key}",
                "Content-Length": str(len(body)),
                "Connection": "close",
            },
        )
        + body,
    )
    assert reply.status == 200 and reply.headers["connection"] == "close"
    assert len(scores(reply)) == 1


def test_head_request_gets_the_head_without_a_body(digits_server) -> None:  # noqa: ANN001
    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as sock:
        sock.sendall(
            head("HEAD", "/v2/models/digits/infer", {"Authorization": f"Bearer {digits_server.key}"})
            + head("GET", "/v2/health/live", {})
        )
        reply = b""
        while b"HTTP/1.1 200" not in reply:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the connection"
            reply += chunk
    first, _, rest = reply.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 405")
    assert rest.startswith(b"HTTP/1.1 200")  # no body between the two heads


def test_render_head_refuses_values_that_would_split_the_head() -> None:
    from serving.dataplane.http.frontdoor import render_head

    assert render_head([(b"a", b"1"), (b"b", b"two")]) == b"a: 1\r\nb: two\r\n"
    for value in (b"x\r\nset-cookie: y", b"x\ny", b"x\0y"):
        with pytest.raises(ValueError):
            render_head([(b"x-ferry-fallback-from", value)])


# -- the inference lane (frontdoor.Lane): inference POSTs answered by the protocol without ASGI --------------


def _infer_head(key: str, body: bytes, path: str = "/v2/models/digits/infer", **extra: str) -> bytes:
    return head(
        "POST",
        path,
        {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {key}",
            "Content-Length": str(len(body)),
            **extra,
        },
    )


def _read_answers(sock: socket.socket, count: int) -> list[tuple[str, list[tuple[str, str]], bytes]]:
    reply = b""
    while True:
        answers = raw_heads(reply) if reply.count(b"\r\n\r\n") >= count else []
        if len(answers) >= count and len(answers[-1][2]) >= int(
            dict((k.lower(), v) for k, v in answers[-1][1]).get("content-length", "0")
        ):
            return answers
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        reply += chunk


def test_the_lane_answers_as_the_asgi_path_does(digits_server, digits_samples) -> None:  # noqa: ANN001
    # given one request sent by the lane and the same one with a query string (which takes the ASGI consumer)
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:2]))
    lane = exchange(digits_server.port, _infer_head(digits_server.key, body) + body)
    asgi = exchange(digits_server.port, _infer_head(digits_server.key, body, "/v2/models/digits/infer?via=asgi") + body)
    # then both are the same answer: status, headers (but the date and the quota's countdown) and body
    assert lane.status == asgi.status == 200
    varying = {"date", "ratelimit-remaining", "ratelimit-reset"}
    assert {k: v for k, v in lane.headers.items() if k not in varying} == {
        k: v for k, v in asgi.headers.items() if k not in varying
    }
    assert lane.body == asgi.body
    # and errors alike: a malformed body is the same 400 either way
    bad = b"{]"
    assert (
        exchange(digits_server.port, _infer_head(digits_server.key, bad) + bad).body
        == exchange(
            digits_server.port, _infer_head(digits_server.key, bad, "/v2/models/digits/infer?via=asgi") + bad
        ).body
    )


def test_lane_and_asgi_requests_pipelined_on_one_connection_answer_in_order(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:1]))
    infer_request = _infer_head(digits_server.key, body) + body
    metadata = head("GET", "/v2/models/digits", {"Authorization": f"Bearer {digits_server.key}"})
    live = head("GET", "/v2/health/live", {})
    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as sock:
        # given ASGI, lane, ASGI, lane, lane requests in one write
        sock.sendall(metadata + infer_request + live + infer_request + infer_request)
        answers = _read_answers(sock, 5)
    # then five answers, in the order asked
    assert [a[0] for a in answers] == ["HTTP/1.1 200 OK"] * 5
    assert orjson.loads(answers[0][2])["name"] == "digits"
    assert orjson.loads(answers[2][2]) == {"live": True}
    for i in (1, 3, 4):
        assert orjson.loads(answers[i][2])["model_name"] == "digits"


def test_a_lane_body_given_up_mid_way_gives_back_its_bytes(digits_server, digits_samples) -> None:  # noqa: ANN001
    # given a request whose body has partly arrived (held, and charged to the process's budget)
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:1]))[:-1] + b" " * (100 * 1024) + b"}"

    def gauge() -> float:
        return sample(metrics(digits_server), "ferry_frontdoor_inflight_body_bytes") or 0.0

    sock = socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT)
    sock.sendall(_infer_head(digits_server.key, body) + body[: 60 * 1024])
    wait_until(lambda: gauge() >= 60 * 1024, "the server holding the partial body", deadline_s=15)
    # when its client goes away / then the bytes are given back
    sock.close()
    wait_until(lambda: gauge() == 0, "the budget released", deadline_s=15)
    # and the server still serves
    assert infer(digits_server, "digits", body).status == 200


def test_a_lane_body_past_the_limit_is_413_at_once_and_closed(digits_server, settings) -> None:  # noqa: ANN001
    # given a 64 KiB inference body limit and a request declaring 1 MiB
    settings.FERRY_MAX_INFER_BODY_BYTES = 64 * 1024
    settings.FERRY_REQUEST_READ_TIMEOUT_S = 60
    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as sock:
        sock.sendall(_infer_head(digits_server.key, b"x" * MiB))
        # when 128 KiB of it has been sent (and no more)
        sock.sendall(b" " * (128 * 1024))
        # then 413 as JSON, before the rest, and the connection is closed
        answer = read_response(sock)
        assert_error(answer, 413, str(64 * 1024))
        assert answer.headers.get("connection") == "close", answer.headers
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass  # closed with the unread rest of the body still arriving: a reset is how TCP says it


def test_an_idle_keep_alive_connection_is_closed_and_a_busy_one_is_not(digits_server, digits_samples) -> None:  # noqa: ANN001
    # given uvicorn's keep-alive timeout (5 s) and two connections each answered once
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:1]))
    request = _infer_head(digits_server.key, body) + body
    idle = socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT)
    busy = socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT)
    try:
        for sock in (idle, busy):
            sock.sendall(request)
            assert _read_answers(sock, 1)[0][0] == "HTTP/1.1 200 OK"
        # when one sends a request every second for 8 s and the other nothing
        for _ in range(8):
            time.sleep(1)
            busy.sendall(request)
            assert _read_answers(busy, 1)[0][0] == "HTTP/1.1 200 OK"
        # then the idle one was closed by the server, and the busy one still serves
        assert idle.recv(1) == b""
        busy.sendall(request)
        assert _read_answers(busy, 1)[0][0] == "HTTP/1.1 200 OK"
    finally:
        idle.close()
        busy.close()


# -- the wait before a request is read -------------------------------------------------------------


@pytest.mark.parametrize("connection", ["new", "keep-alive"])
def test_a_request_that_waited_in_the_kernel_for_a_busy_loop_counts_that_wait(  # noqa: ANN001
    digits_server, digits_samples, settings, connection
) -> None:
    # given a server that judges a request by its own wait only (the loop's lag, which the stall below also
    # raises, is lifted, and the shed gate it steers held open)
    settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 150
    GATE.tick = lambda lag, target: None  # type: ignore[method-assign]
    GATE.reset()
    x, _ = digits_samples
    body = orjson.dumps(digits_request(x[:1]))
    request = _infer_head(digits_server.key, body) + body
    warm = socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT)
    try:
        warm.sendall(request)
        ((status, _, answer),) = _read_answers(warm, 1)
        assert " 200 " in status, answer  # the model is loaded: what follows waits on the loop only
        # when the server's event loop is stalled for 1.5 s (as a process behind on its work is) and a request
        # is sent meanwhile, on a new connection (it waits in the listen queue) or a keep-alive one (in its
        # socket's buffer)
        stalled = threading.Event()

        def stall() -> None:
            stalled.set()
            time.sleep(1.5)

        digits_server.plane().loop.call_soon_threadsafe(stall)
        assert stalled.wait(TIMEOUT)
        address = ("127.0.0.1", digits_server.port)
        sock = warm if connection == "keep-alive" else socket.create_connection(address, timeout=TIMEOUT)
        sent = time.monotonic()
        sock.sendall(request)
        ((status, headers, answer),) = _read_answers(sock, 1)
        took = time.monotonic() - sent
        if sock is not warm:
            sock.close()
    finally:
        del GATE.tick  # the class's own again
        GATE.reset()
        warm.close()
    # then the kernel's wait counted as the request's own: it is refused at once as having waited past the
    # front end's bound, instead of being admitted with a budget it had already spent (it was: 200 after
    # the stall, its time read from when the loop got to it), and by the protocol, as soon as its head was
    # read, not by a handler: a refusal that cost a task and a handler would crowd out the answers of a loop
    # that is behind
    assert " 503 " in status, answer
    payload = orjson.loads(answer)
    waited_ms = float(payload["error"].split(" waited ")[1].split(" ms")[0])
    assert "server saturated" in payload["error"] and dict(headers).get("retry-after") == "1"
    assert payload["error"].endswith("before it was read"), payload
    # its wait as the server measured it is the time it was held, within the kernel's tick (4 ms) and what
    # ran between the send and the stall's end on a busy machine
    assert 150 < waited_ms <= took * 1000 + 10, (waited_ms, took)


def test_the_kernel_says_how_long_it_held_a_connections_bytes() -> None:
    async def main() -> tuple[float, float]:
        # given a connection whose request reached the kernel 300 ms before this process took it
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        client = socket.create_connection(server.getsockname())
        sent = time.monotonic()
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.3)
        accepted, _ = server.accept()
        loop = asyncio.get_running_loop()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, accepted)
        try:
            # when it asks when the bytes came
            now = time.monotonic()
            return _ReceivedAt(transport)(now, 60.0) - sent, now - sent
        finally:
            transport.close()
            client.close()
            server.close()

    came, held = asyncio.run(main())
    # then the answer is when they were sent (to the kernel's tick, 4 ms at 250 Hz, and what a busy machine
    # delays the send by), not when they were read
    assert held >= 0.3 and -0.005 <= came < 0.1, (came, held)
