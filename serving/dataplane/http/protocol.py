"""Open Inference Protocol (KServe V2 / Triton HTTP/REST) infer codec, with Triton's binary
tensor extension: a JSON header of `Inference-Header-Content-Length` bytes, then raw tensor bytes."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np
import orjson

DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    # numpy has no bfloat16: a BF16 tensor travels as its raw bits, little-endian uint16 (as Triton's binary
    # form and raw_input_contents carry it); the runtime views them as torch.bfloat16 where they meet the
    # model, and JSON `data` holds their values as numbers (bf16_to_float32, float_to_bf16).
    "BF16": np.dtype("<u2"),
}

# The largest finite value of each floating-point datatype; a larger finite JSON number is refused.
_FLOAT_MAX: dict[str, float] = {
    **{name: float(np.finfo(dt).max) for name, dt in DATATYPES.items() if dt.kind == "f"},
    "BF16": float(np.array(0x7F7F0000, "<u4").view("<f4")),
}
_INT_LIMITS: dict[str, tuple[int, int]] = {
    name: (int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for name, dt in DATATYPES.items()
    if dt.kind in "iu" and name not in _FLOAT_MAX
}
_NUMPY_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


class ProtocolError(Exception):
    """A request the protocol rejects; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


# The largest a variable (-1) dimension may be when the signature declares no maximum: one long
# request pads every row of its batch to its length, so every variable dimension has a ceiling.
DEFAULT_MAX_DIM = 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]
    # Upper bound of each dimension: equal to `shape` for fixed dims, the declared maximum (or
    # DEFAULT_MAX_DIM) for variable ones. A request beyond it is refused with 400.
    max_shape: tuple[int, ...] | None = None
    # The dimensions after the batch one as a list when none is variable: a request's shape is then
    # checked with one list comparison (see _check_shape).
    fixed_dims: list[int] | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("tensor name must be a non-empty string")
        if not isinstance(self.datatype, str) or self.datatype not in DATATYPES:
            raise ValueError(f"tensor {self.name!r}: unsupported datatype {self.datatype!r}")
        if not isinstance(self.shape, (list, tuple)) or any(type(d) is not int or d < -1 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape must be a list of integers >= 0 or -1")
        object.__setattr__(self, "shape", tuple(self.shape))
        maxima = self.max_shape
        if maxima is None:
            maxima = tuple(DEFAULT_MAX_DIM if d == -1 else d for d in self.shape)
        if (
            not isinstance(maxima, (list, tuple))
            or len(maxima) != len(self.shape)
            or any(type(m) is not int for m in maxima)
        ):
            raise ValueError(f"tensor {self.name!r}: max_shape must be a list of integers as long as shape")
        for d, m in zip(self.shape, maxima, strict=True):
            if d == -1 and not 1 <= m <= 1_000_000:
                raise ValueError(f"tensor {self.name!r}: a variable dimension's maximum must be 1..1000000")
            if d != -1 and m != d:
                raise ValueError(f"tensor {self.name!r}: max_shape must equal shape on fixed dimensions")
        object.__setattr__(self, "max_shape", tuple(maxima))
        object.__setattr__(self, "fixed_dims", None if -1 in self.shape else list(self.shape))

    @property
    def variable(self) -> bool:
        return -1 in self.shape

    @classmethod
    def from_dict(cls, d: dict) -> TensorSpec:
        if not isinstance(d, dict):
            raise ValueError("tensor spec must be an object")
        try:
            return cls(d["name"], d["datatype"], d["shape"], d.get("max_shape"))
        except KeyError as e:
            raise ValueError(f"tensor spec is missing {e.args[0]!r}") from None

    def to_dict(self) -> dict:
        """As stored in the registry: the maxima only where a dimension is variable."""
        d: dict = {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}
        if self.variable:
            d["max_shape"] = list(self.max_shape or ())
        return d

    def to_metadata(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape]}


@dataclass(slots=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass(slots=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    rows: int
    outputs: list[RequestedOutput] | None
    binary_output: bool
    parameters: dict


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 bits (uint16) as the float32 values they are: bfloat16 is float32's upper half."""
    return (bits.astype("<u4") << 16).view("<f4")


def float_to_bf16(values: np.ndarray) -> np.ndarray:
    """Floats as BF16 bits (uint16), rounded to nearest even through float32 as torch rounds; a NaN stays a
    (quiet) NaN. The caller keeps finite values within BF16's range."""
    bits = np.ascontiguousarray(values, "<f4").view("<u4")
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        rounded[nan] = (rounded[nan] & 0x8000) | 0x7FC0
    return rounded


_NON_FINITE_TOKENS = (b"NaN", b"Infinity", b"-Infinity")


def json_data(flat: np.ndarray) -> np.ndarray | orjson.Fragment:
    """A 1-D tensor as the `data` of a JSON tensor, for orjson.dumps(..., OPT_SERIALIZE_NUMPY). orjson writes a
    float that is not finite as null, so where there is one (rare: one check of the common case) the list is
    written here with NaN, Infinity and -Infinity, the tokens tritonclient (python-rapidjson) and Python's
    json read and write."""
    if flat.dtype.kind != "f" or np.isfinite(flat).all():
        return flat
    text = orjson.dumps(flat, option=orjson.OPT_SERIALIZE_NUMPY)
    odd = flat[~np.isfinite(flat)]
    tokens = [_NON_FINITE_TOKENS[0 if math.isnan(v) else 1 if v > 0 else 2] for v in odd.tolist()]
    pieces = text.split(b"null")  # a list of numbers holds no other "null": one per value not finite, in order
    out = [pieces[0]]
    for token, piece in zip(tokens, pieces[1:], strict=True):
        out += (token, piece)
    return orjson.Fragment(b"".join(out))


def _finite_float(text: str) -> float:
    # The tolerant parser's float literals: one too large for a double is an overflow, not Infinity.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text} is infinity when parsed as double")
    return value


def load_header(header: bytes | memoryview) -> Any:
    """A request's JSON header (a REST body's, a WebSocket message's), or ProtocolError (400). orjson reads
    every request but one with a float that is not finite: it refuses python-rapidjson's NaN, Infinity and
    -Infinity tokens, which tritonclient writes for such floats, so a header holding one is read again by
    Python's json, which reads those tokens as floats. That parse is slower, bounded as orjson's by the
    body's limit and by the interpreter's recursion limit; what orjson cannot write back (a lone surrogate,
    an integer beyond 64 bits) it refuses as orjson would."""
    try:
        return orjson.loads(header)
    except orjson.JSONDecodeError as e:
        refused = e
    raw = bytes(header)
    if b"NaN" in raw or b"Infinity" in raw:
        try:
            tree = json.loads(raw.decode("utf-8"), parse_float=_finite_float)
            orjson.dumps(tree)  # what orjson would have refused besides the tokens: a surrogate, a huge integer
        except (ValueError, RecursionError, TypeError):
            pass
        else:
            return tree
    raise ProtocolError(f"malformed JSON request: {refused}") from None


# Triton's protocol extensions Ferry does not implement: a request that asks for one is refused, naming the
# parameter, rather than served as if it had not asked.
SHARED_MEMORY = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
SEQUENCE = ("sequence_id", "sequence_start", "sequence_end")


def refuse_extensions(what: str, parameters: Mapping[str, Any], *, output: bool = False) -> None:
    """Refuse (400) the tensor `what` ("input 'x'", "output 'y'") whose `parameters` ask for shared memory
    or, on an output, for classification (tritonclient's class_count)."""
    for key in SHARED_MEMORY:
        if key in parameters:
            raise ProtocolError(
                f"{what}: parameter {key!r} is not supported: Ferry has no shared-memory extension;"
                " send the tensor in the request and take it from the response"
            )
    if output and parameters.get("classification") not in (None, 0):
        raise ProtocolError(
            f"{what}: parameter 'classification' is not supported: Ferry has no classification extension;"
            " ask for the output and take its top classes from it"
        )


def refuse_sequence(parameters: Mapping[str, Any]) -> None:
    """Refuse (400) a request of a sequence (Triton's sequence_id, sequence_start, sequence_end): Ferry's
    models are stateless, served in batches of unrelated requests, and it keeps no state between calls."""
    for key in SEQUENCE:
        if parameters.get(key) not in (None, 0, ""):  # tritonclient sends none of them outside a sequence
            raise ProtocolError(
                f"parameter {key!r} is not supported: Ferry serves stateless models and has no sequence"
                " batcher; send each request on its own, with its whole input"
            )


def _optional_dict(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be an object")
    return value


def _parse_outputs(raw: Any, binary_output: bool) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ProtocolError("'outputs' must be a list")
    if not raw:  # Triton treats an empty list like an absent one: all outputs
        return None
    result: list[RequestedOutput] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ProtocolError(f"outputs[{i}] must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise ProtocolError(f"outputs[{i}]: 'name' must be a string")
        if name in seen:
            raise ProtocolError(f"output {name!r} is requested more than once")
        seen.add(name)
        parameters = _optional_dict(item.get("parameters"), f"output {name!r}: 'parameters'")
        if parameters:
            refuse_extensions(f"output {name!r}", parameters, output=True)
        binary = parameters.get("binary_data")
        if binary is None:
            binary = binary_output
        elif not isinstance(binary, bool):
            raise ProtocolError(f"output {name!r}: 'binary_data' must be a boolean")
        result.append(RequestedOutput(name, binary))
    return result


_INTS = {int}


def _check_shape(name: str, shape: Any, spec: TensorSpec) -> tuple[int, ...]:
    fixed = spec.fixed_dims
    if (
        fixed is not None
        and type(shape) is list
        and shape[1:] == fixed
        and len(shape) == len(fixed) + 1
        and set(map(type, shape)) == _INTS
        and shape[0] >= 1
    ):
        return tuple(shape)  # the common case, in C: every dimension an int, all but the batch's as declared
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise ProtocolError(f"input {name!r}: 'shape' must be a list of non-negative integers")
    expected = [-1, *spec.shape]
    if len(shape) != len(expected):
        raise ProtocolError(f"input {name!r}: expected rank {len(expected)} shape {expected}, got {shape}")
    if shape[0] < 1:
        raise ProtocolError(f"input {name!r}: batch dimension must be >= 1, got {shape[0]}")
    for axis, (got, want, most) in enumerate(zip(shape[1:], spec.shape, spec.max_shape or (), strict=True), 1):
        if (want == -1 and got < 1) or (want != -1 and got != want):
            raise ProtocolError(f"input {name!r}: expected shape {expected}, got {shape}")
        if got > most:
            raise ProtocolError(f"input {name!r}: dimension {axis} is {got}, above the signature's maximum {most}")
    return tuple(shape)


def _from_json(name: str, data: Any, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(data, list):
        raise ProtocolError(f"input {name!r}: 'data' must be a list")
    dtype = DATATYPES[datatype]
    limit = _FLOAT_MAX.get(datatype)
    count = prod(shape)
    try:
        # Let numpy infer first so floats, bools and strings are visible before the cast.
        raw = np.asarray(data)
    except _NUMPY_ERRORS:
        raise ProtocolError(f"input {name!r}: 'data' is ragged or not numeric") from None
    if raw.size != count:
        raise ProtocolError(f"input {name!r}: expected {count} elements, got {raw.size}")
    if count == 0:
        return np.zeros(shape, dtype)
    kind = raw.dtype.kind
    if limit is not None:  # FP16, FP32, FP64, BF16
        if kind not in "iuf":
            raise ProtocolError(f"input {name!r}: {datatype} data must be numbers")
        # NaN, Infinity and -Infinity (the tokens, or a gRPC message's typed floats) are values; a finite
        # value beyond the type's largest can only be an overflow. One reduction each way finds the common
        # case (every value finite and in range); NaN fails the comparisons, so only then are the finite
        # values looked at alone. The cast then cannot overflow.
        if not (-limit <= raw.min() and raw.max() <= limit):
            finite = raw[np.isfinite(raw)] if kind == "f" else raw
            if finite.size and not (-limit <= finite.min() and finite.max() <= limit):
                raise ProtocolError(f"input {name!r}: value out of range for {datatype}")
        if datatype == "BF16":
            return float_to_bf16(raw).reshape(shape)
    elif dtype.kind == "b":
        if kind in "iu" and ((raw == 0) | (raw == 1)).all():
            raw = raw.astype(dtype)
        elif kind != "b":
            raise ProtocolError(f"input {name!r}: BOOL data must be true/false or 0/1")
    elif dtype.kind in "iu":
        if kind in "iu":
            lo, hi = _INT_LIMITS[datatype]
            if int(raw.min()) < lo or int(raw.max()) > hi:
                raise ProtocolError(f"input {name!r}: value out of range for {datatype}")
        elif kind == "f" and datatype == "UINT64":
            raw = _uint64_fallback(name, data)
        else:
            raise ProtocolError(f"input {name!r}: {datatype} data must be integers")
    return raw.astype(dtype, copy=False).reshape(shape)


def _uint64_fallback(name: str, data: list) -> np.ndarray:
    # numpy infers float64 for ints above INT64_MAX; rare, so a per-element check is fine.
    flat = np.asarray(data, dtype=object).ravel()
    if not all(type(v) is int for v in flat):
        raise ProtocolError(f"input {name!r}: UINT64 data must be integers")
    try:
        return flat.astype(np.uint64)
    except _NUMPY_ERRORS:
        raise ProtocolError(f"input {name!r}: value out of range for UINT64") from None


def parse_infer_request(
    body: bytes,
    header_length: int | None,
    inputs: Sequence[TensorSpec],
    *,
    max_rows: int,
) -> InferRequest:
    size = len(body)
    if header_length is None:
        header: bytes | memoryview = body
        data_start = size
    else:
        if header_length < 0 or header_length > size:
            raise ProtocolError(f"Inference-Header-Content-Length {header_length} is outside the body of {size} bytes")
        header = memoryview(body)[:header_length]
        data_start = header_length
    req = load_header(header)
    if not isinstance(req, dict):
        raise ProtocolError("request must be a JSON object")

    req_id = req.get("id")
    if req_id is not None and not isinstance(req_id, str):
        raise ProtocolError("'id' must be a string")
    parameters = _optional_dict(req.get("parameters"), "'parameters'")
    refuse_sequence(parameters)
    binary_output = parameters.get("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise ProtocolError("'binary_data_output' must be a boolean")
    outputs = _parse_outputs(req.get("outputs"), binary_output)

    raw_inputs = req.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError("'inputs' must be a non-empty list")
    specs = {s.name: s for s in inputs}
    arrays: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    binary: list[tuple[str, np.dtype, tuple[int, ...], int]] = []
    offset = data_start
    rows = 0
    for i, item in enumerate(raw_inputs):
        if not isinstance(item, dict):
            raise ProtocolError(f"inputs[{i}] must be an object")
        name = item.get("name")
        if not isinstance(name, str):
            raise ProtocolError(f"inputs[{i}]: 'name' must be a string")
        if name in seen:
            raise ProtocolError(f"input {name!r} appears more than once")
        seen.add(name)
        spec = specs.get(name)
        if spec is None:
            raise ProtocolError(f"unknown input {name!r}")
        datatype = item.get("datatype")
        if not isinstance(datatype, str) or datatype not in DATATYPES:
            raise ProtocolError(f"input {name!r}: unsupported datatype {datatype!r}")
        if datatype != spec.datatype:
            raise ProtocolError(f"input {name!r}: expected datatype {spec.datatype}, got {datatype}")
        shape = _check_shape(name, item.get("shape"), spec)
        if not rows:
            rows = shape[0]
            if rows > max_rows:
                raise ProtocolError(f"batch of {rows} rows exceeds max_batch_size {max_rows}")
        elif shape[0] != rows:
            raise ProtocolError(f"input {name!r}: batch dimension {shape[0]} differs from {rows} of other inputs")
        item_parameters = _optional_dict(item.get("parameters"), f"input {name!r}: 'parameters'")
        if item_parameters:
            refuse_extensions(f"input {name!r}", item_parameters)
        nbytes = item_parameters.get("binary_data_size")
        data = item.get("data")
        if nbytes is not None:
            if data is not None:
                raise ProtocolError(f"input {name!r} has both 'data' and 'binary_data_size'")
            if type(nbytes) is not int or nbytes < 0:
                raise ProtocolError(f"input {name!r}: 'binary_data_size' must be a non-negative integer")
            dtype = DATATYPES[datatype]
            expected = prod(shape) * dtype.itemsize
            if nbytes != expected:
                raise ProtocolError(
                    f"input {name!r}: binary_data_size {nbytes} does not match shape {list(shape)} ({expected} bytes)"
                )
            binary.append((name, dtype, shape, offset))
            offset += nbytes
        elif data is None:
            raise ProtocolError(f"input {name!r} has neither 'data' nor 'binary_data_size'")
        else:
            arrays[name] = _from_json(name, data, datatype, shape)

    missing = [s.name for s in inputs if s.name not in seen]
    if missing:
        raise ProtocolError("missing required input(s): " + ", ".join(map(repr, missing)))
    if offset != size:
        raise ProtocolError(
            f"binary_data_size values add up to {offset - data_start} bytes,"
            f" but {size - data_start} bytes follow the JSON header"
        )
    for name, dtype, shape, start in binary:
        arr = np.frombuffer(body, dtype=dtype, count=prod(shape), offset=start).reshape(shape)
        if dtype.kind == "b" and arr.size and arr.view(np.uint8).max() > 1:
            raise ProtocolError(f"input {name!r}: BOOL bytes must be 0 or 1")
        arrays[name] = arr
    return InferRequest(
        id=req_id,
        inputs=arrays,
        rows=rows,
        outputs=outputs,
        binary_output=binary_output,
        parameters=parameters,
    )


def encode_infer_response(
    *,
    model_name: str,
    model_version: str,
    request_id: str | None,
    outputs: dict[str, np.ndarray],
    output_specs: Sequence[TensorSpec],
    requested: list[RequestedOutput] | None,
    binary_output: bool,
    parameters: dict | None = None,
) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    if requested is None:
        selected = [(spec, binary_output) for spec in output_specs]
    else:
        by_name = {spec.name: spec for spec in output_specs}
        try:
            selected = [(by_name[r.name], r.binary) for r in requested]
        except KeyError as e:
            raise ProtocolError(f"unknown output {e.args[0]!r}") from None

    entries: list[dict] = []
    chunks: list[memoryview] = []
    any_binary = False
    for spec, binary in selected:
        value = outputs.get(spec.name)
        if value is None:
            raise ProtocolError(f"model did not produce output {spec.name!r}", 503)
        # No copy when the model already returns the spec's dtype, C-contiguous.
        arr = np.asarray(value, dtype=DATATYPES[spec.datatype], order="C")
        entry: dict[str, Any] = {
            "name": spec.name,
            "datatype": spec.datatype,
            "shape": list(arr.shape),
        }
        if binary:
            any_binary = True
            entry["parameters"] = {"binary_data_size": arr.nbytes}
            chunks.append(arr.data)
        else:
            flat = arr.ravel()  # orjson writes 1-D numpy arrays as flat lists
            entry["data"] = json_data(bf16_to_float32(flat) if spec.datatype == "BF16" else flat)
        entries.append(entry)

    response: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        response["id"] = request_id
    if parameters is not None:
        response["parameters"] = parameters
    response["outputs"] = entries
    header = orjson.dumps(response, option=orjson.OPT_SERIALIZE_NUMPY)
    if not any_binary:
        return header, [(b"content-type", b"application/json")]
    return b"".join([header, *chunks]), [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", str(len(header)).encode()),
    ]
