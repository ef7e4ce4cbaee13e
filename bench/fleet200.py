"""The 200-version, two-node run: distributed mode with real processes, versions loaded on demand.

    .venv/bin/python -m bench.fleet200 [--versions 200] [--hold 50] [--rate 40] [--duration 60]
                                       [--record docs/benchmarks/fleet.md]

A fresh PostgreSQL database (`--database-url`, dropped and created again) and the ferry keys of a Redis
database (`--redis-url`, cleared). `--versions` distinct small models (64 -> 32 -> 10, each its own
random weights, so each its own artifact) are built and registered with synchronous validation. Then one
web process (`manage.py serve`, FERRY_EMBEDDED_NODE=false) and `--nodes` `manage.py runnode` processes
start, each node with a memory budget of `--hold / --nodes` footprints (validation's measurement of the
first version), so the fleet holds about `--hold` versions at once.

An open-loop stream (Poisson arrivals at `--rate` per second, for `--duration` seconds, each request its
own task: a slow answer does not slow the stream) asks for versions drawn from a Zipf law over all of them
(rank r has weight 1/r^s, ranks shuffled so popularity is unrelated to version number or load order).

Every request must be answered 200, or 503 with Retry-After; anything else (a 5xx, a 503 without
Retry-After, no answer within its deadline plus 10 s) fails the run (exit status 1). Reported: the
answers; the hot-version hit rate (stream entries that found their version loaded on the node that took
them, from the nodes' heartbeat counts); loads and evictions per node (heartbeats); cold-load latency
p50/p99 (each load's time on the node, evictions and warm-up included, from the nodes' "loaded ... in"
log lines); versions loaded on both nodes; the client's latency; `/v2/repository/index` states at the
end. `--record PATH` writes the fleet200 section of that page (bench.run leaves it alone), and `--plot` a figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import orjson

from bench import report as reports
from bench.server import free_port, manage, say, start_group, stop_groups

MODEL = "fleet"
START, END = "<!-- fleet200:start -->", "<!-- fleet200:end -->"
NODE_LOAD = re.compile(r"loaded (\S+) on \S+ in ([0-9.]+)s")

SETUP = """
import tempfile
import time
from pathlib import Path

import torch

from serving.actions import register_version
from serving.demo import save_artifact
from serving.models import ModelVersion
from tenants.actions import create_key
from tenants.models import Tenant

IO = {{"inputs": [{{"name": "input", "datatype": "FP32", "shape": [64]}}],
       "outputs": [{{"name": "scores", "datatype": "FP32", "shape": [10]}}]}}
started = time.monotonic()
with tempfile.TemporaryDirectory() as tmp:
    for number in range(1, {versions} + 1):
        torch.manual_seed(number)  # distinct weights: distinct artifacts, each loaded from its own bytes
        module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).eval()
        path = Path(tmp) / f"model-{{number}}.pt"
        save_artifact(module, "torchscript", torch.zeros(2, 64), path)
        with path.open("rb") as f:
            version = register_version(model_name="{model}", artifact_file=f, fmt="torchscript", validate="sync",
                                       max_batch_size=8, max_queue_delay_ms=1, default_timeout_ms={timeout_ms},
                                       **IO)
        version.refresh_from_db()
        assert version.state == "ready", version.failure_reason
        if number % 25 == 0:
            print(f"registered {{number}} versions in {{time.monotonic() - started:.0f}} s", flush=True)
first = ModelVersion.objects.get(model__name="{model}", version=1)
tenant, _ = Tenant.objects.get_or_create(slug="bench", defaults={{"name": "bench"}})
quota = tenant.quota
quota.requests_per_second, quota.burst, quota.max_in_flight = 1_000_000, 1_000_000, 100_000
quota.monthly_requests = 10**12
quota.save()
_, token = create_key(tenant=tenant, name="bench", scopes=["infer", "manage"])
Path("{data_dir}", "bench.key").write_text(token)
Path("{data_dir}", "footprint").write_text(str(first.memory_bytes))
print("footprint", first.memory_bytes, "bytes (validation's measurement of version 1)")
"""

BODY = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]})


@dataclass
class Result:
    version: int
    sent: float  # seconds from the stream's start
    status: int  # -1: no answer
    retry_after: bool
    seconds: float
    body: bytes = b""


@dataclass
class Sample:
    at: float
    nodes: dict[str, dict] = field(default_factory=dict)  # name -> {hot, memory_used, memory_budget, counts}


def zipf_weights(n: int, s: float, seed: int) -> list[float]:
    ranks = list(range(1, n + 1))
    random.Random(seed).shuffle(ranks)  # version v has popularity rank ranks[v - 1]
    return [1.0 / r**s for r in ranks]


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


# -- processes -------------------------------------------------------------------------------------------


def fresh_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = parts._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def clear_redis(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter("ferry:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


class Procs:
    """The web process and the nodes, each in its own process group, always stopped on exit."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str]) -> None:
        say(f"$ manage.py {' '.join(args)}  (log: {self.logs / name}.log)")
        self.procs[name] = start_group([sys.executable, "manage.py", *args], self.logs / f"{name}.log", self.env)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-3000:]}")

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_groups(list(self.procs.values()))


async def read_nodes(client) -> dict[str, dict]:  # noqa: ANN001
    from serving.dataplane.transport import fleet

    return {
        n.name: {
            "hot": sorted(n.hot),
            "ready": len(n.ready),
            "memory_used": n.memory_used,
            "memory_budget": n.memory_budget,
            "counts": dict(n.counts),
            "failures": dict(n.failures),
        }
        for n in await fleet.read_fleet(client)
    }


async def settled_nodes(client, nodes: int, timeout: float = 20.0) -> dict[str, dict]:  # noqa: ANN001
    """The nodes' last counts, once every one of the `nodes` is live. A node whose heartbeat is more than
    TTL_SECONDS late (a machine busy with other work stalls every process for seconds at times) is out of
    the fleet until its next one: read again rather than report it as having served nothing."""
    deadline = time.monotonic() + timeout
    while True:
        found = await read_nodes(client)
        if len(found) >= nodes or time.monotonic() > deadline:
            if len(found) < nodes:
                say(f"only {len(found)} of {nodes} nodes live after {timeout:g} s: their counts are missing")
            return found
        await asyncio.sleep(0.5)


# -- the stream --------------------------------------------------------------------------------------------


async def one(
    session,
    url: str,
    version: int,
    token: str,
    sent: float,
    limit: float,  # noqa: ANN001
    results: list[Result],
) -> None:
    import aiohttp

    started = time.monotonic()
    try:
        async with session.post(
            f"{url}/v2/models/{MODEL}/versions/{version}/infer",
            data=BODY,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=limit),
        ) as resp:
            body = await resp.read()
            results.append(
                Result(
                    version,
                    sent,
                    resp.status,
                    "Retry-After" in resp.headers,
                    time.monotonic() - started,
                    body if resp.status != 200 else b"",
                )
            )
    except (TimeoutError, aiohttp.ClientError) as exc:
        results.append(Result(version, sent, -1, False, time.monotonic() - started, repr(exc).encode()))


async def stream(
    a: argparse.Namespace,
    url: str,
    token: str,
    redis_url: str,
    budget: int,
) -> tuple[list[Result], list[Sample], dict[str, dict]]:
    import aiohttp
    import redis.asyncio as aioredis

    versions = list(range(1, a.versions + 1))
    weights = zipf_weights(a.versions, a.zipf, a.seed)
    rng = random.Random(a.seed)
    results: list[Result] = []
    samples: list[Sample] = []
    client = aioredis.Redis.from_url(redis_url)
    before = await read_nodes(client)
    limit = a.timeout_ms / 1000 + 10  # past this, no answer: lost
    tasks: set[asyncio.Task[None]] = set()
    stop = asyncio.Event()
    t0 = time.monotonic()

    async def sample() -> None:
        last_note = 0.0
        while not stop.is_set():
            now = time.monotonic() - t0
            samples.append(Sample(now, await read_nodes(client)))
            if now - last_note >= 5:
                last_note = now
                statuses = Counter(r.status for r in results)
                hot = {n: f"{len(s['hot'])} hot" for n, s in samples[-1].nodes.items()}
                say(
                    f"  {now:5.0f} s: sent {len(results) + len(tasks)}, answered {len(results)}"
                    f" {dict(sorted(statuses.items()))}; {hot} (budget {a.hold / a.nodes:g} each)"
                )
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=a.connections)) as session:
        sampler = asyncio.create_task(sample())
        due = 0.0
        while due < a.duration:
            wait = t0 + due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            version = rng.choices(versions, weights)[0]
            task = asyncio.create_task(one(session, url, version, token, due, limit, results))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            due += rng.expovariate(a.rate)
        if tasks:
            await asyncio.wait(list(tasks))
        await asyncio.sleep(2.5)  # the counts travel with the heartbeats (every second)
        stop.set()
        await sampler
    after = await settled_nodes(client, a.nodes)
    await client.aclose()
    for name, state in after.items():
        state["before"] = before.get(name, {}).get("counts", {})
    return results, samples, after


# -- the run ------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fleet200", description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", type=int, default=200)
    p.add_argument("--hold", type=float, default=50, help="versions the fleet's budgets hold at once, in all")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", type=float, default=40.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of requests")
    p.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent s")
    p.add_argument("--timeout-ms", type=int, default=2000, help="the versions' default request timeout")
    p.add_argument("--connections", type=int, default=256, help="client connections at most")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--database-url",
        default=os.environ.get("FERRY_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/ferry_bench_fleet200"),
        help="dropped and created again",
    )
    p.add_argument(
        "--redis-url",
        default=os.environ.get("FERRY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/4"),
        help="its ferry:* keys are cleared",
    )
    p.add_argument("--record", type=Path, default=None, help="write the fleet200 section of this page")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="the figure (default: bench-fleet200.png one folder above --record's page)",
    )
    a = p.parse_args(argv)
    outcome = run(a)
    return 0 if outcome else 1


def run(a: argparse.Namespace) -> bool:
    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-fleet200-"))
    env = {k: v for k, v in os.environ.items() if k not in ("FERRY_QUOTA_REDIS_URL",)}
    env.update(
        {
            "FERRY_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": a.database_url,
            "DATABASE_CONN_MAX_AGE": "0",
            "REDIS_URL": a.redis_url,
            "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(50),  # the run's processes share it
            "FERRY_EMBEDDED_NODE": "false",
            "FERRY_TORCH_THREADS": "1",
            "FERRY_QUOTAS": "false",
            # on-demand loading is measured here, not the front door's shedding on a small shared machine
            "FERRY_LOOP_LAG_TARGET_MS": "60000",
            "FERRY_MAX_LOOP_LAG_MS": "60000",
            "FERRY_MAX_FRONTEND_WAIT_MS": "60000",
        }
    )
    try:
        fresh_database(a.database_url)
        clear_redis(a.redis_url)
        manage(["migrate", "--noinput", "-v0"], env)
        setup = data_dir / "setup.py"
        setup.write_text(SETUP.format(model=MODEL, versions=a.versions, data_dir=data_dir, timeout_ms=a.timeout_ms))
        say(f"building and registering {a.versions} models ({setup})")
        manage(["shell", "-c", f"exec(open({str(setup)!r}).read())"], env)
        setup_seconds = time.monotonic() - started
        footprint = int((data_dir / "footprint").read_text())
        token = (data_dir / "bench.key").read_text().strip()
        budget = int(a.hold / a.nodes * footprint)
        say(
            f"{a.versions} versions of about {footprint} bytes; {a.nodes} nodes of {budget} bytes"
            f" ({a.hold / a.nodes:g} versions each)"
        )
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        names = [f"node-{chr(ord('a') + i)}" for i in range(a.nodes)]
        with Procs(env, data_dir) as procs:
            procs.start("web", ["serve", "--host", "127.0.0.1", "--port", str(port)])
            for name in names:
                procs.start(
                    name,
                    [
                        "runnode",
                        "--name",
                        name,
                        "--accelerator",
                        "a10g",
                        "--memory",
                        str(budget),
                        "--labels",
                        f"zone={name}",
                    ],
                )
            wait_up(procs, url, token, a.redis_url, names)
            say(f"{a.rate:g} requests/s for {a.duration:g} s, Zipf s={a.zipf:g} over {a.versions} versions")
            skip = {name: len(procs.log(name)) for name in names}  # the loads at start-up are not the stream's
            results, samples, nodes = asyncio.run(stream(a, url, token, a.redis_url, budget))
            index = settled_index(url, token)
            procs.check()
            loads = {
                name: [(key, float(s)) for key, s in NODE_LOAD.findall(procs.log(name)[skip[name] :])] for name in names
            }
        lines, ok = report(
            a, results, samples, nodes, loads, index, footprint, budget, setup_seconds, time.monotonic() - started
        )
        print("\n".join(lines))
        if a.record is not None:
            splice(a.record, section(a, lines))
        plot_path = a.plot or (a.record.parent.parent / "bench-fleet200.png" if a.record is not None else None)
        if plot_path is not None:
            plot(plot_path, a, results, samples, loads, budget, footprint)
        return ok
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def wait_up(procs: Procs, url: str, token: str, redis_url: str, names: list[str], timeout: float = 300) -> None:
    import urllib.request

    import redis

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            procs.check()
            assert time.monotonic() < deadline, "the processes did not come up"
            live = {n.decode() for n in client.smembers("ferry:nodes")}
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as resp:
                    web = resp.status == 200
            except OSError:
                web = False
            if web and live >= set(names):
                break
            time.sleep(0.5)
    finally:
        client.close()
    say("web process and nodes up")


def repository_index(url: str, token: str) -> list[dict]:
    import urllib.request

    req = urllib.request.Request(
        f"{url}/v2/repository/index",
        data=b"{}",
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return orjson.loads(resp.read())


def settled_index(url: str, token: str, timeout: float = 10.0) -> list[dict]:
    """The repository index once the web process sees the nodes again: while it has no live node (their
    heartbeats late, see `settled_nodes`) it reports every version LOADING, which says nothing of the run."""
    deadline = time.monotonic() + timeout
    while True:
        index = repository_index(url, token)
        if any(row.get("state") == "READY" for row in index) or time.monotonic() > deadline:
            return index
        time.sleep(0.5)


def both(sample: Sample) -> int:
    """Versions hot on more than one node in `sample`."""
    seen = Counter(key for state in sample.nodes.values() for key in state["hot"])
    return sum(1 for n in seen.values() if n > 1)


def report(
    a: argparse.Namespace,
    results: list[Result],
    samples: list[Sample],
    nodes: dict[str, dict],
    loads: dict[str, list[tuple[str, float]]],
    index: list[dict],
    footprint: int,
    budget: int,
    setup_seconds: float,
    seconds: float,
) -> tuple[list[str], bool]:
    statuses = Counter(r.status for r in results)
    without_retry = sum(1 for r in results if r.status == 503 and not r.retry_after)
    bad = sum(n for status, n in statuses.items() if status not in (200, 503)) + without_retry
    ok_ms = [r.seconds * 1000 for r in results if r.status == 200]
    out = [
        f"bench.fleet200: {a.versions} versions ({footprint} bytes each by validation), {a.nodes} nodes of"
        f" {budget} bytes ({a.hold / a.nodes:g} versions each, {a.hold:g} in all), Zipf s={a.zipf:g},"
        f" open loop {a.rate:g}/s for {a.duration:g} s, deadline {a.timeout_ms} ms;"
        f" set-up {setup_seconds:.0f} s, {seconds:.0f} s in all"
    ]
    out.append(
        f"requests sent {len(results)}; answers {dict(sorted(statuses.items()))} (-1: none within deadline + 10 s)"
    )
    out.append(
        "every request answered 200 or 503 with Retry-After: "
        + ("yes" if not bad else f"NO ({bad} other answers or 503s without Retry-After)")
    )
    out.append(f"distinct versions asked for: {len({r.version for r in results})}")
    hot = cold = 0
    for name, state in sorted(nodes.items()):
        grew = {k: v - state["before"].get(k, 0) for k, v in state["counts"].items()}
        hot += grew.get("hot", 0)
        cold += grew.get("cold", 0)
        out.append(
            f"{name}: took {grew.get('hot', 0) + grew.get('cold', 0)} requests"
            f" ({grew.get('hot', 0)} hot, {grew.get('cold', 0)} cold), served {grew.get('served', 0)},"
            f" past their deadline {grew.get('expired', 0)},"
            f" loads {grew.get('loads', 0)}, evictions {grew.get('evictions', 0)};"
            f" at the end {len(state['hot'])} hot, {state['memory_used']} of {state['memory_budget']} bytes"
        )
    if hot + cold:
        out.append(
            f"hot-version hit rate: {hot / (hot + cold):.1%} ({hot} of {hot + cold} requests taken by a node"
            f" found their version loaded there)"
        )
    every = [s for lst in loads.values() for _, s in lst]
    if every:
        out.append(
            f"cold-load latency on the nodes (load + evictions + warm-up), {len(every)} loads:"
            f" p50 {percentile(every, 50) * 1000:.0f} ms, p99 {percentile(every, 99) * 1000:.0f} ms,"
            f" max {max(every) * 1000:.0f} ms"
        )
    if samples:
        twice = [both(s) for s in samples]
        out.append(
            f"versions hot on more than one node at once (sampled every second): mean {np.mean(twice):.1f},"
            f" max {max(twice)}"
        )
    if ok_ms:
        out.append(
            f"client latency of 200s: p50 {percentile(ok_ms, 50):.1f} ms, p99 {percentile(ok_ms, 99):.1f} ms,"
            f" max {max(ok_ms):.0f} ms"
        )
    refusals = Counter(
        re.sub(rb"fleet:[0-9]+", b"fleet:N", r.body)[:140].decode(errors="replace") for r in results if r.status != 200
    )
    for kind, n in refusals.most_common(3):
        out.append(f"refusal seen {n} times: {kind}")
    ours = [row for row in index if row.get("name") == MODEL]
    states = Counter((row["state"], row["reason"].split(":")[0] if row.get("reason") else "") for row in ours)
    out.append(
        "/v2/repository/index at the end: "
        + ", ".join(f"{state}{f' ({why})' if why else ''} {n}" for (state, why), n in sorted(states.items()))
    )
    return out, not bad and bool(results)


# -- records ------------------------------------------------------------------------------------------------


def command(a: argparse.Namespace) -> str:
    return (
        f"python -m bench.fleet200 --versions {a.versions} --hold {a.hold:g} --nodes {a.nodes} --rate {a.rate:g}"
        f" --duration {a.duration:g} --zipf {a.zipf:g} --timeout-ms {a.timeout_ms}"
        " --record docs/benchmarks/fleet.md"
    )


def section(a: argparse.Namespace, lines: list[str]) -> list[str]:
    from datetime import UTC, datetime

    return [
        START,
        "## 200 versions on two nodes",
        "",
        f"`{command(a)}` on {datetime.now(UTC):%Y-%m-%d %H:%M UTC}: distributed mode with real processes (one"
        " web process, two `runnode` processes, PostgreSQL, Redis Streams), every version a distinct small"
        " model registered with validation. No versions are placed by a reconciler: a node takes the requests"
        " of the versions it holds and of those no other live node holds or is loading, and loads a cold one on"
        " demand, evicting idle versions least recently used first."
        f" Zipf s={a.zipf:g} puts {top_share(a):.0%} of requests on the {a.hold:g} most popular versions, the"
        " best a static placement of that many could do. The hit rate is counted by the nodes (an entry"
        " taken from a version's stream, with the version loaded or not); load times come from the nodes'"
        " log lines.",
        "",
        f"Load average (1 min) at the end of the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        " (other work on the machine shares them).",
        "",
        "```",
        *lines,
        "```",
        "",
        "![200 versions on two nodes](../bench-fleet200.png)",
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
    say(f"wrote the fleet200 section of {path}")


def kept_section(text: str) -> str:
    return reports.kept_section(text, START, END)


def plot(
    path: Path,
    a: argparse.Namespace,
    results: list[Result],
    samples: list[Sample],
    loads: dict[str, list[tuple[str, float]]],
    budget: int,
    footprint: int,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((answers, rate), (hot, cold)) = plt.subplots(2, 2, figsize=(13, 8))
    edges = np.arange(0, a.duration + 1, 1.0)
    for status, colour in ((200, "tab:green"), (503, "tab:orange"), (-1, "tab:red")):
        sent = [r.sent for r in results if r.status == status]
        if sent:
            counts, _ = np.histogram(sent, edges)
            answers.plot(edges[:-1], counts, label=f"{status if status > 0 else 'no answer'}", color=colour)
    other = [r.sent for r in results if r.status not in (200, 503, -1)]
    if other:
        counts, _ = np.histogram(other, edges)
        answers.plot(edges[:-1], counts, label="other", color="black")
    answers.set_ylabel("requests per second, by answer")
    answers.set_xlabel("seconds (send time)")
    answers.set_title(f"{a.versions} versions, Zipf s={a.zipf:g}, {a.rate:g}/s open loop")
    answers.legend()
    names = sorted({n for s in samples for n in s.nodes})
    pairs = list(zip(samples, samples[1:], strict=False))
    xs = [later.at for _, later in pairs]
    for name in names:

        def grew(what: str, name: str = name) -> list[float]:
            return [
                (
                    later.nodes.get(name, {}).get("counts", {}).get(what, 0)
                    - early.nodes.get(name, {}).get("counts", {}).get(what, 0)
                )
                / max(later.at - early.at, 1e-9)
                for early, later in pairs
            ]

        rate.plot(xs, grew("loads"), label=f"{name} loads (= evictions)")
    taken = [
        sum(
            later.nodes.get(n, {}).get("counts", {}).get(k, 0) - early.nodes.get(n, {}).get("counts", {}).get(k, 0)
            for n in names
            for k in ("hot", "cold")
        )
        for early, later in pairs
    ]
    found = [
        sum(
            later.nodes.get(n, {}).get("counts", {}).get("hot", 0)
            - early.nodes.get(n, {}).get("counts", {}).get("hot", 0)
            for n in names
        )
        for early, later in pairs
    ]
    window = 5
    hits = [
        sum(found[max(0, i - window + 1) : i + 1]) / max(sum(taken[max(0, i - window + 1) : i + 1]), 1)
        for i in range(len(found))
    ]
    rate.set_ylabel("loads per second")
    rate.set_xlabel("seconds")
    share = rate.twinx()
    share.plot(xs, [h * 100 for h in hits], color="black", linewidth=1, label=f"hit rate ({window} s window)")
    share.set_ylim(0, 100)
    share.set_ylabel("hot-version hit rate (%)")
    rate.legend(loc="upper left", fontsize=8)
    share.legend(loc="lower right", fontsize=8)
    for name in names:
        hot.plot(
            [s.at for s in samples], [len(s.nodes.get(name, {}).get("hot", ())) for s in samples], label=f"{name} hot"
        )
    hot.plot([s.at for s in samples], [both(s) for s in samples], color="black", label="hot on both nodes")
    hot.axhline(a.hold / a.nodes, color="grey", linewidth=0.8, linestyle=":", label="budget of a node (versions)")
    hot.set_ylabel("versions")
    hot.set_xlabel("seconds")
    hot.set_ylim(0, a.hold / a.nodes * 1.3)
    hot.legend(fontsize=8)
    every = [s * 1000 for lst in loads.values() for _, s in lst]
    if every:
        cold.hist(every, bins=np.geomspace(max(min(every), 1), max(every) * 1.01, 40), color="tab:blue")
        cold.set_xscale("log")
    cold.set_xlabel("cold load on the node (ms): load + evictions + warm-up")
    cold.set_ylabel("loads")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    say(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
