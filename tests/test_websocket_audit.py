"""Inference over a WebSocket, what the audit found (docs/websocket.md): a pipeline is served on it as on REST
(its quota, its deadline), a socket without its key waits as long as an idle HTTP connection, a message over
the bound closes 1009 saying its id, a binary frame's length is not counted against the bound, and an answer
holds its bytes in the process's budget until it is sent."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import orjson

from serving.dataplane.http import websocket
from serving.dataplane.http.websocket import InferenceSocket
from serving.pipelines import register_pipeline
from tests.conftest import tenant
from tests.test_inference_http import digits_request, infer, scores
from tests.test_pipeline_http import pipeline_server, weak_digits  # noqa: F401 - the fixtures
from tests.test_quota_http import set_quota
from tests.test_websocket import (
    DEADLINE_S,
    answer_scores,
    binary_message,
    closed_with,
    handshake_refusal,
    json_message,
    keyed,
    recv_json,
)

PIPE = "cheap-then-big"


def test_a_pipeline_is_answered_over_a_websocket_as_over_rest(pipeline_server, digits_samples) -> None:  # noqa: ANN001, F811
    images = digits_samples[0][:24]
    rest = scores(infer(pipeline_server, PIPE, digits_request(images)))

    async def run(path: str) -> dict[str, np.ndarray]:
        async with keyed(pipeline_server, model=path) as ws:
            await ws.send(json_message("json", images))
            await ws.send(binary_message("binary", images, binary_output=True))
            return dict([answer_scores(await asyncio.wait_for(ws.recv(), DEADLINE_S)) for _ in range(2)])

    # when a connection to the pipeline (and to its version 1) sends its requests, as text and binary frames
    for path in (PIPE, f"{PIPE}/versions/1"):
        got = asyncio.run(run(path))
        # then each is answered as REST answers it (the cascade's rows, each by the model it calls for)
        np.testing.assert_allclose(got["json"], rest, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["binary"], rest, rtol=1e-5, atol=1e-5)


def test_a_pipelines_messages_take_one_request_of_the_quota_and_its_deadline(pipeline_server, digits_samples) -> None:  # noqa: ANN001, F811
    images = digits_samples[0][:24]  # enough that both steps run
    # given a tenant that may send two requests this month
    set_quota(monthly_requests=2)
    pipeline_server.refresh()

    async def run() -> list[dict]:
        async with keyed(pipeline_server, model=PIPE) as ws:
            answers = []
            for rid in ("m1", "m2", "m3"):
                await ws.send(json_message(rid, images))
                answers.append(await recv_json(ws))
            return answers

    first, second, third = asyncio.run(run())
    # then two calls of two steps each are answered (a call is one request of the quota, not one per step)
    assert "outputs" in first and "outputs" in second, (first, second)
    # and the third is refused as REST refuses it: 429, with when to retry
    assert third["id"] == "m3" and third["status"] == 429 and "monthly" in third["error"], third
    assert third["retry_after"] >= 1

    # and with the quota raised, a deadline its steps cannot meet is REST's 503 with Retry-After
    set_quota(monthly_requests=1_000_000)
    pipeline_server.refresh()

    async def late() -> dict:
        async with keyed(pipeline_server, model=PIPE) as ws:
            await ws.send(json_message("late", images[:2], parameters={"timeout": 1}))
            return await recv_json(ws)

    refused = asyncio.run(late())
    assert refused["id"] == "late" and refused["status"] == 503 and refused["retry_after"] >= 1, refused


def test_a_pipeline_the_key_may_not_see_is_refused_as_an_unknown_model(pipeline_server) -> None:  # noqa: ANN001, F811
    register_pipeline(name="hidden-pipe", spec={"model": "p-small"}, tenant=tenant("other"), visibility="private")
    pipeline_server.refresh()
    hidden = handshake_refusal(lambda: keyed(pipeline_server, model="hidden-pipe"))
    missing = handshake_refusal(lambda: keyed(pipeline_server, model="no-such-pipe"))
    assert hidden[0] == missing[0] == 404
    assert hidden[1]["error"].replace("hidden-pipe", "X") == missing[1]["error"].replace("no-such-pipe", "X")


def test_a_socket_without_its_key_waits_as_an_idle_http_connection(settings) -> None:  # noqa: ANN001
    # given sends that may wait an hour (a send's bound is not the key's)
    settings.FERRY_BODY_TIMEOUT_S = 3600
    sent: list[dict] = []

    async def run() -> None:
        incoming: asyncio.Queue[dict] = asyncio.Queue()
        incoming.put_nowait({"type": "websocket.connect"})

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "websocket.close":
                incoming.put_nowait({"type": "websocket.disconnect", "code": message["code"]})

        scope = {"type": "websocket", "path": "/ws/v2/models/digits/infer", "query_string": b"", "headers": []}
        # when a connection without a key in its handshake sends nothing (the wait only stops a hang)
        await asyncio.wait_for(InferenceSocket()(scope, incoming.get, send), DEADLINE_S)

    asyncio.run(run())
    # then it is closed at the key's own wait, saying so: 4408, not an hour later
    (close,) = [m for m in sent if m["type"] == "websocket.close"]
    frame = json.loads(next(m["text"] for m in sent if m.get("text")))
    assert close["code"] == 4408 and frame["status"] == 408, (close, frame)
    assert f"sent no key for {websocket.KEY_WAIT_S:g} s" in frame["error"] and websocket.KEY_WAIT_S <= 5


def test_the_bound_is_the_bodys_and_a_message_over_it_closes_1009_with_its_id(
    digits_server, digits_samples, settings
) -> None:  # noqa: ANN001
    x, _ = digits_samples
    exact = binary_message("exact", x[:1], binary_output=False)
    # given connections whose bound is this binary frame's body: the frame less its 4-byte header length
    settings.FERRY_MAX_INFER_BODY_BYTES = len(exact) - 4

    async def run() -> tuple[dict, int, list[dict]]:
        async with keyed(digits_server) as ws:
            await ws.send(exact)
            answered = await recv_json(ws)
            await ws.send(json_message("over", x[:1], pad="x" * len(exact)))
            code, frames = await closed_with(ws)
            return answered, code, frames

    answered, code, frames = asyncio.run(run())
    # then that frame is taken (its body is within the bound, as REST's would be)
    assert answered["id"] == "exact" and "outputs" in answered, answered
    # and a message over it is refused as the docs say, close 1009, after a frame saying which one it was
    assert code == 1009 and [(f["id"], f["status"]) for f in frames] == [("over", 413)], (code, frames)


def test_an_answer_holds_its_bytes_in_the_process_budget_until_sent(digits_server, settings) -> None:  # noqa: ANN001
    request = orjson.dumps(
        {"id": "t", "inputs": [{"name": "tokens", "datatype": "INT64", "shape": [1, 1], "data": [3]}]}
    ).decode()

    async def ask() -> dict:
        async with keyed(digits_server, model="tokens") as ws:
            await ws.send(request)
            return await recv_json(ws)

    answer = len(orjson.dumps(asyncio.run(ask())))  # (the frame's JSON, give or take its spacing)
    assert answer > len(request) + 16, (answer, len(request))  # this model's answer is larger than its request
    # given a process budget with room for the request, not for its answer
    settings.FERRY_MAX_INFLIGHT_BODY_BYTES = len(request) + 8
    refused = asyncio.run(ask())
    # then the answer is not held outside the budget: the message is answered 503, as one refused on arrival
    assert refused["id"] == "t" and refused["status"] == 503 and refused["retry_after"] == 1, refused
    assert websocket.STATS.held_bytes == 0
