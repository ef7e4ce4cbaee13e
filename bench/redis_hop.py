"""What the Redis Streams hop costs: embedded mode against one web process + one `runnode` process.

Same data dir (SQLite, the demo models), same model (digits), same open-loop load from `bench.loadgen`
(request i leaves at t0 + i/rate; latency from the scheduled time). Per mode, requests one at a time
(no queueing: the difference between the modes is the hop alone), then two open-loop steps:
- a light fixed rate, where queueing is small: p50/p99 there are mostly the path itself, so the
  difference between the modes is what the hop adds;
- a heavy fixed rate: the throughput each mode achieves at it (completed 2xx/s) and its tail.
Quotas are off in both modes (FERRY_QUOTAS=false), so the distributed numbers carry no quota round trip
to Redis: only the hop. Under 2 minutes on the 2-core dev box.

    python -m bench.redis_hop [--redis redis://127.0.0.1:6379/4] [--light 100] [--heavy 600] [--seconds 6]
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

from bench import loadgen
from bench.run import digits_body
from bench.server import HEADERS, ROOT, Server, free_port, manage, say, use_key


def setup(env: dict[str, str]) -> None:
    """The demo digits network (briefly trained: its accuracy is not what is measured) with the demo's
    batching settings, and the demo user's key."""
    import torch

    from serving.demo import build_digits, save_artifact

    manage(["migrate", "--noinput", "-v0"], env)
    artifact = Path(env["FERRY_DATA_DIR"]) / "digits.pt"
    save_artifact(build_digits(64, 1, 40)(lambda line: None, 0.05)[0], "torchscript", torch.zeros(2, 64), artifact)
    manage(["register_model", "digits", str(artifact), "--format", "torchscript", "--input", "input:FP32:64",
            "--output", "scores:FP32:10", "--max-batch-size", "64", "--max-queue-delay-ms", "2",
            "--max-queue-size", "2048"], env)
    manage(["ensure_demo_user"], env)
    if use_key(Path(env["FERRY_DATA_DIR"])) is None:
        raise RuntimeError("ensure_demo_user wrote no demo API key")


class Node:
    """`manage.py runnode` in its own process group, terminated on exit."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env, self.log_path = env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Node:
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "manage.py", "runnode", "--name", "bench-node", "--accelerator", "cpu"],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def one_at_a_time(port: int, n: int = 300) -> tuple[float, float]:
    """p50 and p99 (ms) of `n` requests sent one after another on one keep-alive connection: no queueing
    at all, so the difference between the modes is the hop alone."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    body = digits_body()
    latencies = []
    try:
        for _ in range(n):
            started = time.perf_counter()
            conn.request("POST", "/v2/models/digits/infer", body=body, headers=HEADERS)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                raise RuntimeError(f"one-at-a-time probe answered {resp.status}")
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(0.002)
    finally:
        conn.close()
    p50, p99 = np.percentile(latencies, [50, 99])
    say(f"  one at a time: p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    return float(p50), float(p99)


def measure(base: str, rates: tuple[float, float], seconds: float) -> list[loadgen.LoadResult]:
    url = f"{base}/v2/models/digits/infer"
    body = digits_body()
    results = []
    for rate in rates:
        result = loadgen.arun(loadgen.run(url, body, dict(HEADERS), rate, seconds, warmup=1.0, progress=False))
        say(f"  {rate:.0f} req/s offered: {result.achieved_rate:.0f}/s ok, p50 {result.p50_ms:.2f} ms,"
            f" p99 {result.p99_ms:.2f} ms, errors {result.errors_by_status or {}} {result.client_errors_by_kind or {}}")
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_hop", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis", default="redis://127.0.0.1:6379/4", help="a Redis database this run may flush")
    p.add_argument("--light", type=float, default=100.0, help="req/s of the latency step")
    p.add_argument("--heavy", type=float, default=600.0, help="req/s of the throughput step")
    p.add_argument("--seconds", type=float, default=6.0, help="measured seconds per step")
    a = p.parse_args(argv)
    rates = (a.light, a.heavy)
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-hop-"))
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", "FERRY_QUOTAS": "false"}
    for name in ("REDIS_URL", "DATABASE_URL"):
        env.pop(name, None)  # SQLite in the data dir for both modes: the hop is the only difference
    client = redis.Redis.from_url(a.redis)
    try:
        setup(env)
        say("embedded mode: one process, in-process node")
        with Server(env, free_port(), data_dir / "embedded.log") as server:
            server.wait_ready(("digits",))
            embedded_alone = one_at_a_time(server.port)
            embedded = measure(server.base, rates, a.seconds)
        say(f"distributed mode: web (FERRY_EMBEDDED_NODE=false) + runnode, through Redis at {a.redis}")
        client.flushdb()
        remote_env = {**env, "REDIS_URL": a.redis, "FERRY_EMBEDDED_NODE": "false"}
        with Server(remote_env, free_port(), data_dir / "web.log") as server, Node(remote_env, data_dir / "node.log"):
            server.wait_ready(("digits",))
            distributed_alone = one_at_a_time(server.port)
            distributed = measure(server.base, rates, a.seconds)
    finally:
        client.flushdb()
        client.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    print(f"\nRedis hop on digits (open loop, {a.seconds:.0f} s measured per step, quotas off)")
    print(f"{'':24}{'embedded':>12}{'web+node':>12}{'added':>10}")
    for label, e, d in (("p50 ms one at a time", embedded_alone[0], distributed_alone[0]),
                        ("p99 ms one at a time", embedded_alone[1], distributed_alone[1])):
        print(f"{label:24}{e:12.2f}{d:12.2f}{d - e:+10.2f}")
    for label, pick in (("p50 ms", "p50_ms"), ("p99 ms", "p99_ms")):
        e, d = getattr(embedded[0], pick), getattr(distributed[0], pick)
        print(f"{label + f' @ {a.light:.0f}/s':24}{e:12.2f}{d:12.2f}{d - e:+10.2f}")
    for label, pick in (("throughput /s", "achieved_rate"), ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms")):
        e, d = getattr(embedded[1], pick), getattr(distributed[1], pick)
        print(f"{label + f' @ {a.heavy:.0f}/s':24}{e:12.2f}{d:12.2f}{d - e:+10.2f}")
    hop = distributed_alone[0] - embedded_alone[0]
    print(f"\nhop adds {hop:.2f} ms at p50 one at a time, {distributed[0].p50_ms - embedded[0].p50_ms:.2f} ms at"
          f" {a.light:.0f}/s (target < 2 ms): {'met' if hop < 2.0 else 'NOT met'} one at a time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
