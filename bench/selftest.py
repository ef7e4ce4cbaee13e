"""Checks of the load generator against its own echo server (no Ferry needed): `python -m bench.selftest`.

- a modest rate completes with no errors and small latency;
- a slow server (--delay-ms 200) shows ~200 ms latency, and the pool grows past its initial size;
- a server stalled for 1 s (SIGSTOP/SIGCONT) shows the stall in p99/max: latency runs from the
  scheduled send time, not from when a free connection let the request out (no coordinated omission);
- a server slower than the timeout turns every request into a client-side timeout with latency = timeout;
- the ramp generator (bench.ramp) sends each step's rate, reads every answer (and grades it against the
  label), and reads a 503's reason from the server's messages.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np
import orjson

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
                r.client_errors_by_kind.get("timeout") == r.count == 100 and abs(r.p50_ms - 1000) < 1e-6 and r.ok == 0,
                f"count={r.count} client_errors={r.client_errors_by_kind} p50={r.p50_ms:.1f}ms",
            )
        )
    results += await ramp_checks()
    return 0 if all(results) else 1


async def ramp_checks() -> list[bool]:
    from bench.overload import per_second
    from bench.ramp import PRIMARY, Requests, Step, run_ramp, shed_reason

    # the server's messages (serving.dataplane.node.node, serving.dataplane.http.consumers) and the reason each is
    # counted as
    messages = {
        "digits:1: estimated completion 412 ms (device backlog included) exceeds the request's deadline of 250 ms":
            "deadline",
        "digits:1: estimated completion 90 ms (device backlog included) exceeds priority 2's share of 250 ms": "tier",
        "digits:1: queue holds 1024 requests, 5 bytes: no room for priority 2 (requests bound at 50%)": "queue_full",
        "digits:1: evicted from the queue by higher-priority work": "evicted",
        "server saturated: its event loop runs 180 ms late and this request waited 12 ms before it was handled":
            "frontend",
        "something else": "other",
        "digits:1: estimated completion 1200 ms on the least loaded of 1 node(s) (its device backlog and the stream's"
        " unread requests included) exceeds the request's deadline budget (80% of 300 ms left); refused at the gateway":
            "gateway_deadline",
        "digits:1: no live node serves it: the 1 node(s) consuming its stream published no load for 600 ms (lost until"
        " their heartbeat expires); refused at the gateway": "gateway_node_lost",
    }  # fmt: skip
    got = {m: shed_reason(orjson.dumps({"error": m})) for m in messages}
    out = [check("503 reasons", got == messages, f"{sum(got[m] == w for m, w in messages.items())}/{len(messages)}")]
    with EchoServer() as echo:
        # The echo answers model "echo", scores [1.0]: top class 0, the label given here.
        req = Requests(echo.url, [sample_body()], np.array([0]), np.array([1]), HEADERS)
        rec = await run_ramp(req, "echo", [Step(1, 100, 1.0), Step(2, 300, 1.0)], progress=False)
    series = per_second(rec, req, 0.25)
    out.append(
        check(
            "ramp",
            len(rec.sched) == 400
            and bool((rec.outcome == PRIMARY).all())
            and bool((rec.correct == 1).all())
            and series["offered"] == [100.0, 300.0]
            and series["goodput"] == [100.0, 300.0],
            f"offered/s {series['offered']} goodput/s {series['goodput']} p99 {series['p99_ms']}",
        )
    )
    return out


if __name__ == "__main__":
    sys.exit(lg.arun(main()))
