"""Checks of the load generator against its own echo server (no Ferry needed): `python -m bench.selftest`.

- a modest rate completes with no errors and small latency;
- a slow server (--delay-ms 200) shows ~200 ms latency, and the pool grows past its initial size;
- a server stalled for 1 s (SIGSTOP/SIGCONT) shows the stall in p99/max: latency runs from the
  scheduled send time, not from when a free connection let the request out (no coordinated omission);
- a server slower than the timeout turns every request into a client-side timeout with latency = timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from bench import loadgen as lg
from bench.echo import EchoServer, sample_body

HEADERS = {"Content-Type": "application/json"}


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    return ok


async def main() -> int:
    body = sample_body()
    results: list[bool] = []
    with EchoServer() as echo:
        r = await lg.run(echo.url, body, HEADERS, 500, 3, warmup=0.5, progress=False)
        results.append(
            check(
                "modest rate",
                r.errors == 0 and r.ok == 1500 and r.p99_ms < 50,
                f"ok={r.ok}/{r.count} p50={r.p50_ms:.2f}ms p99={r.p99_ms:.2f}ms",
            )
        )

        async def stall() -> None:
            await asyncio.sleep(1.5)  # mid-way through the measured window
            assert echo.proc is not None
            os.kill(echo.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(1.0)
            os.kill(echo.proc.pid, signal.SIGCONT)

        task = asyncio.create_task(stall())
        r = await lg.run(echo.url, body, HEADERS, 200, 3, warmup=0.5, progress=False)
        await task
        # 200 of 600 requests fall inside the stall, waiting 0..1000 ms: p90 lands around 700 ms.
        results.append(
            check(
                "stalled server",
                850 < r.max_ms < 1300 and 400 < r.p90_ms < 1000 and r.errors == 0,
                f"p50={r.p50_ms:.1f}ms p90={r.p90_ms:.1f}ms max={r.max_ms:.1f}ms errors={r.errors}",
            )
        )

    with EchoServer(delay_ms=200) as echo:
        r = await lg.run(echo.url, body, HEADERS, 200, 3, warmup=0.5, progress=False)
        results.append(
            check(
                "slow server (200 ms)",
                195 < r.p50_ms < 240 and r.errors == 0 and r.max_connections > 16,
                f"p50={r.p50_ms:.1f}ms p99={r.p99_ms:.1f}ms conns={r.max_connections} errors={r.errors}",
            )
        )

    with EchoServer(delay_ms=2000) as echo:
        r = await lg.run(echo.url, body, HEADERS, 50, 2, warmup=0.2, timeout=1.0, progress=False)
        results.append(
            check(
                "timeouts",
                r.client_errors_by_kind.get("timeout") == r.count == 100
                and abs(r.p50_ms - 1000) < 1e-6
                and r.ok == 0,
                f"count={r.count} client_errors={r.client_errors_by_kind} p50={r.p50_ms:.1f}ms",
            )
        )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(lg.arun(main()))
