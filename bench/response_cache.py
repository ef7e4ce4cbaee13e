"""What the response cache gives: `digits` closed-loop throughput and p99 at 0%, 50% and 90% repeated requests.

    .venv/bin/python -m bench.response_cache [--rounds 3] [--seconds 5] [--concurrency 32] [--record PAGE]

One data dir (the demo models, the demo tenant's key, its quota lifted, `digits` opted in to the cache) and two
servers from this checkout: **cached** as shipped (FERRY_RESPONSE_CACHE_BYTES at its default) and **no cache**
(FERRY_RESPONSE_CACHE_BYTES=0), the same version. Each measurement is a closed loop of `--concurrency`
keep-alive connections for `--seconds` (after one warm second): each request repeats one of 16 popular inputs
with the repeat rate's probability, else sends an input never sent before (a sure miss). The cached server is
measured at 0%, 50% and 90% and the other at 0% (what a miss costs over no cache at all), round by round in a
rotated order; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import report
from bench.loadgen import request_bytes
from bench.run import infer_body, setup_data_dir
from bench.server import HEADERS, Server, free_port, manage, say, unbind_quota, use_key

START, END = "<!-- responsecache:start -->", "<!-- responsecache:end -->"
POPULAR = 16
CASES = (("cached", 0.0), ("cached", 0.5), ("cached", 0.9), ("no cache", 0.0))


def bodies(url: str, count: int, seed: int) -> list[bytes]:
    """`count` raw requests with distinct inputs (a digit-like row of 64 values, unique per request)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        row = [float(rng.randrange(17)) for _ in range(63)] + [float(i)]
        out.append(request_bytes(url, infer_body(row), HEADERS)[2])
    return out


async def _read_answer(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return status


async def closed_loop(
    url: str,
    host: str,
    port: int,
    popular: list[bytes],
    unique: list[bytes],
    repeat: float,
    concurrency: int,
    seconds: float,
) -> tuple[float, float, int]:
    """(2xx answers/s, p99 ms, errors) over `seconds`, counted after one warm second."""

    def never_sent():  # noqa: ANN202
        yield from unique
        extra = 0
        while True:  # a fast run outgrew the inputs built ahead: build more (a cost in the client, counted)
            extra += 1
            yield request_bytes(url, infer_body([float(-extra)] * 64), HEADERS)[2]

    fresh = never_sent()
    latencies: list[float] = []
    errors = 0
    start = time.perf_counter()
    counting_from, stop_at = start + 1.0, start + 1.0 + seconds
    rng = random.Random(7)

    async def client() -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while True:
                sent = time.perf_counter()
                if sent >= stop_at:
                    return
                request = popular[rng.randrange(len(popular))] if rng.random() < repeat else next(fresh)
                writer.write(request)
                status = await _read_answer(reader)
                done = time.perf_counter()
                if sent >= counting_from and done <= stop_at:
                    if status == 200:
                        latencies.append(done - sent)
                    else:
                        errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))] * 1000 if latencies else float("nan")
    return len(latencies) / seconds, p99, errors


def section(results: dict[tuple[str, float], list[tuple[float, float, int]]], command: str, commit: str) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    base = statistics.median(r[0] for r in results[("no cache", 0.0)])
    rows = []
    for case in CASES:
        runs = results[case]
        rate = statistics.median(r[0] for r in runs)
        p99 = statistics.median(r[1] for r in runs)
        errors = sum(r[2] for r in runs)
        per_round = ", ".join(f"{r[0]:,.0f}" for r in runs)
        rows.append(
            f"| {case[0]} | {case[1]:.0%} | {per_round} | **{rate:,.1f}** | {p99:.1f} | {rate / base:.2f} | {errors} |"
        )
    return "\n".join(
        [
            START,
            "## Throughput and p99 by repeat rate",
            "",
            f"`{command}` on {when}, commit `{commit}`: `digits`, closed loop, on this shared 2-core machine while"
            " other work ran on it (the load generator shares it too).",
            "",
            "| server | repeats | req/s per round | median req/s | median p99 ms | / no cache | errors |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            END,
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.response_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--data-dir", type=Path, help="use (and keep) this FERRY_DATA_DIR; an existing one is reused as is")
    p.add_argument("--record", type=Path, help="write the result into this page (docs/benchmarks/response-cache.md)")
    a = p.parse_args(argv)
    data = a.data_dir or Path(tempfile.mkdtemp(prefix="ferry-rcache-"))
    data.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL") and not k.startswith("OTEL_")}
    env.update(
        {
            "FERRY_DATA_DIR": str(data),
            "PYTHONUNBUFFERED": "1",
            "FERRY_LOOP_LAG_TARGET_MS": "60000",
            "FERRY_MAX_LOOP_LAG_MS": "60000",
            "FERRY_MAX_FRONTEND_WAIT_MS": "60000",
        }
    )
    say(f"data dir {data}")
    if a.data_dir is not None and (data / "ferry.sqlite3").exists():  # a data dir of an earlier run: reused
        manage(["migrate", "--noinput", "-v0"], env)
        manage(["ensure_demo_user"], env)
        unbind_quota(env)
        use_key(data)
    else:
        setup_data_dir(env, None, demo=True)
    opt_in = (
        "from serving.models import ModelVersion;"
        " ModelVersion.objects.filter(model__name='digits').update(response_cache=True)"
    )
    manage(["shell", "-c", opt_in], env)
    results: dict[tuple[str, float], list[tuple[float, float, int]]] = {case: [] for case in CASES}
    cached = Server(env, free_port(), data / "server-cached.log")
    plain = Server({**env, "FERRY_RESPONSE_CACHE_BYTES": "0"}, free_port(), data / "server-plain.log")
    with cached, plain:
        servers = {"cached": cached, "no cache": plain}
        for server in servers.values():
            server.wait_ready(("digits",))
        per_run = 20_000  # unique inputs built ahead of a measurement (more are built if a run outgrows them)
        for rnd in range(a.rounds):
            turn = list(CASES[rnd % len(CASES) :] + CASES[: rnd % len(CASES)])
            for name, repeat in turn:
                server = servers[name]
                url = f"{server.base}/v2/models/digits/infer"
                seed = 1000 * rnd + int(repeat * 100) + (500 if name == "no cache" else 0)
                popular = bodies(url, POPULAR, seed=-1)
                unique = bodies(url, per_run, seed=seed)
                rate, p99, errors = asyncio.run(
                    closed_loop(url, "127.0.0.1", server.port, popular, unique, repeat, a.concurrency, a.seconds)
                )
                say(f"round {rnd + 1}/{a.rounds}, {name} at {repeat:.0%} repeats: {rate:,.1f} req/s, p99 {p99:.1f} ms")
                results[(name, repeat)].append((rate, p99, errors))
    commit = report.commit()
    report.publish(section(results, report.command_line("bench.response_cache", argv), commit), a.record, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
