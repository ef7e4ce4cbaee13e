"""Every Ferry benchmark in one run: writes docs/benchmarks/served.md (and the overload and rate-limit sections
of docs/benchmarks/overload.md and rate-limits.md), docs/bench-latency.png,
docs/bench-batching.png and docs/bench-overload.png.

    .venv/bin/python -m bench.run [--quick] [--only PHASES] [--docs DIR] [--json FILE]

Phases, in this order: `ceiling` (the load generator against a trivial server), `batching` (the wide
MLP raw, then served batched and unbatched, then raw at the served mean batch), `digits` (the demo
classifiers served), `overload` (bench.overload: ramps past capacity with admission on and off),
`ratelimit` (bench.ratelimit, in-process quotas: a tenant at twice its rate limit beside another).
Order matters: the raw model loop and the generator's own ceiling are measured first, while no server
is running, so they do not compete for cores; then a fresh data dir is set up, the server is started,
and each model is swept with the open-loop generator; the overload phase starts its own servers.

`--only overload` (or `--only ratelimit`) rewrites only that section of an existing report; any other
`--only` writes a whole report in which the phases not run say so (point `--docs` elsewhere to keep docs/ as it is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import capacity, loadgen, overload, overload_report, ratelimit, raw
from bench.loadgen import LoadResult
from bench.report import (
    DIGITS_MODELS,
    MAX_ERROR_RATIO,
    P99_BUDGET_MS,
    WIDE,
    WIDE_OFF,
    Settings,
    Sweep,
    fmt,
    page,
    plot,
    ratios,
    verdict,
    write_report,
)
from bench.server import (
    HEADERS,
    ROOT,
    OtherCpu,
    Server,
    batch_totals,
    free_port,
    http_post,
    manage,
    say,
    unbind_quota,
    use_key,
)

PHASES = ("ceiling", "batching", "digits", "overload", "ratelimit")
_T0 = time.monotonic()


# -------------------------------------------------------------------------------------------- machine


def machine_facts(threads: int) -> dict[str, str]:
    import torch

    dev = raw.device()
    device = str(dev)
    if dev.type == "cuda":
        device += f" ({torch.cuda.get_device_name(dev)}, CUDA {torch.version.cuda})"

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": f"{threads} (FERRY_TORCH_THREADS={os.environ.get('FERRY_TORCH_THREADS', 'unset')})",
        "platform": platform.platform(),
        "device": f"{device} (FERRY_DEVICE={os.environ.get('FERRY_DEVICE') or 'unset'})",
    }


def command_line() -> str:
    env = "".join(f"{k}={os.environ[k]} " for k in ("FERRY_TORCH_THREADS", "FERRY_DEVICE") if os.environ.get(k))
    return env + " ".join([".venv/bin/python", "-m", "bench.run", *map(shlex.quote, sys.argv[1:])])


# -------------------------------------------------------------------------------------------- bodies


def infer_body(data: list[float]) -> bytes:
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": data}]}).encode()


def digits_body() -> bytes:
    from sklearn.datasets import load_digits

    return infer_body([float(v) for v in load_digits().data[0]])


def mlp_body() -> bytes:
    import numpy as np

    return infer_body([round(float(v), 4) for v in np.random.default_rng(0).uniform(0.0, 16.0, 64)])


# -------------------------------------------------------------------------------------------- sweeps


async def sweep(base: str, model: str, body: bytes, s: Settings) -> Sweep:
    url = f"{base}/v2/models/{model}/infer"
    out = Sweep(model)
    status, payload = http_post(url, body)
    if status != 200:
        out.error = f"sanity request answered {status}: {payload[:300]!r}"
        say(f"{model}: {out.error}")
        return out
    # A closed-loop burst only seeds the sweep's first rate; 64 in flight lets batches of 32 form.
    out.probe_rps = await capacity.probe_capacity(url, body, HEADERS, concurrency=64, duration=s.probe_seconds)
    say(f"{model}: closed-loop probe {out.probe_rps:.1f} req/s")
    if out.probe_rps <= 0:
        out.error = "no successful responses under a closed-loop probe"
        return out
    await asyncio.sleep(3.0)  # let the probe's backlog drain before timing anything

    async def before() -> tuple[float, float] | None:
        return batch_totals(base, model)

    async def after(r: LoadResult, snap: tuple[float, float] | None) -> None:
        now = batch_totals(base, model)
        if snap and now and now[1] > snap[1]:
            r.extra["mean_batch"] = (now[0] - snap[0]) / (now[1] - snap[1])
            r.extra["batches"] = now[1] - snap[1]
        if "mean_batch" in r.extra:
            say(f"{model}: mean batch {r.extra['mean_batch']:.2f} over {r.extra['batches']:.0f} batches")

    # In the smoke run the open-loop pass rate landed at 0.5-0.65 x the closed-loop probe.
    factor = 1.3
    start = max(1.0, 0.4 * out.probe_rps)
    out.best, out.steps = await capacity.find_max_rate(
        url,
        body,
        HEADERS,
        start=start,
        stop=50_000.0,  # climb until a step fails: a closed-loop probe can badly underestimate (unbatched)
        p99_budget_ms=P99_BUDGET_MS,
        max_error_ratio=MAX_ERROR_RATIO,
        duration=s.step,
        warmup=s.warmup,
        factor=factor,
        refine_steps=s.refine_steps,
        min_rate=start / factor**4,
        before_step=before,
        after_step=after,
    )
    await asyncio.sleep(2.0)
    return out


async def sweep_all(base: str, s: Settings, models: tuple[str, ...]) -> dict[str, Sweep]:
    bodies = {"digits": digits_body(), "digits-small": digits_body(), WIDE: mlp_body(), WIDE_OFF: mlp_body()}
    results: dict[str, Sweep] = {}
    for model in models:
        say(f"===== sweeping {model} =====")
        try:
            results[model] = await sweep(base, model, bodies[model], s)
        except Exception as exc:  # one broken model must not lose the others' figures
            results[model] = Sweep(model, error=f"{type(exc).__name__}: {exc}")
            say(f"{model}: {results[model].error}")
    return results


# -------------------------------------------------------------------------------------------- main


class Phases:
    """Wall time per phase, for the report: the whole run has to stay well under 15 minutes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> Phases:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t = time.monotonic()
        say(f"===== {self._name} =====")

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._name] = time.monotonic() - self._t


def setup_data_dir(env: dict[str, str], model_path: Path | None, demo: bool) -> None:
    """Migrate; build the demo models (skipped where already built) when `demo`; register the wide MLP
    batched and unbatched when `model_path` (platform models: no tenant, visible to every key); then
    `ensure_demo_user`, whose demo API key every request of the run sends (bench.server.use_key), and the
    demo tenant's quota lifted out of the way (bench.server.unbind_quota)."""
    manage(["migrate", "--noinput", "-v0"], env)
    if demo:
        manage(["build_demo_models"], env)
    if model_path is not None:
        common = ["--format", "torchscript", "--input", "input:FP32:64", "--output", "scores:FP32:10"]
        common += ["--task", "classification"]
        for name, max_batch, delay in ((WIDE, "32", "10"), (WIDE_OFF, "1", "0")):
            manage(["register_model", name, str(model_path), *common, "--max-batch-size", max_batch,
                    "--max-queue-delay-ms", delay], env)  # fmt: skip
    manage(["ensure_demo_user"], env)
    unbind_quota(env)
    if use_key(Path(env["FERRY_DATA_DIR"])) is None:
        raise RuntimeError("ensure_demo_user wrote no demo API key")


def parse_only(value: str | None) -> tuple[str, ...]:
    if not value:
        return PHASES
    chosen = [p.strip() for p in value.split(",") if p.strip()]
    unknown = [p for p in chosen if p not in PHASES]
    if unknown:
        raise SystemExit(f"--only: unknown phase {unknown[0]!r}; choose from {', '.join(PHASES)}")
    return tuple(p for p in PHASES if p in chosen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short steps: a smoke run, not numbers to publish")
    p.add_argument("--only", help=f"comma-separated phases to run, of {', '.join(PHASES)} (default: all)")
    p.add_argument("--threads", type=int, help="set FERRY_TORCH_THREADS for raw and served runs alike")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the report and plots go")
    p.add_argument("--json", type=Path, help="also write every measurement as JSON here")
    p.add_argument("--data-dir", type=Path, help="use (and keep) this FERRY_DATA_DIR; built models are reused")
    p.add_argument("--keep-data", action="store_true", help="keep the temporary FERRY_DATA_DIR")
    p.add_argument("--step", type=float, help="seconds measured per sweep step (default 8, quick 3)")
    p.add_argument(
        "--deadline-ms",
        type=int,
        help="overload: each request carries this deadline (default: none, the platform's 300 ms budget applies)",
    )
    p.add_argument("--ramp-step", type=float, help="overload: seconds per ramp step (default 8, quick 2)")
    p.add_argument("--tiers", help="overload: priority:share pairs, e.g. 1:0.25,2:0.75 (the default) or 1:1")
    a = p.parse_args(argv)
    only = parse_only(a.only)
    if a.threads is not None:
        os.environ["FERRY_TORCH_THREADS"] = str(a.threads)
    s = Settings.for_mode(a.quick)
    if a.step:
        s.step, s.ceiling_step = a.step, min(s.ceiling_step, a.step)
    o = overload.OverloadSettings.for_mode(a.quick)
    if a.deadline_ms:
        o.deadline_ms, o.client_deadline = a.deadline_ms, True
    if a.ramp_step:
        o.step_s = a.ramp_step
    if a.tiers:
        try:
            o.tiers = tuple((int(t), float(w)) for t, w in (pair.split(":") for pair in a.tiers.split(",")))
        except ValueError:
            p.error("--tiers: expected priority:share pairs such as 1:0.25,2:0.75")
    phase = Phases()
    facts = machine_facts(raw.configure_threads())
    say(f"phases: {', '.join(only)}{' (quick)' if a.quick else ''}; {facts}")
    data_dir = a.data_dir.resolve() if a.data_dir else Path(tempfile.mkdtemp(prefix="ferry-bench-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    say(f"FERRY_DATA_DIR={data_dir}")
    raw_rows: list[raw.RawRow] = []
    ceiling: LoadResult | None = None
    ceiling_steps: list[LoadResult] = []
    sweeps: dict[str, Sweep] = {}
    over: dict[str, Any] | None = None
    ok = False
    try:
        model_path = None
        if "batching" in only:
            from bench.models import build_wide_mlp, save_torchscript

            with phase("raw model throughput (no server running)"):
                model_path = save_torchscript(build_wide_mlp(), data_dir / "wide-mlp.pt")
                with OtherCpu() as other:
                    raw_rows = raw.measure(model_path, [64], seconds=s.raw_seconds)
            facts["other processes' CPU during raw"] = _cores(other.cores)
        if "ceiling" in only:
            with phase("load generator ceiling (no server running)"):
                ceiling, ceiling_steps = loadgen.arun(
                    capacity.measure_ceiling(p99_budget_ms=P99_BUDGET_MS, max_error_ratio=MAX_ERROR_RATIO,
                                            duration=s.ceiling_step, warmup=s.warmup, refine_steps=s.refine_steps)
                )  # fmt: skip
        demo = "digits" in only or "overload" in only or "ratelimit" in only
        with phase("data dir: migrate" + (", build_demo_models" if demo else "")
                   + (", register_model x2" if model_path else "")):  # fmt: skip
            setup_data_dir(env, model_path, demo)
        served = (*(DIGITS_MODELS if "digits" in only else ()), *((WIDE, WIDE_OFF) if model_path else ()))
        if served:
            with Server(env, free_port(), data_dir / "server.log") as server:
                with phase("server start"):
                    server.wait_ready(served)
                with phase("served sweeps"), OtherCpu(server.pids()) as other:
                    sweeps = loadgen.arun(sweep_all(server.base, s, served))
            facts["other processes' CPU during sweeps"] = _cores(other.cores, "besides server and generator")
        wide = sweeps.get(WIDE)
        if model_path is not None and wide is not None and wide.mean_batch:
            # The server has stopped: time the raw model at the batch size the server actually formed.
            size = round(wide.mean_batch)
            if size not in {r.batch_size for r in raw_rows}:
                with phase(f"raw model throughput at the served mean batch {size} (server stopped)"):
                    raw_rows = sorted(
                        raw_rows + raw.measure(model_path, [64], [size], seconds=s.raw_seconds),
                        key=lambda r: r.batch_size,
                    )
        if "overload" in only:
            digits = sweeps.get("digits")
            known = digits.best.achieved_rate if digits and digits.best else None
            with phase("overload ramps (admission on, off; digits)"):
                over = overload.run_overload(env, data_dir, o, fast_capacity=known)

        limits: list[str] = []
        if "ratelimit" in only:
            with phase("rate limits: two tenants, one at twice its limit (in-process quotas)"):
                started = time.monotonic()
                results = ratelimit.run_all(env, data_dir)
                limits = ratelimit.section(results, command_line(), time.monotonic() - started)

        rt = ratios(raw_rows, sweeps)
        page(a.docs, "served").parent.mkdir(parents=True, exist_ok=True)
        if only == ("ratelimit",):
            ratelimit.splice(page(a.docs, "ratelimit"), limits)
        elif only == ("overload",) and over is not None:
            overload_report.splice(page(a.docs, "overload"), overload_report.section(over, o, command_line()))
            overload_report.plot(a.docs, over)
        else:
            # The served page is this run's whole; the overload and rate-limit sections go into their own pages,
            # where every other writer's section (bench.compare, auth_cost, packing, redis_hop, fleet200, and the
            # hand-kept shadow, opcodes, warm-tier and fleet-page runs) stays as it was: nothing to carry over.
            if over is not None:
                overload_report.splice(page(a.docs, "overload"), overload_report.section(over, o, command_line()))
            if limits:
                ratelimit.splice(page(a.docs, "ratelimit"), limits)
            write_report(page(a.docs, "served"), facts, s, ceiling, ceiling_steps, raw_rows, sweeps, rt,
                         phase.seconds, a.quick, command_line(), time.monotonic() - _T0, only)  # fmt: skip
            plot(a.docs, raw_rows, sweeps)
            if over is not None:
                overload_report.plot(a.docs, over)
        if a.json:
            a.json.write_text(json.dumps(_as_json(facts, ceiling, ceiling_steps, raw_rows, sweeps, rt, over),
                                         indent=2, default=_plain))  # fmt: skip
            say(f"wrote {a.json}")
        _summary(ceiling, sweeps, rt, over)
        ok = True
    finally:
        if ok and not a.keep_data and not a.data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            say(f"data dir kept: {data_dir}")
    say(f"done in {(time.monotonic() - _T0) / 60:.1f} min")
    return 0


def _plain(v: object) -> object:
    if hasattr(v, "to_dict"):
        return v.to_dict()  # type: ignore[union-attr]
    if hasattr(v, "tolist"):
        return v.tolist()  # type: ignore[union-attr]
    return str(v)


def _cores(cores: float | None, note: str = "") -> str:
    if cores is None:
        return "n/a"
    if cores > 0.2:
        say(f"WARNING: other processes used {cores:.2f} cores {note}: figures may be depressed")
    return f"{cores:.2f} cores {note} (should be ~0)".replace("  ", " ")


def _as_json(
    facts: dict[str, str], ceiling: LoadResult | None, ceiling_steps: list[LoadResult],
    raw_rows: list[raw.RawRow], sweeps: dict[str, Sweep], rt: dict[str, Any], over: dict[str, Any] | None,
) -> dict[str, Any]:  # fmt: skip
    served = {
        m: {"best": sw.best.to_dict() if sw.best else None, "error": sw.error, "probe_rps": sw.probe_rps,
            "steps": [r.to_dict() for r in sw.steps]}
        for m, sw in sweeps.items()
    }  # fmt: skip
    return {
        "machine": facts, "command": command_line(), "ceiling": ceiling.to_dict() if ceiling else None,
        "ceiling_steps": [r.to_dict() for r in ceiling_steps], "raw": [r.to_dict() for r in raw_rows],
        "ratios": rt, "served": served, "overload": over,
    }  # fmt: skip


def _summary(ceiling: LoadResult | None, sweeps: dict[str, Sweep], rt: dict[str, Any],
             over: dict[str, Any] | None) -> None:  # fmt: skip
    say("===== summary =====")
    say(f"generator ceiling: {fmt(ceiling.achieved_rate if ceiling else None, ',.0f')} req/s")
    for m, sw in sweeps.items():
        b = sw.best
        say(
            f"{m}: "
            + (
                f"{b.achieved_rate:,.1f} req/s p50 {b.p50_ms:.1f} ms p99 {b.p99_ms:.1f} ms mean batch "
                f"{fmt(sw.mean_batch, '.2f')}"
                if b
                else f"n/a {sw.error}"
            )
        )
    if sweeps:  # the ratios come from the sweeps: a run of other phases only (--only overload) has none to judge
        efficiency, speedup = verdict(rt.get("efficiency")), verdict(rt.get("speedup_ratio"))
        say(f"served/raw(mean batch): {efficiency}; speedup ratio: {speedup}")
    for r in (over or {}).get("ramps", []):
        for check, measured, target, passed in overload_report.checks(r):
            if passed is not None or r.admission:
                say(f"{r.label}: {check}: {measured} [{target}] {overload_report._ok(passed)}")


if __name__ == "__main__":
    sys.exit(main())
