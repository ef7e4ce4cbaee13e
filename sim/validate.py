"""Validate the simulator against the real server: one demo model, one open-loop load, both ways.

    python -m sim.validate [--model digits] [--rate 300] [--duration 20]

Starts an embedded server (`manage.py serve`, fresh data dir, SQLite) with the demo models, reads the
model's measured latency profile and batching settings from the registry's API, then
- measures: `bench.loadgen` sends `rate` requests a second on a fixed timetable (open loop) for
  `duration` seconds, and reports throughput and latency from the client;
- simulates: one version with that profile on one node, the same rate and duration.
The simulator models queueing and compute, not HTTP: the front end's cost per request (parse, route,
encode, loopback) is measured separately at 20 requests a second, where nothing queues (its p50 less
the batch window and the profile's batch of one), and added to the simulated latencies. The profile is
measured again at the end by the node's own `ModelRuntime.profile`, 30 calls a size, on the idle machine.
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
from bench.server import HEADERS, Server, free_port, say
from sim.engine import simulate
from sim.scenario import from_dict

DOCS = Path(__file__).resolve().parent.parent / "docs"
WITHIN = 0.20


def _version(base: str, model: str) -> dict[str, Any]:
    """The model's first version as the API shows it (console login from `ensure_demo_user`)."""
    user = os.environ.get("FERRY_ADMIN_USER", "admin")
    password = os.environ.get("FERRY_ADMIN_PASSWORD", "ferry-admin")
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    req = urllib.request.Request(f"{base}/api/models/{model}/versions/", headers={"Authorization": f"Basic {auth}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc = json.loads(resp.read())
    rows = doc["results"] if isinstance(doc, dict) else doc
    return min(rows, key=lambda r: r["version"])


def measure_profile(data_dir: Path, version: dict[str, Any], repeats: int = 30) -> dict[int, float]:
    """The version's latency profile measured now, by the node's own `ModelRuntime.profile` (median of
    `repeats` calls per batch size, the node's thread count), on an otherwise idle server: the registry's
    profile was measured once at registration, whatever else the machine was doing then."""
    from serving.dataplane.protocol import TensorSpec
    from serving.dataplane.runtime import ModelRuntime, configure_torch_threads, pick_device

    configure_torch_threads(0)
    sha = version["artifact_sha256"]
    path = data_dir / "artifacts" / sha[:2] / sha
    runtime = ModelRuntime(path, version["format"], [TensorSpec.from_dict(d) for d in version["inputs"]],
                           [TensorSpec.from_dict(d) for d in version["outputs"]], pick_device())
    runtime.load()
    top = int(version["max_batch_size"])
    sizes = sorted({1, top, *(2**i for i in range(1, top.bit_length()) if 2**i <= top)})
    return runtime.profile(sizes, repeats=repeats)


def simulated(version: dict[str, Any], rate: float, duration: float, seed: int = 1) -> dict[str, Any]:
    profile_ms = {int(b): s * 1000 for b, s in version["latency_profile"].items()}
    max_batch = int(version["max_batch_size"])
    if max_batch not in profile_ms:  # the profile is measured at powers of two; the largest batch is its own
        top = max(profile_ms)
        profile_ms[max_batch] = profile_ms[top] * max_batch / top
    sc = from_dict({
        "name": "validate", "duration": duration, "seed": seed, "versions": 1, "canary_share": 0.0,
        "fallback_share": 0.0, "window": max(1.0, duration / 10),
        "traffic": {"shape": "steady", "rate": rate},
        "families": {"demo": {"share": 1.0, "accelerator": "cpu", "memory_gb": 0.1, "base_ms": 1, "per_row_ms": 0,
                              "max_batch_size": max_batch, "max_queue_delay_ms": version["max_queue_delay_ms"],
                              "profile_ms": profile_ms}},
        "fleet": {"cpu": {"nodes": 1, "memory_gb": 1, "speed": 1.0, "cost_per_hour": 0.0, "cold_start": 0}},
        "scaling": {"timeout": version["default_timeout_ms"] / 1000, "max_queue_size": version["max_queue_size"]},
        "policies": ["static"],
    })
    return simulate(sc, "static")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="digits")
    p.add_argument("--rate", type=float, default=300.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--out", type=Path, default=DOCS / "sim-validation.json")
    p.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "ferry-sim-validate",
                   help="FERRY_DATA_DIR, kept: the demo models are trained once and reused (training takes minutes)")
    args = p.parse_args(argv)

    data_dir = args.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update({"FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"})
    setup_data_dir(env, None, demo=True)
    body = digits_body()
    with Server(env, free_port(), data_dir / "server.log") as server:
        server.wait_ready((args.model,))
        version = _version(server.base, args.model)
        url = f"{server.base}/v2/models/{args.model}/infer"
        say(f"{args.model}: profile {version['latency_profile']}, max batch {version['max_batch_size']},"
            f" window {version['max_queue_delay_ms']} ms")
        idle = arun(loadgen_run(url, body, HEADERS, 20.0, 5.0, warmup=1.0, progress=False))
        measured = arun(loadgen_run(url, body, HEADERS, args.rate, args.duration, warmup=2.0))
    registry_profile = version["latency_profile"]
    profile = measure_profile(data_dir, version)
    version = {**version, "latency_profile": profile}
    say(f"{args.model}: profile measured now {profile}")
    # Alone at 20 requests/s, a request waits the whole batch window and then runs as a batch of one.
    front_end_ms = max(0.0, idle.p50_ms - version["max_queue_delay_ms"] - profile[1] * 1000)
    sim = simulated(version, args.rate, args.duration)
    sim_throughput = (sim["outcomes"]["served"] + sim["outcomes"]["fallback"]) / args.duration
    sim_p50 = sim["latency_ms"]["p50"] + front_end_ms
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": args.model,
        "rate": args.rate,
        "duration": args.duration,
        "profile_ms": {b: round(s * 1000, 3) for b, s in sorted(profile.items())},
        "registry_profile_ms": {b: round(s * 1000, 3) for b, s in registry_profile.items()},
        "front_end_ms": front_end_ms,
        "measured": {"throughput": measured.achieved_rate, "p50_ms": measured.p50_ms, "p99_ms": measured.p99_ms,
                     "errors": measured.errors, "send_lag_p99_ms": measured.send_lag_p99_ms},
        "simulated": {"throughput": sim_throughput, "p50_ms": sim_p50,
                      "p99_ms": sim["latency_ms"]["p99"] + front_end_ms, "shed": sim["outcomes"]["shed"]},
    }
    result["throughput_ok"] = abs(sim_throughput - measured.achieved_rate) <= WITHIN * measured.achieved_rate
    result["p50_ok"] = abs(sim_p50 - measured.p50_ms) <= WITHIN * measured.p50_ms
    result["note"] = (f"The front end's cost, {front_end_ms:.2f} ms a request (p50 alone at 20 requests/s less"
                      " the batch window and the profile's batch of one), is added to the simulated latencies.")
    args.out.write_text(json.dumps(result, indent=1))
    for name, row in (("measured", result["measured"]), ("simulated", result["simulated"])):
        print(f"{name:10} {row['throughput']:8.1f} req/s  p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms")
    print(f"throughput within 20%: {result['throughput_ok']}; p50 within 20%: {result['p50_ok']} -> {args.out}")
    return 0 if result["throughput_ok"] and result["p50_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
