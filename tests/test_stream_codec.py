"""The Redis Streams message codec: tensors round-trip as bytes with dtype and shape; errors map back to
the data plane's own types; a malformed message is an error to answer, never a crash, and a damaged reply
entry still names every request it answers."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from serving.dataplane.errors import DeadlineExceeded, ModelFailed, ServingError, Shed, Unavailable
from serving.dataplane.http.protocol import DATATYPES
from serving.dataplane.transport.stream_codec import (
    MalformedMessage,
    StreamRequest,
    decode_reply,
    decode_request,
    encode_error,
    encode_request,
    encode_success,
    pack_replies,
    read_replies,
    request_stream,
    unpack_replies,
)
from serving.dataplane.transport.transport import Outputs


def request(**inputs: np.ndarray) -> StreamRequest:
    return StreamRequest(7, b"ferry:reply:gw", 1_700_000_000.25, 3, 2, 2, inputs, ("scores",))


@pytest.mark.parametrize("datatype", sorted(DATATYPES))
def test_every_protocol_dtype_round_trips_with_its_shape(datatype: str) -> None:
    # given a tensor of each protocol dtype, 3-D and not contiguous
    dtype = DATATYPES[datatype]
    values = (np.arange(24) % 2 == 0) if dtype == np.bool_ else np.arange(24)
    tensor = values.astype(dtype).reshape(2, 3, 4).transpose(0, 2, 1)
    # when it travels in a request
    decoded = decode_request(encode_request(request(x=tensor)))
    # then it comes back equal, with its dtype and shape, and the request's fields intact
    assert decoded.inputs["x"].dtype == dtype
    assert decoded.inputs["x"].shape == (2, 4, 3)
    np.testing.assert_array_equal(decoded.inputs["x"], tensor)
    assert (
        decoded.id,
        decoded.reply_to,
        decoded.deadline,
        decoded.tenant,
        decoded.priority,
        decoded.rows,
        decoded.outputs,
    ) == (7, b"ferry:reply:gw", 1_700_000_000.25, 3, 2, 2, ("scores",))


def test_tensors_travel_as_raw_bytes_not_lists() -> None:
    tensor = np.linspace(0, 1, 64, dtype=np.float32).reshape(1, 64)
    raw = encode_request(request(input=tensor))
    doc = msgpack.unpackb(raw)
    name, dtype, shape, data = doc["inputs"][0]
    assert (name, dtype, shape) == ("input", "<f4", [1, 64])
    assert data == tensor.tobytes()
    assert len(raw) < tensor.nbytes + 200  # no list of 64 floats


def test_a_success_reply_keeps_only_the_outputs_asked_for_and_the_compute_share() -> None:
    outputs = Outputs({"scores": np.ones((2, 10), np.float32), "hidden": np.zeros((2, 4), np.float64)}, 0.004)
    reply = decode_reply(encode_success(9, outputs, ("scores",)))
    assert reply.id == 9 and reply.error is None
    assert set(reply.outputs) == {"scores"}
    np.testing.assert_array_equal(reply.outputs["scores"], np.ones((2, 10), np.float32))
    assert reply.outputs.compute_seconds == pytest.approx(0.004)
    assert set(decode_reply(encode_success(9, outputs, None)).outputs) == {"scores", "hidden"}


@pytest.mark.parametrize(
    "error",
    [
        Shed("queue full", reason="queue_full", tier=2, retry_after=3.0),
        Unavailable("not loaded", retry_after=1),
        DeadlineExceeded("too late"),
        ModelFailed("negative pixel"),
        ServingError("rows", status=400),
        ServingError("bug", status=500),
    ],
)
def test_an_error_reply_comes_back_as_the_same_type_status_and_retry_after(error: ServingError) -> None:
    decoded = decode_reply(encode_error(4, error)).error
    assert type(decoded) is type(error)
    assert (decoded.status, decoded.message, decoded.retry_after) == (error.status, error.message, error.retry_after)
    if isinstance(error, Shed):
        assert (decoded.reason, decoded.tier) == ("queue_full", 2)


def _tampered(**changes: object) -> bytes:
    doc = msgpack.unpackb(encode_request(request(input=np.zeros((2, 64), np.float32))))
    doc.update(changes)
    return msgpack.packb(doc)


@pytest.mark.parametrize(
    "raw",
    [
        _tampered(inputs=[["input", "<f4", [2, 64], b"\0" * 10]]),  # bytes do not fill the shape
        _tampered(inputs=[["input", "|O", [2, 64], b"\0" * 512]]),  # object dtype: never
        _tampered(inputs=[["input", "<f4", [2, -64], b""]]),
        _tampered(inputs=[["input", "<f4", "2x64", b""]]),
        _tampered(inputs=[["a", "<f4", [1], b"\0" * 4], ["a", "<f4", [1], b"\0" * 4]]),
        _tampered(inputs=[]),
        _tampered(deadline="soon"),
        _tampered(rows=0),
        _tampered(priority=True),
        _tampered(outputs="scores"),
    ],
)
def test_a_malformed_request_that_says_where_to_answer_can_be_answered(raw: bytes) -> None:
    with pytest.raises(MalformedMessage) as caught:
        decode_request(raw)
    assert (caught.value.request_id, caught.value.reply_to) == (7, b"ferry:reply:gw")


def test_a_request_missing_a_field_is_malformed() -> None:
    doc = msgpack.unpackb(encode_request(request(input=np.zeros((1, 64), np.float32))))
    del doc["deadline"]
    with pytest.raises(MalformedMessage, match="deadline") as caught:
        decode_request(msgpack.packb(doc))
    assert caught.value.request_id == 7


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        b"not msgpack at all \xff",
        msgpack.packb([1, 2]),
        msgpack.packb({"id": "7", "reply": b"r"}),
        msgpack.packb({"id": 7}),
    ],
)
def test_garbage_is_malformed_without_an_address(raw: bytes) -> None:
    with pytest.raises(MalformedMessage) as caught:
        decode_request(raw)
    assert caught.value.reply_to is None


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",
        msgpack.packb({"id": 1, "status": 200, "message": "ok"}),
        msgpack.packb({"id": 1, "outputs": [["s", "<f4", [3], b"\0"]]}),
        msgpack.packb({"status": 503, "message": "x"}),
    ],
)
def test_a_malformed_reply_is_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode_reply(raw)


def test_the_stream_key_hash_tags_the_version() -> None:
    assert request_stream("digits:1") == "ferry:{digits:1}:req"


# -- reply entries ---------------------------------------------------------------------------

A = encode_success(3, {"s": np.ones((1, 2), np.float32)}, None)
B = encode_error(9, Unavailable("busy", retry_after=1))
C = encode_error(12, ServingError("bug"))
ENTRY = pack_replies([3, 9, 12], [A, B, C])


def test_a_reply_entry_names_its_requests_ahead_of_their_replies() -> None:
    # the ids first, on their own; the replies as they were encoded, not copied into another form
    assert msgpack.unpackb(ENTRY) == [[3, 9, 12], A, B, C]
    entry = read_replies(ENTRY)
    assert (entry.replies, entry.named, entry.damage) == ([(3, A), (9, B), (12, C)], [3, 9, 12], None)
    assert unpack_replies(ENTRY) == [A, B, C]


def test_a_reply_entry_of_the_old_framing_is_still_read() -> None:
    # a node from before the header (a rolling upgrade): a plain array of replies, each naming its own request
    entry = read_replies(msgpack.packb([A, B]))
    assert (entry.replies, entry.named, entry.damage) == ([(None, A), (None, B)], [], None)


@pytest.mark.parametrize(
    ("raw", "readable"),
    [
        (ENTRY[: len(ENTRY) - len(C) // 2], [(3, A), (9, B)]),  # cut inside the last reply
        (ENTRY[: len(msgpack.packb([3, 9, 12])) + 1], []),  # cut right after the header
        (msgpack.packb([[3, 9, 12], A, {"id": 9}, C]), [(3, A), (12, C)]),  # a reply that is no encoded reply
        (ENTRY + b"\x00", [(3, A), (9, B), (12, C)]),  # bytes after the entry
        (msgpack.packb([[3, 9, 12], A, B]), [(None, A), (None, B)]),  # fewer replies than ids: none paired by place
    ],
)
def test_a_damaged_reply_entry_still_names_every_request_it_answers(
    raw: bytes, readable: list[tuple[int | None, bytes]]
) -> None:
    entry = read_replies(raw)
    assert entry.replies == readable
    assert entry.named == [3, 9, 12]
    assert entry.damage is not None
    with pytest.raises(MalformedMessage):
        unpack_replies(raw)


@pytest.mark.parametrize("raw", [b"", b"\xc1", ENTRY[:3], msgpack.packb({"id": 3}), msgpack.packb([1, 2])])
def test_a_reply_entry_damaged_in_its_header_names_nobody_and_raises_nothing(raw: bytes) -> None:
    entry = read_replies(raw)
    assert (entry.replies, entry.named) == ([], [])
    assert entry.damage is not None
