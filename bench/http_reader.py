"""One HTTP/1.1 response read off a keep-alive connection, fed as bytes arrive: the framing both load
generators (`bench.loadgen`, `bench.ramp`) need, and nothing more (no header parsing beyond framing, and
whether Ferry's fallback answered)."""

from __future__ import annotations


class ResponseReader:
    __slots__ = ("buf", "header_end", "need", "status", "chunked", "keep", "fell_back")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.reset()

    def reset(self) -> None:
        self.buf = bytearray()
        self.header_end = -1
        self.need = -1  # total bytes of head + body; -2: the body runs to connection close
        self.status = 0
        self.chunked = False
        self.keep = True
        self.fell_back = False  # Ferry answered with the model's fallback (`x-ferry-fallback-from`)

    @property
    def to_close(self) -> bool:
        """The response has no length: it ends when the connection does."""
        return self.need == -2

    def feed(self, data: bytes) -> bool:
        """Add bytes; True once the whole response (head and body) has arrived."""
        buf = self.buf
        buf += data
        if self.header_end < 0:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            self.header_end = end + 4
            self.status = int(buf[9:12])
            head = bytes(buf[:end]).lower()
            self.keep = b"\r\nconnection: close" not in head
            self.fell_back = b"\r\nx-ferry-fallback-from:" in head
            i = head.find(b"\r\ncontent-length:")
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                self.need = self.header_end + int(head[i + 17 : j if j >= 0 else len(head)])
            elif b"\r\ntransfer-encoding: chunked" in head:
                self.chunked = True
            elif self.status in (204, 304) or 100 <= self.status < 200:
                self.need = self.header_end
            else:
                self.need = -2
        if self.chunked:
            return buf.endswith(b"0\r\n\r\n")
        return self.need != -2 and len(buf) >= self.need

    def body(self) -> bytes:
        """The body of a complete response (or, at connection close, of one that ran to it)."""
        if self.chunked:
            return _dechunk(bytes(self.buf[self.header_end :]))
        if self.need == -2:
            return bytes(self.buf[self.header_end :])
        return bytes(self.buf[self.header_end : self.need])


def _dechunk(raw: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = raw.find(b"\r\n", pos)
        size = int(raw[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += raw[end + 2 : end + 2 + size]
        pos = end + 2 + size + 2
