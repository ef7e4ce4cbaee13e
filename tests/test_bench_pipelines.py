"""bench.pipelines' verdict against issue 23's acceptance, the setup script its overload models pick, and the
mix of bodies its capacity search sends."""

from __future__ import annotations

import asyncio

from bench import loadgen, pipelines


def step(multiplier: float, p99: float, shed: float = 0.0, fallback: float = 0.0, retry: int | None = None) -> dict:
    seconds = 5.0
    shed_n = round(shed * seconds)
    return {
        "multiplier": multiplier, "p99_ms": p99, "shed_rps": shed, "fallback_rps": fallback, "seconds": seconds,
        "shed_with_retry_after": shed_n if retry is None else retry,
    }  # fmt: skip


def ramp(*steps: dict) -> dict:
    return {"result": {"steps": list(steps)}}


class Answering(asyncio.Protocol):
    """A keep-alive HTTP/1.1 server's side, enough for the load generator: each request's body to `answer`,
    whose bytes (a whole response) are sent back."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, rest = self.buf.split(b"\r\n\r\n", 1)
            length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))[15:])
            if len(rest) < length:
                return
            self.buf = rest[length:]
            self.transport.write(self.answer(rest[:length]))  # type: ignore[attr-defined]

    def answer(self, body: bytes) -> bytes:
        raise NotImplementedError


def test_a_ramp_under_budget_that_sheds_past_1x_passes() -> None:
    worst, under, retry, relieved = pipelines.verdict(ramp(step(0.5, 40), step(2, 250, shed=100), step(1, 60)))
    assert (worst, under, retry, relieved) == (250, True, True, True)


def test_falling_back_counts_as_relief() -> None:
    assert pipelines.verdict(ramp(step(1, 50), step(3, 120, fallback=30)))[3] is True


def test_a_step_over_budget_fails() -> None:
    worst, under, *_ = pipelines.verdict(ramp(step(0.5, 40), step(3, 300, shed=50)))
    assert worst == 300 and under is False


def test_a_step_without_any_200_fails() -> None:
    worst, under, *_ = pipelines.verdict(ramp(step(0.5, 40), step(3, float("nan"), shed=50)))
    assert worst != worst and under is False


def test_an_overloaded_step_neither_shedding_nor_falling_back_fails() -> None:
    assert pipelines.verdict(ramp(step(1.5, 100, shed=10), step(2, 100)))[3] is False


def test_a_503_without_retry_after_fails() -> None:
    assert pipelines.verdict(ramp(step(2, 100, shed=10, retry=49)))[2] is False


def test_the_setup_registers_a_cascade_per_big_model_and_only_the_models_asked() -> None:
    script = pipelines.setup(["digits-wide"])
    assert "'digits-wide-cascade'" in script and "'digits-cascade'" in script and "demo_cache_dir()" in script
    assert "token-sentiment" not in script
    assert "'digits-wide'" not in pipelines.setup(["digits"])


def test_the_open_loop_generator_sends_a_mix_of_bodies_in_turn() -> None:
    # The capacity search offers the ramp's mix (pipelines.ramp_mix) through loadgen.run's list of bodies.
    seen: list[bytes] = []

    class Recorder(Answering):
        def answer(self, body: bytes) -> bytes:
            seen.append(body)
            return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"

    async def scenario() -> loadgen.LoadResult:
        server = await asyncio.get_running_loop().create_server(Recorder, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await loadgen.run(
                f"http://127.0.0.1:{port}/v2/models/m/infer", [b'{"a":1}', b'{"b":22}', b'{"c":333}'], {},
                rate=200.0, duration=0.3, warmup=0.0, progress=False,
            )  # fmt: skip
        finally:
            server.close()

    result = asyncio.run(scenario())
    assert result.ok == result.count == len(seen) >= 30
    # each body in turn: all three, as often as each other (arrival order across connections may differ)
    assert set(seen) == {b'{"a":1}', b'{"b":22}', b'{"c":333}'}
    assert {seen.count(b) for b in set(seen)} <= {len(seen) // 3, len(seen) // 3 + 1}


def test_a_capacity_search_can_count_the_fallbacks_answers_as_the_models_failures() -> None:
    # given a server that answers every other request with the model's fallback (Ferry's header says so)
    class HalfFallback(Answering):
        answered = 0  # over every connection: every other answer is the fallback's

        def answer(self, body: bytes) -> bytes:
            HalfFallback.answered += 1
            fallback = b"x-ferry-fallback-from: m:1\r\n" if HalfFallback.answered % 2 else b""
            return b"HTTP/1.1 200 OK\r\n" + fallback + b"content-length: 2\r\n\r\n{}"

    async def scenario(fallback_is_error: bool) -> loadgen.LoadResult:
        server = await asyncio.get_running_loop().create_server(HalfFallback, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await loadgen.run(
                f"http://127.0.0.1:{port}/v2/models/m/infer", b"{}", {}, rate=200.0, duration=0.3, warmup=0.0,
                progress=False, fallback_is_error=fallback_is_error,
            )  # fmt: skip
        finally:
            server.close()

    # then by default every answer counts as the model's, and a search for the model's own capacity counts the
    # fallback's as failures (a busy machine may leave some requests unsent or unanswered: the generator's own
    # errors, of other kinds, which neither count hides)
    plain = asyncio.run(scenario(False))
    assert loadgen.FELL_BACK not in plain.client_errors_by_kind and plain.ok == plain.count - plain.client_errors
    strict = asyncio.run(scenario(True))
    fell_back = strict.client_errors_by_kind[loadgen.FELL_BACK]
    others = strict.client_errors - fell_back
    assert strict.ok + fell_back + others == strict.count and not strict.errors_by_status
    assert abs(strict.ok - fell_back) <= 1 + others and fell_back >= 10
