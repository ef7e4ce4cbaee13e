"""The Open Inference Protocol over raw HTTP (http.client; httpx is not installed) against a live Ferry.

Every failure must be a JSON {"error": "..."} with a meaningful status, never a 500, never a hang.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import orjson
import pytest
from django.db import OperationalError
from django.test import override_settings
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TOKENS_IO, register

TIMEOUT = 60  # seconds a single HTTP exchange may take before the test fails instead of hanging


# -- helpers -------------------------------------------------------------------------------------


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)

    @property
    def error(self) -> str:
        payload = self.json()
        assert isinstance(payload, dict) and set(payload) == {"error"}, payload
        assert isinstance(payload["error"], str) and payload["error"], payload
        return payload["error"]


SERVER_KEY = object()  # call()'s default: the live server's own key (infer + manage, the test tenant)


def auth_headers(server, auth: object = SERVER_KEY) -> dict[str, str]:  # noqa: ANN001
    """The Authorization header for `auth`: the server's key by default, a given token, or None for none."""
    token = getattr(server, "key", None) if auth is SERVER_KEY else auth
    return {"Authorization": f"Bearer {token}"} if token else {}


def call(
    server,
    method: str,
    path: str,
    body: bytes | dict | list | None = None,  # noqa: ANN001
    headers: dict[str, str] | None = None,
    auth: object = SERVER_KEY,
) -> Resp:
    if isinstance(body, dict | list):
        body = orjson.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        all_headers = {"Content-Type": "application/json", **auth_headers(server, auth), **(headers or {})}
        conn.request(method, path, body=body, headers=all_headers)
        resp = conn.getresponse()
        return Resp(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def infer(
    server,
    model: str,
    body: bytes | dict,
    headers: dict[str, str] | None = None,  # noqa: ANN001
    auth: object = SERVER_KEY,
) -> Resp:
    return call(server, "POST", f"/v2/models/{model}/infer", body, headers, auth)


def digits_request(rows: np.ndarray, **extra: object) -> dict:
    return {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": list(rows.shape), "data": rows.ravel().tolist()}],
        **extra,
    }


def tokens_request(tokens: list[list[int]]) -> dict:
    return {
        "inputs": [
            {
                "name": "tokens",
                "datatype": "INT64",
                "shape": [len(tokens), len(tokens[0])],
                "data": [t for row in tokens for t in row],
            }
        ]
    }


def scores(resp: Resp) -> np.ndarray:
    assert resp.status == 200, (resp.status, resp.body)
    out = {o["name"]: o for o in resp.json()["outputs"]}["scores"]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def assert_error(resp: Resp, status: int, *fragments: str) -> str:
    assert resp.status == status, (resp.status, resp.body)
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    message = resp.error
    for fragment in fragments:
        assert fragment.lower() in message.lower(), (fragment, message)
    return message


METRICS_TOKEN = "test-metrics-token"


def metrics(server) -> list:  # noqa: ANN001
    """The server's metrics as the operator's Prometheus reads them: with the metrics token, every label
    (tests/test_metrics_access.py checks what a caller without it sees)."""
    with override_settings(FERRY_METRICS_TOKEN=METRICS_TOKEN):
        resp = call(server, "GET", "/metrics", auth=METRICS_TOKEN)
    assert resp.status == 200
    return list(text_string_to_metric_families(resp.body.decode()))


def sample(families: list, name: str, **labels: str) -> float | None:
    for family in families:
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def grew(before: list, after: list, name: str, **labels: str) -> float:
    """How much a sample rose between two scrapes (metrics are process-wide: other tests add to them)."""
    return (sample(after, name, **labels) or 0.0) - (sample(before, name, **labels) or 0.0)


def has_line(text: str, name: str, **labels: str) -> bool:
    """A sample line `name{...}` of the exposition text whose labels are exactly `labels`."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            inside = line[len(name) + 1 : line.index("}")]
            if set(inside.split(",")) == want:
                return True
    return False


def wait_until(predicate: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Poll with a deadline (not a timing assertion: the deadline only stops a hang)."""
    deadline = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def in_background(fn: Callable[[], Resp]) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["resp"] = fn()
        except BaseException as exc:  # surfaced by the test thread
            box["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def joined(thread: threading.Thread, box: dict) -> Resp:
    thread.join(TIMEOUT)
    assert not thread.is_alive(), "background request hung"
    if "exc" in box:
        raise box["exc"]
    return box["resp"]


# -- health and metadata -------------------------------------------------------------------------


def test_health_and_server_metadata(digits_server) -> None:  # noqa: ANN001
    # given a running server / when asked for liveness, readiness and metadata / then all answer 200
    assert call(digits_server, "GET", "/v2/health/live").status == 200
    assert call(digits_server, "GET", "/v2/health/ready").status == 200
    meta = call(digits_server, "GET", "/v2")
    assert meta.status == 200
    body = meta.json()
    assert body["name"] == "ferry"
    assert {"binary_tensor_data", "model_repository"} <= set(body["extensions"])
    # a trailing slash is the same endpoint
    assert call(digits_server, "GET", "/v2/").status == 200


def test_model_metadata_ready_and_config(digits_server) -> None:  # noqa: ANN001
    # given the digits model / when its metadata is asked with and without a version / then both describe it
    plain = call(digits_server, "GET", "/v2/models/digits")
    pinned = call(digits_server, "GET", "/v2/models/digits/versions/1")
    for resp in (plain, pinned):
        assert resp.status == 200, resp.body
        meta = resp.json()
        assert meta["name"] == "digits"
        assert meta["versions"] == ["1"]
        assert meta["platform"] == "pytorch_libtorch"  # Triton's name for TorchScript, as the config says
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
        assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 10]}]
    assert call(digits_server, "GET", "/v2/models/digits-export").json()["platform"] == "pytorch_export"
    assert call(digits_server, "GET", "/v2/models/tokens").json()["inputs"][0]["shape"] == [-1, -1]

    # when readiness is asked / then each model is ready, pinned or not
    for model in ("digits", "digits-export", "tokens"):
        assert call(digits_server, "GET", f"/v2/models/{model}/ready").status == 200
        assert call(digits_server, "GET", f"/v2/models/{model}/versions/1/ready").status == 200

    # when the config is asked / then it carries the batching policy
    for path in ("/v2/models/digits/config", "/v2/models/digits/versions/1/config"):
        config = call(digits_server, "GET", path)
        assert config.status == 200
        cfg = config.json()
        assert cfg["name"] == "digits"
        assert cfg["max_batch_size"] == 16
        assert cfg["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [64]}]
        assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 2000


def test_unknown_model_version_and_endpoint_are_404(digits_server) -> None:  # noqa: ANN001
    # given a server / when paths name things that do not exist / then 404 with a JSON error each time
    assert_error(call(digits_server, "GET", "/v2/models/nope"), 404, "unknown model", "nope")
    assert_error(call(digits_server, "GET", "/v2/models/nope/ready"), 404, "nope")
    assert_error(call(digits_server, "GET", "/v2/models/nope/config"), 404, "nope")
    assert_error(infer(digits_server, "nope", {"inputs": []}), 404, "nope")
    for version in ("9", "abc", "0", "-1"):
        for suffix in ("", "/ready", "/config"):
            resp = call(digits_server, "GET", f"/v2/models/digits/versions/{version}{suffix}")
            assert_error(resp, 404, version)
        assert_error(infer(digits_server, f"digits/versions/{version}", {"inputs": []}), 404)
    for path in (
        "/v2/nothing",
        "/v2/health/dead",
        "/v2/models",
        "/v2/models/digits/bogus",
        "/v2/models/digits/versions/1/infer/more",
        "/v2/repository/bogus",
    ):
        method = "POST" if path.startswith("/v2/repository") else "GET"
        assert_error(call(digits_server, method, path), 404)


def test_wrong_method_is_405(digits_server) -> None:  # noqa: ANN001
    # given endpoints with one allowed method / when called with another / then 405 JSON naming the right one
    assert_error(call(digits_server, "GET", "/v2/models/digits/infer"), 405, "POST")
    assert_error(call(digits_server, "PUT", "/v2/models/digits/versions/1/infer", b"{}"), 405, "POST")
    assert_error(call(digits_server, "POST", "/v2/models/digits", b"{}"), 405, "GET")
    assert_error(call(digits_server, "POST", "/v2/models/digits/ready", b""), 405, "GET")
    assert_error(call(digits_server, "DELETE", "/v2/models/digits/config"), 405, "GET")
    assert_error(call(digits_server, "POST", "/v2/health/live", b""), 405, "GET")
    assert_error(call(digits_server, "GET", "/v2/repository/index"), 405, "POST")
    assert_error(call(digits_server, "POST", "/metrics", b""), 405, "GET")


# -- inference -----------------------------------------------------------------------------------


def test_infer_json_happy_path(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, y = digits_samples
    # given a few held-out digits / when each is sent alone as JSON / then the argmax is the label for most
    rows = x[-20:]
    predicted = [
        int(scores(infer(digits_server, "digits", digits_request(rows[i : i + 1]))).argmax()) for i in range(len(rows))
    ]
    assert np.mean(np.array(predicted) == y[-20:]) >= 0.8

    # when the same rows go in one multi-row request / then the answer has one row per input, same argmaxes
    many = infer(digits_server, "digits", digits_request(rows[:16], id="req-42"))
    batch_scores = scores(many)
    assert batch_scores.shape == (16, 10)
    assert batch_scores.argmax(axis=1).tolist() == predicted[:16]
    body = many.json()
    # and the request id is echoed, the version named
    assert body["id"] == "req-42"
    assert body["model_name"] == "digits" and body["model_version"] == "1"
    assert many.headers["content-type"] == "application/json"

    # when an output is requested by name, on a pinned version / then just that output comes back
    named = call(
        digits_server,
        "POST",
        "/v2/models/digits/versions/1/infer",
        digits_request(rows[:2], outputs=[{"name": "scores"}]),
    )
    assert [o["name"] for o in named.json()["outputs"]] == ["scores"]
    assert scores(named).shape == (2, 10)

    # when the torch.export twin is asked / then it agrees with the TorchScript model
    export = scores(infer(digits_server, "digits-export", digits_request(rows[:4])))
    np.testing.assert_allclose(export, batch_scores[:4], rtol=1e-4, atol=1e-4)

    # when an unknown output is requested / then 400 naming it
    assert_error(infer(digits_server, "digits", digits_request(rows[:1], outputs=[{"name": "logits"}])), 400, "logits")


def test_binary_tensor_request(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    rows = x[:3]
    # given a request with the binary tensor extension / when sent / then it answers as the JSON form does
    header = orjson.dumps(
        {
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [3, 64], "parameters": {"binary_data_size": rows.nbytes}}
            ],
            "parameters": {"binary_data_output": False},
        }
    )
    resp = infer(
        digits_server,
        "digits",
        header + rows.tobytes(),
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )
    expected = scores(infer(digits_server, "digits", digits_request(rows)))
    np.testing.assert_allclose(scores(resp), expected, rtol=1e-5, atol=1e-5)


def _good(n: int = 1) -> dict:
    return {"inputs": [{"name": "input", "datatype": "FP32", "shape": [n, 64], "data": [1.0] * (64 * n)}]}


def _with_input(**changes: object) -> dict:
    body = _good()
    body["inputs"][0].update(changes)
    return body


BAD_REQUESTS: list[tuple[str, bytes | dict | list, dict[str, str], int, tuple[str, ...]]] = [
    ("malformed JSON", b'{"inputs": [', {}, 400, ("malformed json",)),
    ("empty body", b"", {}, 400, ("malformed json",)),
    ("not utf-8", b"\xff\xfe\x00garbage", {}, 400, ("malformed json",)),
    ("top-level array", [_good()], {}, 400, ("json object",)),
    ("top-level string", b'"hello"', {}, 400, ("json object",)),
    ("missing inputs", {"id": "x"}, {}, 400, ("inputs",)),
    ("empty inputs", {"inputs": []}, {}, 400, ("inputs",)),
    ("inputs not a list", {"inputs": {"name": "input"}}, {}, 400, ("inputs",)),
    ("input not an object", {"inputs": [42]}, {}, 400, ("inputs[0]",)),
    ("unknown input name", _with_input(name="pixels"), {}, 400, ("unknown input", "pixels")),
    ("duplicate input", {"inputs": [_good()["inputs"][0], _good()["inputs"][0]]}, {}, 400, ("more than once",)),
    ("wrong datatype", _with_input(datatype="FP64"), {}, 400, ("expected datatype FP32", "FP64")),
    ("unsupported datatype", _with_input(datatype="FP128"), {}, 400, ("unsupported datatype",)),
    ("datatype missing", {"inputs": [{"name": "input", "shape": [1, 64], "data": [0.0] * 64}]}, {}, 400, ("datatype",)),
    ("wrong rank", _with_input(shape=[64]), {}, 400, ("rank",)),
    ("rank too high", _with_input(shape=[1, 8, 8]), {}, 400, ("rank",)),
    ("wrong fixed dim", _with_input(shape=[1, 63], data=[0.0] * 63), {}, 400, ("expected shape",)),
    ("zero rows", _with_input(shape=[0, 64], data=[]), {}, 400, ("batch dimension",)),
    ("negative dim", _with_input(shape=[-1, 64]), {}, 400, ("shape",)),
    ("shape not a list", _with_input(shape="1x64"), {}, 400, ("shape",)),
    ("too few elements", _with_input(data=[0.0] * 63), {}, 400, ("expected 64 elements", "63")),
    ("too many elements", _with_input(data=[0.0] * 65), {}, 400, ("expected 64 elements", "65")),
    ("ragged data", _with_input(data=[[0.0] * 32, [0.0] * 31]), {}, 400, ("input 'input'",)),
    ("non-numeric data", _with_input(data=["a"] * 64), {}, 400, ("must be numbers",)),
    ("null in data", _with_input(data=[None] * 64), {}, 400, ("input 'input'",)),
    ("object in data", _with_input(data=[{"x": 1}] * 64), {}, 400, ("input 'input'",)),
    ("data not a list", _with_input(data="0" * 64), {}, 400, ("'data' must be a list",)),
    ("no data", {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64]}]}, {}, 400, ("neither",)),
    ("overflowing float", _with_input(data=[1e300] * 64), {}, 400, ("out of range",)),
    ("rows over max_batch_size", _good(17), {}, 400, ("17", "max_batch_size 16")),
    ("id not a string", {**_good(), "id": 7}, {}, 400, ("'id'",)),
    ("parameters not an object", {**_good(), "parameters": [1]}, {}, 400, ("parameters",)),
    ("timeout not an integer", {**_good(), "parameters": {"timeout": "soon"}}, {}, 400, ("timeout",)),
    ("negative timeout", {**_good(), "parameters": {"timeout": -5}}, {}, 400, ("timeout",)),
    ("bad priority", {**_good(), "parameters": {"priority": -1}}, {}, 400, ("priority",)),
    ("outputs not a list", {**_good(), "outputs": "scores"}, {}, 400, ("outputs",)),
    (
        "duplicate output",
        {**_good(), "outputs": [{"name": "scores"}, {"name": "scores"}]},
        {},
        400,
        ("more than once",),
    ),
    (
        "header length not an integer",
        _good(),
        {"Inference-Header-Content-Length": "ten"},
        400,
        ("Inference-Header-Content-Length",),
    ),
    (
        "header length larger than body",
        _good(),
        {"Inference-Header-Content-Length": "999999"},
        400,
        ("Inference-Header-Content-Length", "999999"),
    ),
    (
        "header length negative",
        _good(),
        {"Inference-Header-Content-Length": "-3"},
        400,
        ("Inference-Header-Content-Length",),
    ),
    ("header length cuts the JSON", _good(), {"Inference-Header-Content-Length": "10"}, 400, ("malformed json",)),
    (
        "binary size not matching shape",
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": 100}}]},
        {"Inference-Header-Content-Length": "H"},
        400,
        ("binary_data_size 100", "256 bytes"),
    ),
    (
        "binary size and data both",
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 64],
                    "data": [0.0] * 64,
                    "parameters": {"binary_data_size": 256},
                }
            ]
        },
        {},
        400,
        ("both",),
    ),
    (
        "binary size negative",
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": -256}}]},
        {},
        400,
        ("binary_data_size",),
    ),
]


def test_bad_inputs_answer_4xx_json(digits_server) -> None:  # noqa: ANN001
    # given one server and a table of malformed requests, each labelled once
    assert len({c[0] for c in BAD_REQUESTS}) == len(BAD_REQUESTS)
    # when each is sent / then each gets its 4xx JSON error with a useful message
    for label, body, headers, status, fragments in BAD_REQUESTS:
        raw = body if isinstance(body, bytes) else orjson.dumps(body)
        hdrs = dict(headers)
        if hdrs.get("Inference-Header-Content-Length") == "H":
            hdrs["Inference-Header-Content-Length"] = str(len(raw))
        resp = infer(digits_server, "digits", raw, hdrs)
        try:
            assert_error(resp, status, *fragments)
        except AssertionError as exc:
            raise AssertionError(f"case {label!r}: {exc}") from None
    # and the 400s left the server answering
    assert infer(digits_server, "digits", _good()).status == 200


def test_binary_sizes_that_do_not_add_up(digits_server) -> None:  # noqa: ANN001
    header = orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": 256}}]}
    )
    length = {"Inference-Header-Content-Length": str(len(header))}
    # given a header announcing 256 bytes / when fewer follow / then 400 saying how many did
    short = infer(digits_server, "digits", header + b"\x00" * 100, length)
    assert_error(short, 400, "256", "100 bytes follow")
    # when more follow / then 400 too
    assert_error(infer(digits_server, "digits", header + b"\x00" * 300, length), 400, "300 bytes follow")
    # when the exact amount follows / then it is served
    assert infer(digits_server, "digits", header + np.zeros(64, np.float32).tobytes(), length).status == 200
    # when binary bytes follow a JSON-only request / then 400
    assert_error(
        infer(
            digits_server,
            "digits",
            orjson.dumps(_good()) + b"\x00" * 8,
            {"Inference-Header-Content-Length": str(len(orjson.dumps(_good())))},
        ),
        400,
        "8 bytes",
    )


def test_body_over_limit_is_413(digits_server, settings) -> None:  # noqa: ANN001
    limit = settings.FERRY_MAX_INFER_BODY_BYTES  # 8 MiB unless FERRY_MAX_INFER_BODY_BYTES says otherwise
    # given a body 1 MiB over the limit (about 9 MiB by default) / when posted / then 413 naming the limit
    body = b'{"inputs": [' + b" " * (limit + 1024 * 1024) + b"]}"
    conn = http.client.HTTPConnection("127.0.0.1", digits_server.port, timeout=TIMEOUT)
    try:
        try:
            conn.request("POST", "/v2/models/digits/infer", body=body, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before reading everything: the answer is still there
        resp = conn.getresponse()
        answer = Resp(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()
    assert_error(answer, 413, str(limit))
    # and the server still serves
    assert infer(digits_server, "digits", _good()).status == 200


def test_chunked_body_over_limit_is_413(digits_server, settings) -> None:  # noqa: ANN001
    # given a body 1 MiB over the limit sent chunked, with no Content-Length to refuse it by
    chunk = b" " * (256 * 1024)
    chunks = settings.FERRY_MAX_INFER_BODY_BYTES // len(chunk) + 4
    body = iter([b'{"inputs": [', *([chunk] * chunks), b"]}"])
    conn = http.client.HTTPConnection("127.0.0.1", digits_server.port, timeout=TIMEOUT)
    try:
        try:
            conn.request(
                "POST",
                "/v2/models/digits/infer",
                body=body,
                encode_chunked=True,
                headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            )
        except (BrokenPipeError, ConnectionResetError):
            pass
        resp = conn.getresponse()
        answer = Resp(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()
    # when it streams in / then 413 once the limit is passed
    assert_error(answer, 413, "exceeds")


def test_odd_requests_never_500(digits_server) -> None:  # noqa: ANN001
    import socket

    # given odd methods / when used on the protocol's paths / then 405, as JSON
    for method in ("HEAD", "OPTIONS", "PATCH"):
        resp = call(digits_server, method, "/v2/models/digits/infer")
        assert resp.status == 405, (method, resp.status)
    # given data nested deeper than any tensor / when sent / then 400, not a crash
    deep: object = [1.0]
    for _ in range(200):
        deep = [deep]
    assert_error(infer(digits_server, "digits", _with_input(data=deep)), 400, "input 'input'")
    # given a client that announces a body and goes away half-way / then the server keeps answering
    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b'POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"inputs": [')
    assert infer(digits_server, "digits", _good()).status == 200
    # given a model name with characters outside the registry's alphabet / then 404 naming it, as JSON
    assert_error(call(digits_server, "GET", "/v2/models/%C3%A9t%C3%A9"), 404, "\u00e9t\u00e9")


def test_stalled_body_is_answered_408(digits_server, settings) -> None:  # noqa: ANN001
    import socket

    # given a client that announces 1000 bytes, sends 12 and then goes quiet
    settings.FERRY_BODY_TIMEOUT_S = 1
    with socket.create_connection(("127.0.0.1", digits_server.port), timeout=TIMEOUT) as sock:
        sock.sendall(b'POST /v2/models/digits/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"inputs": [')
        # when the body timeout passes / then the server answers 408 as JSON instead of holding the slot
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"not received within 1 s" in orjson.loads(body)["error"].encode()


def test_random_garbage_never_breaks_the_server(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    rng = random.Random(1234)
    valid = [
        orjson.dumps(digits_request(x[:2])),
        orjson.dumps(digits_request(x[5:6], id="abc")),
        orjson.dumps({**digits_request(x[:1]), "outputs": [{"name": "scores"}]}),
    ]
    tokens_valid = orjson.dumps(tokens_request([[3, 4, 5]]))
    header = orjson.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": 256}}]}
    )
    binary_valid = header + np.ones(64, np.float32).tobytes()

    def mutate(data: bytes) -> bytes:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            pos = rng.randrange(len(b)) if b else 0
            if op < 0.4 and b:
                b[pos] = rng.randrange(256)
            elif op < 0.6:
                alphabet = b'{}[]",:0123456789-.eE ntfrul'
                b[pos:pos] = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            elif op < 0.8 and b:
                del b[pos : pos + rng.randint(1, 16)]
            else:
                b[pos:pos] = rng.choice(
                    [
                        b"[",
                        b"]",
                        b"{",
                        b'"shape": [99999999999]',
                        b"1e999",
                        b"-0",
                        b'"binary_data_size": 4',
                        b"null",
                        b"[[[[[[[[",
                        b"\x00",
                    ]
                )
        return bytes(b)

    # given a few hundred seeded garbage bodies: random bytes, and mutations of valid ones
    cases: list[tuple[str, bytes, dict[str, str]]] = []
    for _ in range(80):
        cases.append(("digits", bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))), {}))
    for _ in range(160):
        cases.append(("digits", mutate(rng.choice(valid)), {}))
    for _ in range(40):
        cases.append(("tokens", mutate(tokens_valid), {}))
    for _ in range(60):
        body = mutate(binary_valid) if rng.random() < 0.7 else binary_valid
        length = rng.choice([len(header), len(header) + rng.randint(-20, 20), rng.randint(-5, 600)])
        cases.append(("digits", body, {"Inference-Header-Content-Length": str(length)}))

    # when each is posted / then the status is always one the protocol allows, errors are JSON
    allowed = {200, 400, 404, 413, 422}
    for i, (model, body, headers) in enumerate(cases):
        resp = infer(digits_server, model, body, headers)
        assert resp.status in allowed, (i, body[:200], headers, resp.status, resp.body)
        if resp.status != 200:
            resp.error  # noqa: B018 - asserts the {"error": "..."} shape

    # and the server keeps answering
    assert call(digits_server, "GET", "/v2/health/ready").status == 200
    assert infer(digits_server, "digits", valid[0]).status == 200


# -- batching of variable-length inputs ----------------------------------------------------------


def test_variable_length_requests_batch_without_changing_answers(digits_server, model_files) -> None:  # noqa: ANN001
    rng = random.Random(7)
    requests = [[[rng.randint(1, 63) for _ in range(length)]] for length in (1, 3, 5, 2, 9, 4)]
    # given each request's answer when sent alone
    alone = [scores(infer(digits_server, "tokens", tokens_request(r))) for r in requests]
    # and a copy of the tokens model that holds its queue until a full batch of 6 rows has gathered
    register(
        model_files.tokens,
        "tokens-held",
        io=TOKENS_IO,
        max_batch_size=6,
        max_queue_delay_ms=10_000,
        default_timeout_ms=30_000,
    )
    digits_server.refresh()

    before = metrics(digits_server)

    # when the six requests, all of different lengths, are sent concurrently to it
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: infer(digits_server, "tokens-held", tokens_request(r)), requests))

    # then they ran as one padded batch of 6 rows
    after = metrics(digits_server)
    assert grew(before, after, "ferry_batch_size_count", model="tokens-held", version="1") == 1
    assert grew(before, after, "ferry_batch_size_sum", model="tokens-held", version="1") == 6
    # and each answer equals the one it got alone: zero padding did not change it
    for single, batched in zip(alone, together, strict=True):
        np.testing.assert_allclose(scores(batched), single, rtol=1e-5, atol=1e-6)

    # when the same requests are sent concurrently to the ordinary tokens model / then answers match too
    with ThreadPoolExecutor(len(requests)) as pool:
        again = list(pool.map(lambda r: infer(digits_server, "tokens", tokens_request(r)), requests))
    for single, batched in zip(alone, again, strict=True):
        np.testing.assert_allclose(scores(batched), single, rtol=1e-5, atol=1e-6)

    # when a request carries its own trailing zero padding / then the answer is the unpadded one
    padded = tokens_request([requests[1][0] + [0, 0, 0]])
    np.testing.assert_allclose(scores(infer(digits_server, "tokens", padded)), alone[1], rtol=1e-5, atol=1e-6)


def test_bad_row_in_a_batch_fails_only_itself(digits_server, model_files) -> None:  # noqa: ANN001
    # given a tokens model that gathers full batches of 4, and one request with a token outside the vocabulary
    register(
        model_files.tokens,
        "tokens-isolating",
        io=TOKENS_IO,
        max_batch_size=4,
        max_queue_delay_ms=10_000,
        default_timeout_ms=30_000,
    )
    digits_server.refresh()
    requests = [[[5, 6]], [[7, 8, 9]], [[500, 1]], [[2]]]
    alone = {i: scores(infer(digits_server, "tokens", tokens_request(r))) for i, r in enumerate(requests) if i != 2}
    before = metrics(digits_server)

    # when the four go concurrently, so they share one batch
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: infer(digits_server, "tokens-isolating", tokens_request(r)), requests))

    # then the bad one alone gets 422 with the model's reason, the others their usual answers
    assert_error(answers[2], 422, "model failed")
    for i, single in alone.items():
        np.testing.assert_allclose(scores(answers[i]), single, rtol=1e-5, atol=1e-6)
    after = metrics(digits_server)
    labels = {"model": "tokens-isolating", "version": "1"}
    # the joint batch failed; its parts that ran clean (a half of 2 rows, then 1 row of the other) are batches
    assert grew(before, after, "ferry_batch_size_count", **labels) == 2
    assert grew(before, after, "ferry_batch_size_sum", **labels) == 3
    assert grew(before, after, "ferry_requests_total", **labels, status="422") == 1
    assert grew(before, after, "ferry_requests_total", **labels, status="200") == 3


# -- deadlines, admission, fallback --------------------------------------------------------------


def test_expired_deadline_is_504_or_503(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given a request whose timeout is 1 microsecond / when sent / then 504 (or 503 from admission), explained
    resp = infer(digits_server, "digits", digits_request(x[:1], parameters={"timeout": 1}))
    assert resp.status in (503, 504), (resp.status, resp.body)
    assert resp.headers["content-type"] == "application/json"
    assert "deadline" in resp.error
    if resp.status == 503:
        assert "retry-after" in resp.headers
    # and a generous timeout is served
    generous = digits_request(x[:1], parameters={"timeout": 5_000_000})
    assert infer(digits_server, "digits", generous).status == 200


HELD = {"max_batch_size": 8, "max_queue_size": 1, "max_queue_delay_ms": 2000, "default_timeout_ms": 20_000}


def _hold_one(server, model: str, body: dict) -> tuple[threading.Thread, dict]:  # noqa: ANN001
    """Send one request that waits in `model`'s queue (long window, batch not full) until it is seen there."""
    thread, box = in_background(lambda: infer(server, model, body))
    plane = server.plane()
    wait_until(
        lambda: plane.node.queue_depth(f"{model}:1") == 1 or not thread.is_alive(),
        f"a request waiting in {model}'s queue",
    )
    assert thread.is_alive(), box
    return thread, box


def test_queue_full_is_503_with_retry_after(transactional_db, model_files, digits_samples, request) -> None:  # noqa: ANN001
    x, y = digits_samples
    # given a model whose queue holds one request and whose window is 2 s long, served live
    register(model_files.digits, "held", **HELD)
    server = request.getfixturevalue("live_server")
    before = metrics(server)
    # and one request already waiting in that queue
    first, box = _hold_one(server, "held", digits_request(x[:1]))

    # when more requests come concurrently while it waits
    with ThreadPoolExecutor(4) as pool:
        others = list(pool.map(lambda i: infer(server, "held", digits_request(x[i : i + 1])), range(1, 5)))

    # then they are refused with 503, a Retry-After header and a JSON reason
    for resp in others:
        assert_error(resp, 503, "max_queue_size")
        assert int(resp.headers["retry-after"]) >= 1
    # and the waiting request is answered 200 when its window closes
    assert int(scores(joined(first, box)).argmax()) == y[0]
    # and nothing was a 500
    after = metrics(server)
    assert grew(before, after, "ferry_requests_total", model="held", version="1", status="503") == 4
    assert grew(before, after, "ferry_requests_total", model="held", version="1", status="200") == 1
    assert sample(after, "ferry_requests_total", model="held", version="1", status="500") is None


def test_unload_answers_waiting_requests_before_the_model_goes(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, y = digits_samples
    # given a request waiting in a long batching window
    register(model_files.digits, "held", **HELD)
    server = request.getfixturevalue("live_server")
    first, box = _hold_one(server, "held", digits_request(x[:1]))
    # when the model is unloaded through the repository extension
    assert call(server, "POST", "/v2/repository/models/held/unload", b"").status == 200
    # then the waiting request was answered with its result first (as Triton's unload lets work in flight
    # finish), neither refused nor left hanging, and the version is no longer loaded
    resp = joined(first, box)
    assert resp.status == 200, resp.body
    assert int(scores(resp).argmax()) == y[0]
    assert not server.plane().node.is_ready("held:1")


def test_saturated_model_falls_back_to_smaller_one(  # noqa: ANN001
    transactional_db, model_files, digits_samples, request
) -> None:
    x, y = digits_samples
    # given `big`, saturated by one waiting request, with `small` (same signature) as its fallback
    small = register(model_files.digits, "small")
    big = register(model_files.digits, "big", **HELD)
    big.model.fallback = small.model
    big.model.save()
    server = request.getfixturevalue("live_server")
    labels = {"model": "big", "version": "1", "fallback": "small"}
    fallbacks = lambda: REGISTRY.get_sample_value("ferry_fallbacks_total", labels) or 0  # noqa: E731
    small_labels = {"model": "small", "version": "1", "status": "200"}
    small_ok = lambda: REGISTRY.get_sample_value("ferry_requests_total", small_labels) or 0  # noqa: E731
    fallbacks_before, small_ok_before = fallbacks(), small_ok()
    first, box = _hold_one(server, "big", digits_request(x[:1]))

    # when more requests for `big` arrive concurrently
    with ThreadPoolExecutor(3) as pool:
        others = list(pool.map(lambda i: infer(server, "big", digits_request(x[i : i + 1], id=str(i))), range(1, 4)))

    # then `small` answers them, saying it stood in for big:1, and its answers are right
    for i, resp in enumerate(others, start=1):
        assert resp.status == 200, resp.body
        body = resp.json()
        assert body["model_name"] == "small" and body["model_version"] == "1"
        assert body["parameters"] == {"fallback_from": "big:1"}
        assert body["id"] == str(i)
        assert int(scores(resp).argmax()) == y[i]
    # and the waiting request is answered by `big` itself
    own = joined(first, box).json()
    assert own["model_name"] == "big" and "parameters" not in own
    # and the metrics say who served what: three fallbacks from big, three answers counted for small
    assert fallbacks() - fallbacks_before == 3
    assert small_ok() - small_ok_before == 3


def test_no_fallback_when_signatures_differ(transactional_db, model_files, digits_samples, request) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given `big` saturated, whose fallback takes other inputs
    other = register(model_files.tokens, "other", io=TOKENS_IO)
    big = register(model_files.digits, "big", **HELD)
    big.model.fallback = other.model
    big.model.save()
    server = request.getfixturevalue("live_server")
    first, box = _hold_one(server, "big", digits_request(x[:1]))
    # when another request for `big` arrives / then 503 (the fallback cannot take it), not a wrong answer
    resp = infer(server, "big", digits_request(x[1:2]))
    assert_error(resp, 503, "max_queue_size")
    assert "retry-after" in resp.headers
    assert joined(first, box).status == 200


# -- repository extension ------------------------------------------------------------------------


def test_repository_index_load_unload(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given the server / when the index is asked / then every version is listed READY
    index = call(digits_server, "POST", "/v2/repository/index", b"")
    assert index.status == 200
    rows = {(r["name"], r["version"]): r for r in index.json()}
    assert set(rows) == {("digits", "1"), ("digits-export", "1"), ("tokens", "1")}
    assert all(r["state"] == "READY" and r["reason"] == "" for r in rows.values()), rows

    # when digits is unloaded / then it is no longer ready and inference is refused with 503
    assert call(digits_server, "POST", "/v2/repository/models/digits/unload", b"").status == 200
    not_ready = call(digits_server, "GET", "/v2/models/digits/ready")
    assert_error(not_ready, 503, "digits")
    assert "retry-after" in not_ready.headers
    assert_error(infer(digits_server, "digits", digits_request(x[:1])), 503, "digits")
    unloaded = {r["name"]: r for r in call(digits_server, "POST", "/v2/repository/index").json()}
    assert unloaded["digits"]["state"] == "UNAVAILABLE"
    # and the other models are untouched
    assert call(digits_server, "GET", "/v2/models/digits-export/ready").status == 200

    # when it is loaded again / then it is ready and serving
    assert call(digits_server, "POST", "/v2/repository/models/digits/load", b"").status == 200
    assert call(digits_server, "GET", "/v2/models/digits/ready").status == 200
    assert infer(digits_server, "digits", digits_request(x[:1])).status == 200

    # when an unknown model is loaded or unloaded / then 404
    assert_error(call(digits_server, "POST", "/v2/repository/models/nope/load", b""), 404, "nope")
    assert_error(call(digits_server, "POST", "/v2/repository/models/nope/unload", b""), 404, "nope")
    assert_error(call(digits_server, "GET", "/v2/repository/models/digits/load"), 405)
    assert_error(call(digits_server, "POST", "/v2/repository/models/digits/reload", b""), 404)


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_after_inferences(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    before = metrics(digits_server)
    # given some answered inferences (two rows each) and one bad request
    for i in range(5):
        assert infer(digits_server, "digits", digits_request(x[i : i + 2])).status == 200
    assert infer(digits_server, "digits", {"inputs": []}).status == 400

    # when /metrics is scraped
    resp = call(digits_server, "GET", "/metrics")
    assert resp.status == 200
    assert resp.headers["content-type"].startswith("text/plain")
    text = resp.body.decode()

    # then it has the request counters by status, the batching and timing histograms, queue and device figures
    # (label order in the exposition is the client library's choice, so lines are compared as label sets)
    assert has_line(text, "ferry_requests_total", model="digits", version="1", status="200")
    assert has_line(text, "ferry_requests_total", model="digits", version="1", status="400")
    families = list(text_string_to_metric_families(text))
    digits = {"model": "digits", "version": "1"}
    assert grew(before, families, "ferry_requests_total", **digits, status="200") == 5
    assert grew(before, families, "ferry_requests_total", **digits, status="400") == 1
    assert grew(before, families, "ferry_batch_size_bucket", **digits, le="+Inf") >= 1
    assert grew(before, families, "ferry_batch_size_sum", **digits) == 10
    assert grew(before, families, "ferry_queue_wait_seconds_count", **digits) == 5  # one per request
    # every answer's time, by status class: the 200s and the 400
    assert grew(before, families, "ferry_request_seconds_count", **digits, status_class="2xx") == 5
    assert grew(before, families, "ferry_request_seconds_count", **digits, status_class="4xx") == 1
    assert grew(before, families, "ferry_compute_seconds_count", **digits) >= 1  # one per batch
    assert sample(families, "ferry_queue_depth", **digits) == 0
    assert grew(before, families, "ferry_device_busy_seconds_total") > 0
    assert sample(families, "ferry_model_loaded", **digits) == 1


# -- database outage -----------------------------------------------------------------------------


def test_serving_survives_registry_outage(digits_server, digits_samples, monkeypatch, caplog) -> None:  # noqa: ANN001
    from serving.dataplane import plane as dataplane

    x, y = digits_samples
    plane = digits_server.plane()
    serial = plane.gateway.hub.current.serial
    attempts = threading.Event()

    def unreachable() -> tuple:
        attempts.set()
        raise OperationalError("connection to server at 127.0.0.1, port 5432 failed: Connection refused")

    # given the registry becomes unreachable, and the refresh loop runs often
    caplog.set_level(logging.WARNING, logger="serving.dataplane.plane")
    monkeypatch.setattr(plane, "fingerprint", unreachable)
    monkeypatch.setattr(dataplane, "REFRESH_SECONDS", 0.05)

    # when a refresh is attempted directly / then it fails with the database error and keeps the snapshot
    future = asyncio.run_coroutine_threadsafe(plane.refresh_once(), plane.loop)
    with pytest.raises(OperationalError):
        future.result(timeout=TIMEOUT)
    assert attempts.is_set()

    # when the periodic refresh loop hits the outage / then it logs it rather than dying
    wait_until(
        lambda: any("snapshot refresh failed" in r.getMessage() for r in caplog.records),
        "the refresh failure to be logged",
    )
    assert plane.refresher is not None and not plane.refresher.done()

    # and inference, metadata and readiness keep answering from the last snapshot
    assert plane.gateway.hub.current.serial == serial
    resp = infer(digits_server, "digits", digits_request(x[:1]))
    assert int(scores(resp).argmax()) == y[0]
    assert call(digits_server, "GET", "/v2/models/digits").status == 200
    assert call(digits_server, "GET", "/v2/health/ready").status == 200

    # when the registry comes back / then refreshing works again
    monkeypatch.undo()
    digits_server.refresh()
    assert infer(digits_server, "digits", digits_request(x[:1])).status == 200


# -- console -------------------------------------------------------------------------------------


def test_console_live_json_needs_login(digits_server, django_user_model) -> None:  # noqa: ANN001
    from django.test import Client

    # given an anonymous visitor / when the live JSON is asked over HTTP / then a redirect to the login page
    resp = call(digits_server, "GET", "/console/live/")
    assert resp.status == 302
    assert resp.headers["location"].startswith("/login/?next=/console/live/")

    # given a logged-in user of this process / when asked / then the live figures of every version
    user = django_user_model.objects.create_user("viewer", password="pw-for-tests-only")
    client = Client()
    client.force_login(user)
    live = client.get("/console/live/")
    assert live.status_code == 200
    versions = live.json()["versions"]
    assert set(versions) == {"digits:1", "digits-export:1", "tokens:1"}
    assert versions["digits:1"]["loaded"] is True
