"""The framing between a node and its sandboxed runtime process (serving.dataplane.node.runtime_process and
runtime_worker), over a Unix socketpair: no JSON, no pickle.

A message is a 4-byte big-endian header length, a msgpack header (a map; its "arrays" key lists each array's
dtype, shape and name), then each array's raw bytes in order. Arrays are sent from memoryviews (no copy) and
received with recv_into a preallocated numpy buffer. The header is checked before anything is allocated:
only plain numeric and bool dtypes (never object, void or strings: bytes written into an object array would
be pointers), bounded header and total sizes, so a hostile runtime process cannot make its parent allocate
or interpret what it likes.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from collections.abc import Sequence

import msgpack
import numpy as np

MAX_HEADER_BYTES = 1024 * 1024
_LENGTH = struct.Struct(">I")
_DTYPE_KINDS = "biuf"  # bool, signed and unsigned ints, floats


class ChannelClosed(Exception):
    """The other end went away (EOF or a reset) before a whole message arrived."""


class ChannelTimeout(Exception):
    """The other end did not send or take a whole message in time."""


class ChannelError(Exception):
    """A message that breaks the framing's rules."""


def send(
    sock: socket.socket,
    header: dict,
    arrays: Sequence[np.ndarray] = (),
    *,
    deadline: float | None = None,
    names: Sequence[str] | None = None,
) -> None:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = {
        **header,
        "arrays": [
            {"dtype": a.dtype.str, "shape": list(a.shape), **({"name": names[i]} if names else {})}
            for i, a in enumerate(arrays)
        ],
    }
    packed = msgpack.packb(header, use_bin_type=True)
    buffers = [memoryview(_LENGTH.pack(len(packed)) + packed)]
    buffers += [memoryview(a).cast("B") for a in arrays if a.nbytes]
    _sendall(sock, buffers, deadline)


def recv(
    sock: socket.socket, *, deadline: float | None = None, max_bytes: int = 1 << 40
) -> tuple[dict, list[np.ndarray]]:
    """One message: its header and its arrays (names, where sent, in header["arrays"][i]["name"])."""
    length = bytearray(_LENGTH.size)
    _recv_into(sock, memoryview(length), deadline)
    (size,) = _LENGTH.unpack(length)
    if size > MAX_HEADER_BYTES:
        raise ChannelError(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    raw = bytearray(size)
    _recv_into(sock, memoryview(raw), deadline)
    try:
        header = msgpack.unpackb(bytes(raw), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ChannelError(f"malformed header: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise ChannelError("the header is not a map")
    specs = header.get("arrays", [])
    if not isinstance(specs, list):
        raise ChannelError("'arrays' is not a list")
    shapes = [_spec(s) for s in specs]
    total = sum(dtype.itemsize * math.prod(shape) for dtype, shape in shapes)
    if total > max_bytes:
        raise ChannelError(f"message of {total} bytes exceeds {max_bytes}")
    arrays = []
    for dtype, shape in shapes:
        array = np.empty(shape, dtype)
        if array.nbytes:
            _recv_into(sock, memoryview(array).cast("B"), deadline)
        arrays.append(array)
    return header, arrays


def _spec(spec: object) -> tuple[np.dtype, tuple[int, ...]]:
    if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str) or not isinstance(spec.get("shape"), list):
        raise ChannelError("an array spec needs a dtype string and a shape list")
    try:
        dtype = np.dtype(spec["dtype"])
    except TypeError:
        raise ChannelError(f"unknown dtype {spec['dtype']!r}") from None
    if dtype.kind not in _DTYPE_KINDS or dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
        raise ChannelError(f"dtype {spec['dtype']!r} is not a plain numeric or bool type")
    shape = spec["shape"]
    if len(shape) > 32 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape):
        raise ChannelError("a shape is at most 32 non-negative integers")
    return dtype, tuple(shape)


def _remaining(sock: socket.socket, deadline: float | None) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise ChannelTimeout("timed out")
    sock.settimeout(left)


def _sendall(sock: socket.socket, buffers: list[memoryview], deadline: float | None) -> None:
    """sendmsg of every buffer at once (one syscall for a small message), resumed where a partial send stopped."""
    while buffers:
        _remaining(sock, deadline)
        try:
            sent = sock.sendmsg(buffers)
        except TimeoutError:
            raise ChannelTimeout("timed out sending") from None
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise ChannelClosed(str(exc)) from None
        while sent and buffers:
            if sent >= len(buffers[0]):
                sent -= len(buffers[0])
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    while len(view):
        _remaining(sock, deadline)
        try:
            n = sock.recv_into(view)
        except TimeoutError:
            raise ChannelTimeout("timed out receiving") from None
        except ConnectionResetError as exc:
            raise ChannelClosed(str(exc)) from None
        if n == 0:
            raise ChannelClosed("the other end closed the channel")
        view = view[n:]
