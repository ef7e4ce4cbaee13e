"""Open-loop HTTP/1.1 load generator (pure asyncio, uvloop when available).

Requests leave on a fixed timetable (request i at t0 + i/rate) whatever the server does, and latency is
counted from each request's *scheduled* time, so a stalled server shows up as latency instead of as a
quietly lower send rate (no coordinated omission). The generator reports its own send lag so a reader
can tell when it, not the server, was the bottleneck.

    python -m bench.loadgen URL --body-file F --rate R --duration D
    python -m bench.capacity                                    (this generator's own ceiling)
    python -m bench.loadgen --echo-server PORT [--delay-ms MS]   (see bench.echo)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
from array import array
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np

from bench.echo import echo_server
from bench.http_reader import ResponseReader

T = TypeVar("T")

MAX_CONNECTIONS = 512
FELL_BACK = "fallback"  # the kind, among client-side counts, of a fallback's answer counted as a failure


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop when it is installed."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


@dataclass
class LoadResult:
    offered_rate: float
    achieved_rate: float  # completed 2xx per second of the measured window
    duration: float
    count: int  # requests scheduled in the measured window
    ok: int
    errors_by_status: dict[str, int]
    # Timeouts, connection failures, requests that could not be sent on time, and (`run`'s fallback_is_error)
    # answers of the model's fallback.
    client_errors: int
    client_errors_by_kind: dict[str, int]
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    send_lag_p99_ms: float
    max_connections: int
    aborted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return sum(self.errors_by_status.values()) + self.client_errors

    @property
    def error_ratio(self) -> float:
        return self.errors / self.count if self.count else 1.0

    def passes(self, p99_budget_ms: float, max_error_ratio: float) -> bool:
        return (
            not self.aborted and self.count > 0 and self.p99_ms < p99_budget_ms and self.error_ratio < max_error_ratio
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_bytes(url: str, body: bytes, headers: dict[str, str]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {url!r}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    method = "POST" if body else "GET"
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    lower = {k.lower() for k in headers}
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body and "content-length" not in lower:
        lines.append(f"Content-Length: {len(body)}")
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying at most one request at a time (no pipelining)."""

    __slots__ = ("gen", "transport", "reader", "sched", "record")

    def __init__(self, gen: Generator) -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader()
        self.sched = -1.0  # scheduled time of the request in flight; < 0 when idle
        self.record = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, sched: float, record: bool) -> None:
        self.sched = sched
        self.record = record
        gen = self.gen
        if gen.mix is None:
            self.transport.write(gen.request)  # type: ignore[union-attr]
        else:  # a mix of bodies, sent in turn
            self.transport.write(gen.mix[gen.fired % len(gen.mix)])  # type: ignore[union-attr]
            gen.fired += 1
        if record:
            self.gen.lag.append(perf_counter() - sched)

    def data_received(self, data: bytes) -> None:
        if self.sched < 0:
            return  # late bytes after a timeout; the connection is being closed anyway
        reader = self.reader
        if not reader.feed(data):
            return
        status, keep, fell_back = reader.status, reader.keep, reader.fell_back
        reader.reset()
        self.gen.done(self, status, keep, fell_back)
        if not keep and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        reader = self.reader
        if reader.to_close and self.sched >= 0:
            status = reader.status
            reader.reset()
            self.gen.done(self, status, reuse=False)
        self.gen.lost(self)


class Generator:
    def __init__(
        self,
        host: str,
        port: int,
        request: bytes,
        timeout: float,
        cap: int,
        mix: list[bytes] | None = None,
        fallback_is_error: bool = False,
    ) -> None:
        self.host, self.port, self.request = host, port, request
        self.fallback_is_error = fallback_is_error
        self.mix = mix  # several framed requests, sent in turn (`run`'s body as a list), or None: `request`
        self.fired = 0
        self.timeout, self.cap = timeout, cap
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Conn] = []
        self.busy: set[_Conn] = set()
        self.conns: set[_Conn] = set()
        self.connecting = 0
        self.max_conns = 0
        self.lat = array("d")  # seconds, recorded requests only
        self.lag = array("d")
        self.status_counts: dict[int, int] = {}
        self.client_errors: dict[str, int] = {}
        self.done_total = 0
        self.outstanding = 0
        self.closed = False
        self.tasks: set[asyncio.Task[None]] = set()

    def _finish(self, sched: float, record: bool, latency: float, status: int | None, kind: str = "") -> None:
        if self.closed:
            return  # callbacks from connections aborted after the run ended
        self.outstanding -= 1
        self.done_total += 1
        if not record:
            return
        self.lat.append(latency)
        if status is None:
            self.client_errors[kind] = self.client_errors.get(kind, 0) + 1
        else:
            self.status_counts[status] = self.status_counts.get(status, 0) + 1

    def done(self, conn: _Conn, status: int, reuse: bool = True, fell_back: bool = False) -> None:
        sched, record = conn.sched, conn.record
        conn.sched = -1.0
        self.busy.discard(conn)
        failed = fell_back and self.fallback_is_error
        self._finish(sched, record, perf_counter() - sched, None if failed else status, FELL_BACK if failed else "")
        if reuse:
            self.idle.append(conn)

    def lost(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        if conn in self.busy:
            self.busy.discard(conn)
            sched, conn.sched = conn.sched, -1.0
            self._finish(sched, conn.record, perf_counter() - sched, None, "connection")
        else:
            try:
                self.idle.remove(conn)
            except ValueError:
                pass

    async def _connect(self) -> _Conn:
        # The caller has already counted this connection in `connecting`: a task does not start until the
        # next loop iteration, and a burst of due requests must see the connections it has asked for.
        try:
            _, conn = await self.loop.create_connection(lambda: _Conn(self), self.host, self.port)
        finally:
            self.connecting -= 1
        self.conns.add(conn)
        self.max_conns = max(self.max_conns, len(self.conns))
        return conn

    async def open(self, n: int) -> None:
        self.connecting += n
        conns = await asyncio.gather(*(self._connect() for _ in range(n)))
        self.idle.extend(conns)

    async def _connect_and_send(self, sched: float, record: bool) -> None:
        try:
            conn = await self._connect()
        except OSError:
            self._finish(sched, record, perf_counter() - sched, None, "connect")
            return
        if self.closed:
            conn.transport.abort()  # type: ignore[union-attr]
            return
        if perf_counter() - sched >= self.timeout:
            self.idle.append(conn)
            self._finish(sched, record, self.timeout, None, "timeout")
            return
        self.busy.add(conn)
        conn.send(sched, record)

    def fire(self, sched: float, record: bool) -> None:
        self.outstanding += 1
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue  # closed by the server while idle; connection_lost has not run yet
            self.busy.add(conn)
            conn.send(sched, record)
            return
        if len(self.conns) + self.connecting < self.cap:
            self.connecting += 1
            task = self.loop.create_task(self._connect_and_send(sched, record))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        else:
            # Every connection is busy and the cap is reached: the request cannot leave on time.
            self._finish(sched, record, self.timeout, None, "unsent")

    def expire(self, now: float) -> None:
        limit = now - self.timeout
        for conn in [c for c in self.busy if c.sched <= limit]:
            self.busy.discard(conn)
            sched, conn.sched = conn.sched, -1.0
            self._finish(sched, conn.record, self.timeout, None, "timeout")
            if conn.transport is not None:
                conn.transport.abort()  # a late response would desynchronise the connection

    def close(self) -> None:
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.abort()


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values.size else float("nan")


async def run(
    url: str,
    body: bytes | Sequence[bytes],
    headers: dict[str, str],
    rate: float,
    duration: float,
    *,
    timeout: float = 5.0,
    warmup: float = 1.0,
    progress: bool = True,
    connections: int | None = None,
    max_connections: int = MAX_CONNECTIONS,
    abort_after_errors: int | None = None,
    fallback_is_error: bool = False,
) -> LoadResult:
    """Send `rate` req/s for `warmup + duration` seconds; only the last `duration` seconds are measured.

    `fallback_is_error`: an answer of the model's fallback counts as a failure of the model (its kind
    FELL_BACK among the client-side counts), as a search for what the model itself serves needs.

    `abort_after_errors`: stop early once this many measured requests have failed (the step can no
    longer pass), which keeps overload steps of a sweep short. `body` may be several bodies: they are sent
    in turn, in the order given (shuffle them for a random mix), so a search can offer the mix a ramp sends.
    """
    bodies = [body] if isinstance(body, bytes) else list(body)
    host, port, request = request_bytes(url, bodies[0], headers)
    mix = [request_bytes(url, b, headers)[2] for b in bodies] if len(bodies) > 1 else None
    gen = Generator(host, port, request, timeout, max_connections, mix, fallback_is_error)
    if connections is None:
        # Enough for ~5 ms of requests: the send loop fires in bursts after any stall, and opening
        # connections mid-burst costs both processes CPU exactly when it is scarcest.
        connections = max(16, int(rate * 0.005))
    await gen.open(min(connections, max_connections))
    # A full collection in a process that has imported torch stalls the send loop for tens of ms, which
    # would show up as send lag and burst-opened connections; nothing here builds reference cycles.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    interval = 1.0 / rate
    n_warm = int(round(warmup * rate))
    n_total = n_warm + max(1, int(round(duration * rate)))
    aborted = False
    t0 = perf_counter() + 0.01
    next_tick = t0 + 1.0
    next_expire = t0
    i = 0
    try:
        while i < n_total:
            now = perf_counter()
            due = t0 + i * interval
            if due > now:
                # uvloop's timers have 1 ms resolution and round a sub-ms sleep to zero, which would spin
                # on a core the server needs; sleep at least 1 ms and record the resulting lag instead.
                await asyncio.sleep(max(due - now, 0.001))
                continue
            while i < n_total and t0 + i * interval <= now:
                gen.fire(t0 + i * interval, i >= n_warm)
                i += 1
            if now >= next_tick:
                next_tick += 1.0
                gen.expire(now)
                if progress:
                    _progress(gen, now - t0, rate, i, n_warm)
                if abort_after_errors is not None and _n_errors(gen) >= abort_after_errors:
                    aborted = True
                    break
            if now >= next_expire:
                next_expire = now + 0.05
                gen.expire(now)
        # Drain: wait for what is in flight, at most `timeout` after the last send.
        end = perf_counter() + timeout + 0.2
        while (gen.outstanding > 0) and perf_counter() < end and not aborted:
            await asyncio.sleep(0.02)
            now = perf_counter()
            gen.expire(now)
            if progress and now >= next_tick:
                next_tick += 1.0
                _progress(gen, now - t0, rate, i, n_warm)
    finally:
        gen.close()
        if gc_was_enabled:
            gc.enable()
    measured = len(gen.lat)
    if aborted:
        # Requests still in flight at abort are neither counted nor timed.
        count, window = measured, max(perf_counter() - t0 - warmup, 1e-9)
    else:
        count, window = n_total - n_warm, duration
        # Anything neither completed nor expired by now ran past the drain deadline: a timeout.
        missing = count - measured
        if missing > 0:
            gen.lat.extend([timeout] * missing)
            gen.client_errors["timeout"] = gen.client_errors.get("timeout", 0) + missing
    lat = np.array(gen.lat, dtype=np.float64)
    lag = np.array(gen.lag, dtype=np.float64)
    ok = sum(v for k, v in gen.status_counts.items() if 200 <= k < 300)
    result = LoadResult(
        offered_rate=rate,
        achieved_rate=ok / window,
        duration=window,
        count=count,
        ok=ok,
        errors_by_status={str(k): v for k, v in sorted(gen.status_counts.items()) if not 200 <= k < 300},
        client_errors=sum(gen.client_errors.values()),
        client_errors_by_kind=dict(gen.client_errors),
        p50_ms=_pct(lat, 50),
        p90_ms=_pct(lat, 90),
        p99_ms=_pct(lat, 99),
        p999_ms=_pct(lat, 99.9),
        max_ms=float(lat.max()) * 1000.0 if lat.size else float("nan"),
        send_lag_p99_ms=_pct(lag, 99),
        max_connections=gen.max_conns,
        aborted=aborted,
    )
    if progress:
        log(
            f"[loadgen] rate={rate:.1f}/s achieved={result.achieved_rate:.1f}/s p50={result.p50_ms:.1f}ms "
            f"p99={result.p99_ms:.1f}ms errors={result.errors}/{count} "
            f"lag_p99={result.send_lag_p99_ms:.2f}ms "
            f"conns={gen.max_conns}{' ABORTED' if aborted else ''}"
        )
    return result


def answered_ok(gen: Generator) -> int:
    return sum(v for k, v in gen.status_counts.items() if 200 <= k < 300)


def _n_errors(gen: Generator) -> int:
    bad = sum(v for k, v in gen.status_counts.items() if not 200 <= k < 300)
    return bad + sum(gen.client_errors.values())


def _p99_so_far(gen: Generator) -> float:
    n = len(gen.lat)
    if not n:
        return float("nan")
    # A zero-copy view plus selection (not a sort) keeps this tick's stall on the send loop to ~1 ms.
    view = np.frombuffer(gen.lat, dtype=np.float64)
    k = min(n - 1, int(math.ceil(0.99 * n)) - 1)
    value = float(np.partition(view, k)[k]) * 1000.0
    del view  # release the buffer export before the array is appended to again
    return value


def _progress(gen: Generator, elapsed: float, rate: float, sent: int, n_warm: int) -> None:
    phase = "warmup" if sent <= n_warm else "measure"
    log(
        f"[loadgen] t={elapsed:4.1f}s {phase} rate={rate:.1f}/s sent={sent} done={gen.done_total} "
        f"p99={_p99_so_far(gen):.1f}ms errors={_n_errors(gen)} conns={len(gen.conns)}"
    )


def _default_key_file() -> Path | None:
    """The demo API key `manage.py ensure_demo_user` wrote, as bench.server.use_key reads it."""
    data_dir = os.environ.get("FERRY_DATA_DIR") or str(Path(__file__).resolve().parent.parent / "var")
    path = Path(data_dir) / "demo-api-key"
    return path if path.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("url", nargs="?")
    p.add_argument("--body-file", type=Path)
    p.add_argument("--header", action="append", default=[], help="'Name: value'; repeatable")
    p.add_argument(
        "--key-file",
        type=Path,
        help="API key to send as 'Authorization: Bearer ...' (default: "
        "$FERRY_DATA_DIR/demo-api-key, else var/demo-api-key, when present)",
    )
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--echo-server", type=int, metavar="PORT", help="run the built-in echo server (0: any port)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="echo server: answer after this delay")
    a = p.parse_args(argv)
    if a.echo_server is not None:
        try:
            arun(echo_server(a.echo_server, a.delay_ms))
        except KeyboardInterrupt:
            pass
        return 0
    if not a.url:
        p.error("URL is required (or --echo-server; the generator's own ceiling: python -m bench.capacity)")
    body = a.body_file.read_bytes() if a.body_file else b""
    headers = {"Content-Type": "application/json"} if body else {}
    key_file = a.key_file or _default_key_file()
    if key_file is not None:
        headers["Authorization"] = f"Bearer {key_file.read_text().strip()}"
    for h in a.header:
        k, _, v = h.partition(":")
        headers[k.strip()] = v.strip()
    result = arun(
        run(a.url, body, headers, a.rate, a.duration, timeout=a.timeout, warmup=a.warmup, progress=not a.quiet)
    )
    print(json.dumps(result.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
