"""What the shared quota check costs the web process: CPU per admit through Redis, by requests per loop turn.

    .venv/bin/python -m bench.quota_cost [--admits 6000] [--redis-url redis://127.0.0.1:6379/13]
        [--record docs/benchmarks/rate-limits.md]

Each request in distributed mode runs the quota script in Redis (`serving.dataplane.gateway.quota_redis`).
`RedisQuota.admit` sends the calls of one event-loop turn as one pipeline; beside it, in the same run, one
EVALSHA per call on the same client (what each request cost before the pipeline). For 1, 4 and 16 requests a
turn (a web process under load admits several a turn), this process's CPU time per admit over `--admits`
admits, after 200 to warm up, against a tenant whose quota never binds. Redis' own CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.report import command_line, commit, publish
from serving.dataplane.gateway.quota_redis import ADMIT, RedisQuota, keys_of
from serving.dataplane.gateway.snapshot import TenantEntry

START, END = "<!-- quotacost:start -->", "<!-- quotacost:end -->"
TENANT = 987_654_321  # a tenant id no real one has; its keys are deleted after the run
UNBOUND = TenantEntry("bench", 1e9, 10**9, 10**9, 10**15, 1)
TURNS = (1, 4, 16)


async def per_admit(admit, admits: int, per_turn: int) -> float:  # noqa: ANN001
    """CPU seconds of this process per admit, `per_turn` admits gathered in each turn."""
    for _ in range(200 // per_turn + 1):
        await asyncio.gather(*(admit() for _ in range(per_turn)))
    started = time.process_time()
    for _ in range(admits // per_turn):
        await asyncio.gather(*(admit() for _ in range(per_turn)))
    return (time.process_time() - started) / (admits // per_turn * per_turn)


async def measure(url: str, admits: int) -> dict[int, tuple[float, float]]:
    """Per requests-a-turn: (pipelined, one call each) CPU seconds per admit."""
    quota = RedisQuota.from_url(url, timeout_s=2.0, lease_s=60)
    script = quota.client.register_script(ADMIT)  # redis-py's Script: EVALSHA, loaded again on NOSCRIPT
    lease = iter(range(10**12))

    async def pipelined() -> object:
        return await quota.admit(TENANT, UNBOUND)

    async def one_call() -> object:
        args = [repr(1e9), 10**9, 10**9, 10**15, f"bench:{next(lease)}", repr(60.0), 0, repr(0.0), repr(1.0)]
        return await script(keys=keys_of(TENANT), args=args)

    out: dict[int, tuple[float, float]] = {}
    try:
        for per_turn in TURNS:
            out[per_turn] = (
                await per_admit(pipelined, admits, per_turn),
                await per_admit(one_call, admits, per_turn),
            )
            print(
                f"{per_turn:2d} a turn: pipelined {out[per_turn][0] * 1e6:.0f} us, one call each"
                f" {out[per_turn][1] * 1e6:.0f} us of CPU per admit",
                file=sys.stderr,
            )
    finally:
        await quota.client.delete(*keys_of(TENANT))
        await quota.close()
    return out


def section(rows: dict[int, tuple[float, float]], command: str, admits: int) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        START,
        "## What the shared quota check costs the web process",
        "",
        f"`{command}` on {when}, commit {commit()}: the web process's CPU per quota admit through Redis"
        f" (distributed mode's check, every request), over {admits:,} admits, by requests a loop turn. Pipelined:"
        " `RedisQuota.admit`, a turn's calls as one pipeline; one call each: an EVALSHA per request on the same"
        " client, as before the pipeline, in the same run. Redis' own CPU is not counted.",
        "",
        "| requests a turn | pipelined | one call each | pipelined / one call each |",
        "|---|---|---|---|",
    ]
    for per_turn, (piped, single) in rows.items():
        lines.append(f"| {per_turn} | {piped * 1e6:.0f} us | {single * 1e6:.0f} us | {piped / single:.2f} |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quota_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--admits", type=int, default=6000)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    p.add_argument("--record", type=Path, help="splice the section into this page")
    a = p.parse_args(argv)
    rows = asyncio.run(measure(a.redis_url, a.admits))
    publish(section(rows, command_line("bench.quota_cost", argv), a.admits), a.record, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
