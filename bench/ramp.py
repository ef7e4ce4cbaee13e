"""Open-loop load along a rate schedule, with a different request body per send and every answer read.

Like `bench.loadgen` (whose request framing it shares), request *i* leaves at its scheduled time
whatever the server does and its latency runs from that scheduled time (no coordinated omission), over
a pool of keep-alive HTTP/1.1 connections that grows rather than delay a send. Unlike it, each request
carries its own body (a labelled sample, a priority tier) and each answer is classified: answered by
the model asked, by its fallback (`parameters.fallback_from`), shed (503, with the reason its body
gives), 504, other status, or a client-side failure; a 200's top class is checked against the label.
Everything is kept per request, so per-second and per-step series are cut afterwards.
"""

from __future__ import annotations

import asyncio
import gc
import re
from array import array
from dataclasses import dataclass
from time import perf_counter, process_time

import numpy as np
import orjson

from bench.http_reader import ResponseReader
from bench.loadgen import log, request_bytes

# Outcome codes, one per request.
PENDING, PRIMARY, FALLBACK, SHED, TIMEOUT_504, OTHER_STATUS, CLIENT = -1, 0, 1, 2, 3, 4, 5
OUTCOMES = {PRIMARY: "primary", FALLBACK: "fallback", SHED: "shed", TIMEOUT_504: "504", OTHER_STATUS: "other",
            CLIENT: "client error"}  # fmt: skip
# Reasons for a 503, from the answer's body: a `reason` field when the server gives one, else read from
# its message. The names follow the server's `ferry_shed_total` reasons; one a gateway gave before the stream
# (distributed mode: "refused at the gateway", `ferry_gateway_refusals_total`) is prefixed "gateway_".
SHED_REASONS = ["deadline", "tier", "queue_full", "evicted", "frontend", "not_loaded", "other"]
AT_GATEWAY = "refused at the gateway"
_REASON_PATTERNS = [
    ("node_lost", re.compile(r"no live node serves it", re.I)),
    ("evicted", re.compile(r"evicted", re.I)),
    ("tier", re.compile(r"priority \d+'s share", re.I)),
    ("deadline", re.compile(r"estimated (completion|wait)", re.I)),
    ("queue_full", re.compile(r"queue", re.I)),
    ("frontend", re.compile(r"saturated|before it was handled|before they are read", re.I)),
    ("not_loaded", re.compile(r"not loaded|is loading|unloaded", re.I)),
]
CLIENT_KINDS = ["timeout", "connection", "connect", "unsent"]


def shed_reason(body: bytes) -> str:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "other"
    if not isinstance(doc, dict):
        return "other"
    reason = doc.get("reason") or (doc.get("parameters") or {}).get("reason")
    if isinstance(reason, str) and reason:
        return reason
    message = str(doc.get("error", ""))
    where = "gateway_" if AT_GATEWAY in message else ""
    for name, pattern in _REASON_PATTERNS:
        if pattern.search(message):
            return where + name
    return where + "other"


@dataclass
class Step:
    multiplier: float  # of the measured capacity
    rate: float  # requests scheduled per second
    seconds: float


class Requests:
    """Pre-encoded HTTP requests, e.g. one per (labelled sample, tier). `ids`: the request id each body
    carries, which the answer must echo (a check that answers are matched to the right request)."""

    def __init__(self, url: str, bodies: list[bytes], labels: np.ndarray, tiers: np.ndarray,
                 headers: dict[str, str], ids: list[str | None] | None = None,
                 weights: np.ndarray | None = None) -> None:  # fmt: skip
        self.bodies = bodies
        self.wire = [request_bytes(url, b, headers)[2] for b in bodies]
        self.host, self.port, _ = request_bytes(url, bodies[0], headers)
        self.labels = labels  # per body
        self.tiers = tiers  # per body
        self.ids = ids or [None] * len(bodies)
        self.weights = weights  # chance of each body at a send; None: uniform


@dataclass
class RampRecord:
    """Per request, in schedule order. Times are seconds from the schedule's start."""

    sched: np.ndarray
    sent: np.ndarray  # actual send time (nan: never sent)
    latency: np.ndarray  # from the scheduled time to the end of the answer (nan: no answer counted)
    status: np.ndarray  # HTTP status (0: none)
    outcome: np.ndarray
    reason: np.ndarray  # index into `reasons` for SHED, client kind index for CLIENT, else -1
    correct: np.ndarray  # 1/0 for a 200 with an output, -1 otherwise
    body: np.ndarray  # which pre-encoded request went
    reasons: list[str]
    steps: list[Step]
    step_of: np.ndarray  # index into steps
    conns_max: int
    id_mismatches: int  # 200s whose `id` was not the request's: should be 0
    generator_cores: float  # this process's CPU time over the ramp's wall time (it shares the cores)
    retry_after: np.ndarray | None = None  # per request: 1 for a 503/429 carrying Retry-After, 0 without, -1 else
    # The generator's own event loop: when a 5 ms timer ran (seconds from the start) and how late. An answer
    # that reached the socket is read only when the loop gets to it, so a late loop adds its lag to the
    # latencies above (this process shares the cores with the server); these say how much.
    loop_t: np.ndarray | None = None
    loop_lag: np.ndarray | None = None


class _Conn(asyncio.Protocol):
    __slots__ = ("gen", "transport", "reader", "idx")

    def __init__(self, gen: _Ramp) -> None:
        self.gen = gen
        self.transport: asyncio.Transport | None = None
        self.reader = ResponseReader()
        self.idx = -1  # request in flight; < 0 when idle

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, idx: int) -> None:
        self.idx = idx
        gen = self.gen
        self.transport.write(gen.requests.wire[gen.body[idx]])  # type: ignore[union-attr]
        gen.sent[idx] = perf_counter() - gen.t0

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        if self.idx < 0 or not reader.feed(data):
            return
        status, keep, idx, body = reader.status, reader.keep, self.idx, reader.body()
        if status in (503, 429):  # a shed or a quota refusal must say when to come back: kept per request
            head = bytes(reader.buf[: reader.header_end]).lower()
            self.gen.retry_after[idx] = int(b"\r\nretry-after:" in head)
        reader.reset()
        self.idx = -1
        self.gen.answered(self, idx, status, body, keep)
        if not keep and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.idx >= 0:
            idx, self.idx = self.idx, -1
            reader = self.reader
            if reader.to_close:
                self.gen.answered(self, idx, reader.status, reader.body(), False)
            else:
                self.gen.failed(idx, "connection")
        self.gen.lost(self)


class _Ramp:
    def __init__(self, requests: Requests, n: int, timeout: float, cap: int) -> None:
        self.requests, self.timeout, self.cap = requests, timeout, cap
        self.loop = asyncio.get_running_loop()
        self.t0 = 0.0
        self.idle: list[_Conn] = []
        self.busy: dict[_Conn, int] = {}
        self.conns: set[_Conn] = set()
        self.connecting = 0
        self.max_conns = 0
        self.closed = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.sched = np.zeros(n)
        self.sent = np.full(n, np.nan)
        self.latency = np.full(n, np.nan)
        self.status = np.zeros(n, dtype=np.int16)
        self.outcome = np.full(n, PENDING, dtype=np.int8)
        self.reason = np.full(n, -1, dtype=np.int16)
        self.correct = np.full(n, -1, dtype=np.int8)
        self.body = np.zeros(n, dtype=np.int32)
        self.retry_after = np.full(n, -1, dtype=np.int8)
        self.reasons = list(SHED_REASONS)
        self.model = ""  # the model asked: answers naming another one came from its fallback
        self.id_mismatches = 0

    def _done(self, idx: int) -> bool:
        return self.closed or self.outcome[idx] != PENDING

    def answered(self, conn: _Conn, idx: int, status: int, body: bytes, reuse: bool) -> None:
        self.busy.pop(conn, None)
        if reuse and not self.closed:
            self.idle.append(conn)
        if self._done(idx):
            return
        self.latency[idx] = perf_counter() - self.t0 - self.sched[idx]
        self.status[idx] = status
        if status == 200:
            self._classify_ok(idx, body)
        elif status == 503:
            self.outcome[idx] = SHED
            reason = shed_reason(body)
            if reason not in self.reasons:
                self.reasons.append(reason)
            self.reason[idx] = self.reasons.index(reason)
        elif status == 504:
            self.outcome[idx] = TIMEOUT_504
        else:
            self.outcome[idx] = OTHER_STATUS

    def _classify_ok(self, idx: int, body: bytes) -> None:
        try:
            doc = orjson.loads(body)
            params = doc.get("parameters") or {}
            fallback = bool(params.get("fallback_from")) or doc.get("model_name") != self.model
            want = self.requests.ids[self.body[idx]]
            if want is not None and doc.get("id") != want:
                self.id_mismatches += 1
            data = doc["outputs"][0]["data"]
            top = max(range(len(data)), key=data.__getitem__)
            self.correct[idx] = int(top == self.requests.labels[self.body[idx]])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError, AttributeError):
            fallback = False
        self.outcome[idx] = FALLBACK if fallback else PRIMARY

    def failed(self, idx: int, kind: str) -> None:
        if self._done(idx):
            return
        self.latency[idx] = perf_counter() - self.t0 - self.sched[idx]
        self.outcome[idx] = CLIENT
        self.reason[idx] = CLIENT_KINDS.index(kind)

    def lost(self, conn: _Conn) -> None:
        self.conns.discard(conn)
        self.busy.pop(conn, None)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    async def _connect(self) -> _Conn:
        try:
            _, conn = await self.loop.create_connection(lambda: _Conn(self), self.requests.host, self.requests.port)
        finally:
            self.connecting -= 1
        self.conns.add(conn)
        self.max_conns = max(self.max_conns, len(self.conns))
        return conn

    async def open(self, n: int) -> None:
        self.connecting += n
        self.idle.extend(await asyncio.gather(*(self._connect() for _ in range(n))))

    async def _connect_and_send(self, idx: int) -> None:
        try:
            conn = await self._connect()
        except OSError:
            self.failed(idx, "connect")
            return
        if self.closed:
            conn.transport.abort()  # type: ignore[union-attr]
            return
        self.busy[conn] = idx
        conn.send(idx)

    def fire(self, idx: int) -> None:
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            self.busy[conn] = idx
            conn.send(idx)
            return
        if len(self.conns) + self.connecting < self.cap:
            self.connecting += 1
            task = self.loop.create_task(self._connect_and_send(idx))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        else:
            self.failed(idx, "unsent")  # every connection busy and the cap reached: it cannot leave on time

    def expire(self, now_rel: float) -> None:
        limit = now_rel - self.timeout
        for conn, idx in [(c, i) for c, i in self.busy.items() if self.sched[i] <= limit]:
            self.busy.pop(conn, None)
            conn.idx = -1
            self.failed(idx, "timeout")
            if conn.transport is not None:
                conn.transport.abort()

    def close(self) -> None:
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.abort()


def schedule(steps: list[Step]) -> tuple[np.ndarray, np.ndarray]:
    """Send times (seconds from start) and the step of each: request k of a step at start + k / rate."""
    times, owner, start = [], [], 0.0
    for i, st in enumerate(steps):
        n = int(round(st.rate * st.seconds))
        times.append(start + np.arange(n) / st.rate)
        owner.append(np.full(n, i, dtype=np.int16))
        start += st.seconds
    return np.concatenate(times), np.concatenate(owner)


async def run_ramp(
    requests: Requests,
    model: str,
    steps: list[Step],
    *,
    timeout: float = 5.0,
    max_connections: int = 1024,
    seed: int = 0,
    label: str = "ramp",
    progress: bool = True,
) -> RampRecord:
    """Send along `steps` open-loop; each send picks a pre-encoded request at random (seeded, by weight)."""
    sched, step_of = schedule(steps)
    n = len(sched)
    gen = _Ramp(requests, n, timeout, max_connections)
    gen.model = model
    gen.sched[:] = sched
    w = requests.weights
    gen.body[:] = np.random.default_rng(seed).choice(len(requests.wire), size=n, p=None if w is None else w / w.sum())
    await gen.open(min(max(16, int(steps[0].rate * 0.01)), max_connections))
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a full collection stalls the send loop; nothing here builds reference cycles
    cpu0 = process_time()
    gen.t0 = t0 = perf_counter() + 0.01
    loop_t, loop_lag = array("d"), array("d")
    probe = asyncio.get_running_loop().create_task(_probe_loop(t0, loop_t, loop_lag))
    end_sched = sum(st.seconds for st in steps)
    i, next_tick, next_expire = 0, 1.0, 0.0
    ticker = _Ticker(gen, steps, step_of, label) if progress else None
    try:
        while i < n:
            now = perf_counter() - t0
            if sched[i] > now:
                await asyncio.sleep(max(sched[i] - now, 0.001))  # >= 1 ms: uvloop rounds less to a spin
                continue
            while i < n and sched[i] <= now:
                gen.fire(i)
                i += 1
            if now >= next_expire:
                next_expire = now + 0.05
                gen.expire(now)
            if now >= next_tick:
                next_tick += 1.0
                if ticker:
                    ticker.tick(now, i)
        drain_end = end_sched + timeout + 0.2
        while gen.busy or gen.tasks:
            now = perf_counter() - t0
            if now > drain_end:
                break
            await asyncio.sleep(0.02)
            gen.expire(now)
            if now >= next_tick:
                next_tick += 1.0
                if ticker:
                    ticker.tick(now, i)
    finally:
        probe.cancel()
        gen.close()
        if gc_was_enabled:
            gc.enable()
    cores = (process_time() - cpu0) / max(perf_counter() - t0, 1e-9)
    left = gen.outcome == PENDING
    gen.outcome[left] = CLIENT  # neither answered nor expired by the drain deadline: a timeout
    gen.reason[left] = CLIENT_KINDS.index("timeout")
    gen.latency[left] = timeout
    return RampRecord(
        sched=gen.sched, sent=gen.sent, latency=gen.latency, status=gen.status, outcome=gen.outcome,
        reason=gen.reason, correct=gen.correct, body=gen.body, reasons=gen.reasons, steps=steps,
        step_of=step_of, conns_max=gen.max_conns, id_mismatches=gen.id_mismatches, generator_cores=cores,
        retry_after=gen.retry_after, loop_t=np.frombuffer(loop_t), loop_lag=np.frombuffer(loop_lag),
    )  # fmt: skip


async def _probe_loop(t0: float, times: array, lags: array, period: float = 0.005) -> None:
    """Until cancelled: sleep `period`, and record when the loop woke (from `t0`) and how late."""
    while True:
        start = perf_counter()
        await asyncio.sleep(period)
        now = perf_counter()
        times.append(now - t0)
        lags.append(max(0.0, now - start - period))


class _Ticker:
    """One progress line a second: the last whole second's schedule cohort, as far as it has answered."""

    def __init__(self, gen: _Ramp, steps: list[Step], step_of: np.ndarray, label: str) -> None:
        self.gen, self.steps, self.step_of, self.label = gen, steps, step_of, label

    def tick(self, now: float, fired: int) -> None:
        gen = self.gen
        sec = int(now) - 1
        if sec < 0:
            return
        lo, hi = np.searchsorted(gen.sched, [sec, sec + 1])
        if hi <= lo:
            return
        out = gen.outcome[lo:hi]
        ok = (out == PRIMARY) | (out == FALLBACK)
        lat = gen.latency[lo:hi][ok]
        p99 = f"{np.percentile(lat, 99) * 1000:.0f}ms" if lat.size else "n/a"
        st = self.steps[int(self.step_of[min(fired, len(self.step_of)) - 1])] if fired else self.steps[0]
        log(
            f"[{self.label}] t={now:5.1f}s step {st.multiplier:g}x ({st.rate:.0f}/s) | second {sec}:"
            f" sched={hi - lo} ok={int((out == PRIMARY).sum())} fallback={int((out == FALLBACK).sum())}"
            f" shed={int((out == SHED).sum())} 504={int((out == TIMEOUT_504).sum())}"
            f" client={int((out == CLIENT).sum())} pending={int((out == PENDING).sum())} admitted p99={p99}"
            f" conns={len(gen.conns)}"
        )
