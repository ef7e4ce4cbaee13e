"""tritonclient.grpc, unchanged, against a live Ferry's gRPC port: the checks tests/test_tritonclient.py runs with
tritonclient.http (metadata, digits accuracy, a bad key, an unknown and a foreign model, overload, a deadline),
the quota, the repository extension, and ModelStreamInfer."""

from __future__ import annotations

import asyncio
import queue
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from django.conf import settings as django_settings
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.grpc.status import CODES
from serving.dataplane.http.consumers import InferenceRequest
from serving.pipelines import register_pipeline
from tests.conftest import LiveServer, free_port, mint_key, register, tenant
from tests.test_inference_http import HELD, call, grew, metrics, wait_until
from tests.test_quota_http import set_quota


@pytest.fixture
def grpc_port(settings) -> int:  # noqa: ANN001
    # Before the server starts (its lifespan reads it); the suite has gRPC off (tests/xdist_workers.py).
    settings.FERRY_GRPC_PORT = port = free_port()
    # Not a saturation test: a busy machine must not shed these requests.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    return port


@pytest.fixture
def server(grpc_port, digits_server) -> LiveServer:  # noqa: ANN001
    digits_server.grpc_url = f"127.0.0.1:{grpc_port}"
    return digits_server


@pytest.fixture
def client(server) -> Iterator[grpcclient.InferenceServerClient]:  # noqa: ANN001
    c = grpcclient.InferenceServerClient(url=server.grpc_url)
    yield c
    c.close()


@pytest.fixture
def auth(server) -> dict[str, str]:  # noqa: ANN001
    """What an application passes to every tritonclient call: its API key, as gRPC metadata."""
    return {"authorization": f"Bearer {server.key}"}


def digits_input(rows: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    return inp


def status_of(exc: InferenceServerException) -> str:
    return exc.status() or ""


def test_without_the_key_the_client_raises_unauthenticated(client) -> None:  # noqa: ANN001
    # given no metadata / when inferring or reading metadata / then UNAUTHENTICATED; health stays open
    for attempt in (
        lambda: client.infer("digits", [digits_input(np.zeros((1, 64)))]),
        lambda: client.get_model_metadata("digits"),
        lambda: client.infer("digits", [digits_input(np.zeros((1, 64)))], headers={"authorization": "Bearer fy_x_y"}),
    ):
        with pytest.raises(InferenceServerException, match="API key") as refused:
            attempt()
        assert status_of(refused.value) == "StatusCode.UNAUTHENTICATED"
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata(as_json=True)["extensions"]


def test_a_key_without_the_scope_is_permission_denied(client, server) -> None:  # noqa: ANN001
    token = mint_key(scopes=("manage",))
    with pytest.raises(InferenceServerException, match="'infer' scope") as refused:
        client.infer("digits", [digits_input(np.zeros((1, 64)))], headers={"authorization": f"Bearer {token}"})
    assert status_of(refused.value) == "StatusCode.PERMISSION_DENIED"


def test_health_and_metadata(client, auth) -> None:  # noqa: ANN001
    # given a server with the digits model / when asked as Triton's client asks / then it answers as Triton
    assert client.is_model_ready("digits", headers=auth)
    assert client.is_model_ready("digits", "1", headers=auth)
    meta = client.get_model_metadata("digits", headers=auth, as_json=True)
    assert meta["name"] == "digits" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": ["-1", "10"]}]
    config = client.get_model_config("digits", headers=auth).config
    assert config.max_batch_size == 16 and config.input[0].dims == [64]
    assert config.dynamic_batching.default_queue_policy.default_timeout_microseconds > 0
    server = client.get_server_metadata()
    assert server.name == "ferry" and "model_repository" in server.extensions


def test_prediction_matches_label(client, auth, digits_samples) -> None:  # noqa: ANN001
    # given held-out digits / when sent through tritonclient.grpc (raw_input_contents) / then they are right
    x, y = digits_samples
    rows = x[-64:]
    correct = 0
    for i in range(len(rows)):
        result = client.infer(
            "digits",
            [digits_input(rows[i : i + 1])],
            outputs=[grpcclient.InferRequestedOutput("scores")],
            request_id=f"r{i}",
            headers=auth,
        )
        scores = result.as_numpy("scores")
        assert scores.shape == (1, 10) and scores.dtype == np.float32
        correct += int(scores.argmax() == y[-64 + i])
        response = result.get_response()
        assert (response.model_version, response.id) == ("1", f"r{i}")
    assert correct / len(rows) >= 0.85
    # and the statistics count them (this process's metrics: at least these 64 rows, in at least one batch)
    stats = client.get_inference_statistics("digits", headers=auth).model_stats
    assert [(s.name, s.version) for s in stats] == [("digits", "1")]
    assert stats[0].inference_stats.success.count >= 64 and stats[0].inference_count >= 64
    assert 1 <= stats[0].execution_count <= stats[0].inference_count
    assert stats[0].inference_stats.compute_infer.ns > 0


def test_typed_contents_answer_as_raw_ones(server, client, auth, digits_samples) -> None:  # noqa: ANN001
    # given five rows / when sent once as raw bytes (tritonclient) and once in fp32_contents (a bare stub)
    x, _ = digits_samples
    raw = client.infer("digits", [digits_input(x[:5])], headers=auth).as_numpy("scores")
    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=[5, 64]).contents.fp32_contents.extend(
        x[:5].astype(np.float32).ravel().tolist()
    )
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(request, metadata=tuple(auth.items()))
    typed = np.frombuffer(response.raw_output_contents[0], "<f4").reshape(5, 10)
    # then the answers agree
    np.testing.assert_allclose(typed, raw, rtol=1e-6)


def test_torch_export_model_and_pinned_version(client, auth, digits_samples) -> None:  # noqa: ANN001
    x, y = digits_samples
    result = client.infer("digits-export", [digits_input(x[:1])], model_version="1", headers=auth)
    assert result.as_numpy("scores").argmax() == y[0]


def test_bad_input_is_invalid_argument(client, auth) -> None:  # noqa: ANN001
    inp = grpcclient.InferInput("input", [1, 64], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float64))
    with pytest.raises(InferenceServerException, match="expected datatype FP32") as refused:
        client.infer("digits", [inp], headers=auth)
    assert status_of(refused.value) == "StatusCode.INVALID_ARGUMENT"


def test_an_extension_ferry_lacks_is_invalid_argument_naming_it(client, auth) -> None:  # noqa: ANN001
    # given tritonclient.grpc asking for classification, or for a sequence / then INVALID_ARGUMENT, naming it
    inputs = [digits_input(np.zeros((1, 64), np.float32))]
    classified = [grpcclient.InferRequestedOutput("scores", class_count=3)]
    for attempt, parameter in (
        (lambda: client.infer("digits", inputs, outputs=classified, headers=auth), "classification"),
        (lambda: client.infer("digits", inputs, sequence_id=12, sequence_start=True, headers=auth), "sequence_id"),
    ):
        with pytest.raises(InferenceServerException, match=f"parameter '{parameter}' is not supported") as refused:
            attempt()
        assert status_of(refused.value) == "StatusCode.INVALID_ARGUMENT"


def test_an_unknown_and_a_foreign_model_are_not_found_alike(server, client, auth, model_files) -> None:  # noqa: ANN001
    # given a private model of another tenant
    other = tenant("other")
    register(model_files.digits, "theirs", owner=other, visibility="private")
    server.refresh()
    # when this tenant asks for it, or for a model that does not exist / then NOT_FOUND, the same words
    answers = {}
    for name in ("theirs", "nope"):
        with pytest.raises(InferenceServerException) as refused:
            client.infer(name, [digits_input(np.zeros((1, 64)))], headers=auth)
        assert status_of(refused.value) == "StatusCode.NOT_FOUND"
        answers[name] = refused.value.message().replace(name, "NAME")
        with pytest.raises(InferenceServerException, match="unknown model") as meta:
            client.get_model_metadata(name, headers=auth)
        assert status_of(meta.value) == "StatusCode.NOT_FOUND"
    assert answers["theirs"] == answers["nope"]
    # while its own tenant's key is served
    mine = {"authorization": f"Bearer {mint_key('other')}"}
    assert client.infer("theirs", [digits_input(np.zeros((1, 64)))], headers=mine).as_numpy("scores").shape == (1, 10)


def test_an_expired_deadline_is_deadline_exceeded(client, auth, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given a request whose timeout is 1 microsecond / then the server refuses it: DEADLINE_EXCEEDED (or
    # UNAVAILABLE from admission), naming the deadline
    with pytest.raises(InferenceServerException, match="deadline") as refused:
        client.infer("digits", [digits_input(x[:1])], timeout=1, headers=auth)
    assert status_of(refused.value) in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.UNAVAILABLE")
    # and gRPC's own deadline becomes the request's: once passed it is DEADLINE_EXCEEDED, or, when the server
    # reads the call with a sliver of it left, admission's refusal that it cannot finish by then (the run in
    # CI saw both: which one wins is the race between the client's timer and the server's answer)
    with pytest.raises(InferenceServerException) as late:
        client.infer("digits", [digits_input(x[:1])], client_timeout=1e-6, headers=auth)
    status = status_of(late.value)
    assert status in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.UNAVAILABLE"), status
    if status == "StatusCode.UNAVAILABLE":
        assert "deadline" in str(late.value).lower(), late.value
    # while a generous one is served
    assert client.infer("digits", [digits_input(x[:1])], client_timeout=30, headers=auth).as_numpy("scores").size


def test_a_full_queue_is_unavailable_with_a_retry_hint(server, auth, digits_samples, model_files) -> None:  # noqa: ANN001
    x, y = digits_samples
    # given a model whose queue holds one request, with one waiting in its 2 s window
    register(model_files.digits, "held", **HELD)
    server.refresh()
    before = metrics(server)
    box: dict = {}
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def request(i: int) -> service_pb2.ModelInferRequest:
            m = service_pb2.ModelInferRequest(model_name="held")
            m.inputs.add(name="input", datatype="FP32", shape=[1, 64])
            m.raw_input_contents.append(x[i : i + 1].astype(np.float32).tobytes())
            return m

        first = threading.Thread(target=lambda: box.update(r=stub.ModelInfer(request(0), metadata=tuple(auth.items()))))
        first.start()
        plane = server.plane()
        wait_until(lambda: plane.node.queue_depth("held:1") == 1 or not first.is_alive(), "a request in the queue")
        # when another comes / then UNAVAILABLE naming the bound, with retry-after in the trailing metadata
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(request(1), metadata=tuple(auth.items()))
        first.join(timeout=30)
    error = refused.value
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "max_queue_size" in error.details()
    trailers = dict(error.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1 and trailers["ferry-status"] == "503"
    # and the waiting one was answered
    assert np.frombuffer(box["r"].raw_output_contents[0], "<f4").argmax() == y[0]
    after = metrics(server)
    assert grew(before, after, "ferry_requests_total", model="held", version="1", status="503") == 1


def test_over_quota_is_resource_exhausted(server, client, auth) -> None:  # noqa: ANN001
    # given a tenant with two requests left this month
    set_quota(monthly_requests=2)
    server.refresh()
    for _ in range(2):
        client.infer("digits", [digits_input(np.zeros((1, 64)))], headers=auth)
    # when it sends a third / then RESOURCE_EXHAUSTED naming the monthly budget
    with pytest.raises(InferenceServerException, match="monthly") as refused:
        client.infer("digits", [digits_input(np.zeros((1, 64)))], headers=auth)
    assert status_of(refused.value) == "StatusCode.RESOURCE_EXHAUSTED"


def test_repository_index_unload_and_load(client, auth) -> None:  # noqa: ANN001
    index = client.get_model_repository_index(headers=auth, as_json=True)["models"]
    assert {"name": "digits", "version": "1", "state": "READY"} in [
        {k: m.get(k) for k in ("name", "version", "state")} for m in index
    ]
    client.unload_model("digits", headers=auth)
    assert not client.is_model_ready("digits", headers=auth)
    client.load_model("digits", headers=auth)
    assert client.is_model_ready("digits", headers=auth)


def test_the_stream_answers_each_request_and_survives_a_bad_one(client, auth, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=auth)
    try:
        # when ten requests, and one with the wrong datatype among them, go down one stream
        for i in range(10):
            client.async_stream_infer("digits", [digits_input(x[i : i + 1])], request_id=str(i))
        bad = grpcclient.InferInput("input", [1, 64], "FP64")
        bad.set_data_from_numpy(np.zeros((1, 64)))
        client.async_stream_infer("digits", [bad], request_id="bad")
        got = [answers.get(timeout=60) for _ in range(11)]
    finally:
        client.stop_stream()
    # then each good one is answered by its id, and the bad one with its reason, on the same stream
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [e for r, e in got if e is not None]
    assert sorted(results, key=int) == [str(i) for i in range(10)]
    for i in range(10):  # the same scores as the unary call gives
        alone = client.infer("digits", [digits_input(x[i : i + 1])], headers=auth).as_numpy("scores")
        np.testing.assert_allclose(results[str(i)].as_numpy("scores"), alone, rtol=1e-5, atol=1e-6)
    assert len(errors) == 1 and "expected datatype FP32" in str(errors[0])


def test_a_pipeline_is_described_and_ready_as_a_model(server, client, auth) -> None:  # noqa: ANN001
    # given a pipeline of one step on digits, and another tenant's private one
    register_pipeline(name="digits-pipe", spec={"model": "digits", "name": "s"}, tenant=tenant(), visibility="public")
    register_pipeline(name="their-pipe", spec={"model": "digits"}, tenant=tenant("other"), visibility="private")
    server.refresh()
    # when its metadata and readiness are asked over gRPC / then they are a model's, with the derived signature
    meta = client.get_model_metadata("digits-pipe", headers=auth, as_json=True)
    assert meta["name"] == "digits-pipe" and meta["versions"] == ["1"] and meta["platform"] == "ferry_pipeline"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "64"]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": ["-1", "10"]}]
    assert client.is_model_ready("digits-pipe", headers=auth)
    assert client.is_model_ready("digits-pipe", "1", headers=auth)
    # and the other tenant's private pipeline is NOT_FOUND, in the words a missing name gets, and not ready, as a
    # missing name is
    answers = {}
    for name in ("their-pipe", "no-such-pipe"):
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_metadata(name, headers=auth)
        assert status_of(refused.value) == "StatusCode.NOT_FOUND"
        answers[name] = refused.value.message().replace(name, "NAME")
        assert client.is_model_ready(name, headers=auth) is False
    assert answers["their-pipe"] == answers["no-such-pipe"]


def test_a_pipeline_is_inferred_as_a_model(server, client, auth, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given a pipeline of one step on digits, and another tenant's private one
    register_pipeline(name="digits-pipe", spec={"model": "digits", "name": "s"}, tenant=tenant(), visibility="public")
    register_pipeline(name="their-pipe", spec={"model": "digits"}, tenant=tenant("other"), visibility="private")
    server.refresh()
    alone = client.infer("digits", [digits_input(x[:3])], headers=auth).as_numpy("scores")
    # when it is inferred over gRPC, as tritonclient sends (raw_input_contents), with an id and a deadline
    result = client.infer("digits-pipe", [digits_input(x[:3])], request_id="p1", client_timeout=30, headers=auth)
    # then it answers as REST serves it: its step's scores, under the pipeline's name and version
    np.testing.assert_allclose(result.as_numpy("scores"), alone, rtol=1e-5, atol=1e-6)
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == ("digits-pipe", "1", "p1")
    # and typed contents too
    request = service_pb2.ModelInferRequest(model_name="digits-pipe")
    request.inputs.add(name="input", datatype="FP32", shape=[3, 64]).contents.fp32_contents.extend(
        x[:3].astype(np.float32).ravel().tolist()
    )
    request.outputs.add(name="scores")
    with grpc.insecure_channel(server.grpc_url) as channel:
        typed = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, metadata=tuple(auth.items()))
    np.testing.assert_allclose(np.frombuffer(typed.raw_output_contents[0], "<f4").reshape(3, 10), alone, rtol=1e-5)
    # while input the pipeline's signature refuses is INVALID_ARGUMENT, in REST's words
    with pytest.raises(InferenceServerException, match="expected datatype FP32") as refused:
        bad = grpcclient.InferInput("input", [1, 64], "FP64")
        bad.set_data_from_numpy(np.zeros((1, 64)))
        client.infer("digits-pipe", [bad], headers=auth)
    assert status_of(refused.value) == "StatusCode.INVALID_ARGUMENT"
    # and another tenant's private pipeline is NOT_FOUND, as a missing name is
    with pytest.raises(InferenceServerException, match="unknown model") as hidden:
        client.infer("their-pipe", [digits_input(x[:1])], headers=auth)
    assert status_of(hidden.value) == "StatusCode.NOT_FOUND"


def test_a_stream_error_carries_its_code(server, auth) -> None:  # noqa: ANN001
    # given a stream with a request the model refuses, and one for a model that does not exist
    bad = service_pb2.ModelInferRequest(model_name="digits", id="bad")
    bad.inputs.add(name="input", datatype="FP64", shape=[1, 64])
    bad.raw_input_contents.append(np.zeros((1, 64)).tobytes())
    missing = service_pb2.ModelInferRequest(model_name="nope", id="missing")
    missing.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    missing.raw_input_contents.append(np.zeros((1, 64), np.float32).tobytes())
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter([bad, missing]), metadata=tuple(auth.items()), timeout=60))
    # then each is answered with REST's message, and the status a unary call would end with in its parameters
    by_id = {a.infer_response.id: a for a in answers}
    assert sorted(by_id) == ["bad", "missing"]
    got = {
        rid: {k: v.string_param for k, v in a.infer_response.parameters.items()} | {"error": a.error_message}
        for rid, a in by_id.items()
    }
    assert got["bad"]["grpc-code"] == "INVALID_ARGUMENT" and got["bad"]["ferry-status"] == "400", got
    assert "expected datatype FP32" in got["bad"]["error"]
    assert got["missing"]["grpc-code"] == "NOT_FOUND" and got["missing"]["ferry-status"] == "404", got


def test_past_the_concurrency_limit_a_call_is_unavailable_with_a_retry_hint(
    grpc_port, settings, transactional_db, model_files, digits_samples, request
) -> None:  # noqa: ANN001
    x, y = digits_samples
    # given a process that serves one gRPC call at a time, and a model that holds a request 2 s in its window
    settings.FERRY_GRPC_MAX_CONCURRENT_RPCS = 1
    register(model_files.digits, "held", **HELD)
    server = request.getfixturevalue("live_server")
    metadata = (("authorization", f"Bearer {server.key}"),)
    message = service_pb2.ModelInferRequest(model_name="held")
    message.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    message.raw_input_contents.append(x[:1].astype(np.float32).tobytes())
    box: dict = {}
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        first = threading.Thread(target=lambda: box.update(r=stub.ModelInfer(message, metadata=metadata)))
        first.start()
        plane = server.plane()
        wait_until(lambda: plane.node.queue_depth("held:1") == 1 or not first.is_alive(), "a call being served")
        # when another call comes, a unary one or a stream / then UNAVAILABLE with REST's 503 and a retry hint,
        # not RESOURCE_EXHAUSTED (the quota's code)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ServerMetadata(service_pb2.ServerMetadataRequest())
        with pytest.raises(grpc.RpcError) as stream:
            list(stub.ModelStreamInfer(iter([message]), metadata=metadata))
        # while the health calls are answered: a probe of a busy process must not fail
        assert stub.ServerLive(service_pb2.ServerLiveRequest()).live
        assert stub.ServerReady(service_pb2.ServerReadyRequest()).ready
        ready = stub.ModelReady(service_pb2.ModelReadyRequest(name="held"), metadata=metadata)
        assert ready.ready
        first.join(timeout=30)
        # and once the first is answered, calls are served again
        assert stub.ServerMetadata(service_pb2.ServerMetadataRequest()).name == "ferry"
    for error in (refused.value, stream.value):
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "concurrent calls" in error.details()
        trailers = dict(error.trailing_metadata())
        assert trailers["ferry-status"] == "503" and trailers["retry-after"] == "1"
    assert np.frombuffer(box["r"].raw_output_contents[0], "<f4").argmax() == y[0]


def test_the_deadline_counts_from_the_calls_arrival(server, client, auth, digits_samples, monkeypatch) -> None:  # noqa: ANN001
    x, _ = digits_samples
    seen: list = []
    admit, serve = InferenceRequest.admit, Gateway.serve

    async def slow_admit(self, *args):  # noqa: ANN001, ANN002, ANN202
        await asyncio.sleep(0.2)  # a quota's round trip that takes 200 ms
        return await admit(self, *args)

    async def watched(self, request):  # noqa: ANN001, ANN202
        seen.append((request.waited, request.timeout))
        return await serve(self, request)

    monkeypatch.setattr(InferenceRequest, "admit", slow_admit)
    monkeypatch.setattr(Gateway, "serve", watched)
    # given a quota that takes 200 ms / when a call without a deadline, and one with a 5 s deadline, come
    client.infer("digits", [digits_input(x[:1])], headers=auth)
    client.infer("digits", [digits_input(x[:1])], client_timeout=5, headers=auth)
    (waited, timeout), (waited_too, limit) = seen
    # then the time spent before the gateway counts from the request's budget, as REST's does
    assert waited >= 0.2 and timeout is None
    # and the client's deadline, moved to the same origin, is counted once: not past the 5 s it set (gRPC sends
    # a deadline of 1 to 10 s rounded up to 10 ms), where counting the 200 ms twice would pass 5.2 s
    assert waited_too >= 0.2 and limit is not None and waited_too < limit < 5.1


# -- the audit of the protocol's corners ----------------------------------------------------------------


def test_model_ready_is_false_alike_for_an_unknown_and_a_foreign_model(server, client, auth, model_files) -> None:  # noqa: ANN001
    # given a private model of another tenant
    register(model_files.digits, "theirs", owner=tenant("other"), visibility="private")
    server.refresh()
    # when this tenant asks whether it, a missing model, or a missing version is ready / then ready=false with OK,
    # as Triton answers for a model it does not have, the same for all three
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for name, version in (("theirs", ""), ("nope", ""), ("digits", "9")):
            answer, rpc = stub.ModelReady.with_call(
                service_pb2.ModelReadyRequest(name=name, version=version), metadata=tuple(auth.items())
            )
            assert answer == service_pb2.ModelReadyResponse(ready=False), name
            assert rpc.code() == grpc.StatusCode.OK
    # while its own tenant sees it ready, and a key is still needed to ask
    assert client.is_model_ready("theirs", headers={"authorization": f"Bearer {mint_key('other')}"})
    with pytest.raises(InferenceServerException) as refused:
        client.is_model_ready("digits")
    assert status_of(refused.value) == "StatusCode.UNAUTHENTICATED"


def test_a_load_with_a_config_or_files_is_invalid_argument(server, client, auth) -> None:  # noqa: ANN001
    # when a load sends Triton's config override, or files / then INVALID_ARGUMENT naming the parameter
    for options, named in (({"config": "{}"}, "'config'"), ({"config": "{}", "files": {"file:1/model.pt": b"x"}}, "")):
        with pytest.raises(InferenceServerException, match="not supported") as refused:
            client.load_model("digits", headers=auth, **options)
        assert status_of(refused.value) == "StatusCode.INVALID_ARGUMENT"
        assert named in refused.value.message()
    request = service_pb2.RepositoryModelLoadRequest(model_name="digits")
    request.parameters["file:1/model.pt"].bytes_param = b"x"
    with grpc.insecure_channel(server.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as files:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).RepositoryModelLoad(
                request, metadata=tuple(auth.items())
            )
    assert files.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'file:1/model.pt'" in files.value.details()
    # and nothing was done: the model is served as it was, and a plain load still works
    assert client.is_model_ready("digits", headers=auth)
    client.load_model("digits", headers=auth)


def test_the_stream_sends_the_final_response_a_request_asks_for(client, auth, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=auth)
    try:
        # when a request and a bad one ask for the empty final response (tritonclient's enable_empty_final_response)
        client.async_stream_infer("digits", [digits_input(x[:1])], request_id="good", enable_empty_final_response=True)
        bad = grpcclient.InferInput("input", [1, 64], "FP64")
        bad.set_data_from_numpy(np.zeros((1, 64)))
        client.async_stream_infer("digits", [bad], request_id="bad", enable_empty_final_response=True)
        got = [answers.get(timeout=60) for _ in range(4)]
    finally:
        client.stop_stream()
    # then each is answered, and then finished by an empty response with its id, flagged final
    results = [r for r, e in got if e is None]
    errors = [e for r, e in got if e is not None]
    assert len(errors) == 1 and "expected datatype FP32" in str(errors[0])

    def final(result) -> bool:  # noqa: ANN001
        return result.get_response().parameters["triton_final_response"].bool_param

    finals = {r.get_response().id: r for r in results if final(r)}
    data = [r for r in results if not final(r)]
    assert sorted(finals) == ["bad", "good"]
    assert all(not r.get_response().outputs for r in finals.values())
    assert [r.get_response().id for r in data] == ["good"] and data[0].as_numpy("scores").shape == (1, 10)
    # the good request's answer came before its final one
    order = [r.get_response().id + ("/final" if final(r) else "") for r, e in got if e is None]
    assert order.index("good") < order.index("good/final")


def documented_codes() -> dict[int, str]:
    """docs/grpc.md's error table: the gRPC code it says each REST status becomes."""
    table = (Path(__file__).resolve().parent.parent / "docs" / "grpc.md").read_text().split("## Errors", 1)[1]
    codes = {}
    for line in table.strip().split("\n\n", 1)[0].splitlines()[2:]:
        statuses, code = line.strip().strip("|").split("|")
        for status in re.findall(r"\b\d{3}\b", statuses.split("(")[0]):
            codes[int(status)] = code.strip().strip("`")
    return codes


def test_an_oversize_message_is_what_the_docs_say(server, auth) -> None:  # noqa: ANN001
    # given a message one byte over the bound
    limit = django_settings.FERRY_MAX_INFER_BODY_BYTES
    message = service_pb2.ModelInferRequest(model_name="digits")
    message.inputs.add(name="input", datatype="FP32", shape=[1, 64])
    message.raw_input_contents.append(b"\0" * (limit + 1))
    # when it is sent / then grpcio refuses it before Ferry sees it: RESOURCE_EXHAUSTED, without ferry-status
    with grpc.insecure_channel(server.grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(message, metadata=tuple(auth.items()))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ferry-status" not in dict(refused.value.trailing_metadata() or ())
    # and the docs' table says so, as the status mapping does for every status it lists
    documented = documented_codes()
    assert documented[413] == "RESOURCE_EXHAUSTED"
    assert documented == {status: CODES[status].name for status in documented}
    assert {400, 401, 403, 404, 409, 413, 422, 429, 503, 504} <= set(documented)


def test_statistics_are_one_answer_on_both_protocols(server, client, auth, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    client.infer("digits", [digits_input(x[:3])], headers=auth)
    # when the statistics are asked over gRPC and over REST, all models' and one version's
    for name, version, path in (
        ("", "", "/v2/models/stats"),
        ("digits", "", "/v2/models/digits/stats"),
        ("digits", "1", "/v2/models/digits/versions/1/stats"),
    ):
        over_grpc = client.get_inference_statistics(name, version, headers=auth, as_json=True)
        over_rest = call(server, "GET", path)
        assert over_rest.status == 200, over_rest.body
        # then they are the same figures (protobuf's JSON writes 64-bit integers as strings and leaves out zeros)
        assert over_grpc == json_format.MessageToDict(
            json_format.ParseDict(over_rest.json(), service_pb2.ModelStatisticsResponse()),
            preserving_proto_field_name=True,
        )
    # and both protocols' server metadata claim the extension
    assert "statistics" in client.get_server_metadata(as_json=True)["extensions"]
    assert "statistics" in call(server, "GET", "/v2").json()["extensions"]
