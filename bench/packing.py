"""Multi-model packing: many versions, a node budget that holds a quarter of them, a Zipf-skewed stream.

    .venv/bin/python -m bench.packing [--versions 200] [--hold 50] [--duration 30] [--zipf 1.0] [--record]

A fresh data dir in embedded mode (SQLite, the in-process node). One small model (64 -> 32 -> 10, untrained:
packing, not accuracy, is measured) is registered and validated once, then registered again as versions
2..N of the same model on the same artifact, with the first version's measured profile and footprint (the
validation of identical bytes would measure the same; skipping it keeps the run under two minutes). The node's
budget (FERRY_NODE_MEMORY_BYTES) is `--hold` footprints. Then `--concurrency` closed-loop clients send
`--duration` seconds of requests pinned to versions drawn from a Zipf law (rank r has weight 1/r^s), ranks
shuffled so popularity is unrelated to version number or load order.

Reported: every request's answer (200, or 503 with Retry-After; anything else is a failure of the run), the
hot-version hit rate (requests that found their version loaded, from the node's counters), evictions, cold
loads, the cold start (load on the node, evictions and warm-up included) p50/p99 interpolated from its
histogram, and the client's latency p50/p99 over all 200s. `--record` also writes them into the packing
section of docs/benchmarks/fleet.md (`bench.run` leaves that page alone).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson

from bench import report as reports
from bench.server import Server, counters, free_port, manage, say, scrape

MODEL = "packed"
START, END = "<!-- packing:start -->", "<!-- packing:end -->"
SAMPLES: list[str] = []  # bodies of the first refusals, to show what they said

SETUP = """
import tempfile
from pathlib import Path

import torch
from django.db import transaction

from serving.actions import register_version
from serving.demo import save_artifact
from serving.models import ModelVersion
from tenants.actions import create_key
from tenants.models import Tenant

IO = {{"inputs": [{{"name": "input", "datatype": "FP32", "shape": [64]}}],
       "outputs": [{{"name": "scores", "datatype": "FP32", "shape": [10]}}]}}
torch.manual_seed(0)
module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).eval()
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "model.pt"
    save_artifact(module, "torchscript", torch.zeros(2, 64), path)
    with path.open("rb") as f:
        first = register_version(model_name="{model}", artifact_file=f, fmt="torchscript", validate="sync",
                                 max_batch_size=8, max_queue_delay_ms=1, default_timeout_ms={timeout_ms}, **IO)
first.refresh_from_db()
assert first.state == "ready", first.failure_reason
clones = []
for number in range(2, {versions} + 1):
    clone = ModelVersion.objects.get(pk=first.pk)
    clone.pk = None
    clone.version = number
    clones.append(clone)
with transaction.atomic():
    ModelVersion.objects.bulk_create(clones)
tenant, _ = Tenant.objects.get_or_create(slug="bench", defaults={{"name": "bench"}})
quota = tenant.quota
quota.requests_per_second, quota.burst, quota.max_in_flight = 1_000_000, 1_000_000, 100_000
quota.monthly_requests = 10**12
quota.save()
_, token = create_key(tenant=tenant, name="bench", scopes=["infer"])
Path("{data_dir}", "bench.key").write_text(token)
Path("{data_dir}", "footprint").write_text(str(first.memory_bytes))
print("registered", ModelVersion.objects.filter(model__name="{model}").count(), "versions;",
      first.memory_bytes, "bytes each")
"""

BODY = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]})


def zipf_weights(n: int, s: float, seed: int) -> list[float]:
    ranks = list(range(1, n + 1))
    random.Random(seed).shuffle(ranks)  # version v has popularity rank ranks[v - 1]
    return [1.0 / r**s for r in ranks]


async def client(
    port: int,
    token: str,
    versions: list[int],
    weights: list[float],
    until: float,
    seed: int,
    results: list[tuple[int, int, bool, float]],
) -> None:
    """One keep-alive connection sending requests back to back; (version, status, retry-after, seconds)."""
    rng = random.Random(seed)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            version = rng.choices(versions, weights)[0]
            head = (
                f"POST /v2/models/{MODEL}/versions/{version}/infer HTTP/1.1\r\nHost: bench\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(BODY)}\r\n\r\n"
            ).encode()
            started = time.monotonic()
            writer.write(head + BODY)
            status_line = await reader.readline()
            status = int(status_line.split()[1])
            length, retry_after = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "retry-after":
                    retry_after = True
            body = await reader.readexactly(length)
            if status != 200 and len(SAMPLES) < 200:
                SAMPLES.append(body.decode(errors="replace"))
            results.append((version, status, retry_after, time.monotonic() - started))
    finally:
        writer.close()


def histogram_quantile(text: str | None, name: str, q: float) -> float | None:
    """A quantile of a Prometheus histogram summed over its series, linear within the bucket (as PromQL's
    histogram_quantile does)."""
    buckets: dict[float, float] = {}
    for (_, labels), value in counters(text, (f"{name}_bucket",)).items():
        le = dict(labels)["le"]
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets or buckets[float("inf")] == 0:
        return None
    total = buckets[float("inf")]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in sorted(buckets):
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / max(count - lower_count, 1e-12)
        lower_bound, lower_count = bound, count
    return None


def total(text: str | None, name: str, **match: str) -> float:
    return sum(
        v
        for (_, labels), v in counters(text, (name,)).items()
        if all(dict(labels).get(k) == want for k, want in match.items())
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=200)
    p.add_argument("--hold", type=float, default=50, help="the node budget, in footprints of one version")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of requests")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients")
    p.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent s")
    p.add_argument("--timeout-ms", type=int, default=1000, help="the versions' default request timeout")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--record", action="store_true", help="write the packing section of docs/benchmarks/fleet.md")
    p.add_argument("--docs", type=Path, default=Path(__file__).resolve().parent.parent / "docs")
    a = p.parse_args(argv)
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-packing-"))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "FERRY_QUOTA_REDIS_URL")}
    env.update(
        {
            "FERRY_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            # packing is measured here, not the front door's shedding on a small shared machine
            "FERRY_LOOP_LAG_TARGET_MS": "60000",
            "FERRY_MAX_LOOP_LAG_MS": "60000",
        }
    )
    try:
        manage(["migrate", "--noinput", "-v0"], env)
        manage(
            ["shell", "-c", SETUP.format(model=MODEL, versions=a.versions, data_dir=data_dir, timeout_ms=a.timeout_ms)],
            env,
        )
        footprint = int((data_dir / "footprint").read_text())
        token = (data_dir / "bench.key").read_text().strip()
        env["FERRY_NODE_MEMORY_BYTES"] = str(int(a.hold * footprint))
        say(
            f"{a.versions} versions of {footprint} bytes; node budget {env['FERRY_NODE_MEMORY_BYTES']} bytes"
            f" ({a.hold:g} versions)"
        )
        port = free_port()
        with Server(env, port, data_dir / "server.log") as server:
            server_started = time.monotonic()
            while scrape(server.base) is None:
                if time.monotonic() - server_started > 120:
                    raise RuntimeError(f"server not up:\n{server.log_tail()}")
                time.sleep(0.5)
            say(f"server up in {time.monotonic() - server_started:.1f} s")
            versions = list(range(1, a.versions + 1))
            weights = zipf_weights(a.versions, a.zipf, a.seed)
            before = scrape(server.base)
            results: list[tuple[int, int, bool, float]] = []
            until = time.monotonic() + a.duration

            async def drive() -> None:
                await asyncio.gather(
                    *(client(port, token, versions, weights, until, a.seed + i, results) for i in range(a.concurrency))
                )

            asyncio.run(drive())
            after = scrape(server.base)
        lines = report(a, results, before, after, footprint, time.monotonic() - started)
        print("\n".join(lines))
        if a.record:
            splice(reports.page(a.docs, "packing"), section(a, lines))
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


def report(
    a: argparse.Namespace,
    results: list[tuple[int, int, bool, float]],
    before: str | None,
    after: str | None,
    footprint: int,
    seconds: float,
) -> list[str]:
    statuses = Counter(status for _, status, _, _ in results)
    unanswered_503 = sum(1 for _, status, retry, _ in results if status == 503 and not retry)
    other = sum(n for status, n in statuses.items() if status not in (200, 503))
    ok = np.array([s for _, status, _, s in results if status == 200]) * 1000

    def grew(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    requests = grew("ferry_requests_total", model=MODEL)
    cold = grew("ferry_cold_loads_total", model=MODEL)
    outcomes = {
        o: grew("ferry_cold_loads_total", model=MODEL, outcome=o)
        for o in ("waited", "refused", "load_queue_full", "deadline", "failed")
    }
    evictions = grew("ferry_evictions_total", model=MODEL)
    p50 = histogram_quantile(after, "ferry_cold_start_seconds", 0.5)
    p99 = histogram_quantile(after, "ferry_cold_start_seconds", 0.99)
    loads = total(after, "ferry_cold_start_seconds_count", model=MODEL)
    out: list[str] = []
    out.append(
        f"bench.packing: {a.versions} versions, budget {a.hold:g} of them ({footprint} bytes each),"
        f" Zipf s={a.zipf}, {a.concurrency} clients for {a.duration:g} s; {seconds:.0f} s in all"
    )
    out.append(
        f"  requests sent {len(results)} ({len(results) / a.duration:.0f}/s); answers {dict(sorted(statuses.items()))}"
    )
    out.append(
        f"  every request answered 200 or 503 with Retry-After: "
        f"{'yes' if not other and not unanswered_503 else f'NO ({other} other, {unanswered_503} 503 without)'}"
    )
    out.append(f"  distinct versions asked for: {len({v for v, *_ in results})}")
    if requests:
        out.append(
            f"  hot-version hit rate: {1 - cold / requests:.1%} ({requests - cold:.0f} of {requests:.0f} found"
            f" their version loaded)"
        )
    out.append(f"  cold requests: {cold:.0f} ({', '.join(f'{k} {v:.0f}' for k, v in outcomes.items())})")
    out.append(f"  evictions: {evictions:.0f}; loads on the node (start-up included): {loads:.0f}")
    if p50 is not None and p99 is not None:
        out.append(
            f"  cold start (load + evictions + warm-up, node histogram, interpolated): p50 {p50 * 1000:.0f} ms,"
            f" p99 {p99 * 1000:.0f} ms"
        )
    w50 = histogram_quantile(after, "ferry_cold_wait_seconds", 0.5)
    w99 = histogram_quantile(after, "ferry_cold_wait_seconds", 0.99)
    if w50 is not None and w99 is not None:
        out.append(
            f"  wait of a served cold request for its load (node histogram, interpolated):"
            f" p50 {w50 * 1000:.0f} ms, p99 {w99 * 1000:.0f} ms"
        )
    kinds = Counter(re.sub(r"packed:[0-9]+", "packed:N", sample)[:160] for sample in SAMPLES)
    for kind, n in kinds.most_common(4):
        out.append(f"  refusal seen ({n} of the first {len(SAMPLES)}): {kind}")
    if ok.size:
        out.append(
            f"  client latency of 200s: p50 {np.percentile(ok, 50):.1f} ms, p99 {np.percentile(ok, 99):.1f} ms,"
            f" max {ok.max():.1f} ms"
        )
    return out


def section(a: argparse.Namespace, lines: list[str]) -> list[str]:
    from datetime import UTC, datetime

    return [
        START,
        "## Multi-model packing",
        "",
        f"`python -m bench.packing` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC} (embedded mode, one in-process"
        " node). Versions of one small model, a node budget that holds a quarter of them, closed-loop clients"
        " whose requests are pinned to versions drawn from a Zipf law; a request for a cold version loads it"
        " (evicting idle versions, least recently used first) and waits when its cold start fits the deadline,"
        " else 503 with Retry-After, as does one that finds the node's load queue full"
        " (`FERRY_MAX_QUEUED_LOADS`). The hit rate counts requests that found their version loaded; Zipf"
        f" s={a.zipf:g} puts {top_share(a):.0%} of requests on the most popular quarter, the best a static"
        " placement of that quarter could do.",
        "",
        f"Load average (1 min) at the end of the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        " (other work on the machine shares them).",
        "",
        "```",
        *(line.strip() for line in lines),
        "```",
        END,
    ]


def top_share(a: argparse.Namespace) -> float:
    weights = sorted(zipf_weights(a.versions, a.zipf, a.seed), reverse=True)
    return sum(weights[: int(a.hold)]) / sum(weights)


def splice(path: Path, lines: list[str]) -> None:
    text = path.read_text() if path.exists() else "# Ferry benchmarks\n"
    block = "\n".join(lines)
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    path.write_text(text.rstrip("\n") + "\n")
    say(f"wrote the packing section of {path}")


def kept_section(text: str) -> str:
    """This benchmark's section of an existing report, for bench.run to keep when it rewrites the page."""
    return reports.kept_section(text, START, END)


if __name__ == "__main__":
    raise SystemExit(main())
