"""Frames between the web processes and the node host of embedded mode (`serve --workers N`), over a Unix socket.

A frame is a 9-byte head, payload length (u32), kind (u8) and request id (u32), then the payload. A request
and its answer carry the same id; a connection carries many at once, answered in any order. What each kind
holds is in `serving.dataplane.transport.host_link` (the web side) and `serving.dataplane.node.node_host`
(the host's). Writes made in one turn of the event loop leave in one `write`: at thousands of requests a
second, a syscall per frame would cost the loop more than the frames do.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import cast

log = logging.getLogger(__name__)

HEAD = struct.Struct("!IBI")
# Inference payloads are bounded long before this (the body limits of the front door); a bigger length is a
# broken peer, and the connection is dropped rather than a buffer grown for it.
MAX_FRAME_BYTES = 512 * 1024**2

INFER, REPLY = 1, 2
STATUS, STATUS_REPLY = 3, 4
QUOTA, QUOTA_REPLY = 5, 6
QUOTA_RELEASE = 7  # no answer
REFRESH, REFRESH_REPLY = 8, 9
# The host could not read a request it was sent (an id it can still answer): the payload is its message.
BAD_FRAME = 10
# The client of the INFER of this id left (no payload, no answer): the host drops it unrun if it still waits.
CANCEL = 11
# The host's node as the fleet page shows it (a heartbeat's document) and its record of the last hour: asked for
# only when the page or /api/fleet/ is read, never on the request path.
FLEET, FLEET_REPLY = 12, 13

# Above this many bytes unwritten, a connection stops reading until its peer drains it.
HIGH_WATER = 4 * 1024**2


class FrameProtocol(asyncio.Protocol):
    """Parses frames out of the byte stream and hands each to `on_frame(kind, id, payload)`."""

    def __init__(
        self, on_frame: Callable[[int, int, bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of asyncio's
        self.transport.set_write_buffer_limits(high=HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        offset = 0
        size = len(buf)
        while size - offset >= HEAD.size:
            length, kind, rid = HEAD.unpack_from(buf, offset)
            if length > MAX_FRAME_BYTES:
                log.error("a frame of %d bytes from the other side of the node socket: closing it", length)
                self.close()
                return
            end = offset + HEAD.size + length
            if end > size:
                break
            payload = bytes(buf[offset + HEAD.size : end])
            offset = end
            self.on_frame(kind, rid, payload)
        if offset:
            del buf[:offset]

    def send(self, kind: int, rid: int, payload: bytes) -> None:
        if self.closed or self.transport is None:
            return
        self._out.append(HEAD.pack(len(payload), kind, rid))
        self._out.append(payload)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(b"".join(out))

    def pause_writing(self) -> None:  # the peer is not reading: stop reading its requests meanwhile
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._out.clear()
        self.on_lost(exc)
