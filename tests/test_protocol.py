"""Tests for serving.dataplane.http.protocol: the Open Inference Protocol codec (pure Python, no Django)."""

from __future__ import annotations

import json
import random

import ml_dtypes
import numpy as np
import orjson
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from serving.dataplane.http.protocol import (
    DATATYPES,
    DEFAULT_MAX_DIM,
    InferRequest,
    ProtocolError,
    RequestedOutput,
    TensorSpec,
    bf16_to_float32,
    encode_infer_response,
    error_body,
    float_to_bf16,
    parse_infer_request,
)

X = [TensorSpec("x", "FP32", (64,))]
MULTI = [
    TensorSpec("a", "INT64", (-1,)),
    TensorSpec("b", "BOOL", (2,)),
    TensorSpec("h", "FP16", (3,)),
]
OUT = [TensorSpec("y", "FP32", (2,)), TensorSpec("label", "INT64", ())]


def parse(req: dict, specs=X, max_rows: int = 8, tail: bytes | None = None) -> InferRequest:
    header = orjson.dumps(req)
    if tail is None:
        return parse_infer_request(header, None, specs, max_rows=max_rows)
    return parse_infer_request(header + tail, len(header), specs, max_rows=max_rows)


def x_input(**overrides) -> dict:
    item = {"name": "x", "datatype": "FP32", "shape": [1, 64], "data": list(range(64))}
    item.update(overrides)
    return item


def expect_400(fragment: str, req: dict, specs=X, max_rows: int = 8, tail: bytes | None = None):
    with pytest.raises(ProtocolError) as exc:
        parse(req, specs, max_rows, tail)
    assert exc.value.status == 400
    assert fragment in exc.value.message
    return exc.value


def triton_request(
    inputs, outputs=None, request_id="", parameters=None, sequence=(0, False, False)
) -> tuple[bytes, int | None]:
    return _get_inference_request(
        inputs=inputs,
        request_id=request_id,
        outputs=outputs,
        sequence_id=sequence[0],
        sequence_start=sequence[1],
        sequence_end=sequence[2],
        priority=0,
        timeout=None,
        custom_parameters=parameters,
    )


def header_value(headers, key: bytes) -> bytes | None:
    return dict(headers).get(key)


# --- types -------------------------------------------------------------------------------


def test_datatypes():
    assert set(DATATYPES) == {
        "BOOL", "UINT8", "UINT16", "UINT32", "UINT64",
        "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16",
    }  # fmt: skip
    assert DATATYPES["BOOL"].itemsize == 1
    assert DATATYPES["BF16"] == np.uint16  # its bits: numpy has no bfloat16
    assert DATATYPES["FP16"] == np.float16 and DATATYPES["INT64"] == np.int64


def test_tensor_spec_from_dict_and_metadata():
    spec = TensorSpec.from_dict({"name": "x", "datatype": "FP32", "shape": [-1, 3]})
    assert spec == TensorSpec("x", "FP32", (-1, 3))
    assert isinstance(spec.shape, tuple)
    assert spec.to_metadata() == {"name": "x", "datatype": "FP32", "shape": [-1, -1, 3]}
    assert TensorSpec("s", "INT64", ()).to_metadata()["shape"] == [-1]


@pytest.mark.parametrize(
    "d",
    [
        {"name": "x", "datatype": "BYTES", "shape": [1]},
        {"name": "x", "datatype": "fp32", "shape": [1]},
        {"name": "x", "datatype": "FP32", "shape": [-2]},
        {"name": "x", "datatype": "FP32", "shape": [1.0]},
        {"name": "x", "datatype": "FP32", "shape": [True]},
        {"name": "x", "datatype": "FP32", "shape": "3"},
        {"name": "", "datatype": "FP32", "shape": [1]},
        {"name": 3, "datatype": "FP32", "shape": [1]},
        {"name": "x", "datatype": ["FP32"], "shape": [1]},
        {"name": "x", "shape": [1]},
        ["x", "FP32", [1]],
    ],
)
def test_tensor_spec_rejects(d):
    with pytest.raises(ValueError):
        TensorSpec.from_dict(d)


def test_protocol_error_and_error_body():
    e = ProtocolError("bad")
    assert (e.status, e.message, str(e)) == (400, "bad", "bad")
    assert ProtocolError("boom", 500).status == 500
    assert orjson.loads(error_body('it\'s "broken"')) == {"error": 'it\'s "broken"'}


# --- JSON requests -----------------------------------------------------------------------


def test_json_flat():
    r = parse({"inputs": [x_input()]})
    x = r.inputs["x"]
    assert x.dtype == np.float32 and x.shape == (1, 64)
    assert np.array_equal(x[0], np.arange(64, dtype=np.float32))
    assert (r.id, r.rows, r.outputs, r.binary_output, r.parameters) == (None, 1, None, False, {})


def test_json_nested():
    data = np.arange(128, dtype=np.float32).reshape(2, 64)
    r = parse({"inputs": [x_input(shape=[2, 64], data=data.tolist())]})
    assert r.rows == 2 and np.array_equal(r.inputs["x"], data)


def test_json_nested_with_different_nesting_is_row_major():
    r = parse({"inputs": [x_input(shape=[2, 64], data=np.arange(128).reshape(8, 16).tolist())]})
    assert np.array_equal(r.inputs["x"].ravel(), np.arange(128))


def test_json_multi_types():
    r = parse(
        {
            "inputs": [
                {"name": "h", "datatype": "FP16", "shape": [2, 3], "data": [0.5, 1, 2, 3, 4, 65504]},
                {"name": "b", "datatype": "BOOL", "shape": [2, 2], "data": [True, False, 0, 1]},
                {"name": "a", "datatype": "INT64", "shape": [2, 1], "data": [[2**62], [-(2**63)]]},
            ]
        },
        MULTI,
    )
    assert r.inputs["h"].dtype == np.float16 and r.inputs["h"][1, 2] == 65504
    assert r.inputs["b"].dtype == np.bool_
    assert r.inputs["b"].tolist() == [[True, False], [False, True]]
    assert r.inputs["a"].dtype == np.int64 and r.inputs["a"].tolist() == [[2**62], [-(2**63)]]


@pytest.mark.parametrize(
    ("datatype", "data", "expected"),
    [
        ("UINT8", [0, 255], [0, 255]),
        ("INT8", [-128, 127], [-128, 127]),
        ("UINT64", [0, 2**64 - 1], [0, 2**64 - 1]),
        ("UINT64", [2**63, 1], [2**63, 1]),
        ("FP64", [1, 2.5], [1.0, 2.5]),
        ("FP32", [3, -1e30], [3.0, np.float32(-1e30)]),
        ("BOOL", [1, 0], [True, False]),
    ],
)
def test_json_values_that_fit(datatype, data, expected):
    spec = [TensorSpec("v", datatype, (2,))]
    r = parse({"inputs": [{"name": "v", "datatype": datatype, "shape": [1, 2], "data": data}]}, spec)
    assert r.inputs["v"].dtype == DATATYPES[datatype]
    assert r.inputs["v"].ravel().tolist() == expected


@pytest.mark.parametrize(
    ("datatype", "data", "fragment"),
    [
        ("INT64", [1.5, 2], "must be integers"),
        ("INT64", [1.0, 2], "must be integers"),
        ("INT64", [True, False], "must be integers"),
        ("UINT8", [300, 1], "out of range for UINT8"),
        ("UINT8", [-1, 1], "out of range for UINT8"),
        ("INT8", [128, 1], "out of range for INT8"),
        ("UINT64", [-1, 2**63], "out of range for UINT64"),
        ("UINT64", [1.5, 2**63], "must be integers"),
        ("FP16", [70000, 1], "out of range for FP16"),
        ("FP32", [1e300, 1], "out of range for FP32"),
        ("FP32", [1, -1e300], "out of range for FP32"),
        ("FP16", [-70000, 1], "out of range for FP16"),
        ("FP16", [-(2**63), 1], "out of range for FP16"),  # |INT64_MIN| overflows int64: not a small number
        ("BF16", [3.4e38, 1], "out of range for BF16"),
        ("BF16", [-1e39, 1], "out of range for BF16"),
        ("BF16", ["1", 2], "must be numbers"),
        ("FP32", ["1", 2], "must be numbers"),
        ("FP32", [None, 2], "must be numbers"),
        ("FP32", [{}, 2], "must be numbers"),
        ("FP32", [True, False], "must be numbers"),
        ("BOOL", [2, 0], "true/false or 0/1"),
        ("BOOL", [0.0, 1.0], "true/false or 0/1"),
        ("BOOL", ["true", "false"], "true/false or 0/1"),
        ("FP32", [[1, 2], [3]], "ragged"),
        ("FP32", [[1], 2], "ragged"),
        ("FP32", 3, "must be a list"),
        ("FP32", {"a": 1}, "must be a list"),
        ("FP32", [1, 2, 3], "expected 2 elements, got 3"),
        ("FP32", [[1, 2, 3]], "expected 2 elements, got 3"),
        ("FP32", [], "expected 2 elements, got 0"),
    ],
)
def test_json_values_rejected(datatype, data, fragment):
    spec = [TensorSpec("v", datatype, (2,))]
    item = {"name": "v", "datatype": datatype, "shape": [1, 2], "data": data}
    expect_400(fragment, {"inputs": [item]}, spec)


def test_zero_sized_fixed_dim():
    spec = [TensorSpec("z", "FP32", (0,))]
    r = parse({"inputs": [{"name": "z", "datatype": "FP32", "shape": [3, 0], "data": []}]}, spec)
    assert r.inputs["z"].shape == (3, 0) and r.rows == 3
    r = parse(
        {"inputs": [{"name": "z", "datatype": "FP32", "shape": [3, 0],
                     "parameters": {"binary_data_size": 0}}]},
        spec, tail=b"",
    )  # fmt: skip
    assert r.inputs["z"].shape == (3, 0)


def test_request_fields():
    r = parse(
        {
            "id": "req-1",
            "parameters": {"binary_data_output": True, "custom": 7},
            "outputs": [
                {"name": "y"},
                {"name": "label", "parameters": {"binary_data": False}},
                {"name": "z", "parameters": {"binary_data": True, "classification": 0}},
            ],
            "inputs": [x_input()],
        }
    )
    assert r.id == "req-1"
    assert r.binary_output is True
    assert r.parameters == {"binary_data_output": True, "custom": 7}
    assert r.outputs == [
        RequestedOutput("y", True),
        RequestedOutput("label", False),
        RequestedOutput("z", True),
    ]
    r = parse({"outputs": [{"name": "y"}], "inputs": [x_input()]})
    assert r.outputs == [RequestedOutput("y", False)] and r.binary_output is False
    assert parse({"outputs": [], "inputs": [x_input()]}).outputs is None


# --- binary requests ---------------------------------------------------------------------


def test_binary_input_is_zero_copy():
    arr = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    item = x_input(shape=[3, 64], parameters={"binary_data_size": arr.nbytes})
    del item["data"]
    r = parse({"inputs": [item]}, tail=arr.tobytes())
    assert r.rows == 3 and np.array_equal(r.inputs["x"], arr)
    assert not r.inputs["x"].flags.owndata


def test_mixed_binary_and_json_follows_request_order():
    a = np.array([[5, -6, 7], [8, 9, 10]], dtype=np.int64)
    h = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.float16)
    req = {
        "inputs": [
            {"name": "h", "datatype": "FP16", "shape": [2, 3], "parameters": {"binary_data_size": h.nbytes}},
            {"name": "b", "datatype": "BOOL", "shape": [2, 2], "data": [[True, True], [False, True]]},
            {"name": "a", "datatype": "INT64", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
        ]
    }
    r = parse(req, MULTI, tail=h.tobytes() + a.tobytes())
    assert np.array_equal(r.inputs["h"], h) and r.inputs["h"].dtype == np.float16
    assert np.array_equal(r.inputs["a"], a) and r.inputs["a"].dtype == np.int64
    assert r.inputs["b"].tolist() == [[True, True], [False, True]]


def test_binary_bool():
    spec = [TensorSpec("b", "BOOL", (2,))]
    item = {"name": "b", "datatype": "BOOL", "shape": [2, 2], "parameters": {"binary_data_size": 4}}
    r = parse({"inputs": [item]}, spec, tail=bytes([1, 0, 0, 1]))
    assert r.inputs["b"].dtype == np.bool_ and r.inputs["b"].tolist() == [[True, False], [False, True]]
    expect_400("0 or 1", {"inputs": [item]}, spec, tail=bytes([1, 0, 2, 1]))


def test_header_length_equal_to_body_without_binary():
    header = orjson.dumps({"inputs": [x_input()]})
    r = parse_infer_request(header, len(header), X, max_rows=1)
    assert r.inputs["x"].shape == (1, 64)


def binary_x(size: int = 256, **parameters) -> dict:
    item = x_input(parameters={"binary_data_size": size, **parameters})
    del item["data"]
    return item


@pytest.mark.parametrize(
    ("item", "tail", "fragment"),
    [
        (binary_x(-4), b"", "non-negative integer"),
        (binary_x(256.0), bytes(256), "non-negative integer"),
        (binary_x(True), bytes(1), "non-negative integer"),
        (binary_x("256"), bytes(256), "non-negative integer"),
        (binary_x(128), bytes(128), "binary_data_size 128 does not match shape [1, 64] (256 bytes)"),
        (binary_x(), bytes(255), "add up to 256 bytes, but 255 bytes follow"),
        (binary_x(), bytes(257), "add up to 256 bytes, but 257 bytes follow"),
        (binary_x(), None, "add up to 256 bytes, but 0 bytes follow"),
        (x_input(), b"junk", "add up to 0 bytes, but 4 bytes follow"),
        ({**binary_x(), "data": [0] * 64}, bytes(256), "both 'data' and 'binary_data_size'"),
        ({**x_input(), "data": None}, None, "neither 'data' nor 'binary_data_size'"),
        (x_input(parameters=[1]), None, "'parameters' must be an object"),
    ],
)
def test_binary_rejected(item, tail, fragment):
    expect_400(fragment, {"inputs": [item]}, tail=tail)


@pytest.mark.parametrize("header_length", [-1, 10_000])
def test_header_length_out_of_range(header_length):
    with pytest.raises(ProtocolError, match="outside the body") as exc:
        parse_infer_request(orjson.dumps({"inputs": [x_input()]}), header_length, X, max_rows=8)
    assert exc.value.status == 400


# --- shape, batch and structure errors ---------------------------------------------------


def test_rows_mismatch():
    req = {
        "inputs": [
            {"name": "a", "datatype": "INT64", "shape": [2, 1], "data": [1, 2]},
            {"name": "b", "datatype": "BOOL", "shape": [1, 2], "data": [True, True]},
            {"name": "h", "datatype": "FP16", "shape": [2, 3], "data": [0] * 6},
        ]
    }
    expect_400("batch dimension 1 differs from 2", req, MULTI)


def test_max_rows():
    data = [0.0] * (64 * 9)
    e = expect_400("batch of 9 rows exceeds max_batch_size 8", {"inputs": [x_input(shape=[9, 64], data=data)]})
    assert e.message == "batch of 9 rows exceeds max_batch_size 8"
    assert parse({"inputs": [x_input(shape=[9, 64], data=data)]}, max_rows=9).rows == 9


def test_variable_dims_are_bounded_by_their_declared_maximum():
    # given a variable dim declared at most 4 long, and one with no declared maximum
    spec = [TensorSpec("v", "INT32", (-1, 3), (4, 3))]
    item = {"name": "v", "datatype": "INT32", "shape": [1, 4, 3], "data": list(range(12))}
    assert parse({"inputs": [item]}, spec).inputs["v"].shape == (1, 4, 3)
    expect_400(
        "dimension 1 is 5, above the signature's maximum 4",
        {"inputs": [{**item, "shape": [1, 5, 3], "data": list(range(15))}]},
        spec,
    )
    assert TensorSpec("w", "INT32", (-1,)).max_shape == (DEFAULT_MAX_DIM,)
    # and a maximum that contradicts a fixed dim, or is not positive, is refused when declared
    with pytest.raises(ValueError, match="fixed dimensions"):
        TensorSpec("v", "INT32", (-1, 3), (4, 2))
    with pytest.raises(ValueError, match="maximum"):
        TensorSpec("v", "INT32", (-1,), (0,))


def test_variable_dims():
    spec = [TensorSpec("v", "INT32", (-1, 3))]
    item = {"name": "v", "datatype": "INT32", "shape": [2, 5, 3], "data": list(range(30))}
    r = parse({"inputs": [item]}, spec)
    assert r.inputs["v"].shape == (2, 5, 3) and r.inputs["v"].dtype == np.int32
    r = parse({"inputs": [{**item, "shape": [1, 1, 3], "data": [1, 2, 3]}]}, spec)
    assert r.inputs["v"].shape == (1, 1, 3)
    expect_400(
        "expected shape [-1, -1, 3], got [2, 0, 3]",
        {"inputs": [{**item, "shape": [2, 0, 3], "data": []}]},
        spec,
    )
    expect_400("expected shape [-1, -1, 3], got [2, 5, 4]", {"inputs": [{**item, "shape": [2, 5, 4]}]}, spec)


@pytest.mark.parametrize(
    ("req", "fragment"),
    [
        ({"inputs": [x_input(shape=[1, 32])]}, "expected shape [-1, 64], got [1, 32]"),
        ({"inputs": [x_input(shape=[64])]}, "expected rank 2 shape [-1, 64], got [64]"),
        ({"inputs": [x_input(shape=[1, 1, 64])]}, "expected rank 2"),
        ({"inputs": [x_input(shape=[0, 64], data=[])]}, "batch dimension must be >= 1, got 0"),
        ({"inputs": [x_input(shape=[1, -64])]}, "'shape' must be a list of non-negative integers"),
        ({"inputs": [x_input(shape=[1, 64.0])]}, "'shape' must be a list of non-negative integers"),
        ({"inputs": [x_input(shape=[True, 64])]}, "'shape' must be a list of non-negative integers"),
        ({"inputs": [x_input(shape="1,64")]}, "'shape' must be a list of non-negative integers"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "data": [0] * 64}]}, "'shape' must be a list"),
        ({"inputs": [x_input(datatype="INT64")]}, "input 'x': expected datatype FP32, got INT64"),
        ({"inputs": [x_input(datatype="BYTES")]}, "unsupported datatype 'BYTES'"),
        ({"inputs": [x_input(datatype="FLOAT")]}, "unsupported datatype 'FLOAT'"),
        ({"inputs": [x_input(datatype=None)]}, "unsupported datatype None"),
        ({"inputs": [x_input(datatype=["FP32"])]}, "unsupported datatype"),
        ({"inputs": [x_input(), x_input()]}, "input 'x' appears more than once"),
        ({"inputs": [x_input(name="nope")]}, "unknown input 'nope'"),
        ({"inputs": [{"datatype": "FP32"}]}, "inputs[0]: 'name' must be a string"),
        ({"inputs": [x_input(name=1)]}, "inputs[0]: 'name' must be a string"),
        ({"inputs": [x_input(name=["x"])]}, "'name' must be a string"),
        ({"inputs": [x_input(), 3]}, "inputs[1] must be an object"),
        ({"inputs": []}, "'inputs' must be a non-empty list"),
        ({"inputs": {"x": 1}}, "'inputs' must be a non-empty list"),
        ({}, "'inputs' must be a non-empty list"),
        ({"id": 5, "inputs": [x_input()]}, "'id' must be a string"),
        ({"parameters": [], "inputs": [x_input()]}, "'parameters' must be an object"),
        (
            {"parameters": {"binary_data_output": 1}, "inputs": [x_input()]},
            "'binary_data_output' must be a boolean",
        ),
        ({"outputs": {"name": "y"}, "inputs": [x_input()]}, "'outputs' must be a list"),
        ({"outputs": ["y"], "inputs": [x_input()]}, "outputs[0] must be an object"),
        ({"outputs": [{"nam": "y"}], "inputs": [x_input()]}, "outputs[0]: 'name' must be a string"),
        (
            {"outputs": [{"name": "y"}, {"name": "y"}], "inputs": [x_input()]},
            "output 'y' is requested more than once",
        ),
        (
            {"outputs": [{"name": "y", "parameters": 1}], "inputs": [x_input()]},
            "output 'y': 'parameters' must be an object",
        ),
        (
            {"outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}], "inputs": [x_input()]},
            "'binary_data' must be a boolean",
        ),
    ],
)
def test_request_rejected(req, fragment):
    expect_400(fragment, req)


def test_missing_required_inputs_are_named():
    e = expect_400(
        "missing required input(s)",
        {"inputs": [{"name": "b", "datatype": "BOOL", "shape": [1, 2], "data": [0, 1]}]},
        MULTI,
    )
    assert "'a'" in e.message and "'h'" in e.message and "'b'" not in e.message


@pytest.mark.parametrize(
    "body",
    [b"", b"{", b"[]", b"null", b"3", b'"x"', b"\xff\xfe", b"{'inputs': []}", b'{"inputs": [NaN}', b"[NaN, nan]"],
)
def test_malformed_json(body):
    with pytest.raises(ProtocolError) as exc:
        parse_infer_request(body, None, X, max_rows=8)
    assert exc.value.status == 400
    assert "JSON" in exc.value.message


# --- responses ---------------------------------------------------------------------------


def model_outputs(rows: int = 2) -> dict[str, np.ndarray]:
    return {
        "y": np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) / 3,
        "label": np.arange(rows, dtype=np.int64) - 1,
    }


def encode(**kwargs):
    args = dict(model_name="m", model_version="3", request_id=None, outputs=model_outputs(),
                output_specs=OUT, requested=None, binary_output=False)  # fmt: skip
    args.update(kwargs)
    return encode_infer_response(**args)


def test_encode_json():
    body, headers = encode(request_id="abc", parameters={"k": 1})
    assert headers == [(b"content-type", b"application/json")]
    doc = orjson.loads(body)
    assert doc["model_name"] == "m" and doc["model_version"] == "3" and doc["id"] == "abc"
    assert doc["parameters"] == {"k": 1}
    y = doc["outputs"][0]
    assert {k: y[k] for k in ("name", "datatype", "shape")} == {
        "name": "y",
        "datatype": "FP32",
        "shape": [2, 2],
    }
    # orjson writes float32 in its shortest exact form, which round-trips through float32.
    assert np.array_equal(np.array(y["data"], np.float32), model_outputs()["y"].ravel())
    assert doc["outputs"][1] == {"name": "label", "datatype": "INT64", "shape": [2], "data": [-1, 0]}
    result = httpclient.InferResult.from_response_body(body, verbose=False, header_length=None)
    assert np.array_equal(result.as_numpy("y"), model_outputs()["y"])
    assert result.as_numpy("label").dtype == np.int64


def test_encode_omits_id_and_parameters():
    doc = orjson.loads(encode()[0])
    assert "id" not in doc and "parameters" not in doc


def test_encode_all_binary():
    body, headers = encode(binary_output=True, request_id="r")
    assert header_value(headers, b"content-type") == b"application/octet-stream"
    length = int(header_value(headers, b"inference-header-content-length"))
    doc = orjson.loads(body[:length])
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 16} and "data" not in doc["outputs"][0]
    assert body[length:] == model_outputs()["y"].tobytes() + model_outputs()["label"].tobytes()
    result = httpclient.InferResult.from_response_body(body, verbose=False, header_length=length)
    for name, arr in model_outputs().items():
        got = result.as_numpy(name)
        assert got.dtype == arr.dtype and np.array_equal(got, arr)


def test_encode_requested_subset_and_mixed():
    requested = [RequestedOutput("label", True), RequestedOutput("y", False)]
    body, headers = encode(requested=requested, binary_output=False)
    length = int(header_value(headers, b"inference-header-content-length"))
    doc = orjson.loads(body[:length])
    assert [o["name"] for o in doc["outputs"]] == ["label", "y"]
    assert "data" in doc["outputs"][1] and "data" not in doc["outputs"][0]
    result = httpclient.InferResult.from_response_body(body, verbose=False, header_length=length)
    assert np.array_equal(result.as_numpy("label"), model_outputs()["label"])
    assert np.array_equal(result.as_numpy("y"), model_outputs()["y"])
    # An explicit per-output False wins over binary_output.
    body, headers = encode(requested=[RequestedOutput("y", False)], binary_output=True)
    assert headers == [(b"content-type", b"application/json")]
    assert [o["name"] for o in orjson.loads(body)["outputs"]] == ["y"]


@pytest.mark.parametrize("binary", [False, True])
def test_encode_dtypes_and_layout(binary):
    specs = [TensorSpec("b", "BOOL", (3,)), TensorSpec("h", "FP16", (2,)), TensorSpec("u", "UINT64", ())]
    outs = {
        "b": np.array([[True, False, True]]),
        "h": np.array([[0.1, 65504]], dtype=np.float64),  # cast to the spec's dtype
        "u": np.array([2**64 - 1], dtype=np.uint64),
    }
    body, headers = encode(outputs=outs, output_specs=specs, binary_output=binary)
    length = header_value(headers, b"inference-header-content-length")
    result = httpclient.InferResult.from_response_body(
        body, verbose=False, header_length=None if length is None else int(length)
    )
    assert result.as_numpy("b").tolist() == [[True, False, True]]
    assert result.as_numpy("h").dtype == np.float16
    assert np.array_equal(result.as_numpy("h"), outs["h"].astype(np.float16))
    assert result.as_numpy("u").tolist() == [2**64 - 1]


@pytest.mark.parametrize("binary", [False, True])
def test_encode_non_contiguous(binary):
    y = np.arange(6, dtype=np.float32).reshape(2, 3).T  # shape (3, 2), Fortran order
    body, headers = encode(outputs={"y": y, "label": np.zeros(3, np.int64)}, binary_output=binary)
    length = header_value(headers, b"inference-header-content-length")
    result = httpclient.InferResult.from_response_body(
        body, verbose=False, header_length=None if length is None else int(length)
    )
    assert np.array_equal(result.as_numpy("y"), y)


def test_encode_errors():
    with pytest.raises(ProtocolError) as exc:
        encode(outputs={"y": model_outputs()["y"]})
    assert exc.value.status == 503 and "label" in exc.value.message
    with pytest.raises(ProtocolError, match="unknown output 'nope'"):
        encode(requested=[RequestedOutput("nope", False)])


# --- tritonclient round trips ------------------------------------------------------------


def test_tritonclient_binary_request_round_trip():
    arr = np.random.default_rng(1).standard_normal((1, 64)).astype(np.float32)
    inp = httpclient.InferInput("x", [1, 64], "FP32")
    inp.set_data_from_numpy(arr)
    body, header_length = triton_request([inp], request_id="7")
    assert header_length is not None
    r = parse_infer_request(body, header_length, X, max_rows=8)
    assert r.id == "7" and r.rows == 1 and r.outputs is None and r.binary_output is True
    assert np.array_equal(r.inputs["x"], arr)

    outs = {"y": np.array([[1.5, -2.0]], np.float32), "label": np.array([4], np.int64)}
    resp, headers = encode_infer_response(
        model_name="m", model_version="1", request_id=r.id, outputs=outs, output_specs=OUT,
        requested=r.outputs, binary_output=r.binary_output,
    )  # fmt: skip
    result = httpclient.InferResult.from_response_body(
        resp, verbose=False, header_length=int(header_value(headers, b"inference-header-content-length"))
    )
    assert result.get_response()["id"] == "7"
    assert np.array_equal(result.as_numpy("y"), outs["y"])
    assert np.array_equal(result.as_numpy("label"), outs["label"])


def test_tritonclient_json_request_with_requested_outputs():
    a = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    b = np.array([[True, False], [False, True]])
    h = np.array([[0.5, 1.5, -2], [3, 4, 5]], dtype=np.float16)
    inputs = []
    for name, arr, dt, binary in (("a", a, "INT64", False), ("b", b, "BOOL", True), ("h", h, "FP16", False)):
        inp = httpclient.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(inp)
    outputs = [
        httpclient.InferRequestedOutput("label", binary_data=False),
        httpclient.InferRequestedOutput("y"),
    ]
    body, header_length = triton_request(inputs, outputs, parameters={"temperature": 0.5})
    r = parse_infer_request(body, header_length, MULTI, max_rows=4)
    assert r.id is None and r.rows == 2 and r.parameters == {"temperature": 0.5}
    assert r.outputs == [RequestedOutput("label", False), RequestedOutput("y", True)]
    for name, arr in (("a", a), ("b", b), ("h", h)):
        assert r.inputs[name].dtype == arr.dtype and np.array_equal(r.inputs[name], arr)

    outs = {"y": np.ones((2, 2), np.float32), "label": np.array([7, 8], np.int64)}
    resp, headers = encode_infer_response(
        model_name="m", model_version="1", request_id=r.id, outputs=outs, output_specs=OUT,
        requested=r.outputs, binary_output=r.binary_output,
    )  # fmt: skip
    length = int(header_value(headers, b"inference-header-content-length"))
    result = httpclient.InferResult.from_response_body(resp, verbose=False, header_length=length)
    assert np.array_equal(result.as_numpy("label"), outs["label"])
    assert np.array_equal(result.as_numpy("y"), outs["y"])


def test_tritonclient_all_json_request():
    arr = np.arange(64, dtype=np.float32).reshape(1, 64)
    inp = httpclient.InferInput("x", [1, 64], "FP32")
    inp.set_data_from_numpy(arr, binary_data=False)
    body, header_length = triton_request([inp], [httpclient.InferRequestedOutput("y", binary_data=False)])
    assert header_length is None
    r = parse_infer_request(body, header_length, X, max_rows=1)
    assert np.array_equal(r.inputs["x"], arr) and r.outputs == [RequestedOutput("y", False)]


# --- floats that are not finite -------------------------------------------------------------

# NaN, both infinities and a negative zero beside ordinary values, exact in every float datatype.
NOT_FINITE = np.array([[-np.inf, 0.25, np.nan], [np.inf, -1.5, -0.0]], np.float32)


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64"])
def test_tritonclient_json_input_that_is_not_finite_is_read(datatype):
    # given tritonclient's JSON body (python-rapidjson writes NaN, Infinity and -Infinity), an output asked for
    arr = NOT_FINITE.astype(DATATYPES[datatype])
    inp = httpclient.InferInput("v", [2, 3], datatype)
    inp.set_data_from_numpy(arr, binary_data=False)
    body, length = triton_request([inp], [httpclient.InferRequestedOutput("y", binary_data=False)], request_id="n")
    assert b"-Infinity" in body and b"NaN" in body
    # when parsed / then the values are the client's, and the rest of the request is read as ever
    r = parse_infer_request(body, length, [TensorSpec("v", datatype, (3,))], max_rows=2)
    assert r.inputs["v"].dtype == arr.dtype
    np.testing.assert_array_equal(r.inputs["v"], arr)  # NaN where NaN
    assert np.signbit(r.inputs["v"][1, 2]) and r.inputs["v"][0, 0] == -np.inf
    assert r.id == "n" and r.outputs == [RequestedOutput("y", False)]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        # a literal too large for a double is an overflow, not Infinity
        (b'{"inputs": [{"name": "v", "datatype": "FP16", "shape": [1, 3], "data": [NaN, 1e400, 0]}]}', "JSON"),
        (b'{"inputs": [{"name": "v", "datatype": "FP16", "shape": [1, 3], "data": [NaN, 7e4, 0]}]}', "out of range"),
        (b'{"inputs": [{"name": "v", "datatype": "FP16", "shape": [1, 3], "data": [-Infinity, -7e4, 0]}]}', "range"),
        # what orjson refuses besides the tokens stays refused: a lone surrogate, an integer beyond 64 bits
        (b'{"id": "\\ud800", "inputs": [{"name": "v", "datatype": "FP16", "shape": [1, 1], "data": [NaN]}]}', "JSON"),
        (b'{"inputs": [{"name": "v", "datatype": "FP16", "shape": [1, 2], "data": [NaN, 1%s]}]}' % (b"0" * 30), "JSON"),
        (b"[" * 100_000 + b"NaN" + b"]" * 100_000, "JSON"),  # deeper than any parser's bound
        (b"\xef\xbb\xbf[NaN]", "JSON"),
    ],
)
def test_what_stays_refused_beside_a_value_not_finite(body, fragment):
    with pytest.raises(ProtocolError, match=fragment) as exc:
        parse_infer_request(body, None, [TensorSpec("v", "FP16", (-1,))], max_rows=1)
    assert exc.value.status == 400


@pytest.mark.parametrize("datatype", ["FP16", "FP32", "FP64", "BF16"])
def test_json_outputs_that_are_not_finite_arrive_as_themselves(datatype):
    # given a model's output with -inf, NaN and inf (a log-softmax's -inf), asked for as JSON beside a binary one
    y = float_to_bf16(NOT_FINITE) if datatype == "BF16" else NOT_FINITE
    specs = [TensorSpec("y", datatype, (3,)), TensorSpec("label", "INT64", ())]
    requested = [RequestedOutput("y", False), RequestedOutput("label", True)]
    body, headers = encode(outputs={"y": y, "label": np.array([1, 2])}, output_specs=specs, requested=requested)
    length = int(header_value(headers, b"inference-header-content-length"))
    # when read by Python's json and by tritonclient's own decoder
    doc = json.loads(body[:length])
    result = httpclient.InferResult.from_response_body(body, verbose=False, header_length=length)
    # then each value is itself, not null (nor NaN for an infinity), and the binary output follows the header
    np.testing.assert_array_equal(np.array(doc["outputs"][0]["data"], np.float64), NOT_FINITE.ravel())
    got = result.as_numpy("y")
    np.testing.assert_array_equal(got.astype(np.float32), NOT_FINITE)
    assert got[0, 0] == -np.inf and got[1, 0] == np.inf and np.isnan(got[0, 2]) and np.signbit(got[1, 2])
    assert result.as_numpy("label").tolist() == [1, 2]


# --- extensions Ferry does not implement -------------------------------------------------------


def _zeros_input(name: str = "x") -> httpclient.InferInput:
    inp = httpclient.InferInput(name, [1, 64], "FP32")
    return inp.set_data_from_numpy(np.zeros((1, 64), np.float32))


def _shared_input() -> httpclient.InferInput:
    inp = httpclient.InferInput("x", [1, 64], "FP32")
    inp.set_shared_memory("region", 256)
    return inp


def _shared_output() -> httpclient.InferRequestedOutput:
    out = httpclient.InferRequestedOutput("y")
    out.set_shared_memory("region", 8, offset=16)
    return out


@pytest.mark.parametrize(
    ("build", "fragment"),
    [
        (lambda: triton_request([_zeros_input()], [httpclient.InferRequestedOutput("y", class_count=3)]),
         "output 'y': parameter 'classification' is not supported"),
        (lambda: triton_request([_shared_input()]), "input 'x': parameter 'shared_memory_region' is not supported"),
        (lambda: triton_request([_zeros_input()], [_shared_output()]),
         "output 'y': parameter 'shared_memory_region' is not supported"),
        (lambda: triton_request([_zeros_input()], sequence=(42, True, False)), "parameter 'sequence_id'"),
        (lambda: triton_request([_zeros_input()], sequence=("session-7", False, True)), "parameter 'sequence_id'"),
        (lambda: (orjson.dumps({"parameters": {"sequence_end": True}, "inputs": [x_input()]}), None),
         "parameter 'sequence_end'"),
        (lambda: (orjson.dumps({"inputs": [x_input(parameters={"shared_memory_offset": 0})]}), None),
         "input 'x': parameter 'shared_memory_offset'"),
    ],
)  # fmt: skip
def test_an_extension_ferry_does_not_implement_is_refused_by_name(build, fragment):
    # given a request that asks for classification, shared memory or a sequence (tritonclient's own body)
    body, length = build()
    # when parsed / then it is refused, naming the parameter, rather than served as if it had not asked
    with pytest.raises(ProtocolError, match=fragment) as exc:
        parse_infer_request(body, length, X, max_rows=1)
    assert exc.value.status == 400


def test_the_extensions_parameters_at_their_defaults_are_no_request_of_them():
    parameters = {"sequence_id": 0, "sequence_start": False, "sequence_end": False}
    outputs = [{"name": "y", "parameters": {"classification": 0}}]
    r = parse({"parameters": parameters, "outputs": outputs, "inputs": [x_input()]})
    assert r.outputs == [RequestedOutput("y", False)]


# --- BF16 ----------------------------------------------------------------------------------


def test_bf16_conversions_are_torchs():
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(20_000) * 10.0 ** rng.integers(-30, 30, 20_000)).astype(np.float32)
    values = np.concatenate([values, np.array([0, -0.0, np.inf, -np.inf, 1e-40, -3.3895e38], np.float32)])
    bits = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()
    np.testing.assert_array_equal(float_to_bf16(values), bits)  # round to nearest even, as torch
    np.testing.assert_array_equal(bf16_to_float32(bits), torch.from_numpy(bits).view(torch.bfloat16).float().numpy())
    assert np.isnan(bf16_to_float32(float_to_bf16(np.array([np.nan, -np.nan], np.float32)))).all()


def test_bf16_binary_input_from_tritonclient_is_its_bits():
    # given tritonclient's BF16 input (ml_dtypes.bfloat16, sent as binary as tritonclient must)
    arr = np.array([[1.5, -2.0, np.inf], [0.1, -np.inf, 3e38]], dtype=ml_dtypes.bfloat16)
    inp = httpclient.InferInput("v", [2, 3], "BF16")
    inp.set_data_from_numpy(arr)
    body, length = triton_request([inp])
    # when parsed / then it is its bits, which torch reads as the same bfloat16 values
    bits = parse_infer_request(body, length, [TensorSpec("v", "BF16", (3,))], max_rows=2).inputs["v"]
    assert bits.dtype == np.uint16 and bits.shape == (2, 3)
    np.testing.assert_array_equal(bits, arr.view(np.uint16))
    as_torch = torch.from_numpy(bits.copy()).view(torch.bfloat16)
    np.testing.assert_array_equal(as_torch.float().numpy(), arr.astype(np.float32))


def test_bf16_json_input_is_rounded_as_torch_rounds():
    data = [[1.5, -2, 0.1], [1e38, float("-inf"), -0.0]]
    item = {"name": "v", "datatype": "BF16", "shape": [2, 3], "data": data}
    body = json.dumps({"inputs": [item]}).encode()  # -Infinity: as tritonclient would write it
    bits = parse_infer_request(body, None, [TensorSpec("v", "BF16", (3,))], max_rows=2).inputs["v"]
    expected = torch.tensor(data, dtype=torch.float32).to(torch.bfloat16).view(torch.uint16).numpy()
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, expected)


@pytest.mark.parametrize("binary", [False, True])
def test_bf16_outputs_reach_tritonclient_as_bfloat16(binary):
    values = np.array([[1.5, -np.inf, 0.1], [3e38, -0.0, 7]], ml_dtypes.bfloat16)
    specs = [TensorSpec("y", "BF16", (3,))]
    body, headers = encode(outputs={"y": values.view(np.uint16)}, output_specs=specs, binary_output=binary)
    length = header_value(headers, b"inference-header-content-length")
    result = httpclient.InferResult.from_response_body(
        body, verbose=False, header_length=None if length is None else int(length)
    )
    got = result.as_numpy("y")
    assert got.dtype == ml_dtypes.bfloat16 and got.shape == (2, 3)
    np.testing.assert_array_equal(got.view(np.uint16), values.view(np.uint16))


# --- fuzz --------------------------------------------------------------------------------

_JUNK = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2**63,
    "",
    "x",
    "FP32",
    [],
    {},
    [1],
    [[1, 2], [3]],
    {"a": 1},
    [-1, 64],
    [1, 64],
]


def _mutate_tree(rng: random.Random, node, depth: int = 0):
    if rng.random() < 0.15 or depth > 6:
        return rng.choice(_JUNK)
    if isinstance(node, dict):
        node = dict(node)
        for key in list(node):
            if rng.random() < 0.1:
                del node[key]
            elif rng.random() < 0.4:
                node[key] = _mutate_tree(rng, node[key], depth + 1)
        if rng.random() < 0.1:
            node[rng.choice(["name", "shape", "data", "parameters", "datatype", "binary_data_size"])] = rng.choice(
                _JUNK
            )
        return node
    if isinstance(node, list):
        node = [_mutate_tree(rng, v, depth + 1) if rng.random() < 0.2 else v for v in node]
        if node and rng.random() < 0.1:
            node.pop(rng.randrange(len(node)))
        if rng.random() < 0.1:
            node.append(rng.choice(_JUNK))
        return node
    return node


def _seed_bodies() -> list[tuple[bytes, int | None]]:
    rng = np.random.default_rng(2)
    seeds = []
    inp = httpclient.InferInput("x", [2, 64], "FP32")
    inp.set_data_from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    seeds.append(triton_request([inp], [httpclient.InferRequestedOutput("y")], request_id="q"))
    inputs = []
    for name, arr, dt, binary in (
        ("a", np.array([[1, 2], [3, 4]], np.int64), "INT64", True),
        ("b", np.array([[True, False], [False, True]]), "BOOL", False),
        ("h", np.ones((2, 3), np.float16), "FP16", True),
    ):
        i = httpclient.InferInput(name, list(arr.shape), dt)
        i.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(i)
    seeds.append(triton_request(inputs))
    seeds.append((orjson.dumps({"inputs": [x_input(data=np.arange(64).reshape(8, 8).tolist())]}), None))
    # JSON with NaN and the infinities, which only the tolerant parser reads
    inp = httpclient.InferInput("x", [1, 64], "FP32")
    inp.set_data_from_numpy(np.resize(NOT_FINITE, (1, 64)), binary_data=False)
    seeds.append(triton_request([inp], [httpclient.InferRequestedOutput("y", class_count=0)]))
    return seeds


def test_fuzz_only_protocol_errors_escape():
    rng = random.Random(1234)
    seeds = _seed_bodies()
    specs_for = [X, MULTI, X, X]
    accepted = 0
    for _ in range(4000):
        idx = rng.randrange(len(seeds))
        body, hl = seeds[idx]
        specs = specs_for[idx]
        op = rng.randrange(6)
        if op == 0:  # truncate
            body = body[: rng.randrange(len(body) + 1)]
        elif op == 1:  # flip bytes
            b = bytearray(body)
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            body = bytes(b)
        elif op == 2:  # insert / delete a span
            at = rng.randrange(len(body))
            if rng.random() < 0.5:
                body = body[:at] + rng.randbytes(rng.randint(1, 16)) + body[at:]
            else:
                body = body[:at] + body[at + rng.randint(1, 16) :]
        elif op == 3:  # mutate the JSON structure, keep the binary tail
            cut = len(body) if hl is None else hl
            tree = _mutate_tree(rng, json.loads(body[:cut]))
            header = json.dumps(tree).encode()  # NaN and the infinities as the tokens
            body = header + body[cut:]
            hl = None if hl is None else len(header)
        elif op == 4:  # garbage header length
            hl = rng.choice([None, -5, 0, 1, len(body), len(body) + 1, rng.randrange(len(body) + 1)])
        else:  # random bytes
            body = rng.randbytes(rng.randrange(64))
        try:
            parse_infer_request(body, hl, specs, max_rows=rng.choice([1, 2, 8]))
            accepted += 1
        except ProtocolError as e:
            assert e.status == 400 and e.message
    assert accepted > 0
