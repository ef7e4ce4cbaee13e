"""A cascade pipeline against its big model alone: `digits-small`, then `digits` only where the small model is
unsure (its top softmax score under 0.9), measured on the demo models in one run.

    .venv/bin/python -m bench.pipelines [--rate R] [--seconds S] [--overload R] [--record docs/benchmarks/pipelines.md]

A fresh data dir (embedded mode: one process, the node in it); the two demo models trained as
`manage.py build_demo_models` trains them (serving.demo), platform models; the pipeline registered through
`serving.pipelines.register_pipeline` with `digits` as its fallback.

1. Accuracy: every held-out image (scikit-learn's split, serving.demo.digits_data) sent once to `digits` and
   once to the pipeline, one request each; the share of rows that reached `digits` is the server's own count
   (each answer's `x-ferry-pipeline-steps` header).
2. Latency at one offered rate, open loop (bench.loadgen), alternating rounds: `digits` alone; the pipeline
   with an image the small model is sure of (one step); the pipeline with one it is unsure of (both steps).
   A body is fixed per run, so the two pipeline rows bound the cascade's latency from both sides.
3. Overload: each target offered `--overload` req/s, past what the process serves: what is answered 200,
   what is shed (503), and the p99 of every request.
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

from bench import loadgen
from bench.report import commit, splice_section
from bench.run import machine_facts
from bench.server import HEADERS, Server, free_port, manage, say, unbind_quota, use_key

PIPELINE = "digits-cascade"
START, END = "<!-- pipelines:start -->", "<!-- pipelines:end -->"  # bench.report.PAGES["pipelines"]
UNSURE = 0.9
SPEC = {
    "sequence": [
        {"model": "digits-small", "name": "small"},
        {
            "switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": UNSURE},
            "then": {"model": "digits", "name": "big"},
            "name": "unsure",
        },
    ]
}
SETUP = f"""
from serving.demo import DEMO_MODELS, train_and_register
from serving.models import Model
from serving.pipelines import register_pipeline
for demo in DEMO_MODELS[:2]:
    train_and_register(demo, demo.build, print)
small, big = Model.objects.get(name="digits-small"), Model.objects.get(name="digits")
big.fallback = small
big.save(update_fields=["fallback", "updated_at"])
register_pipeline(name={PIPELINE!r}, spec={SPEC!r}, tenant=None, visibility="public", fallback="digits")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="offered req/s of the latency rounds")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each target, alternating")
    parser.add_argument("--overload", type=float, default=3000.0, help="offered req/s of the overload phase")
    parser.add_argument("--record", type=Path, help="write the page (docs/benchmarks/pipelines.md)")
    a = parser.parse_args(argv)
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-pipeline-bench-"))
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    env.pop("REDIS_URL", None)
    facts = machine_facts(int(os.environ.get("FERRY_TORCH_THREADS", "0") or 0))
    rounds: list[dict] = []
    overload: list[dict] = []
    try:
        manage(["migrate", "--noinput", "-v0"], env)
        manage(["shell", "-c", SETUP], env)
        manage(["ensure_demo_user"], env)
        unbind_quota(env)
        if use_key(data_dir) is None:
            raise RuntimeError("ensure_demo_user wrote no demo API key")
        with Server(env, free_port(), data_dir / "server.log") as server:
            server.wait_ready(("digits-small", "digits"))
            acc = accuracy(server.base)
            sure, unsure = pick_rows(server.base)
            targets = [("digits alone", "digits", body(unsure)), ("pipeline, sure image", PIPELINE, body(sure))]
            targets.append(("pipeline, unsure image", PIPELINE, body(unsure)))
            for round_no in range(a.rounds):
                for label, model, payload in targets:
                    r = run_phase(server.base, model, payload, a.rate, a.seconds)
                    say(f"{label} round {round_no + 1}: p50 {r.p50_ms:.2f} p99 {r.p99_ms:.2f} ms, ok {r.ok}/{r.count}")
                    rounds.append({"label": label, "round": round_no + 1, **r.to_dict()})
            for label, model, payload in (targets[0], targets[2]):
                r = run_phase(server.base, model, payload, a.overload, 5.0)
                say(f"overload {label}: ok {r.ok}/{r.count}, errors {r.errors_by_status}, p99 {r.p99_ms:.1f} ms")
                overload.append({"label": label, **r.to_dict()})
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    elapsed = time.monotonic() - started
    section = "\n".join([START, *page(acc, rounds, overload, facts, a, elapsed), END])
    print(section)
    if a.record:
        splice_section(a.record, START, END, section)
    return 0


def page(
    acc: dict, rounds: list[dict], overload: list[dict], facts: dict, a: argparse.Namespace, elapsed: float
) -> list[str]:
    n, right, reached = acc["n"], acc["right"], acc["reached"]
    share = reached.get("big", 0.0) / reached["small"] if reached.get("small") else float("nan")
    command = (
        f"python -m bench.pipelines --rate {a.rate:g} --seconds {a.seconds:g} --rounds {a.rounds}"
        f" --overload {a.overload:g}"
    )
    lines = [
        "# Pipelines: a cheap model, then the big one where it is unsure",
        "",
        f"Generated by `{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC} in commit {commit()}"
        f" in {elapsed / 60:.1f} min. Other engineers' work shared the machine during the run: the latencies"
        " are this machine's at that time, not a capacity claim. The method: `bench/pipelines.py`'s docstring.",
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
        " both, one after the other, each batched with the other traffic of its model.",
        "",
        f"## Overload: {a.overload:g} req/s offered for 5 s",
        "",
        "| target | ok / sent | refused | p99 ms (every request) |",
        "|---|---|---|---|",
        *(f"| {r['label']} | {r['ok']}/{r['count']} | {r['errors_by_status']} | {r['p99_ms']:.1f} |" for r in overload),
        "",
        "Under overload a step is refused at admission when it cannot finish in what is left of the call's"
        " deadline (the platform's 300 ms budget); the pipeline then answers with its fallback model if that"
        " fits, else 503 with Retry-After, as a model's request does.",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
