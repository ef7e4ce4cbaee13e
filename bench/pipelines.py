"""A cascade pipeline against its big model alone: `digits-small`, then `digits` only where the small model is
unsure (its top softmax score under 0.9), measured on the demo models in one run.

    .venv/bin/python -m bench.pipelines [--rate R] [--seconds S] [--overload-models digits,digits-wide]
        [--only-overload] [--record docs/benchmarks/pipelines.md]

A fresh data dir (embedded mode: one process, the node in it); the demo models trained as
`manage.py build_demo_models` trains them (serving.demo, its artifact cache reused: demo_cache_dir), platform
models; the pipeline registered through `serving.pipelines.register_pipeline` with `digits` as its fallback.
`--overload-models` names the big models of phase 3: `digits` (the cascade above) and `digits-wide`
(compute-bound: a second cascade, `digits-wide-cascade`, `digits-small` then `digits-wide` where unsure, its
fallback `digits-wide`); each ramp's model falls back to `digits-small`. `--only-overload` skips phases 1 and
2; with `--record` it rewrites the page's overload section only.

1. Accuracy: every held-out image (scikit-learn's split, serving.demo.digits_data) sent once to `digits` and
   once to the pipeline, one request each; the share of rows that reached `digits` is the server's own count
   (each answer's `x-ferry-pipeline-steps` header).
2. Latency at one offered rate, open loop (bench.loadgen), alternating rounds: `digits` alone; the pipeline
   with an image the small model is sure of (one step); the pipeline with one it is unsure of (both steps).
   A body is fixed per run, so the two pipeline rows bound the cascade's latency from both sides.
3. Overload, as bench.overload ramps a model (its pieces: `ramp`, `per_step`; capacity.find_max_rate): the
   pipeline's capacity first (the highest open-loop rate with p99 < 300 ms and < 0.1% errors, searched up
   from 100 req/s with the ramp's own mix, below), then an open-loop ramp of `--multipliers` x that
   capacity, `--overload-step` s each, every request a labelled sample of scikit-learn's digits (1,797,
   drawn at random, so the small model's sure and unsure images mixed as in the search) with
   no client deadline: the platform's budget (FERRY_LATENCY_BUDGET_MS, 300 ms) applies. A step's rate is
   capped at `--overload-max-rate`, what the generator can send on the box it shares with the server. Per
   step: offered, sent, answered by the pipeline, by its fallback (`digits`), shed (503, and how many of
   those carried Retry-After), 504, the admitted p99 (every 200, from its scheduled send time) and the
   goodput (200s within 300 ms); the server's own pipeline counters; the load average. For each big model of
   `--overload-models`: its cascade's ramp, then its own. The section's table marks each ramp PASS or FAIL
   against issue 23's acceptance: admitted p99 < 300 ms at every step, every 503 with Retry-After, and every
   step past 1x shed or fell back (the search saw the mix the ramp sends, so N x capacity is N x the load
   the cascade could take).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import orjson

from bench import capacity, loadgen
from bench.overload import OverloadSettings, digits_requests, ramp
from bench.report import commit, splice_section
from bench.run import machine_facts
from bench.server import HEADERS, Server, counters, free_port, manage, say, scrape, unbind_quota, use_key

PIPELINE = "digits-cascade"
# The overload phase's cascades, by their big model: `digits` (~2 ms a batch, bound by the server's one process
# under overload: issue 19) and `digits-wide` (compute-bound, where admission decides), each beside its model.
PIPELINES = {"digits": PIPELINE, "digits-wide": "digits-wide-cascade"}
BUDGET_MS = 300  # the platform's latency budget this run sets (FERRY_LATENCY_BUDGET_MS)
MULTIPLIERS = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 1.0)
PIPELINE_COUNTERS = (
    "ferry_pipeline_requests_total",
    "ferry_pipeline_fallbacks_total",
    "ferry_shed_total",
    "ferry_fallbacks_total",  # a step answered by its model's fallback (digits: digits-small)
)
START, END = "<!-- pipelines:start -->", "<!-- pipelines:end -->"  # bench.report.PAGES["pipelines"]
# The overload phase's own section: `--only-overload --record` rewrites it alone, the rest of the page kept.
OVERLOAD_START, OVERLOAD_END = "<!-- pipelines-overload:start -->", "<!-- pipelines-overload:end -->"
UNSURE = 0.9


def spec(big: str) -> dict:
    """`digits-small`, then `big` for the rows it is unsure of."""
    return {
        "sequence": [
            {"model": "digits-small", "name": "small"},
            {
                "switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": UNSURE},
                "then": {"model": big, "name": "big"},
                "name": "unsure",
            },
        ]
    }


SPEC = spec("digits")


def setup(bigs: list[str]) -> str:
    """The manage.py shell script: the demo models (from serving.demo's cache when trained earlier by the same
    code: demo_cache_dir, FERRY_DEMO_MODEL_CACHE), each big model falling back to `digits-small` as
    serving.demo.FALLBACKS has it, and one cascade per big model with that model as its fallback."""
    names = ["digits-small", *dict.fromkeys(["digits", *bigs])]
    pipes = {big: (PIPELINES[big], spec(big)) for big in dict.fromkeys(["digits", *bigs])}
    return f"""
from serving.demo import DEMO_MODELS, demo_cache_dir, train_and_register
from serving.models import Model
from serving.pipelines import register_pipeline
for demo in DEMO_MODELS:
    if demo.name in {names!r}:
        train_and_register(demo, demo.build, print, cache=demo_cache_dir())
small = Model.objects.get(name="digits-small")
for big, (name, spec) in {pipes!r}.items():
    model = Model.objects.get(name=big)
    model.fallback = small
    model.save(update_fields=["fallback", "updated_at"])
    register_pipeline(name=name, spec=spec, tenant=None, visibility="public", fallback=big)
"""


def body(row: np.ndarray) -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]})


def answer(base: str, model: str, row: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
    """The scores `model` answers for one image, and the rows each pipeline step ran for it (a pipeline's
    `x-ferry-pipeline-steps` header; empty for a model)."""
    request = urllib.request.Request(f"{base}/v2/models/{model}/infer", data=body(row), headers=HEADERS, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            text, steps = resp.read(), resp.headers.get("x-ferry-pipeline-steps", "")
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{model} answered {exc.code}: {exc.read()[:200]!r}") from None
    out = orjson.loads(text)["outputs"][0]
    ran = {k: int(v) for k, _, v in (part.partition("=") for part in steps.split(",") if part)}
    return np.asarray(out["data"], dtype=np.float32), ran


def softmax_max(scores: np.ndarray) -> float:
    e = np.exp(scores - scores.max())
    return float((e / e.sum()).max())


def accuracy(base: str) -> dict:
    from serving.demo import digits_data

    _, x_test, _, y_test = digits_data()
    started = time.monotonic()
    right = {"digits": 0, PIPELINE: 0, "digits-small": 0}
    reached: dict[str, int] = {}
    for x, y in zip(x_test, y_test, strict=True):
        for model in right:
            scores, ran = answer(base, model, x)
            right[model] += int(np.argmax(scores) == y)
            for step, rows in ran.items():
                reached[step] = reached.get(step, 0) + rows
    n = len(y_test)
    say(f"accuracy over {n} images in {time.monotonic() - started:.0f} s: {right}, rows per step {reached}")
    return {"n": n, "right": right, "reached": reached}


def pick_rows(base: str) -> tuple[np.ndarray, np.ndarray]:
    """An image digits-small is sure of, and one it is not."""
    from serving.demo import digits_data

    _, x_test, _, _ = digits_data()
    sure = unsure = None
    for x in x_test:
        top = softmax_max(answer(base, "digits-small", x)[0])
        if top >= UNSURE and sure is None:
            sure = x
        if top < UNSURE and unsure is None:
            unsure = x
        if sure is not None and unsure is not None:
            return sure, unsure
    raise RuntimeError("digits-small is sure of every image, or of none")


def run_phase(base: str, model: str, payload: bytes, rate: float, seconds: float) -> loadgen.LoadResult:
    return loadgen.arun(
        loadgen.run(f"{base}/v2/models/{model}/infer", payload, dict(HEADERS), rate, seconds, progress=False)
    )


async def search_up(base: str, model: str, payload: bytes | list[bytes]) -> float:
    """The capacity as bench.overload's `measure_capacity` defines it (capacity.find_max_rate: p99 < 300 ms,
    < 0.1% errors, a fallback's answer one of them, 4 s steps, x1.25), but searched up from 100 req/s. Its
    closed-loop seed counts fast answers at 32 in flight, and a first open-loop step far past capacity left
    the server too far behind for the search's steps down to pass (a run of 2026-12-02 07:28 UTC found no
    rate)."""
    best, _ = await capacity.find_max_rate(
        f"{base}/v2/models/{model}/infer", payload, HEADERS, start=100.0, stop=5000.0, p99_budget_ms=300.0,
        max_error_ratio=0.001, duration=4.0, warmup=0.5, factor=1.25, refine_steps=1, min_rate=10.0,
        cooldown=1.0, cooldown_after_fail=3.0, fallback_is_error=True,
    )  # fmt: skip
    if best is None:
        raise RuntimeError(f"{model}: no rate passed the capacity search")
    say(f"{model}: capacity {best.achieved_rate:.1f} req/s (p99 {best.p99_ms:.1f} ms)")
    return best.achieved_rate


RAMP_TIERS = ((1, 1.0),)  # one priority tier: the ramp's requests and the search's are the same bodies


def ramp_mix(base: str, model: str) -> list[bytes]:
    """The bodies the ramp sends (bench.overload.digits_requests, one tier, no deadline), in a seeded random
    order: what the capacity search offers, so that the ramp's multipliers are of the load it measured."""
    bodies = digits_requests(f"{base}/v2/models/{model}/infer", None, RAMP_TIERS).bodies
    order = np.random.default_rng(0).permutation(len(bodies))
    return [bodies[i] for i in order]


def overload_ramp(server: Server, model: str, a: argparse.Namespace) -> dict:
    """`model`'s capacity (the pipeline's, or a model's), then the ramp past it (the module docstring, 3.)."""
    s = OverloadSettings(
        step_s=a.overload_step, capacity_step_s=4.0, probe_s=2.0, deadline_ms=BUDGET_MS,
        tiers=RAMP_TIERS, multipliers=tuple(a.multipliers), settle_s=2.0,
    )  # fmt: skip
    load_before = os.getloadavg()
    cap = loadgen.arun(search_up(server.base, model, ramp_mix(server.base, model)))
    top = a.overload_max_rate / cap
    if max(s.multipliers) > top:  # the generator shares the cores: past this rate it cannot send on time
        say(f"capacity {cap:.0f} req/s: steps capped at {a.overload_max_rate:g} req/s ({top:.2f}x)")
        s.multipliers = tuple(round(min(m, top), 2) for m in s.multipliers)
    before = scrape(server.base)
    source = "measured here (the ramp's mix)"
    res = loadgen.arun(ramp(server, model, cap, source, True, s, model, client_deadline=False))
    after = scrape(server.base)
    b, c = counters(before, PIPELINE_COUNTERS), counters(after, PIPELINE_COUNTERS)
    server_counts = {}
    for key, value in c.items():
        name, labels = key
        lab = dict(labels)
        if lab.get("model") in (*PIPELINES.values(), *PIPELINES, "digits-small") and value - b.get(key, 0.0):
            text = ",".join(f"{k}={v}" for k, v in labels if k != "version")
            server_counts[f"{name}{{{text}}}"] = value - b.get(key, 0.0)
    return {
        "model": model, "capacity": cap, "result": res.to_dict(), "server": server_counts,
        "load_before": load_before, "load_after": os.getloadavg(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="offered req/s of the latency rounds")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each target, alternating")
    parser.add_argument("--multipliers", type=float, nargs="+", default=list(MULTIPLIERS), help="x capacity")
    parser.add_argument("--overload-step", type=float, default=5.0, help="seconds per overload step")
    parser.add_argument("--overload-max-rate", type=float, default=3000.0, help="cap on a step's req/s")
    parser.add_argument(
        "--overload-models", default="digits", help="big models, comma-separated: each one's cascade, then it alone"
    )
    parser.add_argument(
        "--only-overload", action="store_true", help="skip phases 1 and 2 (--record: the overload section only)"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="web processes (serve --workers N: beside a node host when N > 1)"
    )
    parser.add_argument("--record", type=Path, help="write the page (docs/benchmarks/pipelines.md)")
    a = parser.parse_args(argv)
    if a.workers < 1:
        parser.error("--workers: at least 1")
    if a.workers > 1 and not a.only_overload:
        parser.error("--workers N > 1 runs the overload phase only: add --only-overload")
    bigs = [m.strip() for m in a.overload_models.split(",") if m.strip()]
    if not bigs or any(m not in PIPELINES for m in bigs):
        parser.error(f"--overload-models: a comma-separated list of {', '.join(PIPELINES)}")
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-pipeline-bench-"))
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    env["FERRY_LATENCY_BUDGET_MS"] = str(BUDGET_MS)
    env.pop("REDIS_URL", None)
    facts = machine_facts(int(os.environ.get("FERRY_TORCH_THREADS", "0") or 0))
    rounds: list[dict] = []
    overload: list[dict] = []
    acc: dict = {}
    try:
        manage(["migrate", "--noinput", "-v0"], env)
        manage(["shell", "-c", setup(bigs)], env)
        manage(["ensure_demo_user"], env)
        unbind_quota(env)
        if use_key(data_dir) is None:
            raise RuntimeError("ensure_demo_user wrote no demo API key")
        launcher = [sys.executable, "manage.py", "serve", *(["--workers", str(a.workers)] if a.workers > 1 else [])]
        with Server(env, free_port(), data_dir / "server.log", launcher=launcher) as server:
            server.wait_ready(("digits-small", *dict.fromkeys(["digits", *bigs])))
            if not a.only_overload:
                acc = accuracy(server.base)
            sure, unsure = pick_rows(server.base)
            targets = [("digits alone", "digits", body(unsure)), ("pipeline, sure image", PIPELINE, body(sure))]
            targets.append(("pipeline, unsure image", PIPELINE, body(unsure)))
            for round_no in range(0 if a.only_overload else a.rounds):
                for label, model, payload in targets:
                    r = run_phase(server.base, model, payload, a.rate, a.seconds)
                    say(f"{label} round {round_no + 1}: p50 {r.p50_ms:.2f} p99 {r.p99_ms:.2f} ms, ok {r.ok}/{r.count}")
                    rounds.append({"label": label, "round": round_no + 1, **r.to_dict()})
            # Each cascade, then its big model alone the same way: what a model does under the same overload.
            for big in bigs:
                overload += [overload_ramp(server, m, a) for m in (PIPELINES[big], big)]
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    elapsed = time.monotonic() - started
    start, end = overload_markers(a.workers)
    over = "\n".join([start, *overload_page(overload, facts, a, elapsed), end])
    if a.only_overload:
        print(over)
        if a.record:
            splice_section(a.record, start, end, over)
        return 0
    section = "\n".join([START, *page(acc, rounds, facts, a, elapsed), END])
    print(section + "\n\n" + over)
    if a.record:
        splice_section(a.record, START, END, section)
        splice_section(a.record, OVERLOAD_START, OVERLOAD_END, over)
    return 0


def overload_lines(overload: dict, a: argparse.Namespace) -> list[str]:
    res, cap, model = overload["result"], overload["capacity"], overload["model"]
    before, after = overload["load_before"], overload["load_after"]
    is_pipeline = model in PIPELINES.values()
    big = next((b for b, name in PIPELINES.items() if name == model), model)
    rows = []
    for r in res["steps"]:
        shed = round(r["shed_rps"] * r["seconds"])
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["shed_by_reason"].items())) or "-"
        rows.append(
            f"| {r['multiplier']:g}x | {r['offered_rps']:.0f} | {r['sent_rps']:.0f} | {r['primary_rps']:.0f}"
            f" | {r['fallback_rps']:.0f} | {r['shed_rps']:.0f} | {r['shed_with_retry_after']}/{shed} | {reasons}"
            f" | {r['t504_rps']:.0f} | {r['client_rps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f}"
            f" | {r['goodput_rps']:.0f} |"
        )
    worst = max((r["p99_ms"] for r in res["steps"] if r["p99_ms"] == r["p99_ms"]), default=float("nan"))
    what = f"the pipeline `{model}` (`digits-small`, then `{big}`)" if is_pipeline else f"`{model}` alone"
    fallback = f"the pipeline's fallback (`{big}`)" if is_pipeline else "its fallback (`digits-small`)"
    return [
        f"### Overload: {what}, a ramp to {max(r['multiplier'] for r in res['steps']):g}x its capacity",
        "",
        f"Capacity of `{model}` (p99 < 300 ms, < 0.1% errors, open loop, the ramp's mix of digits):"
        f" **{cap:.0f} req/s**. Then {a.overload_step:g} s per step, open loop, labelled digits drawn at"
        f" random, no client deadline (the platform's {BUDGET_MS} ms budget), one priority tier; steps capped at"
        f" {a.overload_max_rate:g} req/s. Load average (1, 5, 15 min) before the capacity search"
        f" {', '.join(f'{x:.2f}' for x in before)}, after the ramp {', '.join(f'{x:.2f}' for x in after)}; the"
        f" generator used {res['generator_cores']:.2f} cores, at most {res['conns_max']} connections.",
        "",
        f"| step | offered/s | sent/s | `{model}` 200/s | fallback 200/s | 503/s | 503s with Retry-After / all"
        " | 503 reasons (requests) | 504/s | client error/s | admitted p50 ms | admitted p99 ms | goodput/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Worst admitted p99 over the steps: **{worst:.1f} ms** (every 200, {fallback}'s included, timed from its"
        " scheduled send). Goodput: 200s within 300 ms. A 503's reason is read from its body (bench.ramp's"
        " `shed_reason`: `deadline` is admission's estimate, `frontend` the front door's saturation shed). A"
        " client error is the generator's own (its 5 s timeout, a connection lost, a send it could not make on"
        " time).",
        "",
        (
            "The server's counters over the ramp"
            # /metrics answers for every web process, whichever the kernel hands a scrape to
            # (serving.dataplane.metrics.process_set); before it did, a run of 2026-12-03 printed a negative
            # difference of two scrapes that reached two processes.
            + (f" (all {a.workers} web processes')" if a.workers > 1 else "")
            + ": "
            + (", ".join(f"`{k}` {v:.0f}" for k, v in sorted(overload["server"].items())) or "none")
        ),
        "",
    ]


def command_line(a: argparse.Namespace) -> str:
    return (
        f"python -m bench.pipelines --rate {a.rate:g} --seconds {a.seconds:g} --rounds {a.rounds}"
        f" --multipliers {' '.join(f'{m:g}' for m in a.multipliers)} --overload-step {a.overload_step:g}"
        f" --overload-max-rate {a.overload_max_rate:g} --overload-models {a.overload_models}"
        + (" --only-overload" if a.only_overload else "")
        + (f" --workers {a.workers}" if a.workers > 1 else "")
    )


def overload_markers(workers: int) -> tuple[str, str]:
    """The overload section's markers: one web process's, or its own section per count of web processes."""
    if workers == 1:
        return OVERLOAD_START, OVERLOAD_END
    return f"<!-- pipelines-overload-{workers}w:start -->", f"<!-- pipelines-overload-{workers}w:end -->"


def verdict(overload: dict) -> tuple[float, bool, bool, bool]:
    """A ramp against issue 23's acceptance: its worst admitted p99 (NaN when a step had no 200: a fail),
    whether every step's admitted p99 was under the budget, whether every 503 carried Retry-After, and
    whether every step past 1x shed or fell back (the capacity was searched with the ramp's mix)."""
    steps = overload["result"]["steps"]
    p99s = [r["p99_ms"] for r in steps]
    worst = float("nan") if any(x != x for x in p99s) else max(p99s, default=float("nan"))
    under = worst == worst and worst < BUDGET_MS
    retry = all(r["shed_with_retry_after"] == round(r["shed_rps"] * r["seconds"]) for r in steps)
    over = [r for r in steps if r["multiplier"] > 1.0]
    relieved = bool(over) and all(r["shed_rps"] > 0 or r["fallback_rps"] > 0 for r in over)
    return worst, under, retry, relieved


def overload_page(overload: list[dict], facts: dict, a: argparse.Namespace, elapsed: float) -> list[str]:
    """The overload phase's section: its command, date, commit, machine, a PASS/FAIL per target, the ramps."""

    def mark(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    rows = []
    for o in overload:
        worst, under, retry, relieved = verdict(o)
        kind = "pipeline" if o["model"] in PIPELINES.values() else "model alone"
        rows.append(
            f"| `{o['model']}` | {kind} | {o['capacity']:.0f} | {worst:.1f} | {mark(under)} | {mark(retry)}"
            f" | {mark(relieved)} | **{mark(under and retry and relieved)}** |"
        )
    where = (
        f", {a.workers} web processes beside a node host (`serve --workers {a.workers}`: the pipelines run in the"
        " web processes, each step a request to the host's queues)"
        if a.workers > 1
        else " (one process: `serve`, the node in it)"
    )
    return [
        f"## Pipelines under overload: each cascade beside its big model{where}",
        "",
        f"Generated by `{command_line(a)}` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC} in commit {commit()}"
        f" in {elapsed / 60:.1f} min (the whole run). Load average (1, 5, 15 min) at the end"
        f" {', '.join(f'{x:.2f}' for x in os.getloadavg())} on {facts.get('nproc', '?')} cores; each ramp's own"
        " is in its table. The method: `bench/pipelines.py`'s docstring, 3.",
        "",
        "Issue 23's acceptance, per ramp: under overload a pipeline sheds or falls back as a model does, its"
        f" admitted p99 < {BUDGET_MS} ms. A row passes when the admitted p99 (every 200, fallbacks' included, from"
        f" its scheduled send) is under {BUDGET_MS} ms at every step, every 503 carried Retry-After, and every"
        " step past 1x shed or fell back. The capacity is searched with the mix of digits the ramp sends (most"
        " stop at `digits-small`), so a step of N x capacity offers N x what the cascade was measured to take."
        " The models' rows are the comparison.",
        "",
        f"| target | kind | capacity req/s | worst admitted p99 ms | p99 < {BUDGET_MS} ms every step"
        " | every 503 with Retry-After | shed or fell back past 1x | acceptance |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(line for o in overload for line in overload_lines(o, a)),
    ]


def loads() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def page(acc: dict, rounds: list[dict], facts: dict, a: argparse.Namespace, elapsed: float) -> list[str]:
    n, right, reached = acc["n"], acc["right"], acc["reached"]
    share = reached.get("big", 0.0) / reached["small"] if reached.get("small") else float("nan")
    command = command_line(a)
    lines = [
        "# Pipelines: a cheap model, then the big one where it is unsure",
        "",
        f"Generated by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC} in commit {commit()}"
        f" in {elapsed / 60:.1f} min; load average (1, 5, 15 min) at the end {loads()}, the run's own load"
        " included. The latencies are this machine's at that time, not a capacity claim. The method:"
        " `bench/pipelines.py`'s docstring.",
        "",
        "The pipeline `digits-cascade` is `digits-small`, then a switch: rows whose top softmax score is under"
        f" {UNSURE} go to `digits` (3 x 1536 MLP), the others keep the small model's answer. Each step is an"
        " ordinary request to its model's queue (`serving/dataplane/gateway/pipeline.py`).",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts.items()),
        "",
        f"## Accuracy over the {n} held-out images (one request each)",
        "",
        "| target | right | accuracy |",
        "|---|---|---|",
        *(f"| `{m}` | {r} | {r / n:.4f} |" for m, r in right.items()),
        "",
        f"Rows that reached `digits` through the pipeline: {reached.get('big', 0):.0f} of {reached.get('small', 0):.0f}"
        f" (**{share:.1%}**), counted by the server (each answer's `x-ferry-pipeline-steps` header).",
        "",
        f"## Latency at {a.rate:g} req/s offered (open loop, {a.seconds:g} s per round, rounds alternating)",
        "",
        "| target | round | p50 ms | p99 ms | ok / sent |",
        "|---|---|---|---|---|",
        *(
            f"| {r['label']} | {r['round']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['ok']}/{r['count']} |"
            for r in rounds
        ),
        "",
        "Percentiles cover every request, errors included. The sure image runs one step; the unsure one runs"
        " both, one after the other, each batched with the other traffic of its model. Overload: the next"
        " section.",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
