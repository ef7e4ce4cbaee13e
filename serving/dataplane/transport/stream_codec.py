"""What travels over Redis Streams between a gateway and the nodes: requests and replies as msgpack.

Tensors travel as raw bytes with their dtype and shape, never as lists of numbers. Deadlines are
absolute wall-clock seconds (each side converts from and to its own monotonic clock), so a request
that waited in a stream, or was claimed from a dead node, is never run past its caller's deadline.

Decoding checks everything it reads: a malformed message is a `MalformedMessage` (a bug or a version
skew between processes, never a client's bad input, which the gateway refused before sending), and
the node answers it as a counted 500 rather than crashing its consumer loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack
import numpy as np

from serving.dataplane.errors import DeadlineExceeded, ModelFailed, NotFound, ServingError, Shed, Unavailable
from serving.dataplane.http.protocol import DATATYPES
from serving.dataplane.transport.transport import Outputs

FIELD = b"m"  # a request stream entry holds one field: the msgpack request
# A reply stream entry holds one field: the replies a node had ready for that gateway at once (the requests
# of a batch finish together), as a msgpack array of encoded replies. One XADD per gateway per flush.
REPLIES = b"r"
GROUP = "nodes"  # one consumer group per version stream; every node hosting the version is a consumer
# The dtypes a tensor may carry: the protocol's, by their numpy names ("<f4", "|b1", ...).
_DTYPES = {dtype.str: dtype for dtype in DATATYPES.values()}
MAX_DIMS = 8


class MalformedMessage(ValueError):
    """A stream message this process cannot read. `request_id` and `reply_to` are set when the
    message said where to answer, so the error can still be answered."""

    def __init__(self, message: str, request_id: int | None = None, reply_to: bytes | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.reply_to = reply_to


def request_stream(key: str) -> str:
    """The stream of version `key` ("digits:1"). The braces are a Redis Cluster hash tag: whatever else
    must sit with the version's stream on one shard names the same tag."""
    return f"ferry:{{{key}}}:req"


@dataclass(slots=True)
class StreamRequest:
    id: int  # unique within its gateway (its reply stream)
    reply_to: bytes  # the gateway process's reply stream
    deadline: float  # wall clock, seconds since the epoch
    tenant: int | None
    priority: int
    rows: int
    inputs: dict[str, np.ndarray]
    outputs: tuple[str, ...] | None  # the outputs the caller asked for; None: all
    # The W3C trace context of the gateway's span (`serving.dataplane.tracing.carrier`); None: not traced.
    trace: dict[str, str] | None = None


@dataclass(slots=True)
class StreamReply:
    id: int
    outputs: Outputs | None = None  # set on success
    error: ServingError | None = None  # set on failure


# -- tensors ---------------------------------------------------------------------------------


def _pack_tensors(tensors: dict[str, np.ndarray]) -> list[list]:
    return [[name, a.dtype.str, list(a.shape), np.ascontiguousarray(a).tobytes()] for name, a in tensors.items()]


def _unpack_tensors(raw: object) -> dict[str, np.ndarray]:
    if not isinstance(raw, list):
        raise MalformedMessage("tensors must be a list")
    tensors: dict[str, np.ndarray] = {}
    for item in raw:
        if not isinstance(item, list) or len(item) != 4:
            raise MalformedMessage("a tensor must be [name, dtype, shape, bytes]")
        name, dtype_name, shape, data = item
        if not isinstance(name, str) or name in tensors:
            raise MalformedMessage(f"bad or repeated tensor name {name!r}")
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise MalformedMessage(f"tensor {name!r}: unsupported dtype {dtype_name!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise MalformedMessage(f"tensor {name!r}: bad shape {shape!r}")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dtype.itemsize:
            raise MalformedMessage(
                f"tensor {name!r}: {len(data) if isinstance(data, bytes) else 'no'} bytes"
                f" for shape {shape} of {dtype_name}"
            )
        # Read-only over the message's bytes: the runtime copies what it must (runtime._owned).
        tensors[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
    return tensors


# -- requests --------------------------------------------------------------------------------


def encode_request(request: StreamRequest) -> bytes:
    return msgpack.packb(
        {
            "id": request.id,
            "reply": request.reply_to,
            "deadline": request.deadline,
            "tenant": request.tenant,
            "priority": request.priority,
            "rows": request.rows,
            "outputs": list(request.outputs) if request.outputs is not None else None,
            "inputs": _pack_tensors(request.inputs),
            **({"trace": request.trace} if request.trace else {}),
        }
    )


def _unpack_map(raw: bytes) -> dict:
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise MalformedMessage(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(doc, dict):
        raise MalformedMessage("a message must be a map")
    return doc


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_request(raw: bytes) -> StreamRequest:
    """Read a request; raises MalformedMessage, with the address to answer when the message had one."""
    doc = _unpack_map(raw)
    request_id, reply_to = doc.get("id"), doc.get("reply")
    if not _int(request_id) or not isinstance(reply_to, bytes) or not reply_to:
        raise MalformedMessage("a request needs an integer id and a reply stream")
    try:
        deadline, tenant, priority, rows = doc["deadline"], doc["tenant"], doc["priority"], doc["rows"]
        outputs = doc["outputs"]
        if not isinstance(deadline, float | int) or isinstance(deadline, bool) or not math.isfinite(deadline):
            raise MalformedMessage("bad deadline")
        if tenant is not None and not _int(tenant):
            raise MalformedMessage("bad tenant")
        if not _int(priority) or priority < 0 or not _int(rows) or rows < 1:
            raise MalformedMessage("bad priority or rows")
        if outputs is not None and (not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs)):
            raise MalformedMessage("bad outputs")
        inputs = _unpack_tensors(doc["inputs"])
        if not inputs:
            raise MalformedMessage("no inputs")
        trace = doc.get("trace")
        if trace is not None and (
            not isinstance(trace, dict)
            or len(trace) > 2
            or not all(isinstance(k, str) and isinstance(v, str) and len(v) <= 512 for k, v in trace.items())
        ):
            raise MalformedMessage("bad trace context")
    except KeyError as exc:
        raise MalformedMessage(f"missing field {exc.args[0]!r}", request_id, reply_to) from None
    except MalformedMessage as exc:
        raise MalformedMessage(str(exc), request_id, reply_to) from None
    return StreamRequest(
        request_id,
        reply_to,
        float(deadline),
        tenant,
        priority,
        rows,
        inputs,
        tuple(outputs) if outputs is not None else None,
        trace,
    )


# -- replies ---------------------------------------------------------------------------------


def encode_success(request_id: int, outputs: dict[str, np.ndarray], wanted: tuple[str, ...] | None) -> bytes:
    if wanted is not None:
        outputs_sent = {name: a for name, a in outputs.items() if name in wanted}
    else:
        outputs_sent = outputs
    return msgpack.packb(
        {
            "id": request_id,
            "outputs": _pack_tensors(outputs_sent),
            "compute": float(getattr(outputs, "compute_seconds", 0.0)),
        }
    )


def encode_error(request_id: int, error: ServingError) -> bytes:
    doc: dict[str, object] = {
        "id": request_id,
        "status": error.status,
        "message": error.message,
        "retry_after": error.retry_after,
    }
    if isinstance(error, Shed):
        doc["shed"] = [error.reason, error.tier]
    return msgpack.packb(doc)


def _error(status: int, message: str, retry_after: float | None, shed: object) -> ServingError:
    """The same `serving.dataplane.errors` type the node raised, so the gateway's fallback and metrics
    treat a remote refusal as they treat a local one."""
    if status == 503 and isinstance(shed, list) and len(shed) == 2 and isinstance(shed[0], str) and _int(shed[1]):
        return Shed(message, reason=shed[0], tier=shed[1], retry_after=retry_after or 1.0)
    kinds: dict[int, type[ServingError]] = {503: Unavailable, 504: DeadlineExceeded, 422: ModelFailed, 404: NotFound}
    kind = kinds.get(status)
    if kind is not None:
        return kind(message, retry_after=retry_after)
    return ServingError(message, status=status, retry_after=retry_after)


def decode_reply(raw: bytes) -> StreamReply:
    doc = _unpack_map(raw)
    request_id = doc.get("id")
    if not _int(request_id):
        raise MalformedMessage("a reply needs an integer id")
    if "outputs" in doc:
        try:
            tensors = _unpack_tensors(doc["outputs"])
        except MalformedMessage as exc:
            raise MalformedMessage(str(exc), request_id) from None
        compute = doc.get("compute", 0.0)
        return StreamReply(
            request_id, outputs=Outputs(tensors, float(compute) if _int(compute) or isinstance(compute, float) else 0.0)
        )
    status, message, retry_after = doc.get("status"), doc.get("message"), doc.get("retry_after")
    if not _int(status) or not 400 <= status <= 599 or not isinstance(message, str):
        raise MalformedMessage("an error reply needs a status and a message", request_id)
    if retry_after is not None and (not isinstance(retry_after, float | int) or isinstance(retry_after, bool)):
        retry_after = None
    return StreamReply(request_id, error=_error(status, message, retry_after, doc.get("shed")))


def pack_replies(replies: list[bytes]) -> bytes:
    return msgpack.packb(replies)


def unpack_replies(raw: bytes) -> list[bytes]:
    try:
        replies = msgpack.unpackb(raw)
    except Exception as exc:
        raise MalformedMessage(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(replies, list) or not all(isinstance(r, bytes) for r in replies):
        raise MalformedMessage("a reply entry must be an array of replies")
    return replies


def salvage_replies(raw: bytes) -> tuple[list[bytes], list[int]]:
    """What can still be read of a reply entry `unpack_replies` refused: the replies before the damage, and the
    request ids of items that are no encoded reply but still say which request they answer (a map with an
    integer id), so that their callers are answered (500) rather than left to their deadlines. Replies past
    the damage, or whose request cannot be told, are lost: no caller can be named for them."""
    unpacker = msgpack.Unpacker(strict_map_key=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    readable: list[bytes] = []
    ids: list[int] = []
    try:
        count = unpacker.read_array_header()
        for _ in range(count):
            item = unpacker.unpack()
            if isinstance(item, bytes):
                readable.append(item)
            elif isinstance(item, dict) and _int(item.get("id")):
                ids.append(item["id"])
    except Exception:  # msgpack raises several types (OutOfData, FormatError, ValueError...): the rest is lost
        pass
    return readable, ids
