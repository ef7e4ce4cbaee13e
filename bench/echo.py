"""A trivial HTTP/1.1 server (fixed 200 JSON, optional delay) for measuring the load generator itself.

Run as `python -m bench.loadgen --echo-server PORT [--delay-ms MS]`; `EchoServer` starts it in a
subprocess so it gets its own interpreter and the generator is not measured against itself.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

ECHO_BODY = b'{"model_name":"echo","outputs":[{"name":"scores","datatype":"FP32","shape":[1,1],"data":[1.0]}]}'


class _EchoProtocol(asyncio.Protocol):
    """Answers every request with a fixed 200 JSON body; `delay` seconds later when set."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.response = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(ECHO_BODY)).encode()
            + b"\r\n\r\n"
            + ECHO_BODY
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buf[:end]).lower()
            i = head.find(b"\r\ncontent-length:")
            length = 0
            if i >= 0:
                j = head.find(b"\r\n", i + 2)
                length = int(head[i + 17 : j if j >= 0 else len(head)])
            if len(buf) < end + 4 + length:
                return
            del buf[: end + 4 + length]
            if self.delay > 0:
                asyncio.get_running_loop().call_later(self.delay, self._reply)
            else:
                self._reply()

    def _reply(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.response)


async def echo_server(port: int, delay_ms: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _EchoProtocol(delay_ms / 1000.0), "127.0.0.1", port, backlog=1024)
    bound = server.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    async with server:
        await server.serve_forever()


class EchoServer:
    """`python -m bench.loadgen --echo-server 0` as a subprocess: its own interpreter (and core)."""

    def __init__(self, delay_ms: float = 0.0) -> None:
        self.delay_ms = delay_ms
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    def __enter__(self) -> EchoServer:
        cmd = [sys.executable, "-m", "bench.loadgen", "--echo-server", "0", "--delay-ms", str(self.delay_ms)]
        root = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("READY "):
            self.__exit__()
            raise RuntimeError(f"echo server did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v2/models/echo/infer"

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def sample_body() -> bytes:
    data = ",".join(["0.5"] * 64)
    return ('{"inputs":[{"name":"input","datatype":"FP32","shape":[1,64],"data":[' + data + "]}]}").encode()
