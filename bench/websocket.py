"""WebSocket against REST inference on `digits`, at the same offered rates, in one run.

    .venv/bin/python -m bench.websocket [--rates 500,1500] [--seconds 10] [--rounds 2] [--connections 4]
                                        [--record docs/benchmarks/websocket.md] [--data-dir DIR]

One server (`manage.py serve`, embedded mode, the demo models), the demo tenant's quota unbound. At each rate
the protocols alternate, REST WS REST WS ..., each an open-loop run of `--seconds` measured after a second
of warm-up: REST through bench.loadgen (HTTP/1.1 keep-alive, as many connections as it needs), WebSocket
through `ws_run` here (`--connections` connections, messages spread over them in turn, the key in
Sec-WebSocket-Protocol). Both count latency from each request's scheduled time, so a stall shows as latency,
and both send the same digits row as JSON. The server's own CPU seconds per request (utime + stime of the web
process, from /proc) are read around each run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import shlex
import statistics
import sys
import tempfile
from array import array
from pathlib import Path
from time import perf_counter

import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench import loadgen, report
from bench.loadgen import LoadResult
from bench.report import splice_section
from bench.run import digits_body, machine_facts, setup_data_dir
from bench.server import HEADERS, OtherCpu, Server, free_port, say, use_key

START = "<!-- websocket:start -->"
END = "<!-- websocket:end -->"
MODEL = "digits"


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values.size else float("nan")


async def ws_run(
    url: str, key: str, body: bytes, rate: float, duration: float, *, connections: int = 4, warmup: float = 1.0,
    timeout: float = 5.0,
) -> LoadResult:  # fmt: skip
    """Send `rate` messages a second over `connections` WebSockets for `warmup + duration` seconds, on a fixed
    timetable (message i at t0 + i/rate); latency from each message's scheduled time to its answer."""
    prefix = b'{"id":"'
    rest = b'",' + body[1:]  # the REST body with an id in front: {"id":"<i>", "inputs": ...}
    socks: list[ClientConnection] = [
        await connect(url, subprotocols=["ferry.v2", f"ferry.key.{key}"], compression=None, max_size=2**24)
        for _ in range(connections)
    ]
    sched: dict[str, tuple[float, bool]] = {}
    lat, lag = array("d"), array("d")
    statuses: dict[str, int] = {}
    lost = 0

    async def reader(ws: ClientConnection) -> None:
        nonlocal lost
        try:
            async for frame in ws:
                answer = json.loads(frame)
                due, record = sched.pop(answer["id"])
                if record:
                    lat.append(perf_counter() - due)
                    status = str(answer.get("status", 200))
                    statuses[status] = statuses.get(status, 0) + 1
        except ConnectionClosed:
            lost += 1

    readers = [asyncio.create_task(reader(ws)) for ws in socks]
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    interval = 1.0 / rate
    n_warm = int(round(warmup * rate))
    n_total = n_warm + max(1, int(round(duration * rate)))
    t0 = perf_counter() + 0.01
    i = 0
    try:
        while i < n_total:
            now = perf_counter()
            due = t0 + i * interval
            if due > now:
                await asyncio.sleep(max(due - now, 0.001))  # as bench.loadgen: at least 1 ms, lag recorded
                continue
            while i < n_total and t0 + i * interval <= now:
                due = t0 + i * interval
                rid = str(i)
                sched[rid] = (due, i >= n_warm)
                lag.append(now - due)
                await socks[i % connections].send((prefix + rid.encode() + rest).decode())
                i += 1
        end = perf_counter() + timeout
        while sched and perf_counter() < end:
            await asyncio.sleep(0.02)
    finally:
        if gc_was_enabled:
            gc.enable()
        for ws in socks:
            await ws.close()
        await asyncio.gather(*readers, return_exceptions=True)
    count = n_total - n_warm
    missing = count - len(lat)  # never answered within `timeout` of the last send
    lat.extend([timeout] * missing)
    values = np.array(lat, dtype=np.float64)
    ok = statuses.get("200", 0)
    return LoadResult(
        offered_rate=rate,
        achieved_rate=ok / duration,
        duration=duration,
        count=count,
        ok=ok,
        errors_by_status={k: v for k, v in sorted(statuses.items()) if k != "200"},
        client_errors=missing,
        client_errors_by_kind={"timeout": missing} if missing else {},
        p50_ms=_pct(values, 50),
        p90_ms=_pct(values, 90),
        p99_ms=_pct(values, 99),
        p999_ms=_pct(values, 99.9),
        max_ms=float(values.max()) * 1000.0 if values.size else float("nan"),
        send_lag_p99_ms=_pct(np.array(lag, dtype=np.float64), 99),
        max_connections=connections,
        aborted=lost > 0,
    )


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (its own threads; not its children, the same for both protocols)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.websocket", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="500,1500", help="offered rates, req/s, comma-separated")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each protocol at each rate, alternating")
    p.add_argument("--connections", type=int, default=4, help="WebSocket connections")
    p.add_argument("--record", type=Path, help="write the results into this page (docs/benchmarks/websocket.md)")
    p.add_argument("--data-dir", type=Path, help="use (and keep) this FERRY_DATA_DIR; built models are reused")
    a = p.parse_args(argv)
    rates = [float(r) for r in a.rates.split(",")]
    data_dir = a.data_dir.resolve() if a.data_dir else Path(tempfile.mkdtemp(prefix="ferry-bench-ws-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    facts = machine_facts(int(os.environ.get("FERRY_TORCH_THREADS", "0") or 0))
    setup_data_dir(env, None, True)  # migrate, the demo models, the demo key, the demo tenant's quota lifted
    key = use_key(data_dir)
    if key is None:
        raise SystemExit("no demo key in the data dir")
    body = digits_body()
    runs: list[dict] = []
    with Server(env, free_port(), data_dir / "server.log") as server:
        server.wait_ready((MODEL,))
        assert server.proc is not None
        ws_url = server.base.replace("http://", "ws://") + f"/ws/v2/models/{MODEL}/infer"
        rest_url = f"{server.base}/v2/models/{MODEL}/infer"
        with OtherCpu(server.pids()) as other:
            for rate in rates:
                for round_no in range(a.rounds):
                    for protocol in ("rest", "ws"):
                        before = cpu_seconds(server.proc.pid)
                        if protocol == "rest":
                            result = loadgen.arun(loadgen.run(rest_url, body, HEADERS, rate, a.seconds, progress=False))
                        else:
                            result = loadgen.arun(ws_run(ws_url, key, body, rate, a.seconds, connections=a.connections))
                        cpu = cpu_seconds(server.proc.pid) - before
                        # The whole run's CPU (warm-up and drain too) over every request it sent.
                        sent = round((a.seconds + 1.0) * rate)
                        row = {"rate": rate, "round": round_no + 1, "protocol": protocol, "cpu_ms": cpu / sent * 1e3}
                        row.update(result.to_dict())
                        runs.append(row)
                        say(
                            f"{protocol:4} {rate:6.0f}/s round {round_no + 1}: achieved {result.achieved_rate:.1f}/s"
                            f" p50 {result.p50_ms:.2f} ms p99 {result.p99_ms:.2f} ms errors {result.errors}"
                            f" server CPU {row['cpu_ms']:.3f} ms/request"
                        )
    others = other.cores
    if a.record:
        record(a.record, runs, facts, others, a)
    print(json.dumps(runs, indent=1, default=str))
    return 0


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def record(path: Path, runs: list[dict], facts: dict[str, str], others: float | None, a: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join([".venv/bin/python", "-m", "bench.websocket", *map(shlex.quote, sys.argv[1:])])
    lines = [
        START,
        "## WebSocket against REST, `digits`",
        "",
        f"`{command}`, {now}, commit {report.commit()}"
        + f"; {facts['nproc']} cores ({facts['cpu']}), {report.others_used(others)}"
        + ".",
        "",
        f"Each run: {a.seconds:g} s measured after 1 s of warm-up, open loop; WebSocket over {a.connections}"
        " connections. Medians of the rounds, then every run.",
        "",
        "| rate (req/s) | protocol | achieved (req/s) | p50 (ms) | p99 (ms) | errors | server CPU per request (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate in sorted({r["rate"] for r in runs}):
        for protocol in ("rest", "ws"):
            rows = [r for r in runs if r["rate"] == rate and r["protocol"] == protocol]
            lines.append(
                f"| {rate:g} | {'REST' if protocol == 'rest' else 'WebSocket'} | {_median(rows, 'achieved_rate'):.1f}"
                f" | {_median(rows, 'p50_ms'):.2f} | {_median(rows, 'p99_ms'):.2f}"
                f" | {sum(r['count'] - r['ok'] for r in rows)} of {sum(r['count'] for r in rows)}"
                f" | {_median(rows, 'cpu_ms'):.3f} |"
            )
    lines += [
        "",
        "| rate | round | protocol | achieved | p50 | p90 | p99 | max | errors | send lag p99 | server CPU/request |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['rate']:g} | {r['round']} | {r['protocol']} | {r['achieved_rate']:.1f} | {r['p50_ms']:.2f}"
            f" | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f} | {r['count'] - r['ok']}"
            f" | {r['send_lag_p99_ms']:.2f} | {r['cpu_ms']:.3f} |"
        )
    lines.append(END)
    splice_section(path, START, END, "\n".join(lines))
    say(f"recorded into {path}")


if __name__ == "__main__":
    sys.exit(main())
