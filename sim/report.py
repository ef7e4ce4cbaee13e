"""Run the shipped scenarios under each policy and write docs/simulation.md, its PNGs and its JSON.

    python -m sim.report [--jobs N] [--only NAME ...] [--out DIR]

Every number in the page is read from the runs it just made; the checks of the acceptance are
computed, not typed. Runs go to a process pool (one scenario x policy per process), each on one
core, after the timed run (TIMED), which runs alone; the validation against the real server is
`python -m sim.validate`, whose last result (docs/sim-validation.json) the page includes when it exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from sim import scenario as scenarios
from sim.engine import simulate
from sim.plots import scenario_plot
from sim.writeup import render

DOCS = Path(__file__).resolve().parent.parent / "docs"
# The page's order; others follow by name.
ORDER = ("steady-50k", "ramp-30s-cold", "spike-3x", "diurnal-day", "daily-rush")
# The run whose time the page checks against the budget ("ten simulated minutes on one core"): it goes first and
# alone, so no other run shares the machine's caches and memory bandwidth while it is timed.
TIMED = ("steady-50k", "predictive")
# The sensitivity of the headline run to the batching gain: steady-50k under the predictive policy with every
# profile reshaped so that a batch of 32 serves this many times what a batch of one does (`scenario.with_gain`),
# over its first SENSITIVITY_SECONDS (to bound the page's CPU time; the steady state is reached within a minute).
SENSITIVITY = ("steady-50k", "predictive", (3.0, 6.0, 10.0))
SENSITIVITY_SECONDS = 90.0
# The same run at other batch windows (ms): the latency a quiet version pays to fill a batch, against the devices
# it saves (the shipped scenarios' own window is in their families).
WINDOWS = (5.0, 20.0, 50.0)


def _order(path: Path) -> tuple[int, str]:
    return (ORDER.index(path.stem) if path.stem in ORDER else len(ORDER), path.stem)


def log(msg: str) -> None:
    print(f"[sim] {msg}", file=sys.stderr, flush=True)


def _run(
    path: str,
    policy: str,
    duration: float | None,
    gain: float | None = None,
    cache: str | None = None,
    window: float | None = None,
) -> dict[str, Any]:
    """One run; with `cache`, a run of the same scenario file, policy, duration and gain found there is reused
    (an interrupted `make sim` goes on where it stopped), and a new one is saved there."""
    saved = _saved(path, policy, duration, gain, cache, window) if cache else None
    if saved is not None and saved.exists():
        return json.loads(saved.read_text())
    sc = scenarios.load(path)
    if gain is not None:
        sc = scenarios.with_gain(sc, gain)
    if window is not None:
        sc = scenarios.with_window(sc, window)
    result = simulate(sc, policy, duration=duration, progress=log)
    result["gain"] = gain
    result["window_ms"] = window
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(_clean(result)))
    return result


def _saved(
    path: str, policy: str, duration: float | None, gain: float | None, cache: str, window: float | None = None
) -> Path:
    text = Path(path).read_text()
    digest = hashlib.sha256(f"{text}|{policy}|{duration}|{gain}|{window}".encode()).hexdigest()[:16]
    return Path(cache) / f"{Path(path).stem}-{policy}-{gain}-{window}-{digest}.json"


def _cached(
    path: str, policy: str, duration: float | None, gain: float | None, cache: str, window: float | None = None
) -> dict[str, Any] | None:
    saved = _saved(path, policy, duration, gain, cache, window)
    return json.loads(saved.read_text()) if saved.exists() else None


def _clean(value: Any) -> Any:
    """JSON without NaN: a percentile of nothing is null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", nargs="*", help="scenario names (default: every shipped one)")
    p.add_argument("--out", type=Path, default=DOCS)
    p.add_argument("--duration", type=float, help="simulate only this many seconds of each (a quick look)")
    p.add_argument(
        "--durations",
        default="",
        help="NAME=SECONDS,...: simulate only that much of those scenarios (the page shows each run's duration)",
    )
    p.add_argument("--policies", default="", help="P,...: run only these policies (default: each scenario's own)")
    p.add_argument("--sensitivity-seconds", type=float, default=SENSITIVITY_SECONDS)
    p.add_argument("--cache", help="a folder where each run is saved as it ends, and reused when run again")
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="with --cache: run nothing, write the page from the runs saved there; it names the runs missing",
    )
    p.add_argument(
        "--timed-with-others",
        action="store_true",
        help="run the timed run in the pool with the others, not alone first (a machine other work shares)",
    )
    p.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite the page from docs/simulation.json (after sim.validate, say)",
    )
    args = p.parse_args(argv)

    paths = [] if args.render_only else [p for p in scenarios.shipped() if not args.only or p.stem in args.only]
    loaded = {str(path): scenarios.load(path) for path in paths}
    # A shortened or filtered invocation is that scenario with those policies and duration: the page says so.
    cut = {k: float(v) for k, v in (item.split("=") for item in args.durations.split(",") if item)}
    only_policies = [q for q in args.policies.split(",") if q]
    loaded = {
        path: sc.scaled(
            duration=cut.get(sc.name, sc.duration),
            policies=tuple(q for q in sc.policies if not only_policies or q in only_policies),
        )
        for path, sc in loaded.items()
    }
    jobs = [(str(path), policy) for path, sc in loaded.items() for policy in sc.policies]

    def dur(job: tuple[str, str]) -> float | None:
        return cut.get(loaded[job[0]].name, args.duration)

    log(f"{len(jobs)} runs ({len(paths)} scenarios) on {args.jobs} processes")
    started = time.perf_counter()
    timed = [job for job in jobs if (loaded[job[0]].name, job[1]) == TIMED]
    rest = [job for job in jobs if job not in timed]
    rest.sort(key=lambda job: -loaded[job[0]].duration)  # the longest first: they bound the pool's wall time
    if args.timed_with_others:  # first in the pool, beside the others
        timed, rest = [], timed + rest
    results = {}
    name, policy, gains = SENSITIVITY
    shaped = [str(path) for path, sc in loaded.items() if sc.name == name]
    sensitivity_jobs = [(path, policy, gain, None) for path in shaped for gain in gains]
    sensitivity_jobs += [(path, policy, None, window) for path in shaped for window in WINDOWS]
    sensitivity: list[dict[str, Any]] = []
    missing: list[str] = []
    if args.cached_only:
        if not args.cache:
            p.error("--cached-only needs --cache")
        for job in timed + rest:
            found = _cached(*job, dur(job), None, args.cache)
            if found is None:
                missing.append(f"{loaded[job[0]].name}/{job[1]}")
            else:
                results[job] = {**found, "alone": False}
        for path, p_, g, w in sensitivity_jobs:
            found = _cached(path, p_, args.duration or args.sensitivity_seconds, g, args.cache, w)
            if found is None:
                missing.append(f"sensitivity at {g:g}x" if g is not None else f"sensitivity at a {w:g} ms window")
            else:
                sensitivity.append(found)
        timed, rest = [], []
    for batch, workers in ((timed, 1), (rest, args.jobs)):
        if not batch:
            continue
        with ProcessPoolExecutor(max_workers=workers) as pool:
            seconds = args.duration or args.sensitivity_seconds
            futures = {job: pool.submit(_run, *job, dur(job), None, args.cache) for job in batch}
            later = (
                [pool.submit(_run, path, p, seconds, g, args.cache, w) for path, p, g, w in sensitivity_jobs]
                if batch is rest
                else []
            )
            for job, future in futures.items():
                results[job] = _clean(future.result())
                r = results[job]
                r["alone"] = batch is timed
                log(
                    f"done {r['scenario']}/{r['policy']}: p99 {r['latency_ms']['p99']:.0f} ms, shed"
                    f" {100 * r['shed_share']:.2f}%, {r['accelerator_hours']:.2f} accelerator-hours,"
                    f" {r['cpu_s']:.0f} s CPU"
                )
            sensitivity += [_clean(f.result()) for f in later]
    args.out.mkdir(parents=True, exist_ok=True)
    # Scenarios not run this time keep their last results (`--only` refreshes some of the page).
    json_path = args.out / "simulation.json"
    partial = args.only or args.render_only
    kept = json.loads(json_path.read_text()) if json_path.exists() and partial else {}
    runs_by_name = {name: list(by_policy.values()) for name, by_policy in kept.items()}
    for path, sc in loaded.items():
        runs_by_name[sc.name] = [results[(path, policy)] for policy in sc.policies if (path, policy) in results]
    by_scenario: list[dict[str, Any]] = []
    for path in sorted(scenarios.shipped(), key=_order):
        sc = scenarios.load(path)
        runs = runs_by_name.get(sc.name)
        if not runs:
            continue
        png = args.out / f"sim-{sc.name}.png"
        if sc.name in {s.name for s in loaded.values()} or not png.exists():
            scenario_plot(sc.name, sc.title, runs, png, budget_ms=sc.scaling.latency_budget * 1000)
        by_scenario.append(
            {"name": sc.name, "title": sc.title, "file": path.name, "scenario": sc, "runs": runs, "plot": png.name}
        )
    sensitivity_path = args.out / "sim-sensitivity.json"
    if sensitivity:
        sensitivity_path.write_text(json.dumps(sensitivity, indent=1))
    elif sensitivity_path.exists():
        sensitivity = json.loads(sensitivity_path.read_text())
    validation_path = args.out / "sim-validation.json"
    validation = json.loads(validation_path.read_text()) if validation_path.exists() else None
    json_path.write_text(json.dumps({s["name"]: {r["policy"]: r for r in s["runs"]} for s in by_scenario}, indent=1))
    (args.out / "simulation.md").write_text(
        render(by_scenario, validation, time.perf_counter() - started, sensitivity=sensitivity, missing=missing)
    )
    log(f"wrote {args.out / 'simulation.md'} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
