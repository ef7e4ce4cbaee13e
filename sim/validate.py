"""Validate the simulator against the real server: one demo model, one open-loop load, both ways.

    python -m sim.validate [--model digits] [--rate 300] [--duration 20]

Starts an embedded server (`manage.py serve`, fresh data dir, SQLite) with the demo models, reads the
model's measured latency profile and batching settings from the registry's API, then
- measures: `bench.loadgen` sends `rate` requests a second on a fixed timetable (open loop) for
  `duration` seconds, and reports throughput and latency from the client;
- simulates: one version with that profile on one node, the same rate and duration.
The simulator models queueing and compute, not HTTP: the front end's cost per request (parse, route,
encode, loopback) is measured separately at 20 requests a second, where nothing queues (the client's p50
less the node's own mean request time), and added to the simulated latencies. The profile is the one the
node measured while serving (`ferry_compute_seconds` per batch over `ferry_batch_size`, quiet and loaded):
on a shared machine a profile measured at registration says little about the run.
Prints both and writes docs/sim-validation.json, which `python -m sim.report` puts in docs/simulation.md.
Under two minutes once the demo models are built in the kept data dir (the first run trains them).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.loadgen import arun
from bench.loadgen import run as loadgen_run
from bench.run import digits_body, setup_data_dir
from bench.server import HEADERS, Server, counters, free_port, say, scrape
from sim.engine import simulate
from sim.scenario import from_dict

DOCS = Path(__file__).resolve().parent.parent / "docs"
WITHIN = 0.20


def _version(base: str, model: str, data_dir: Path) -> dict[str, Any]:
    """The model's first version as the API shows it (console login from `ensure_demo_user`, which writes its
    generated password into the data directory)."""
    user = os.environ.get("FERRY_ADMIN_USER", "admin")
    password = os.environ.get("FERRY_ADMIN_PASSWORD") or (data_dir / "demo-admin-password").read_text().strip()
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    req = urllib.request.Request(f"{base}/api/models/{model}/versions/", headers={"Authorization": f"Basic {auth}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.loads(resp.read())
    rows = doc["results"] if isinstance(doc, dict) else doc
    return min(rows, key=lambda r: r["version"])


SERIES = (
    "ferry_compute_seconds_sum",
    "ferry_compute_seconds_count",
    "ferry_batch_size_sum",
    "ferry_batch_size_count",
    "ferry_request_seconds_sum",
    "ferry_request_seconds_count",
)


def _totals(base: str, model: str) -> dict[str, float]:
    """The node's own counters for `model`, summed over its series (bench.server reads /metrics)."""
    out = dict.fromkeys(SERIES, 0.0)
    for (name, labels), value in counters(scrape(base), SERIES).items():
        if ("model", model) in labels:
            out[name] += value
    return out


def _phase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Means over one load phase: seconds of compute per batch, rows per batch, seconds per request."""
    d = {k: after[k] - before[k] for k in SERIES}
    batches = max(d["ferry_batch_size_count"], 1.0)
    return {
        "compute": d["ferry_compute_seconds_sum"] / max(d["ferry_compute_seconds_count"], 1.0),
        "batch": d["ferry_batch_size_sum"] / batches,
        "request": d["ferry_request_seconds_sum"] / max(d["ferry_request_seconds_count"], 1.0),
    }


def served_profile(idle: dict[str, float], loaded: dict[str, float], max_batch: int) -> dict[int, float]:
    """The latency profile the node measured while serving these loads (`ferry_compute_seconds` over
    `ferry_batch_size`): a line through the quiet phase's (batch, compute) and the loaded phase's, so the
    profile holds whatever else the machine was doing at the time. When the batches did not grow there is
    no slope to draw, and the profile is flat at the loaded phase's compute: the run being simulated is
    that one, and a busy machine computes the same batch slower than a quiet one."""
    b0, t0, b1, t1 = idle["batch"], idle["compute"], loaded["batch"], loaded["compute"]
    sizes = sorted({1, max_batch, *(2**i for i in range(1, max_batch.bit_length()) if 2**i <= max_batch)})
    if b1 <= b0 + 0.5:
        return {b: max(t1, 1e-5) for b in sizes}
    slope = max(0.0, (t1 - t0) / (b1 - b0))
    return {b: max(t0 + slope * (b - b0), 1e-5) for b in sizes}


def simulated(version: dict[str, Any], rate: float, duration: float, seed: int = 1) -> dict[str, Any]:
    profile_ms = {int(b): s * 1000 for b, s in version["latency_profile"].items()}
    max_batch = int(version["max_batch_size"])
    if max_batch not in profile_ms:  # the profile is measured at powers of two; the largest batch is its own
        top = max(profile_ms)
        profile_ms[max_batch] = profile_ms[top] * max_batch / top
    sc = from_dict(
        {
            "name": "validate",
            "duration": duration,
            "seed": seed,
            "versions": 1,
            "canary_share": 0.0,
            "fallback_share": 0.0,
            "window": max(1.0, duration / 10),
            "traffic": {"shape": "steady", "rate": rate},
            "families": {
                "demo": {
                    "share": 1.0,
                    "accelerator": "cpu",
                    "memory_gb": 0.1,
                    "base_ms": 1,
                    "per_row_ms": 0,
                    "max_batch_size": max_batch,
                    "max_queue_delay_ms": version["max_queue_delay_ms"],
                    "profile_ms": profile_ms,
                }
            },
            "fleet": {"cpu": {"nodes": 1, "memory_gb": 1, "speed": 1.0, "cost_per_hour": 0.0, "cold_start": 0}},
            "scaling": {"timeout": version["default_timeout_ms"] / 1000, "max_queue_size": version["max_queue_size"]},
            "policies": ["static"],
        }
    )
    return simulate(sc, "static")


SETTINGS = ("max_batch_size", "max_queue_delay_ms", "default_timeout_ms", "max_queue_size")


def _settings(model: str, row: dict[str, Any]) -> dict[str, Any]:
    """The batching settings a recorded row ran with: kept in the row, or (rows written before they were)
    the demo model's own, which is what the server registered."""
    if "settings" in row:
        return row["settings"]
    from serving.demo import DEMO_MODELS

    demo = next(d for d in DEMO_MODELS if d.name == model)
    return {
        "max_batch_size": demo.batching["max_batch_size"],
        "max_queue_delay_ms": demo.batching["max_queue_delay_ms"],
        "default_timeout_ms": 1000,
        "max_queue_size": demo.batching["max_queue_size"],
    }


def _judge(result: dict[str, Any], sim: dict[str, Any], front_end_ms: float) -> None:
    """Fill in the simulated side and the verdicts of `result` (measured side already there)."""
    sim_throughput = (sim["outcomes"]["served"] + sim["outcomes"]["fallback"]) / result["duration"]
    sim_p50 = sim["latency_ms"]["p50"] + front_end_ms
    result["simulated"] = {
        "throughput": sim_throughput,
        "p50_ms": sim_p50,
        "p99_ms": sim["latency_ms"]["p99"] + front_end_ms,
        "shed": sim["outcomes"]["shed"],
    }
    measured = result["measured"]
    result["throughput_ok"] = abs(sim_throughput - measured["throughput"]) <= WITHIN * measured["throughput"]
    result["p50_ok"] = abs(sim_p50 - measured["p50_ms"]) <= WITHIN * measured["p50_ms"]


def resimulate(path: Path) -> int:
    """Simulate again every recorded row from its own profile, front end and settings, keeping what was
    measured: for a change to the simulator, where measuring again would also change the server's side."""
    rows = json.loads(path.read_text())
    for model, row in rows.items():
        settings = _settings(model, row)
        if "quiet_phase" in row and "loaded_phase" in row:  # the profile by today's rule, from what was measured
            profile = served_profile(row["quiet_phase"], row["loaded_phase"], int(settings["max_batch_size"]))
            row["profile_ms"] = {b: round(seconds * 1000, 3) for b, seconds in sorted(profile.items())}
        version = {**settings, "latency_profile": {int(b): ms / 1000 for b, ms in row["profile_ms"].items()}}
        _judge(row, simulated(version, row["rate"], row["duration"]), row["front_end_ms"])
        row["settings"] = settings
        row["resimulated"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        print(
            f"{model}: measured p50 {row['measured']['p50_ms']:.2f} ms,"
            f" simulated {row['simulated']['p50_ms']:.2f} ms; throughput within 20%: {row['throughput_ok']};"
            f" p50 within 20%: {row['p50_ok']}"
        )
    path.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["throughput_ok"] and r["p50_ok"] for r in rows.values()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="digits")
    p.add_argument("--rate", type=float, default=300.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=DOCS / "sim-validation.json")
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "ferry-sim-validate",
        help="FERRY_DATA_DIR, kept: the demo models are trained once and reused (training takes minutes)",
    )
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="measure nothing: simulate again the rows recorded in --out (after a simulator change)",
    )
    args = p.parse_args(argv)
    if args.resimulate:
        return resimulate(args.out)

    data_dir = args.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"})
    setup_data_dir(env, None, demo=True)
    body = digits_body()
    with Server(env, free_port(), data_dir / "server.log") as server:
        server.wait_ready((args.model,))
        version = _version(server.base, args.model, data_dir)
        url = f"{server.base}/v2/models/{args.model}/infer"
        say(
            f"{args.model}: profile {version['latency_profile']}, max batch {version['max_batch_size']},"
            f" window {version['max_queue_delay_ms']} ms"
        )
        t0 = _totals(server.base, args.model)
        idle = arun(loadgen_run(url, body, HEADERS, 20.0, 5.0, warmup=1.0, progress=False))
        t1 = _totals(server.base, args.model)
        measured = arun(loadgen_run(url, body, HEADERS, args.rate, args.duration, warmup=2.0))
        t2 = _totals(server.base, args.model)
    quiet, busy = _phase(t0, t1), _phase(t1, t2)
    registry_profile = version["latency_profile"]
    profile = served_profile(quiet, busy, int(version["max_batch_size"]))
    version = {**version, "latency_profile": profile}
    say(f"{args.model}: quiet {quiet}, loaded {busy}; profile {profile}")
    # Alone at 20 requests/s nothing queues: what the client saw beyond the node's own time is the front end's.
    front_end_ms = max(0.0, idle.p50_ms - quiet["request"] * 1000)
    sim = simulated(version, args.rate, args.duration)
    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "rate": args.rate,
        "duration": args.duration,
        "profile_ms": {b: round(s * 1000, 3) for b, s in sorted(profile.items())},
        "registry_profile_ms": {b: round(s * 1000, 3) for b, s in registry_profile.items()},
        "quiet_phase": quiet,
        "loaded_phase": busy,
        "front_end_ms": front_end_ms,
        "settings": {k: version[k] for k in SETTINGS},
        "measured": {
            "throughput": measured.achieved_rate,
            "p50_ms": measured.p50_ms,
            "p99_ms": measured.p99_ms,
            "errors": measured.errors,
            "send_lag_p99_ms": measured.send_lag_p99_ms,
        },
    }
    _judge(result, sim, front_end_ms)
    result["note"] = (
        f"The profile is the node's own (ferry_compute_seconds over ferry_batch_size, a line through"
        f" the quiet and the loaded phase); the front end's cost, {front_end_ms:.2f} ms a request (the"
        " client's p50 at 20 requests/s less the node's mean request time), is added to the simulated"
        " latencies."
    )
    # One entry per model: a run for one model keeps the others' last results.
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if "model" in previous:  # the one-result layout of before
        previous = {previous["model"]: previous}
    args.out.write_text(json.dumps({**previous, args.model: result}, indent=1))
    for name, row in (("measured", result["measured"]), ("simulated", result["simulated"])):
        print(f"{name:10} {row['throughput']:8.1f} req/s  p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms")
    print(f"throughput within 20%: {result['throughput_ok']}; p50 within 20%: {result['p50_ok']} -> {args.out}")
    return 0 if result["throughput_ok"] and result["p50_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
