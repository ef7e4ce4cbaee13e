"""What the Redis Streams hop costs: embedded mode against one web process + one `runnode` process.

Both run side by side on one data dir (SQLite; the digits network, briefly trained) with quotas off
(FERRY_QUOTAS=false), so the distributed numbers carry no quota round trip to Redis: only the hop.
- One at a time: requests alternate between the two, one after another: no queueing, and whatever else
  loads the machine loads both alike, so the difference is the hop.
- Open loop (`bench.loadgen`: request i leaves at t0 + i/rate, latency from the scheduled time) at a light
  rate (the path's latency), a fixed load, and a rate past what this machine serves (the throughput each
  achieves: completed 2xx/s), the modes alternating round by round; medians over the rounds.
Under 2 minutes on the 2-core dev box.

    python -m bench.redis_hop [--redis redis://127.0.0.1:6379/4] [--rates 100,600,2000] [--seconds 4]
                              [--rounds 2] [--record docs/benchmarks/request-path.md]
"""

from __future__ import annotations

import argparse
import http.client
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

from bench import loadgen, report
from bench.run import digits_body
from bench.server import HEADERS, Server, free_port, manage, say, start_group, stop_groups, use_key

START, END = "<!-- redishop:start -->", "<!-- redishop:end -->"


def setup(env: dict[str, str]) -> None:
    """The demo digits network (briefly trained: its accuracy is not what is measured) with the demo's
    batching settings, and the demo user's key."""
    import torch

    from serving.demo import build_digits, save_artifact

    manage(["migrate", "--noinput", "-v0"], env)
    artifact = Path(env["FERRY_DATA_DIR"]) / "digits.pt"
    save_artifact(build_digits(64, 1, 40)(lambda line: None, 0.05)[0], "torchscript", torch.zeros(2, 64), artifact)
    manage(
        [
            "register_model",
            "digits",
            str(artifact),
            "--format",
            "torchscript",
            "--input",
            "input:FP32:64",
            "--output",
            "scores:FP32:10",
            "--max-batch-size",
            "64",
            "--max-queue-delay-ms",
            "2",
            "--max-queue-size",
            "2048",
        ],
        env,
    )
    manage(["ensure_demo_user"], env)
    if use_key(Path(env["FERRY_DATA_DIR"])) is None:
        raise RuntimeError("ensure_demo_user wrote no demo API key")


class Node:
    """`manage.py runnode` in its own process group, terminated on exit."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env, self.log_path = env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Node:
        argv = [sys.executable, "manage.py", "runnode", "--name", "bench-node", "--accelerator", "cpu"]
        self.proc = start_group(argv, self.log_path, self.env)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_groups([self.proc])


MODES = ("embedded", "web+node")


def one_at_a_time(ports: dict[str, int], n: int = 400) -> dict[str, tuple[float, float]]:
    """p50 and p99 (ms) per mode of `n` requests each sent one after another on a keep-alive connection,
    alternating between the modes request by request: no queueing, and whatever else loads the machine
    loads both alike, so the difference between the modes is the hop."""
    conns = {mode: http.client.HTTPConnection("127.0.0.1", port, timeout=10) for mode, port in ports.items()}
    body = digits_body()
    latencies: dict[str, list[float]] = {mode: [] for mode in ports}
    try:
        for _ in range(n):
            for mode, conn in conns.items():
                started = time.perf_counter()
                conn.request("POST", "/v2/models/digits/infer", body=body, headers=HEADERS)
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{mode}: one-at-a-time probe answered {resp.status}")
                latencies[mode].append((time.perf_counter() - started) * 1000)
                time.sleep(0.001)
    finally:
        for conn in conns.values():
            conn.close()
    result = {mode: tuple(float(v) for v in np.percentile(values, [50, 99])) for mode, values in latencies.items()}
    for mode, (p50, p99) in result.items():
        say(f"  {mode}, one at a time: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    return result  # type: ignore[return-value]


@dataclass
class Step:
    """One offered rate, run `rounds` times per mode with the modes alternating; medians over the rounds."""

    rate: float
    runs: dict[str, list[loadgen.LoadResult]]

    def median(self, mode: str, field: str) -> float:
        return float(np.median([getattr(r, field) for r in self.runs[mode]]))


def open_loop(bases: dict[str, str], rate: float, seconds: float, rounds: int) -> Step:
    body = digits_body()
    runs: dict[str, list[loadgen.LoadResult]] = {mode: [] for mode in bases}
    for rnd in range(rounds):
        order = list(bases) if rnd % 2 == 0 else list(reversed(bases))
        for mode in order:
            url = f"{bases[mode]}/v2/models/digits/infer"
            r = loadgen.arun(loadgen.run(url, body, dict(HEADERS), rate, seconds, warmup=1.0, progress=False))
            say(
                f"  {mode}, {rate:.0f} req/s offered: {r.achieved_rate:.0f}/s ok, p50 {r.p50_ms:.2f} ms,"
                f" p99 {r.p99_ms:.2f} ms, errors {r.errors_by_status or {}} {r.client_errors_by_kind or {}}"
            )
            runs[mode].append(r)
    return Step(rate, runs)


def section(a: argparse.Namespace, alone: dict[str, tuple[float, float]], steps: list[Step], command: str) -> str:
    e, d = MODES
    rows = [("p50 ms, one at a time", alone[e][0], alone[d][0]), ("p99 ms, one at a time", alone[e][1], alone[d][1])]
    for step in steps:
        rows += [
            (
                f"throughput /s at {step.rate:.0f}/s offered",
                step.median(e, "achieved_rate"),
                step.median(d, "achieved_rate"),
            ),
            (f"p50 ms at {step.rate:.0f}/s", step.median(e, "p50_ms"), step.median(d, "p50_ms")),
            (f"p99 ms at {step.rate:.0f}/s", step.median(e, "p99_ms"), step.median(d, "p99_ms")),
        ]
    errors = [
        f"{mode} at {step.rate:.0f}/s: {r.errors_by_status} {r.client_errors_by_kind}"
        for step in steps
        for mode, results in step.runs.items()
        for r in results
        if r.errors
    ]
    hop = alone[d][0] - alone[e][0]
    load = os.getloadavg()[0]
    lines = [
        START,
        "## What the Redis hop costs",
        "",
        f"`{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, digits (max batch 64, 2 ms window),"
        " quotas off in both modes, both running side by side: **embedded** is one `manage.py serve`;"
        " **web+node** is `serve` with `FERRY_EMBEDDED_NODE=false` and one `manage.py runnode`, through Redis."
        " One at a time: 400 requests to each, alternating request by request, no queueing. Then open loop"
        f" at each rate, {a.rounds} rounds of {a.seconds:.0f} s per mode, the modes alternating; medians over"
        f" the rounds. Load average {load:.1f} on this machine's {os.cpu_count()} cores at the end (other work"
        " shares them).",
        "",
        "| | embedded | web+node | added |",
        "|---|---|---|---|",
        *(f"| {label} | {ev:.2f} | {dv:.2f} | {dv - ev:+.2f} |" for label, ev, dv in rows),
        "",
        f"The hop adds **{hop:.2f} ms at p50** one at a time (target < 2 ms: {'met' if hop < 2.0 else 'NOT met'}).",
        *(["", f"Errors: {'; '.join(errors)}."] if errors else []),
        "",
        END,
    ]
    return "\n".join(lines)


def kept_section(text: str) -> str:
    return report.kept_section(text, START, END)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_hop", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", default="redis://127.0.0.1:6379/4", help="a Redis database this run may flush")
    p.add_argument(
        "--rates",
        default="100,600,2000",
        help="offered req/s, comma-separated: a light one (latency), a fixed load, one past saturation",
    )
    p.add_argument("--seconds", type=float, default=4.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="runs per rate and mode, the modes alternating")
    p.add_argument("--record", type=Path, help="write the result into this page (docs/benchmarks/request-path.md)")
    a = p.parse_args(argv)
    try:
        rates = [float(r) for r in a.rates.split(",") if r.strip()]
    except ValueError:
        p.error("--rates: comma-separated numbers, e.g. 100,600,2000")
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-hop-"))
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", "FERRY_QUOTAS": "false"}
    for name in ("REDIS_URL", "DATABASE_URL"):
        env.pop(name, None)  # SQLite in the data dir for both modes: the hop is the only difference
    # One key for both modes' processes: with Redis the web process refuses a key of its own (config.settings)
    env.setdefault("SECRET_KEY", secrets.token_urlsafe(50))
    remote_env = {**env, "REDIS_URL": a.redis, "FERRY_EMBEDDED_NODE": "false"}
    client = redis.Redis.from_url(a.redis)
    try:
        setup(env)
        client.flushdb()
        say(f"embedded: one process; web+node: FERRY_EMBEDDED_NODE=false + runnode, through Redis at {a.redis}")
        with (
            Server(env, free_port(), data_dir / "embedded.log") as embedded,
            Server(remote_env, free_port(), data_dir / "web.log") as web,
            Node(remote_env, data_dir / "node.log"),
        ):
            embedded.wait_ready(("digits",))
            web.wait_ready(("digits",))
            alone = one_at_a_time({"embedded": embedded.port, "web+node": web.port})
            bases = {"embedded": embedded.base, "web+node": web.base}
            steps = [open_loop(bases, rate, a.seconds, a.rounds) for rate in rates]
    finally:
        client.flushdb()
        client.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    report.publish(section(a, alone, steps, report.command_line("bench.redis_hop", argv)), a.record, START, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
