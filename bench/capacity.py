"""Sweeps over the open-loop generator: a closed-loop probe to seed them, the search for the highest
rate that meets the latency budget, and the generator's own ceiling against a trivial server."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any

from bench.echo import EchoServer, sample_body
from bench.loadgen import Generator, LoadResult, answered_ok, arun, log, request_bytes, run


async def probe_capacity(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    concurrency: int = 64,
    duration: float = 2.0,
    max_duration: float = 10.0,
    timeout: float = 10.0,
) -> float:
    """Closed-loop 2xx completions/s with `concurrency` requests in flight; only seeds a sweep's start.

    Counting starts once every connection has had one answer (the first round mostly measures queueing)
    and runs for `duration` and at least 2 x `concurrency` answers, so a slow model is not judged on a
    handful of completions; `max_duration` bounds both.
    """
    host, port, request = request_bytes(url, body, headers)
    gen = Generator(host, port, request, timeout, concurrency)
    await gen.open(concurrency)
    t0 = perf_counter()
    hard_stop = t0 + max_duration
    start_ok, t_start = 0, t0
    warmed = False
    try:
        for _ in range(len(gen.idle)):
            gen.fire(t0, True)
        while True:
            await asyncio.sleep(0.001)
            now = perf_counter()
            if now >= hard_stop:
                break
            if not warmed and (gen.done_total >= concurrency or now - t0 >= max_duration / 3):
                warmed, start_ok, t_start = True, answered_ok(gen), now
            if warmed and now - t_start >= duration and answered_ok(gen) - start_ok >= 2 * concurrency:
                break
            gen.expire(now)
            while gen.idle:
                gen.fire(now, True)
        ok, t_end = answered_ok(gen), perf_counter()
    finally:
        gen.close()
    return (ok - start_ok) / max(t_end - t_start, 1e-9)


async def find_max_rate(
    url: str,
    body: bytes | Sequence[bytes],
    headers: dict[str, str],
    *,
    start: float,
    stop: float,
    p99_budget_ms: float = 300.0,
    max_error_ratio: float = 0.001,
    duration: float = 8.0,
    warmup: float = 1.0,
    timeout: float = 5.0,
    factor: float = 1.4,
    refine_steps: int = 2,
    refine_tolerance: float = 0.08,
    min_rate: float = 1.0,
    cooldown: float = 1.0,
    cooldown_after_fail: float = 3.0,
    before_step: Callable[[], Awaitable[Any]] | None = None,
    after_step: Callable[[LoadResult, Any], Awaitable[None]] | None = None,
    progress: bool = True,
    fallback_is_error: bool = False,
) -> tuple[LoadResult | None, list[LoadResult]]:
    """Highest offered rate that passes (p99 < budget and error ratio < max): geometric steps up from
    `start` (down when `start` already fails), then bisection (geometric mean) between the last pass and
    the first fail. `before_step`/`after_step` bracket each run, e.g. to diff server metrics. `body`: one
    request body, or several sent in turn (loadgen.run). `fallback_is_error`: the model's fallback answering
    counts as the model failing (loadgen.run): the search is for what the model itself serves."""
    results: list[LoadResult] = []

    async def step(rate: float) -> LoadResult:
        if results:
            await asyncio.sleep(cooldown if results[-1].passes(p99_budget_ms, max_error_ratio) else cooldown_after_fail)
        if progress:
            log(f"[sweep] step {len(results) + 1}: {rate:.1f} req/s for {duration:g}s (+{warmup:g}s warmup)")
        token = await before_step() if before_step else None
        budget = max(1, math.floor(max_error_ratio * rate * duration) + 1)
        r = await run(
            url,
            body,
            headers,
            rate,
            duration,
            timeout=timeout,
            warmup=warmup,
            progress=progress,
            abort_after_errors=budget,
            fallback_is_error=fallback_is_error,
        )
        if after_step:
            await after_step(r, token)
        r.extra["passed"] = r.passes(p99_budget_ms, max_error_ratio)
        if progress:
            log(f"[sweep] {rate:.1f} req/s -> {'PASS' if r.extra['passed'] else 'FAIL'}")
        results.append(r)
        return r

    best: LoadResult | None = None
    fail: LoadResult | None = None
    rate = start
    while rate <= stop * 1.0001:
        r = await step(rate)
        if r.extra["passed"]:
            best = r
            rate *= factor
        else:
            fail = r
            break
    if best is None:
        rate = start / factor
        while rate >= min_rate:
            r = await step(rate)
            if r.extra["passed"]:
                best = r
                break
            fail = r
            rate /= factor
    for _ in range(refine_steps):
        if best is None or fail is None or fail.offered_rate / best.offered_rate <= 1 + refine_tolerance:
            break
        r = await step(math.sqrt(best.offered_rate * fail.offered_rate))
        if r.extra["passed"]:
            best = r
        else:
            fail = r
    return best, results


async def measure_ceiling(
    *,
    p99_budget_ms: float = 300.0,
    max_error_ratio: float = 0.001,
    duration: float = 5.0,
    warmup: float = 1.0,
    refine_steps: int = 2,
    progress: bool = True,
) -> tuple[LoadResult | None, list[LoadResult]]:
    """Highest rate this generator sustains against a trivial local server, under the same pass rule."""
    headers = {"Content-Type": "application/json"}
    with EchoServer() as echo:
        await asyncio.sleep(0.2)
        seed = await probe_capacity(echo.url, sample_body(), headers, duration=2.0)
        if progress:
            log(f"[ceiling] closed-loop probe against the echo server: {seed:.0f} req/s")
        best, steps = await find_max_rate(
            echo.url,
            sample_body(),
            headers,
            start=max(50.0, 0.5 * seed),
            stop=4 * seed,
            p99_budget_ms=p99_budget_ms,
            max_error_ratio=max_error_ratio,
            duration=duration,
            warmup=warmup,
            factor=1.25,
            refine_steps=refine_steps,
            cooldown=0.5,
            cooldown_after_fail=1.0,
            progress=progress,
        )
    if progress:
        log(f"[ceiling] the generator sustains {best.achieved_rate if best else 0:.0f} req/s on this machine")
    return best, steps


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.capacity`: this load generator's own ceiling, against the built-in echo server."""
    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    best, steps = arun(measure_ceiling(duration=min(a.duration, 5.0), progress=not a.quiet))
    print(
        json.dumps(
            {
                "ceiling_rps": best.achieved_rate if best else None,
                "best": best.to_dict() if best else None,
                "steps": [s.to_dict() for s in steps],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
