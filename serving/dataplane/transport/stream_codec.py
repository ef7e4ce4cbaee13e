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
# of a batch finish together), as `pack_replies` frames them. One XADD per gateway per flush.
REPLIES = b"r"
GROUP = "nodes"  # one consumer group per version stream; every node hosting the version is a consumer
# The dtypes a tensor may carry: the protocol's, by their numpy names ("<f4", "|b1", ...).
_DTYPES = {dtype.str: dtype for dtype in DATATYPES.values()}
MAX_DIMS = 8
TRACE_VALUE_MAX = 512  # a trace context's header, at most: W3C's bound on a tracestate (`tracing.TRACESTATE_MAX`)


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


def _trace(trace: object) -> dict[str, str] | None:
    """A request's trace context, checked: at most two W3C headers, strings of at most TRACE_VALUE_MAX characters.
    A longer `tracestate` is left out rather than refused (the gateway cuts it to fit, `tracing.carrier`, but one of
    another build may not): it is the caller's vendors' data, never a reason to fail the request."""
    if trace is None:
        return None
    if not isinstance(trace, dict) or len(trace) > 2:
        raise MalformedMessage("bad trace context")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in trace.items()):
        raise MalformedMessage("bad trace context")
    state = trace.get("tracestate")
    if state is not None and len(state) > TRACE_VALUE_MAX:
        trace = {k: v for k, v in trace.items() if k != "tracestate"}
    if not all(len(v) <= TRACE_VALUE_MAX for v in trace.values()):
        raise MalformedMessage("bad trace context")
    return trace or None


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
        trace = _trace(doc.get("trace"))
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


def pack_replies(ids: list[int], replies: list[bytes]) -> bytes:
    """One reply entry: the msgpack array `[ids, reply_1, ..., reply_n]`, where `ids[i - 1]` is the request `reply_i`
    (an `encode_success` or `encode_error`) answers. The ids come first and apart from the replies, so an entry
    damaged further on (a bug, a version skew) still names every caller it answers: `read_replies`."""
    return msgpack.packb([ids, *replies])  # the list holds references: each reply is copied once, into the entry


@dataclass(slots=True)
class ReplyEntry:
    """What a gateway reads of one reply entry (`read_replies`)."""

    # The encoded replies that could be read, in order, each with the request the entry's header says it answers
    # (None where it does not say: the old framing, or a damaged header; the reply's own id tells then).
    replies: list[tuple[int | None, bytes]]
    # Every request the entry's header names. When the entry is damaged, those that `replies` did not answer are
    # answered 500 by the reader.
    named: list[int]
    damage: str | None = None  # why the entry could not be read whole; None: it is intact


def read_replies(raw: bytes) -> ReplyEntry:
    """Read a reply entry; never raises. An intact entry costs one msgpack pass, as a plain array would.

    A damaged one (a bug or a version skew) gives the replies before the damage, and still names every caller
    whose reply is past it, or is itself damaged: the header is read first, and on its own. Only damage inside
    the header leaves callers unnamed (then they wait for their deadlines, 504).

    Version skew in a rolling upgrade. A gateway reads the old framing too (a plain array of encoded replies,
    from a node older than `pack_replies`' header), so nodes not upgraded yet are read as before (damage in such
    an entry still leaves the callers past it unnamed: it has no header). A gateway older than the header reads
    the new framing through its own salvage path: it delivers every reply (its salvage skips the header and keeps
    the encoded replies) but logs and counts each entry as a malformed one. Neither crashes and no reply is lost
    to the skew; upgrade the gateways before the nodes to keep that noise out of the logs and of
    `ferry_internal_errors_total{component="stream_reply"}`."""
    try:
        items = msgpack.unpackb(raw)
    except Exception:  # msgpack raises several types (ExtraData, FormatError, ValueError...): read what it can
        items = None
    if isinstance(items, list):
        if items and isinstance(items[0], list):
            ids, replies = items[0], items[1:]
            if len(ids) == len(replies) and all(map(_int, ids)) and all(isinstance(r, bytes) for r in replies):
                return ReplyEntry(list(zip(ids, replies, strict=True)), ids)
        elif all(isinstance(r, bytes) for r in items):  # the old framing: no header, each reply names its request
            return ReplyEntry([(None, r) for r in items], [])
    return _salvage(raw)


def _salvage(raw: bytes) -> ReplyEntry:
    """What can still be read of an entry `read_replies` could not read whole, item by item up to the damage."""
    unpacker = msgpack.Unpacker(strict_map_key=False, max_buffer_size=max(len(raw), 1))
    unpacker.feed(raw)
    entry = ReplyEntry([], [], "a reply entry must be [ids, reply, ...]: request ids, then one encoded reply each")
    ids: list | None = None
    positional = False  # whether the header pairs the replies with their requests (one integer id each)
    try:
        count = unpacker.read_array_header()
        for k in range(count):
            item = unpacker.unpack()
            if k == 0 and isinstance(item, list):  # the header
                ids = item
                entry.named = [i for i in ids if _int(i)]
                positional = len(entry.named) == len(ids) == count - 1
            elif isinstance(item, bytes):
                entry.replies.append((ids[k - 1] if ids is not None and positional else None, item))
            elif ids is None and isinstance(item, dict) and _int(item.get("id")):
                # The old framing: an item that is no encoded reply but still says which request it answers.
                entry.named.append(item["id"])
    except Exception as exc:  # msgpack raises several types (OutOfData, FormatError, ValueError...): the rest is lost
        entry.damage = f"unreadable after {len(entry.replies)} replies: {type(exc).__name__}"
    return entry


def unpack_replies(raw: bytes) -> list[bytes]:
    """The encoded replies of an intact entry, of either framing; MalformedMessage if it is damaged."""
    entry = read_replies(raw)
    if entry.damage is not None:
        raise MalformedMessage(entry.damage)
    return [reply for _, reply in entry.replies]
