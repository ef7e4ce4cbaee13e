"""Shadow mirroring's cost to the primary: p99 at one offered load with 100% of requests mirrored to a
second version on the same node, against none, in one run (open loop, bench.loadgen).

    .venv/bin/python -m bench.shadow [--rate R] [--seconds S]

A fresh data dir (embedded mode) with the demo digits classifier's shape (3 x 1536 MLP, seeded weights:
its accuracy does not matter here, its cost does) registered twice as `shadowbench`: version 1 stable,
version 2 the shadow. Phases, each at the same rate: off, on (`route_model --shadow 2=1`), off again, so
a drift of the machine during the run shows as a difference between the two offs. The verdict compares
the on phase's p99 with the mean of the offs; the target is within 10%. The server's own counters say
what was mirrored and what was dropped (queue full, shed by admission) in the on phase.

Then, still mirroring every request, a ramp of rising rates (`--ramp`, past what the server holds) shows
the order of sacrifice under saturation: at each step the primaries refused (503) and the mirrors dropped.
The verdict holds when no step refuses a primary before mirrors are being dropped: the first step with a
refused primary is at or after the first with dropped mirrors, and in it mirrors are dropped, not served.

Last, the share of mirrored requests compared at 50% and 100% of capacity (issue 19): the primary's capacity
measured with mirroring off (the highest open-loop rate with p99 < 300 ms and < 0.1% errors, or `--capacity`),
then, mirroring every request, a phase at each load, once per mirrors' device share (`--shares`, percents of
FERRY_SHADOW_DEVICE_PERCENT, each on a server of its own), so before and after come from one run. *Compared*
= mirrors the shadow answered and kept for comparison (their pairs; `uncompared` drops excluded); the share
is over every mirror the gateway offered (compared + dropped).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

from bench import capacity, loadgen
from bench.server import HEADERS, Server, counters, free_port, http_get, manage, say, scrape, unbind_quota, use_key

MODEL = "shadowbench"
TARGET = 0.10  # on-phase p99 within 10% of the offs'
SHADOW_COUNTERS = ("ferry_shadow_mirrored_total", "ferry_shadow_dropped_total", "ferry_shed_total")


def build_artifact(path: Path) -> None:
    import torch

    from serving.demo import Digits, save_artifact

    torch.manual_seed(0)
    save_artifact(Digits(1536, 3).eval(), "torchscript", torch.zeros(2, 64), path)


def setup(env: dict[str, str], data_dir: Path) -> None:
    manage(["migrate", "--noinput", "-v0"], env)
    artifact = data_dir / "digits-1536x3.pt"
    build_artifact(artifact)
    common = [
        "--format",
        "torchscript",
        "--input",
        "input:FP32:64",
        "--output",
        "scores:FP32:10",
        "--task",
        "classification",
        "--max-batch-size",
        "32",
        "--max-queue-delay-ms",
        "5",
        "--preferred-batch-sizes",
        "8,16,32",
        "--max-queue-size",
        "2048",
    ]
    for _ in range(2):
        manage(["register_model", MODEL, str(artifact), *common], env)
    manage(["ensure_demo_user"], env)
    unbind_quota(env)
    if use_key(data_dir) is None:
        raise RuntimeError("ensure_demo_user wrote no demo API key")


def body() -> bytes:
    row = np.random.default_rng(0).uniform(0, 16, 64).astype(np.float32)
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]})


def shadow_counts(base: str) -> dict[str, float]:
    found = counters(scrape(base), SHADOW_COUNTERS)
    out: dict[str, float] = {}
    for (name, labels), value in found.items():
        labels_d = dict(labels)
        if labels_d.get("model") != MODEL:
            continue
        if name == "ferry_shadow_mirrored_total":
            key = f"mirrored {labels_d['outcome']}"
        elif name == "ferry_shadow_dropped_total":
            key = f"dropped {labels_d['reason']}"
        else:
            key = f"shed v{labels_d['version']} {labels_d['reason']} tier {labels_d['tier']}"
        out[key] = out.get(key, 0.0) + value
    return out


def wait_mirroring(base: str, on: bool, timeout: float = 15.0) -> None:
    """Until the server's snapshot has the shadow on (mirrors counted) or off (no new mirrors)."""
    url = base + f"/v2/models/{MODEL}/infer"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(v for k, v in shadow_counts(base).items() if k.startswith(("mirrored", "dropped")))
        for _ in range(5):
            loadgen_post(url)
        time.sleep(0.3)
        after = sum(v for k, v in shadow_counts(base).items() if k.startswith(("mirrored", "dropped")))
        if (after > before) == on:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the shadow did not turn {'on' if on else 'off'} within {timeout:.0f} s")


def loadgen_post(url: str) -> None:
    from bench.server import http_post

    status, text = http_post(url, body())
    if status != 200:
        raise RuntimeError(f"probe answered {status}: {text[:200]!r}")


def phase(base: str, label: str, rate: float, seconds: float) -> tuple[loadgen.LoadResult, dict[str, float]]:
    before = shadow_counts(base)
    result = loadgen.arun(
        loadgen.run(
            base + f"/v2/models/{MODEL}/infer", body(), dict(HEADERS), rate, seconds, warmup=2.0, progress=False
        )
    )
    after = shadow_counts(base)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    say(
        f"{label}: p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms, ok {result.ok}/{result.count},"
        f" errors {result.errors_by_status} client {result.client_errors}, send lag p99"
        f" {result.send_lag_p99_ms:.1f} ms; server: {delta or 'nothing mirrored'}"
    )
    return result, delta


def ramp(base: str, rates: list[float], seconds: float) -> tuple[list[dict], bool]:
    """Mirroring on, one step per rate: what the primaries and the mirrors got."""
    steps = []
    for rate in rates:
        result, delta = phase(base, f"saturation step {rate:g} req/s", rate, seconds)
        refused = result.errors_by_status.get("503", 0)
        dropped = sum(v for k, v in delta.items() if k.startswith("dropped"))
        mirrored = delta.get("mirrored ok", 0.0) + delta.get("mirrored error", 0.0)
        steps.append(
            {
                "rate": rate,
                "ok": result.ok,
                "count": result.count,
                "p99_ms": result.p99_ms,
                "primary_503": refused,
                "mirrors_answered": mirrored,
                "mirrors_dropped": dropped,
                "client_errors": result.client_errors,
            }
        )
    first_drop = next((i for i, st in enumerate(steps) if st["mirrors_dropped"]), None)
    first_shed = next((i for i, st in enumerate(steps) if st["primary_503"]), None)
    holds = first_shed is None or (
        first_drop is not None
        and first_drop <= first_shed
        and steps[first_shed]["mirrors_dropped"] > steps[first_shed]["mirrors_answered"]
    )
    return steps, holds


def compared_share(delta: dict[str, float]) -> tuple[float, float, float]:
    """(compared, offered to the shadow, share) from one phase's counters."""
    answered = delta.get("mirrored ok", 0.0) + delta.get("mirrored error", 0.0)
    uncompared = delta.get("dropped uncompared", 0.0)
    dropped = sum(v for k, v in delta.items() if k.startswith("dropped") and k != "dropped uncompared")
    compared = answered - uncompared
    offered = answered + dropped
    return compared, offered, compared / offered if offered else float("nan")


def measure_capacity(base: str, seconds: float) -> float:
    """The primary's capacity, mirroring off: open-loop search from a closed-loop probe (as bench.overload)."""
    url = base + f"/v2/models/{MODEL}/infer"
    seed = loadgen.arun(capacity.probe_capacity(url, body(), dict(HEADERS), concurrency=32, duration=2.0))
    best, _ = loadgen.arun(
        capacity.find_max_rate(
            url, body(), dict(HEADERS), start=max(5.0, 0.6 * seed), stop=50_000.0, p99_budget_ms=300.0,
            max_error_ratio=0.001, duration=seconds, warmup=0.5, factor=1.25, refine_steps=1,
            min_rate=max(1.0, 0.6 * seed / 1.25**4), cooldown=1.0, cooldown_after_fail=2.0, progress=False,
        )
    )  # fmt: skip
    if best is None:
        raise RuntimeError("no rate passed the capacity search")
    say(f"capacity, mirroring off: {best.achieved_rate:.1f} req/s (p99 {best.p99_ms:.1f} ms; probe {seed:.0f})")
    return best.achieved_rate


def at_capacity(env: dict[str, str], data_dir: Path, shares: list[int], cap: float | None, seconds: float,
                loads: tuple[float, ...] = (0.5, 1.0)) -> tuple[float, list[dict]]:  # fmt: skip
    """Per device share (a server each), mirroring every request: each load's compared share."""
    rows: list[dict] = []
    for i, percent in enumerate(shares):
        share_env = {**env, "FERRY_SHADOW_DEVICE_PERCENT": str(percent)}
        with Server(share_env, free_port(), data_dir / f"server-share-{percent}.log") as server:
            server.wait_ready((MODEL,))
            while http_get(server.base + f"/v2/models/{MODEL}/versions/2/ready")[0] != 200:
                time.sleep(0.5)
            if i == 0:
                manage(["route_model", MODEL, "--shadow", ""], env)
                wait_mirroring(server.base, on=False)
                cap = cap or measure_capacity(server.base, 4.0)
                manage(["route_model", MODEL, "--shadow", "2=1"], env)
            wait_mirroring(server.base, on=True)
            assert cap is not None
            for load in loads:
                result, delta = phase(server.base, f"share {percent}%, {load:g}x capacity", load * cap, seconds)
                compared, offered, share = compared_share(delta)
                drops = {k[len("dropped ") :]: v for k, v in delta.items() if k.startswith("dropped")}
                rows.append({
                    "device_percent": percent, "load": load, "rate": load * cap, "ok": result.ok,
                    "count": result.count, "p99_ms": result.p99_ms, "compared": compared, "offered": offered,
                    "share": share, "compared_per_s": compared / seconds, "drops": drops,
                })  # fmt: skip
    assert cap is not None
    return cap, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=150.0, help="offered requests per second (default 150)")
    parser.add_argument("--seconds", type=float, default=12.0, help="measured seconds per phase (default 12)")
    parser.add_argument(
        "--ramp",
        default="800,1600,2400,3200,4000",
        help="rates of the saturation ramp, mirroring on (default 800,...,4000; '' skips it)",
    )
    parser.add_argument("--ramp-seconds", type=float, default=5.0, help="measured seconds per ramp step (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the data dir")
    parser.add_argument(
        "--shares",
        default="0,10",
        help="mirrors' device shares (percent) for the compared-share phases at 50%% and 100%% of capacity,"
        " a server each (default 0,10: before and after; '' skips them)",
    )
    parser.add_argument("--capacity", type=float, help="the primary's capacity, req/s (default: measured)")
    parser.add_argument("--share-seconds", type=float, default=10.0, help="seconds per compared-share phase")
    parser.add_argument(
        "--shares-only", action="store_true", help="only the compared-share phases (skip the p99 phases and ramp)"
    )
    a = parser.parse_args(argv)
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-shadow-bench-"))
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)  # embedded mode: one process, the node in it
    shares = [int(v) for v in a.shares.split(",") if v.strip()]
    off1 = on = off2 = None
    counts: dict[str, float] = {}
    steps: list[dict] = []
    ramp_holds = True
    share_rows: list[dict] = []
    cap = a.capacity
    try:
        setup(env, data_dir)
        if not a.shares_only:
            with Server(env, free_port(), data_dir / "server.log") as server:
                server.wait_ready((MODEL,))
                while http_get(server.base + f"/v2/models/{MODEL}/versions/2/ready")[0] != 200:
                    time.sleep(0.5)
                off1, _ = phase(server.base, "mirroring off", a.rate, a.seconds)
                manage(["route_model", MODEL, "--shadow", "2=1"], env)
                wait_mirroring(server.base, on=True)
                on, counts = phase(server.base, "mirroring 100%", a.rate, a.seconds)
                rates = [float(r) for r in a.ramp.split(",") if r.strip()]
                steps, ramp_holds = ramp(server.base, rates, a.ramp_seconds) if rates else ([], True)
                manage(["route_model", MODEL, "--shadow", ""], env)
                wait_mirroring(server.base, on=False)
                off2, _ = phase(server.base, "mirroring off again", a.rate, a.seconds)
        if shares:
            cap, share_rows = at_capacity(env, data_dir, shares, cap, a.share_seconds)
    finally:
        if not a.keep:
            shutil.rmtree(data_dir, ignore_errors=True)
    verdict = "PASS"
    print(f"\nshadow bench ({time.monotonic() - started:.0f} s in all)")
    if off1 is not None and on is not None and off2 is not None:
        base_p99 = (off1.p99_ms + off2.p99_ms) / 2
        ratio = on.p99_ms / base_p99 if base_p99 else float("inf")
        mirrored = counts.get("mirrored ok", 0.0) + counts.get("mirrored error", 0.0)
        dropped = sum(v for k, v in counts.items() if k.startswith("dropped"))
        print(f"  at {a.rate:g} req/s, {a.seconds:g} s per phase:")
        for label, r in (("off", off1), ("100%", on), ("off again", off2)):
            print(
                f"  primary p99, mirroring {label + ':':11}{r.p99_ms:7.1f} ms"
                f"  (p50 {r.p50_ms:.1f}, ok {r.ok}/{r.count})"
            )
        print(f"  mirrored in the on phase: {mirrored:.0f} answered, {dropped:.0f} dropped {counts}")
        verdict = "PASS" if ratio <= 1 + TARGET and on.errors == 0 else "FAIL"
        print(
            f"  on / mean(off) p99: {ratio:.3f} (target <= {1 + TARGET:.2f}); primary errors with mirroring:"
            f" {on.errors}: {verdict}"
        )
    if steps:
        print("\n  saturation ramp, mirroring every request:")
        print(
            "  | offered req/s | primaries ok | primaries 503 | primary p99 ms | mirrors answered | mirrors dropped |"
        )
        print("  |---|---|---|---|---|---|")
        for st in steps:
            print(
                f"  | {st['rate']:,.0f} | {st['ok']:,}/{st['count']:,} | {st['primary_503']:,} | {st['p99_ms']:,.1f}"
                f" | {st['mirrors_answered']:,.0f} | {st['mirrors_dropped']:,.0f} |"
            )
        print(f"  mirrors dropped before any primary is refused: {'PASS' if ramp_holds else 'FAIL'}")
    if share_rows:
        print(
            f"\n  mirrored requests compared, mirroring every request (capacity {cap:,.1f} req/s,"
            f" {a.share_seconds:g} s a phase):"
        )
        print(
            "  | mirrors' device share | load | offered req/s | primaries ok | primary p99 ms | mirrors offered"
            " | compared | share compared | compared/s | dropped by reason |"
        )
        print("  |---|---|---|---|---|---|---|---|---|---|")
        for r in share_rows:
            drops = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["drops"].items())) or "none"
            print(
                f"  | {r['device_percent']}% | {r['load']:g}x | {r['rate']:,.0f} | {r['ok']:,}/{r['count']:,}"
                f" | {r['p99_ms']:,.1f} | {r['offered']:,.0f} | {r['compared']:,.0f} | {100 * r['share']:.1f}%"
                f" | {r['compared_per_s']:,.1f} | {drops} |"
            )
    return 0 if verdict == "PASS" and ramp_holds else 1


if __name__ == "__main__":
    sys.exit(main())
