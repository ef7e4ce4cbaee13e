"""What API keys and quotas cost on the hot path: `digits` capacity with them on against the same checkout without them.

    .venv/bin/python -m bench.auth_cost [--rounds 2] [--quick] [--record docs/benchmarks/request-path.md]

One data dir (demo models, the demo tenant's key, its quota lifted so that it is checked but never binds),
two servers from this checkout, alternating round by round on this machine:
- **on**: `manage.py serve` as shipped, every request carrying the demo key (one memo lookup or HMAC) and
  paying its tenant's quota (in-process: this run has no Redis, like `make bench`);
- **off**: `bench.serve_without_auth` with FERRY_QUOTAS=false, the key check replaced by a fixed caller.
The sweep is bench.run's (open-loop, p99 < 300 ms, < 0.1% errors); the median of each is compared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench import loadgen, report
from bench.report import Settings
from bench.run import digits_body, setup_data_dir, sweep
from bench.server import Server, free_port, say

START, END = "<!-- authcost:start -->", "<!-- authcost:end -->"
TARGET_LOSS = 0.10


def measure(env: dict[str, str], data: Path, s: Settings, *, auth: bool) -> float | None:
    launcher = None
    if not auth:
        env = {**env, "FERRY_QUOTAS": "false"}
        launcher = [sys.executable, "-m", "bench.serve_without_auth"]
    label = "on" if auth else "off"
    with Server(env, free_port(), data / f"server-{label}.log", launcher=launcher) as server:
        server.wait_ready(("digits",))
        result = loadgen.arun(sweep(server.base, "digits", digits_body(), s))
    if result.best is None:
        say(f"keys and quotas {label}: no rate passed ({result.error or 'see the steps above'})")
        return None
    say(f"keys and quotas {label}: {result.best.achieved_rate:,.1f} req/s at p99 {result.best.p99_ms:.1f} ms")
    return result.best.achieved_rate


def section(runs: dict[str, list[float | None]], command: str) -> str:
    import datetime

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.1f}"

    med = {k: statistics.median([v for v in vs if v is not None]) if any(v is not None for v in vs) else None
           for k, vs in runs.items()}  # fmt: skip
    ratio = med["on"] / med["off"] if med["on"] and med["off"] else None
    verdict = "n/a" if ratio is None else ("met" if 1 - ratio < TARGET_LOSS else "**not met**")
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        START,
        "## What API keys and quotas cost",
        "",
        f"`{command}` on {when}: `digits` capacity (p99 < 300 ms, < 0.1% errors) from one checkout and one data"
        " dir, the two servers alternating round by round: **on** is `manage.py serve` as shipped (every request"
        " authenticated by its API key and charged to its tenant's quota, in-process as in `make bench`, which"
        " runs without Redis); **off** is `bench.serve_without_auth` with `FERRY_QUOTAS=false` (a fixed caller,"
        " no quota).",
        "",
        "| keys and quotas | req/s per round | median |",
        "|---|---|---|",
        *(f"| {k} | {', '.join(fmt(v) for v in runs[k])} | **{fmt(med[k])}** |" for k in ("on", "off")),
        "",
        f"On / off: **{'n/a' if ratio is None else f'{ratio:.3f}'}**; the loss target is under"
        f" {TARGET_LOSS:.0%}: {verdict}.",
        "",
        END,
    ]
    return "\n".join(lines)


def kept_section(text: str) -> str:
    return report.kept_section(text, START, END)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.auth_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="alternate on and off this many times each")
    p.add_argument("--quick", action="store_true", help="short steps: a smoke run, not numbers to publish")
    p.add_argument("--data-dir", type=Path, help="use (and keep) this FERRY_DATA_DIR; built models are reused")
    p.add_argument("--record", type=Path, help="write the result into this page (docs/benchmarks/request-path.md)")
    a = p.parse_args(argv)
    s = Settings.for_mode(a.quick)
    data = a.data_dir or Path(tempfile.mkdtemp(prefix="ferry-authcost-"))
    data.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}  # embedded mode
    env.update({"FERRY_DATA_DIR": str(data), "PYTHONUNBUFFERED": "1"})
    say(f"data dir {data}")
    setup_data_dir(env, None, demo=True)  # also sends the demo key on every request (bench.server.use_key)
    runs: dict[str, list[float | None]] = {"on": [], "off": []}
    for rnd in range(a.rounds):
        for key in ("on", "off"):
            say(f"===== round {rnd + 1}/{a.rounds}: keys and quotas {key} =====")
            runs[key].append(measure(env, data, s, auth=key == "on"))
    report.publish(section(runs, report.command_line("bench.auth_cost", argv)), a.record, START, END)
    return 0 if all(v is not None for vs in runs.values() for v in vs) else 1


if __name__ == "__main__":
    sys.exit(main())
