"""The gRPC side's pieces without a server: the vendored protos' generated code, the codec between
ModelInferRequest/Response and the gateway's Inference/Served, the deadline gRPC hands in, and the error map."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc._utils import _get_inference_request

from serving.dataplane.errors import ServingError, Shed
from serving.dataplane.gateway.gateway import Gateway
from serving.dataplane.gateway.request import Served
from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.grpc import codec, generate
from serving.dataplane.grpc.proto import grpc_service_pb2 as pb
from serving.dataplane.grpc.status import code_of, trailing
from serving.dataplane.http.protocol import ProtocolError, TensorSpec, encode_infer_response, parse_infer_request
from tests.test_admission import Clock
from tests.test_latency_budget import Recording, gateway, snapshot


def version(**changes: object) -> VersionEntry:
    base = snapshot(300).models["m"].versions[1]
    return dataclasses.replace(base, **changes)


def message(x: np.ndarray, *, raw: bool = True, datatype: str = "FP32", **fields: object) -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m", **fields)
    tensor = m.inputs.add(name="input", datatype=datatype, shape=x.shape)
    if raw:
        m.raw_input_contents.append(x.tobytes())
    else:
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    return m


def decoded(m: pb.ModelInferRequest, entry: VersionEntry | None = None):  # noqa: ANN201
    request = codec.request_of(m, 1)
    request.decode(request, entry or version())  # type: ignore[misc]
    return request


def test_the_checked_in_code_is_what_protoc_makes_of_the_vendored_protos(tmp_path: Path) -> None:
    # given the vendored protos / when regenerated / then the modules are byte for byte the checked-in ones
    for path in generate.generate(tmp_path):
        assert path.read_text() == (generate.PROTO_DIR / path.name).read_text(), path.name
    assert (generate.PROTO_DIR / "LICENSE").read_text().startswith("Copyright (c)")


def test_raw_and_typed_contents_decode_to_the_same_tensor() -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    raw, typed = decoded(message(x)), decoded(message(x, raw=False))
    for request in (raw, typed):
        assert request.rows == 2
        np.testing.assert_array_equal(request.inputs["input"], x)
        assert request.inputs["input"].dtype == np.float32


def test_parameters_id_and_outputs_are_read() -> None:
    m = message(np.zeros((1, 4), np.float32), id="r-1")
    m.parameters["priority"].uint64_param = 2
    m.parameters["timeout"].int64_param = 5000
    m.outputs.add(name="scores")
    request = codec.request_of(m, 7, tier=1)
    assert (request.id, request.viewer, request.outputs) == ("r-1", 7, ("scores",))
    assert request.parameters == {"priority": 2, "timeout": 5000}


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: message(np.zeros((1, 4), np.float64), datatype="FP64"), "expected datatype FP32"),
        (lambda: message(np.zeros((1, 5), np.float32)), "expected shape"),
        (lambda: message(np.zeros((9, 4), np.float32)), "exceeds max_batch_size"),
        (lambda: _short_raw(), "raw_input_contents holds 12 bytes"),
        (lambda: _fp16_typed(), "FP16 data must be sent in raw_input_contents"),
        (lambda: _wrong_field(), "belongs in 'fp32_contents'"),
        (lambda: _renamed("other"), "unknown input 'other'"),
        (lambda: pb.ModelInferRequest(model_name="m"), "non-empty"),
    ],
)
def test_input_the_signature_refuses_is_a_protocol_error(build, fragment: str) -> None:  # noqa: ANN001
    entry = version(batching=dataclasses.replace(version().batching, max_batch_size=8))
    if "FP16" in fragment:
        entry = version(inputs=(TensorSpec("input", "FP16", (4,)),))
    with pytest.raises(ProtocolError, match=fragment) as refused:
        decoded(build(), entry)
    assert refused.value.status == 400


def _short_raw() -> pb.ModelInferRequest:
    m = message(np.zeros((1, 4), np.float32))
    m.raw_input_contents[0] = b"\0" * 12
    return m


def _fp16_typed() -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m")
    m.inputs.add(name="input", datatype="FP16", shape=[1, 4]).contents.fp32_contents.extend([0.0] * 4)
    return m


def _wrong_field() -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m")
    m.inputs.add(name="input", datatype="FP32", shape=[1, 4]).contents.int_contents.extend([0] * 4)
    return m


def _renamed(name: str) -> pb.ModelInferRequest:
    m = message(np.zeros((1, 4), np.float32))
    m.inputs[0].name = name
    return m


def triton_message(
    inputs: list, outputs: list | None = None, sequence: tuple = (0, False, False)
) -> pb.ModelInferRequest:
    """The message tritonclient.grpc sends, as this server's generated code reads it."""
    sent = _get_inference_request("m", inputs, "", "", outputs, *sequence, 0, None, None)
    return pb.ModelInferRequest.FromString(sent.SerializeToString())


def _zeros_input() -> grpcclient.InferInput:
    return grpcclient.InferInput("input", [1, 4], "FP32").set_data_from_numpy(np.zeros((1, 4), np.float32))


def _shared_input() -> grpcclient.InferInput:
    inp = grpcclient.InferInput("input", [1, 4], "FP32")
    inp.set_shared_memory("region", 16)
    return inp


def _shared_output() -> grpcclient.InferRequestedOutput:
    out = grpcclient.InferRequestedOutput("scores")
    out.set_shared_memory("region", 8, offset=8)
    return out


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: triton_message([_zeros_input()], [grpcclient.InferRequestedOutput("scores", class_count=2)]),
         "output 'scores': parameter 'classification' is not supported"),
        (lambda: triton_message([_shared_input()]), "input 'input': parameter 'shared_memory_region' is not supported"),
        (lambda: triton_message([_zeros_input()], [_shared_output()]),
         "output 'scores': parameter 'shared_memory_region' is not supported"),
        (lambda: triton_message([_zeros_input()], sequence=(7, True, False)), "parameter 'sequence_id'"),
        (lambda: triton_message([_zeros_input()], sequence=("s", False, False)), "parameter 'sequence_id'"),
    ],
)  # fmt: skip
def test_an_extension_ferry_does_not_implement_is_invalid_argument(build, fragment: str) -> None:  # noqa: ANN001
    # given tritonclient.grpc's message asking for classification, shared memory or a sequence
    m = build()
    # when decoded for a model, or written as a pipeline's REST body and parsed / then refused, naming it (400:
    # INVALID_ARGUMENT), rather than served as if it had not asked
    with pytest.raises(ProtocolError, match=fragment) as refused:
        decoded(m)
    assert refused.value.status == 400 and code_of(refused.value.status) is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ProtocolError, match=fragment):
        body, length = codec.rest_body(m, timeout=None)
        parse_infer_request(body, length, version().inputs, max_rows=16)


def test_typed_floats_that_are_not_finite_are_values() -> None:
    # given typed fp32 contents with -inf, NaN and inf (a raw buffer carries any bits anyway)
    x = np.array([[-np.inf, np.nan, np.inf, 0.5]], np.float32)
    m = message(x, raw=False)
    # when decoded for a model, and when written as a pipeline's REST body and parsed / then they are themselves
    np.testing.assert_array_equal(decoded(m).inputs["input"], x)
    body, length = codec.rest_body(m, timeout=None)
    np.testing.assert_array_equal(parse_infer_request(body, length, version().inputs, max_rows=16).inputs["input"], x)


def test_bf16_travels_raw_as_its_bits_both_ways() -> None:
    # given tritonclient.grpc's BF16 input (ml_dtypes.bfloat16, raw) for a BF16 signature
    values = np.array([[1.5, -np.inf, 0.1, 3e38]], ml_dtypes.bfloat16)
    inp = grpcclient.InferInput("input", [1, 4], "BF16").set_data_from_numpy(values)
    entry = version(inputs=(TensorSpec("input", "BF16", (4,)),), outputs=(TensorSpec("scores", "BF16", (4,)),))
    # when decoded / then the tensor is its bits
    request = decoded(triton_message([inp]), entry)
    np.testing.assert_array_equal(request.inputs["input"], values.view(np.uint16))
    # and a BF16 output (its bits) reads back in tritonclient.grpc as the same bfloat16 values
    response = codec.response_of(Served(entry, entry, {"scores": request.inputs["input"]}), request)
    got = grpcclient.InferResult(response).as_numpy("scores")
    assert response.outputs[0].datatype == "BF16" and got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), values.view(np.uint16))
    # typed contents have no BF16 field, as in Triton
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="input", datatype="BF16", shape=[1, 4]).contents.fp32_contents.extend([0.0] * 4)
    with pytest.raises(ProtocolError, match="BF16 data must be sent in raw_input_contents"):
        decoded(typed, entry)


def test_an_output_asked_twice_is_refused() -> None:
    m = message(np.zeros((1, 4), np.float32))
    m.outputs.add(name="scores")
    m.outputs.add(name="scores")
    with pytest.raises(ProtocolError, match="more than once"):
        codec.request_of(m, 1)


def test_outputs_go_back_raw_little_endian_and_name_a_fallback() -> None:
    asked = version()
    served_by = dataclasses.replace(asked, model="small", version=3)
    scores = np.arange(4, dtype=np.float32).reshape(2, 2)
    request = codec.request_of(message(np.zeros((2, 4), np.float32), id="x"), 1)
    response = codec.response_of(Served(asked, served_by, {"scores": scores}), request)
    assert (response.model_name, response.model_version, response.id) == ("small", "3", "x")
    assert response.parameters["fallback_from"].string_param == asked.key
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("scores", "FP32", [2, 2])
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], "<f4").reshape(2, 2), scores)


# -- the deadline: gRPC's own becomes the request's, within the budget ----------------------------------


async def deadline_left(grpc_timeout: float | None, budget_ms: int = 300) -> float:
    clock, transport = Clock(), Recording()
    gw = gateway(snapshot(budget_ms), transport, clock)
    served = await gw.serve(codec.request_of(message(np.zeros((1, 4), np.float32)), None, timeout=grpc_timeout))
    assert served.outputs["scores"].shape == (1, 2)
    return transport.deadlines[0] - clock.now


async def test_a_grpc_deadline_shorter_than_the_budget_is_the_requests() -> None:
    assert await deadline_left(0.05) == pytest.approx(0.05)


async def test_a_grpc_deadline_longer_than_the_budget_is_cut_to_it() -> None:
    assert await deadline_left(30.0) == pytest.approx(0.300)
    assert await deadline_left(None) == pytest.approx(0.300)


async def test_a_timeout_parameter_shorter_than_the_grpc_deadline_wins() -> None:
    m = message(np.zeros((1, 4), np.float32))
    m.parameters["timeout"].int64_param = 20_000  # 20 ms, in microseconds as Triton's
    clock, transport = Clock(), Recording()
    await gateway(snapshot(300), transport, clock).serve(codec.request_of(m, None, timeout=0.1))
    assert transport.deadlines[0] - clock.now == pytest.approx(0.020)
    assert Gateway._timeout(300, {}, 0.1) == pytest.approx(0.1)


# -- errors as Triton maps them -------------------------------------------------------------------------


def test_statuses_map_as_triton_maps_them_with_the_retry_hint_in_trailing_metadata() -> None:
    assert code_of(400) is grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(401) is grpc.StatusCode.UNAUTHENTICATED
    assert code_of(403) is grpc.StatusCode.PERMISSION_DENIED
    assert code_of(404) is grpc.StatusCode.NOT_FOUND
    assert code_of(429) is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(503) is grpc.StatusCode.UNAVAILABLE
    assert code_of(504) is grpc.StatusCode.DEADLINE_EXCEEDED
    assert code_of(500) is grpc.StatusCode.INTERNAL
    shed = dict(trailing(Shed("queue full", reason="queue_full", tier=1, retry_after=1.2)))
    assert shed == {"ferry-status": "503", "retry-after": "2"}
    assert dict(trailing(ServingError("bad", status=400))) == {"ferry-status": "400"}


def test_a_message_as_a_rest_body_parses_as_rest_parses_it() -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)  # the test version takes rows of 4
    specs = version().inputs
    for raw in (True, False):
        # given a message with its inputs raw or typed, an id, an output asked for and the client's 5 ms timeout
        m = message(x, raw=raw, id="r1")
        m.outputs.add(name="scores")
        m.parameters["timeout"].int64_param = 5000
        body, length = codec.rest_body(m, timeout=30.0)
        # when REST's parser reads the body it makes of it
        parsed = parse_infer_request(body, length, specs, max_rows=16)
        # then it reads the same tensor, id and output (in binary), and the shorter timeout, the client's
        np.testing.assert_array_equal(parsed.inputs["input"], x)
        assert parsed.id == "r1" and [(o.name, o.binary) for o in parsed.outputs] == [("scores", True)]
        assert parsed.parameters["timeout"] == 5000
    # gRPC's deadline (seconds from arrival) is the timeout where it is the shorter
    body, length = codec.rest_body(message(x), timeout=0.002)
    assert parse_infer_request(body, length, specs, max_rows=16).parameters["timeout"] == 2000
    # a timeout REST refuses is left for it to refuse, in its words
    bad = message(x)
    bad.parameters["timeout"].int64_param = -1
    body, length = codec.rest_body(bad, timeout=1.0)
    assert parse_infer_request(body, length, specs, max_rows=16).parameters["timeout"] == -1
    # and what the REST side answers reads back as gRPC's response, outputs raw
    scores = np.arange(20, dtype=np.float32).reshape(2, 10)
    payload, headers = encode_infer_response(
        model_name="pipe",
        model_version="1",
        request_id="r1",
        outputs={"scores": scores},
        output_specs=version().outputs,
        requested=None,
        binary_output=True,
        parameters={"fallback_from": "pipe:1"},
    )
    response = codec.response_of_rest(payload, headers)
    assert (response.model_name, response.model_version, response.id) == ("pipe", "1", "r1")
    assert response.parameters["fallback_from"].string_param == "pipe:1"
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("scores", "FP32", [2, 10])]
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], "<f4").reshape(2, 10), scores)
