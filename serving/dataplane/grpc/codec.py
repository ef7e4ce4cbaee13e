"""The Open Inference Protocol's gRPC messages (inference.ModelInferRequest / ModelInferResponse) to and from the
gateway's `Inference` and `Served`.

Inputs come either all in `raw_input_contents` (one little-endian buffer per input, in order: what
tritonclient.grpc sends) or each in its typed `contents` field; both are checked against the routed version's
signature with the REST codec's rules (serving.dataplane.http.protocol): the same names, datatypes, shapes,
batch bound and value ranges, the same messages. Outputs always go back in `raw_output_contents`, as Triton
answers.

A pipeline is served from a REST body (serving.dataplane.gateway.pipeline): `rest_body` writes the message as
one, in the binary tensor extension, and `response_of_rest` reads the answer back.
"""

from __future__ import annotations

import math
from math import prod

import numpy as np
import orjson

from serving.dataplane.gateway.request import Inference, Served
from serving.dataplane.gateway.snapshot import VersionEntry
from serving.dataplane.grpc.proto import grpc_service_pb2 as pb
from serving.dataplane.http.protocol import (
    DATATYPES,
    ProtocolError,
    _check_shape,
    _from_json,
    json_data,
    refuse_extensions,
    refuse_sequence,
)

# The typed field of InferTensorContents for each datatype; FP16 and BF16 have none (raw only, as in Triton).
TYPED_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


_FLOAT_FIELDS = ("fp32_contents", "fp64_contents")


def parameters(message: object) -> dict:
    """A protobuf map<string, InferParameter> as a dict of Python values (Triton's "priority" and "timeout"
    arrive as integers, as the REST side reads them from JSON)."""
    out: dict = {}
    for key, value in message.items():  # type: ignore[attr-defined]
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice is not None else None
    return out


def request_of(message: pb.ModelInferRequest, viewer: int | None, **fields: object) -> Inference:
    """The gateway's request for `message` from tenant `viewer` (`fields`: Inference's other fields, `nbytes`
    the message's size among them); its tensors are decoded once routed."""
    version = message.model_version or None
    outputs = _requested(message)
    request = Inference(
        message.model_name,
        version,
        viewer,
        outputs=outputs,
        parameters=parameters(message.parameters),
        id=message.id or None,
        **fields,  # type: ignore[arg-type]
    )
    request.decode = lambda req, entry: decode_inputs(message, req, entry)
    return request


def _requested(message: pb.ModelInferRequest) -> tuple[str, ...] | None:
    if not message.outputs:  # none asked for: all of them, as Triton
        return None
    names: list[str] = []
    for output in message.outputs:
        if output.name in names:
            raise ProtocolError(f"output {output.name!r} is requested more than once")
        names.append(output.name)
    return tuple(names)


def refuse_extensions_of(message: pb.ModelInferRequest) -> None:
    """Refuse (400) what `message` asks of Triton's extensions Ferry does not implement, as REST's parser refuses
    them: shared memory for an input or output, classification for an output."""
    for tensor in message.inputs:
        if tensor.parameters:
            refuse_extensions(f"input {tensor.name!r}", parameters(tensor.parameters))
    for output in message.outputs:
        if output.parameters:
            refuse_extensions(f"output {output.name!r}", parameters(output.parameters), output=True)


def decode_inputs(message: pb.ModelInferRequest, request: Inference, entry: VersionEntry) -> None:
    """Fill `request`'s tensors from `message` for `entry`'s signature; ProtocolError (400) on anything it
    does not accept."""
    tensors = message.inputs
    raw = message.raw_input_contents
    if not tensors:
        raise ProtocolError("'inputs' must be a non-empty list")
    refuse_sequence(request.parameters)
    refuse_extensions_of(message)
    if raw and len(raw) != len(tensors):
        raise ProtocolError(f"raw_input_contents has {len(raw)} entries for {len(tensors)} inputs")
    specs = {s.name: s for s in entry.inputs}
    max_rows = entry.batching.max_batch_size
    arrays: dict[str, np.ndarray] = {}
    rows = 0
    for i, tensor in enumerate(tensors):
        name = tensor.name
        if name in arrays:
            raise ProtocolError(f"input {name!r} appears more than once")
        spec = specs.get(name)
        if spec is None:
            raise ProtocolError(f"unknown input {name!r}")
        datatype = tensor.datatype
        if datatype not in DATATYPES:
            raise ProtocolError(f"input {name!r}: unsupported datatype {datatype!r}")
        if datatype != spec.datatype:
            raise ProtocolError(f"input {name!r}: expected datatype {spec.datatype}, got {datatype}")
        shape = _check_shape(name, list(tensor.shape), spec)
        if not rows:
            rows = shape[0]
            if rows > max_rows:
                raise ProtocolError(f"batch of {rows} rows exceeds max_batch_size {max_rows}")
        elif shape[0] != rows:
            raise ProtocolError(f"input {name!r}: batch dimension {shape[0]} differs from {rows} of other inputs")
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(f"input {name!r} has both 'contents' and raw_input_contents")
            arrays[name] = _from_raw(name, raw[i], datatype, shape)
        else:
            arrays[name] = _from_typed(name, tensor.contents, datatype, shape)
    missing = [s.name for s in entry.inputs if s.name not in arrays]
    if missing:
        raise ProtocolError("missing required input(s): " + ", ".join(map(repr, missing)))
    request.inputs, request.rows = arrays, rows


def _from_raw(name: str, data: bytes, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    dtype = DATATYPES[datatype]
    expected = prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise ProtocolError(
            f"input {name!r}: raw_input_contents holds {len(data)} bytes, shape {list(shape)} needs {expected}"
        )
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    if dtype.kind == "b" and arr.size and arr.view(np.uint8).max() > 1:
        raise ProtocolError(f"input {name!r}: BOOL bytes must be 0 or 1")
    return arr


def _from_typed(name: str, contents: pb.InferTensorContents, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    field = TYPED_FIELD.get(datatype)
    if field is None:
        raise ProtocolError(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
    present = [f.name for f, _ in contents.ListFields()]
    if any(f != field for f in present):
        raise ProtocolError(f"input {name!r}: {datatype} data belongs in '{field}', not {present[0]!r}")
    return _from_json(name, list(getattr(contents, field)), datatype, shape)


def response_of(served: Served, request: Inference) -> pb.ModelInferResponse:
    """`served`'s outputs (those asked for, in the order asked; else all, in the signature's order) as raw
    little-endian buffers."""
    entry = served.entry
    response = pb.ModelInferResponse(model_name=entry.model, model_version=str(entry.version), id=request.id or "")
    if served.fell_back:
        response.parameters["fallback_from"].string_param = served.asked.key
    specs = entry.outputs
    if request.outputs is not None:
        by_name = {s.name: s for s in specs}
        specs = [by_name[n] for n in request.outputs]  # the gateway checked every name
    for spec in specs:
        arr = np.asarray(served.outputs[spec.name], dtype=DATATYPES[spec.datatype], order="C")
        response.outputs.add(name=spec.name, datatype=spec.datatype, shape=arr.shape)
        response.raw_output_contents.append(arr.tobytes())
    return response


def rest_body(message: pb.ModelInferRequest, timeout: float | None) -> tuple[bytes, int]:
    """`message` as a REST request's body in the binary tensor extension, and its JSON header's length: raw
    inputs as binary data, typed ones as JSON `data`, every output asked for in binary (REST's parser then
    checks them, with its messages). `timeout`: gRPC's deadline in seconds from the request's arrival, sent
    as Triton's "timeout" parameter where it is shorter than the client's own."""
    tensors = message.inputs
    raw = message.raw_input_contents
    if raw and len(raw) != len(tensors):
        raise ProtocolError(f"raw_input_contents has {len(raw)} entries for {len(tensors)} inputs")
    refuse_extensions_of(message)  # the tensors' parameters are not carried over; the request's are (a sequence's)
    inputs: list[dict] = []
    for i, tensor in enumerate(tensors):
        name, datatype = tensor.name, tensor.datatype
        item: dict = {"name": name, "datatype": datatype, "shape": list(tensor.shape)}
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(f"input {name!r} has both 'contents' and raw_input_contents")
            item["parameters"] = {"binary_data_size": len(raw[i])}
        elif datatype not in DATATYPES:
            item["data"] = []  # REST's parser refuses the datatype, in its words
        else:
            field = TYPED_FIELD.get(datatype)
            if field is None:
                raise ProtocolError(f"input {name!r}: {datatype} data must be sent in raw_input_contents")
            present = [f.name for f, _ in tensor.contents.ListFields()]
            if any(f != field for f in present):
                raise ProtocolError(f"input {name!r}: {datatype} data belongs in '{field}', not {present[0]!r}")
            values = getattr(tensor.contents, field)
            # A float that is not finite as the token REST's parser reads (orjson would write it as null).
            item["data"] = json_data(np.asarray(values, np.float64)) if field in _FLOAT_FIELDS else list(values)
        inputs.append(item)
    options = parameters(message.parameters)
    options["binary_data_output"] = True
    if timeout is not None:
        limit = max(1, math.ceil(timeout * 1e6))  # Triton's "timeout" is in microseconds
        asked = options.get("timeout")
        if asked is None or (type(asked) is int and asked > limit):  # a bad one is left for REST's parser to refuse
            options["timeout"] = limit
    header: dict = {"inputs": inputs, "parameters": options}
    if message.id:
        header["id"] = message.id
    if message.outputs:
        header["outputs"] = [{"name": output.name} for output in message.outputs]
    head = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    return b"".join([head, *raw]), len(head)


def response_of_rest(body: bytes, headers: list[tuple[bytes, bytes]]) -> pb.ModelInferResponse:
    """The answer to a request `rest_body` wrote (every output in binary), as REST sent it: its body and
    headers."""
    length = next(int(value) for name, value in headers if name == b"inference-header-content-length")
    header = orjson.loads(memoryview(body)[:length])
    response = pb.ModelInferResponse(
        model_name=header["model_name"], model_version=header["model_version"], id=header.get("id") or ""
    )
    fallback = (header.get("parameters") or {}).get("fallback_from")
    if fallback is not None:
        response.parameters["fallback_from"].string_param = fallback
    offset = length
    for output in header["outputs"]:
        size = output["parameters"]["binary_data_size"]
        response.outputs.add(name=output["name"], datatype=output["datatype"], shape=output["shape"])
        response.raw_output_contents.append(body[offset : offset + size])
        offset += size
    return response
