"""The overload benchmark (bench.overload) in embedded mode with one web process and with several beside a node
host (`manage.py serve --workers N`, issue 19's item 3), in one run: the same capacity search and ramp for each.

    .venv/bin/python -m bench.overload_processes [--quick] [--workers 1,2] [--models digits-wide,digits]
        [--multipliers 1,2,3,3,3,3 --capacity 3000 --ramp-step 6] [--record docs/benchmarks/overload-processes.md]

Embedded mode: SQLite in a fresh data directory, no Redis. With N > 1, `serve` starts `manage.py nodehost`
(the models, their batches and every tenant's quota) and N web processes on one port
(serving.dataplane.transport.host_link). The clients send no deadline (the platform's 300 ms budget applies)
unless bench.overload's settings say otherwise. The server-side counters are one web process's (a scrape reaches
one of them); the statuses are the clients'. Each configuration is judged against its own best step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import overload
from bench.loadgen import arun
from bench.overload_distributed import load_average, run_commit, section, splice
from bench.run import setup_data_dir
from bench.server import Server, free_port, say

HEADING = "## Embedded mode: one web process, and several beside a node host"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bench.overload's quick settings (shorter steps)")
    p.add_argument("--workers", default="1,2", help="web process counts to run, in turn")
    p.add_argument("--models", default=f"{overload.WIDE_MODEL},{overload.FAST_MODEL}")
    p.add_argument("--ramp-step", type=float, help="seconds per ramp step")
    p.add_argument(
        "--multipliers", help="the ramp's steps, as multiples of capacity (default: bench.overload's), e.g. 1,2,3,3,3"
    )
    p.add_argument(
        "--capacity", type=float, help="req/s the multipliers are of, for every configuration (default: searched)"
    )
    p.add_argument("--record", type=Path, help="splice the section into this page (overload-processes.md)")
    a = p.parse_args(argv)
    s = overload.OverloadSettings.for_mode(a.quick)
    if a.ramp_step:
        s.step_s = a.ramp_step
    if a.multipliers:
        s.multipliers = tuple(float(m) for m in a.multipliers.split(",") if m)
    counts = [int(w) for w in a.workers.split(",") if w]
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    commit = run_commit()
    loads = [load_average()]
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-overload-processes-"))
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL", "FERRY_NODE_SOCKET")}
    env.update(
        {
            "FERRY_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            "FERRY_ADMISSION": "true",
            "FERRY_LATENCY_BUDGET_MS": str(s.budget_ms),
        }
    )
    models = tuple(m for m in a.models.split(",") if m)
    results: list[overload.RampResult] = []
    try:
        setup_data_dir(env, None, True)  # migrate, the demo models, the demo user's key, its quota lifted
        for workers in counts:
            launcher = [sys.executable, "manage.py", "serve", "--workers", str(workers)]
            log = data_dir / f"server-{workers}.log"
            with Server(env, free_port(), log, launcher=launcher) as server:
                server.wait_ready((*models, overload.FALLBACK_MODEL), timeout=600)
                for model in models:
                    label = f"{model}, {workers} web process{'es' if workers > 1 else ''}"
                    try:
                        if a.capacity:
                            cap, source = a.capacity, "given (--capacity)"
                        else:
                            cap, source = arun(overload.measure_capacity(server.base, model, s)), "measured here"
                        results.append(arun(overload.ramp(server, model, cap, source, True, s, label)))
                    except Exception as exc:  # the other ramps still say something
                        say(f"{label}: {type(exc).__name__}: {exc}")
                        results.append(
                            overload.RampResult(
                                label, model, True, 0, "", s.goodput_ms, error=f"{type(exc).__name__}: {exc}"
                            )
                        )
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    loads.append(load_average())
    command = "python -m bench.overload_processes " + " ".join(argv if argv is not None else sys.argv[1:])
    about = (
        "Embedded mode (SQLite, no Redis). One web process serves everything itself; with several, `serve` starts",
        "`manage.py nodehost` (the models and the quotas) and the web processes reach it over a Unix socket. Each",
        "configuration's capacity is searched on its own server; the table's goodput is judged against that.",
        "",
    )
    heading = HEADING + " (issue 19)"
    text = section(results, command.strip(), started, commit, loads, heading=heading, about=about)
    print(text)
    if a.record is not None:
        splice(a.record, text, head=HEADING)
    return 0 if results and not any(r.error for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
