"""REST JSON, REST binary and gRPC inference on `digits` and the wide MLP, at the same offered rates, in one run.

    .venv/bin/python -m bench.grpc_compare [--rates 200,600] [--mlp-rates 20] [--seconds 8] [--rounds 2]
        [--models digits,wide-mlp] [--data-dir DIR] [--record docs/benchmarks/grpc.md]

One server (`manage.py serve`, embedded mode, the demo models and the wide MLP of bench.run's batching phase,
gRPC on a free port), the demo tenant's quota unbound. For each model and rate the protocols alternate,
JSON binary gRPC JSON binary gRPC ..., each an open-loop run of `--seconds` measured after a second of
warm-up, one row of the model's input per request:

- REST JSON: bench.loadgen (HTTP/1.1 keep-alive), the row as a JSON list, the answer as JSON;
- REST binary: bench.loadgen, Triton's binary tensor extension both ways (Inference-Header-Content-Length);
- gRPC: `grpc_run` here, grpcio's asyncio client over `--channels` HTTP/2 channels, raw_input_contents, as
  tritonclient.grpc sends it.

All count latency from each request's scheduled time, so a stall shows as latency. The server's CPU seconds
per request (utime + stime of the web process, from /proc) are read around each run. The load generator runs
on the same machine, so a protocol whose client costs more CPU also leaves the server less.
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

import grpc
import numpy as np

from bench import loadgen, report
from bench.loadgen import LoadResult
from bench.report import WIDE, page, splice_section
from bench.run import digits_body, machine_facts, mlp_body, setup_data_dir
from bench.server import HEADERS, ROOT, OtherCpu, Server, free_port, say, use_key
from bench.websocket import cpu_seconds
from serving.dataplane.grpc.proto import grpc_service_pb2 as pb
from serving.dataplane.grpc.proto import grpc_service_pb2_grpc as rpc

START = "<!-- grpc:start -->"
END = "<!-- grpc:end -->"
PROTOCOLS = ("json", "binary", "grpc")
NAMES = {"json": "REST JSON", "binary": "REST binary", "grpc": "gRPC"}


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) * 1000.0 if values.size else float("nan")


def row_of(body: bytes) -> np.ndarray:
    """The one input row of a bench.run JSON body, as float32."""
    doc = json.loads(body)
    return np.asarray(doc["inputs"][0]["data"], dtype=np.float32).reshape(1, -1)


def binary_body(row: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """The REST binary tensor extension's body for `row`, and its headers (binary outputs asked for too)."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": list(row.shape),
                    "parameters": {"binary_data_size": row.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + row.tobytes(), {**HEADERS, "Inference-Header-Content-Length": str(len(header))}


def grpc_request(model: str, row: np.ndarray) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="input", datatype="FP32", shape=list(row.shape))
    request.raw_input_contents.append(row.tobytes())
    return request


async def grpc_run(
    target: str, key: str, request: pb.ModelInferRequest, rate: float, duration: float, *, channels: int = 4,
    warmup: float = 1.0, timeout: float = 5.0,
) -> LoadResult:  # fmt: skip
    """Send `rate` ModelInfer calls a second over `channels` channels for `warmup + duration` seconds, on a fixed
    timetable (call i at t0 + i/rate); latency from each call's scheduled time to its answer."""
    chans = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    stubs = [rpc.GRPCInferenceServiceStub(c) for c in chans]
    for c in chans:
        await c.channel_ready()
    metadata = (("authorization", f"Bearer {key}"),)
    lat, lag = array("d"), array("d")
    statuses: dict[str, int] = {}
    tasks: set[asyncio.Task] = set()

    async def one(i: int, due: float, record: bool) -> None:
        try:
            await stubs[i % channels].ModelInfer(request, metadata=metadata, timeout=timeout)
            status = "200"
        except grpc.aio.AioRpcError as exc:
            status = exc.code().name
        if record:
            lat.append(perf_counter() - due)
            statuses[status] = statuses.get(status, 0) + 1

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
                lag.append(now - due)
                task = asyncio.ensure_future(one(i, due, i >= n_warm))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout + 1)
    finally:
        if gc_was_enabled:
            gc.enable()
        for c in chans:
            await c.close()
    count = n_total - n_warm
    values = np.array(lat, dtype=np.float64)
    ok = statuses.get("200", 0)
    timeouts = statuses.pop("DEADLINE_EXCEEDED", 0)
    return LoadResult(
        offered_rate=rate,
        achieved_rate=ok / duration,
        duration=duration,
        count=count,
        ok=ok,
        errors_by_status={k: v for k, v in sorted(statuses.items()) if k != "200"},
        client_errors=timeouts,
        client_errors_by_kind={"timeout": timeouts} if timeouts else {},
        p50_ms=_pct(values, 50),
        p90_ms=_pct(values, 90),
        p99_ms=_pct(values, 99),
        p999_ms=_pct(values, 99.9),
        max_ms=float(values.max()) * 1000.0 if values.size else float("nan"),
        send_lag_p99_ms=_pct(np.array(lag, dtype=np.float64), 99),
        max_connections=channels,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.grpc_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="200,600", help="offered rates, req/s, comma-separated")
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each protocol at each rate, alternating")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels (HTTP/2 connections)")
    p.add_argument("--models", default=f"digits,{WIDE}", help="models, comma-separated (digits, wide-mlp)")
    p.add_argument("--mlp-rates", default="20", help="offered rates for the wide MLP (slower), req/s")
    p.add_argument("--data-dir", type=Path, help="reuse this data dir when an earlier run set it up (its key file)")
    p.add_argument("--record", type=Path, help="write the results into this page (docs/benchmarks/grpc.md)")
    a = p.parse_args(argv)
    rates = [float(r) for r in a.rates.split(",")]
    models = [m for m in a.models.split(",") if m]
    data_dir = a.data_dir or Path(tempfile.mkdtemp(prefix="ferry-bench-grpc-"))
    grpc_port = free_port()
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1", "FERRY_GRPC_PORT": str(grpc_port)}
    facts = machine_facts(int(os.environ.get("FERRY_TORCH_THREADS", "0") or 0))
    key = use_key(data_dir) if a.data_dir else None
    if key is None:
        model_path = None
        if WIDE in models:
            from bench.models import build_wide_mlp, save_torchscript

            model_path = save_torchscript(build_wide_mlp(), data_dir / "wide-mlp.pt")
        setup_data_dir(env, model_path, True)  # migrate, the demo models, the wide MLP, the demo key, quota lifted
        key = use_key(data_dir)
    if key is None:
        raise SystemExit("no demo key in the data dir")
    bodies = {"digits": digits_body(), WIDE: mlp_body()}
    runs: list[dict] = []
    with Server(env, free_port(), data_dir / "server.log") as server:
        server.wait_ready(tuple(models))
        assert server.proc is not None
        with OtherCpu(server.pids()) as other:
            for model in models:
                url = f"{server.base}/v2/models/{model}/infer"
                json_body = bodies[model]
                row = row_of(json_body)
                binary, binary_headers = binary_body(row)
                request = grpc_request(model, row)
                for rate in [float(r) for r in a.mlp_rates.split(",")] if model == WIDE else rates:
                    for round_no in range(a.rounds):
                        for protocol in PROTOCOLS:
                            before = cpu_seconds(server.proc.pid)
                            if protocol == "json":
                                work = loadgen.run(url, json_body, HEADERS, rate, a.seconds, progress=False)
                            elif protocol == "binary":
                                work = loadgen.run(url, binary, binary_headers, rate, a.seconds, progress=False)
                            else:
                                work = grpc_run(
                                    f"127.0.0.1:{grpc_port}", key, request, rate, a.seconds, channels=a.channels
                                )
                            result = loadgen.arun(work)
                            cpu = cpu_seconds(server.proc.pid) - before
                            sent = round((a.seconds + 1.0) * rate)  # the whole run's CPU over every request sent
                            row_out = {"model": model, "rate": rate, "round": round_no + 1, "protocol": protocol}
                            row_out["cpu_ms"] = cpu / sent * 1e3
                            row_out.update(result.to_dict())
                            runs.append(row_out)
                            say(
                                f"{model} {protocol:6} {rate:6.0f}/s round {round_no + 1}:"
                                f" achieved {result.achieved_rate:.1f}/s p50 {result.p50_ms:.2f} ms"
                                f" p99 {result.p99_ms:.2f} ms errors {result.errors}"
                                f" server CPU {row_out['cpu_ms']:.3f} ms/request"
                            )
    if a.record:
        record(a.record, runs, facts, other.cores, a)
    print(json.dumps(runs, indent=1, default=str))
    return 0


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def record(path: Path, runs: list[dict], facts: dict[str, str], others: float | None, a: argparse.Namespace) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join([".venv/bin/python", "-m", "bench.grpc_compare", *map(shlex.quote, sys.argv[1:])])
    lines = [
        START,
        "## REST JSON, REST binary and gRPC",
        "",
        f"`{command}`, {now}, commit {report.commit()}"
        + f"; {facts['nproc']} cores ({facts['cpu']}), {report.others_used(others)}"
        + ", and the load generator ran on it too.",
        "",
        f"Each run: {a.seconds:g} s measured after 1 s of warm-up, open loop, one row per request; gRPC over"
        f" {a.channels} channels. Medians of the rounds, then every run.",
        "",
        "| model | rate (req/s) | protocol | achieved (req/s) | p50 (ms) | p99 (ms) | errors"
        " | server CPU per request (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in runs):
        for rate in sorted({r["rate"] for r in runs if r["model"] == model}):
            for protocol in PROTOCOLS:
                rows = [r for r in runs if (r["model"], r["rate"], r["protocol"]) == (model, rate, protocol)]
                lines.append(
                    f"| {model} | {rate:g} | {NAMES[protocol]} | {_median(rows, 'achieved_rate'):.1f}"
                    f" | {_median(rows, 'p50_ms'):.2f} | {_median(rows, 'p99_ms'):.2f}"
                    f" | {sum(r['count'] - r['ok'] for r in rows)} of {sum(r['count'] for r in rows)}"
                    f" | {_median(rows, 'cpu_ms'):.3f} |"
                )
    lines += [
        "",
        "| model | rate | round | protocol | achieved | p50 | p90 | p99 | max | errors | send lag p99"
        " | server CPU/request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['model']} | {r['rate']:g} | {r['round']} | {r['protocol']} | {r['achieved_rate']:.1f}"
            f" | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.2f}"
            f" | {r['count'] - r['ok']} | {r['send_lag_p99_ms']:.2f} | {r['cpu_ms']:.3f} |"
        )
    lines.append(END)
    splice_section(path, START, END, "\n".join(lines))
    say(f"recorded into {path} (page for 'grpc': {page(ROOT / 'docs', 'grpc')})")


if __name__ == "__main__":
    sys.exit(main())
