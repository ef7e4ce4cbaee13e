"""Per-tenant rate limits under overload: is the limit held, and is the neighbour unharmed?

    .venv/bin/python -m bench.ratelimit [--rate-limit 200] [--duration 10] [--redis-url URL] [--docs DIR]

A fresh data dir with the `digits` demo model and two tenants, each with its own API key:
tenant A's quota is `--rate-limit` requests/s (bucket depth a fifth of that), tenant B's the default.
Then, on one server (`manage.py serve`):
  1. B alone at `--b-rate` requests/s for `--duration` s: its p99;
  2. A offered twice its limit and B at the same modest rate, at once, for `--duration` s: A's admitted
     rate against its limit (target: within 5%) and B's p99 next to step 1's.
Each run warms up for a second first (not measured), which also drains A's burst, so the measured
window sees the steady rate. With `--redis-url` the quotas live in that Redis (FERRY_QUOTA_REDIS_URL,
one script call per request) and the run is repeated there after the in-process one.
The result replaces the rate-limit section of docs/benchmarks/rate-limits.md. `make bench` (bench.run, phase
`ratelimit`) runs the in-process half with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench import report
from bench.loadgen import LoadResult, arun, run
from bench.server import HEADERS, ROOT, OtherCpu, Server, counters, free_port, manage, say, scrape

START, END = "<!-- ratelimit:start -->", "<!-- ratelimit:end -->"
MODEL = "digits"
TARGET_SHARE = 0.05  # A's admitted rate within 5% of its limit

SETUP = """
import tempfile
from pathlib import Path
from serving.actions import register_version
from serving.demo import DEMO_MODELS, save_artifact
from serving.models import ModelVersion, State
from tenants.actions import create_key
from tenants.models import Tenant

if not ModelVersion.objects.filter(model__name="digits", state=State.READY).exists():
    demo = next(d for d in DEMO_MODELS if d.name == "digits")
    module, accuracy = demo.build(print, 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.pt"
        save_artifact(module, demo.fmt, demo.example, path)
        with path.open("rb") as f:
            register_version(model_name="digits", artifact_file=f, fmt=demo.fmt, inputs=demo.inputs,
                             outputs=demo.outputs, validate="sync", **demo.batching)
for slug, rate in (("tenant-a", {rate_a}), ("tenant-b", None)):
    tenant, _ = Tenant.objects.get_or_create(slug=slug, defaults={{"name": slug}})
    if rate is not None:
        quota = tenant.quota
        quota.requests_per_second, quota.burst = rate, max(1, rate // 5)
        quota.save()
    _, token = create_key(tenant=tenant, name="bench", scopes=["infer"])
    (Path("{data_dir}") / f"{{slug}}.key").write_text(token)
print("tenants and keys ready")
"""


def body() -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]})


def headers(token: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}


def refusals(text: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for (_, labels), value in counters(text, ("ferry_quota_refusals_total",)).items():
        d = dict(labels)
        out[f"{d.get('tenant')}/{d.get('reason')}"] = value
    return out


async def measure(base: str, tokens: dict[str, str], limit: int, b_rate: float, duration: float) -> dict[str, Any]:
    url = f"{base}/v2/models/{MODEL}/infer"
    say(f"step 1: tenant B alone at {b_rate:g}/s for {duration:g} s")
    alone = await run(url, body(), headers(tokens["tenant-b"]), b_rate, duration)
    before = refusals(scrape(base))
    say(
        f"step 2: tenant A at {2 * limit}/s (twice its limit of {limit}/s) and tenant B at {b_rate:g}/s,"
        f" for {duration:g} s"
    )
    a, b = await asyncio.gather(
        run(url, body(), headers(tokens["tenant-a"]), 2.0 * limit, duration),
        run(url, body(), headers(tokens["tenant-b"]), b_rate, duration, progress=False),
    )
    after = refusals(scrape(base))
    refused = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
    return {
        "limit": limit,
        "b_rate": b_rate,
        "duration": duration,
        "b_alone": alone,
        "a": a,
        "b_with_a": b,
        "refusals": refused,
    }


def run_all(
    env: dict[str, str],
    data_dir: Path,
    *,
    rate_limit: int = 200,
    b_rate: float = 50.0,
    duration: float = 10.0,
    redis_url: str | None = None,
) -> list[dict[str, Any]]:
    """Set up the two tenants (and `digits`, unless the data dir has it) and measure: in-process, then,
    with `redis_url`, with the quotas in that Redis. `make bench` runs the in-process half (~40 s)."""
    manage(["shell", "-c", SETUP.format(rate_a=rate_limit, data_dir=data_dir)], env)
    results = [run_mode(env, data_dir, "in-process (embedded)", rate_limit, b_rate, duration)]
    if redis_url:
        results.append(
            run_mode(
                {**env, "FERRY_QUOTA_REDIS_URL": redis_url}, data_dir, "Redis (shared)", rate_limit, b_rate, duration
            )
        )
    return results


def run_mode(
    env: dict[str, str], data_dir: Path, label: str, rate_limit: int, b_rate: float, duration: float
) -> dict[str, Any]:
    tokens = {slug: (data_dir / f"{slug}.key").read_text().strip() for slug in ("tenant-a", "tenant-b")}
    HEADERS["Authorization"] = f"Bearer {tokens['tenant-b']}"  # the readiness probes' key
    with Server(env, free_port(), data_dir / f"server-ratelimit-{label.split()[0]}.log") as server:
        server.wait_ready((MODEL,))
        with OtherCpu(server.pids()) as other:
            result = arun(measure(server.base, tokens, rate_limit, b_rate, duration))
    result["label"] = label
    result["other_cpu"] = other.cores
    return result


def _ms(v: float) -> str:
    return f"{v:.1f}"


def _cores(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} cores"


def verdict(r: dict[str, Any]) -> tuple[float, str]:
    """A's admitted rate against its limit, and the check: pass, FAIL, or saturated (the server itself
    refused or timed out some of A's requests, so its admitted rate says nothing about the quota)."""
    a: LoadResult = r["a"]
    share = a.achieved_rate / r["limit"] - 1.0
    if a.aborted or a.client_errors or any(k != "429" for k in a.errors_by_status):
        return share, "saturated"
    return share, "pass" if abs(share) <= TARGET_SHARE else "FAIL"


def section(results: list[dict[str, Any]], command: str, seconds: float) -> list[str]:
    L = [
        START,
        "## Rate limits under overload",
        "",
        f"`{command}` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC}, {seconds:.0f} s in all (bench.ratelimit).",
        "",
        "Two tenants on one server serving `digits`. Tenant A's quota: the limit below in requests/s, a bucket"
        " a fifth of that deep; tenant B: the default quota. A is offered twice its limit, open loop, while B"
        " sends at a modest rate; B's p99 is measured alone first. Each run's first second (which drains A's"
        " burst) is not measured. Target: A's admitted rate within 5% of its limit; B's p99 unchanged beyond"
        " noise.",
        "",
        "A check reads `saturated` when the server itself refused (503) or lost some of A's requests: the"
        " machine, not the quota, set A's rate then.",
        "",
        "| quotas | A limit/s | A offered/s | A admitted/s | vs limit | A 429s | A other errors | B/s"
        " | B p99 alone | B p99 with A | B errors alone / with A | other processes' CPU | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        a, alone, b = r["a"], r["b_alone"], r["b_with_a"]
        share, check = verdict(r)
        others = a.errors - a.errors_by_status.get("429", 0)
        L.append(
            f"| {r['label']} | {r['limit']} | {a.offered_rate:.0f} | {a.achieved_rate:.1f} | {share:+.1%}"
            f" | {a.errors_by_status.get('429', 0)} | {others} | {r['b_rate']:g} | {_ms(alone.p99_ms)} ms"
            f" | {_ms(b.p99_ms)} ms | {alone.errors} / {b.errors} | {_cores(r.get('other_cpu'))} | {check} |"
        )
    busiest = max((r.get("other_cpu") or 0.0 for r in results), default=0.0)
    if busiest > 0.2:
        L += [
            "",
            f"Other processes used up to {busiest:.2f} cores during these runs: B's p99 figures measure that"
            " contention as much as A's overload; judge isolation from a run on a quiet machine.",
        ]
    L += [
        "",
        "Refusals counted by the server in the overload run (`ferry_quota_refusals_total`, tenant/reason): "
        + "; ".join(
            f"{r['label']}: " + (", ".join(f"{k} {v:.0f}" for k, v in r["refusals"].items()) or "none") for r in results
        )
        + ".",
        END,
    ]
    return L


def splice(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Ferry benchmarks\n"
    block = "\n".join(lines)
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")
    say(f"wrote the rate-limit section of {path}")


def kept_section(text: str) -> str:
    """This benchmark's section of an existing report, for bench.run to keep when it rewrites the page."""
    return report.kept_section(text, START, END)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ratelimit", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-limit", type=int, default=200, help="tenant A's requests/s quota")
    p.add_argument("--b-rate", type=float, default=50.0, help="tenant B's offered requests/s")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per run")
    p.add_argument("--redis-url", help="also run with the quotas in this Redis (FERRY_QUOTA_REDIS_URL)")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="docs folder (writes benchmarks/rate-limits.md)")
    p.add_argument("--data-dir", type=Path, help="use (and keep) this FERRY_DATA_DIR")
    p.add_argument("--json", type=Path, help="also write the measurements as JSON here")
    a = p.parse_args(argv)
    started = time.monotonic()
    data_dir = a.data_dir.resolve() if a.data_dir else Path(tempfile.mkdtemp(prefix="ferry-ratelimit-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    # Embedded mode (SQLite, in-process node) whatever this shell's settings: only the quotas change.
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "FERRY_QUOTA_REDIS_URL")}
    env.update({"FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"})
    say(f"FERRY_DATA_DIR={data_dir}")
    ok = False
    try:
        manage(["migrate", "--noinput", "-v0"], env)
        results = run_all(
            env, data_dir, rate_limit=a.rate_limit, b_rate=a.b_rate, duration=a.duration, redis_url=a.redis_url
        )
        command = "python -m bench.ratelimit" + (" --redis-url URL" if a.redis_url else "")
        splice(report.page(a.docs, "ratelimit"), section(results, command, time.monotonic() - started))
        if a.json:
            a.json.write_text(json.dumps(results, indent=2, default=lambda v: v.to_dict()))
            say(f"wrote {a.json}")
        for r in results:
            share, check = verdict(r)
            say(
                f"{r['label']}: A admitted {r['a'].achieved_rate:.1f}/s of {r['limit']}/s ({share:+.1%},"
                f" {check}); B p99 {r['b_alone'].p99_ms:.1f} ms alone,"
                f" {r['b_with_a'].p99_ms:.1f} ms with A"
            )
        ok = True
    finally:
        if ok and not a.data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            say(f"data dir kept: {data_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
