"""Failures under steady load in distributed mode: nothing lost, nothing hanging, and the time to recover.

    .venv/bin/python -m bench.failures [--rate 20] [--before 8] [--after 20] [--redis-down 5]
                                       [--runs kill,redis,gateway] [--record docs/benchmarks/failures.md]

The deployment: a throwaway `redis-server` on a free port, without persistence (what this run stops and
starts again; its db 0 holds the streams, the fleet and the snapshot, its db 1 is Celery's broker), a fresh
PostgreSQL database (`--database-url`, dropped and created again), `digits` and its fallback `digits-small`
(the demo models, trained briefly: `--epoch-scale`), two web processes
(`manage.py serve`, FERRY_EMBEDDED_NODE=false, each on its own port), two `manage.py runnode` processes, a
Celery worker and Celery beat. Every process runs with the platform's defaults (the 300 ms latency budget,
the front door's shedding), quotas off.

The load: open loop, Poisson arrivals at `--rate` per second on `digits`, each request its own task on its
own connection, with no deadline of its own (the platform's budget applies). The client is a load
balancer's: it sends to the web processes in turn, skips one whose readiness probe (every 0.25 s) failed,
and sends to the other when a connection is refused (the request never left: not lost). An answer later
than the budget plus `--no-answer-s` seconds, a reset connection, or none at all is "no answer".

The runs, each `--before` seconds of load, the failure, then `--after` seconds:
1. `kill`: `digits` is given one replica (desired_replicas 1: the placement reconciler loads it on one node
   and the other stops serving it), then that node gets SIGKILL. In-flight requests must be answered 503 or
   504 within their deadline or run by the other node, which must serve within its cold start plus the
   heartbeat timeout. The version keeps its one replica for the runs after; the killed node is started again.
2. `redis`: the Redis server stopped (SIGTERM) for `--redis-down` seconds, then started again, empty, on the
   same port: 503 with Retry-After meanwhile, and serving again in the same processes.
3. `gateway`: one web process taken out of the client's rotation, stopped (SIGTERM) `--drain` seconds later
   (what the web Deployment's endpoints and preStop sleep do), started again, and put back once ready;
   afterwards both must say the same of readiness and the repository (from the nodes' heartbeats).

Reported per run: requests sent, each answer's count (a 200 from the fallback, `X-Ferry-Fallback-From`,
apart; it counts as a 200 for the time to recover), the requests without an answer (must be 0), the
slowest answer, and the time to recover: from the failure (the kill, Redis back, the web process stopped)
to the start of the first 1 s of requests, by send time, that were all answered 200. Exit status 1 if a
request went without an answer, any answer was a 500, or a 503 came without Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench import report
from bench.fleet200 import fresh_database
from bench.server import KEY_FILE, free_port, manage, say, start_group, stop_groups, unbind_quota

MODEL = "digits"
KEY = "digits:1"
START, END = "<!-- failures:start -->", "<!-- failures:end -->"
NODE_LOAD = re.compile(r"loaded digits:1 on \S+ in ([0-9.]+)s")
BODY = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]})
PROBE_S = 0.25
PLACE = """
from serving.models import ModelVersion
version = ModelVersion.objects.get(model__name="digits", version=1)
version.desired_replicas = {replicas}
version.save(update_fields=["desired_replicas", "updated_at"])  # republishes, and runs the reconciler
"""
# The demo model and its fallback (serving.demo), the same code path as `manage.py build_demo_models`.
SETUP = """
import sys
from serving.demo import DEMO_MODELS, FALLBACKS, train_and_register
from serving.models import Model
for demo in DEMO_MODELS:
    if demo.name in ("digits", FALLBACKS["digits"]):
        train_and_register(demo, demo.build, lambda line: print(line, file=sys.stderr, flush=True), {epoch_scale})
Model.objects.filter(name="digits").update(fallback=Model.objects.get(name=FALLBACKS["digits"]))
"""
SINCE = {"fault": "the failure", "over": "Redis back"}


# -- processes -----------------------------------------------------------------------------------------------


class Deployment:
    """Every process in its own process group, each stopped on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env, self.logs = env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str, argv: list[str]) -> None:
        say(f"$ {' '.join(argv)}  (log: {self.logs / name}.log)")
        self.procs[name] = start_group(argv, self.logs / f"{name}.log", self.env)

    def web(self, name: str, port: int | None = None) -> None:
        self.ports[name] = port or self.ports.get(name) or free_port()
        self.start(name, [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(self.ports[name])])

    def node(self, name: str) -> None:
        self.start(
            name,
            [sys.executable, "manage.py", "runnode", "--name", name, "--accelerator", "cpu", "--memory", "2GiB"],
        )

    def celery(self, name: str, args: list[str]) -> None:
        self.start(name, [sys.executable, "-m", "celery", "-A", "config", *args])

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.log(name)[-3000:]}")

    def kill(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, sig)
        proc.wait(30)
        del self.procs[name]

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_groups(list(self.procs.values()))


class RedisServer:
    def __init__(self, port: int, workdir: Path) -> None:
        self.port, self.workdir = port, workdir
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        say(f"$ {' '.join(argv)}")
        self.proc = subprocess.Popen(
            [*argv, "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


# -- the load ------------------------------------------------------------------------------------------------


@dataclass
class Result:
    sent: float  # seconds from the run's start
    gateway: str
    status: int  # -1: no answer
    retry_after: bool
    seconds: float
    body: bytes = b""
    fallback: bool = False  # a 200 from the model's fallback (X-Ferry-Fallback-From): the asked version refused


@dataclass
class Load:
    """The open-loop client of one run, and what it saw."""

    ports: dict[str, int]
    token: str
    rate: float
    limit: float  # past this, no answer
    seed: int
    results: list[Result] = field(default_factory=list)
    rerouted: int = 0  # connection refused by one web process, sent to the other
    up: dict[str, bool] = field(default_factory=dict)
    out: set[str] = field(default_factory=set)  # taken out of rotation before it is stopped
    t0: float = 0.0
    in_flight: int = 0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def probe(self, session, stop: asyncio.Event) -> None:  # noqa: ANN001
        import aiohttp

        while not stop.is_set():
            for name, port in self.ports.items():
                try:
                    async with session.get(
                        f"http://127.0.0.1:{port}/v2/health/ready", timeout=aiohttp.ClientTimeout(total=1)
                    ) as resp:
                        self.up[name] = resp.status == 200
                except (TimeoutError, aiohttp.ClientError):
                    self.up[name] = False
            try:
                await asyncio.wait_for(stop.wait(), PROBE_S)
            except TimeoutError:
                pass

    def order(self, turn: int) -> list[str]:
        names = list(self.ports)
        names = names[turn % len(names) :] + names[: turn % len(names)]
        ready = [n for n in names if self.up.get(n, True) and n not in self.out]
        return ready + [n for n in names if n not in ready]

    async def one(self, session, turn: int) -> None:  # noqa: ANN001
        import aiohttp

        sent = self.now()
        started = time.monotonic()
        self.in_flight += 1
        try:
            for name in self.order(turn):
                try:
                    async with session.post(
                        f"http://127.0.0.1:{self.ports[name]}/v2/models/{MODEL}/infer",
                        data=BODY,
                        headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
                        timeout=aiohttp.ClientTimeout(total=self.limit),
                    ) as resp:
                        body = await resp.read()
                        self.results.append(
                            Result(
                                sent,
                                name,
                                resp.status,
                                "Retry-After" in resp.headers,
                                time.monotonic() - started,
                                body[:300] if resp.status != 200 else b"",
                                "X-Ferry-Fallback-From" in resp.headers,
                            )
                        )
                        return
                except aiohttp.ClientConnectorError:
                    self.rerouted += 1  # refused before anything was sent: try the other one
                    continue
                except (TimeoutError, aiohttp.ClientError) as exc:
                    self.results.append(Result(sent, name, -1, False, time.monotonic() - started, repr(exc).encode()))
                    return
            self.results.append(Result(sent, "", -2, False, time.monotonic() - started, b"every gateway refused"))
        finally:
            self.in_flight -= 1

    def run_sync(self, script, seconds: float) -> dict[str, float]:  # noqa: ANN001
        return asyncio.run(self.run(script, seconds))

    async def run(self, script, seconds: float) -> dict[str, float]:  # noqa: ANN001
        """Send for `seconds`, running `script(load)` (the failure, returning its moments) alongside."""
        import aiohttp

        rng = random.Random(self.seed)
        stop = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        # A connection of its own per request: a pooled one that the server closed would fail a request
        # that never reached it, which says nothing of the server.
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            self.t0 = time.monotonic()
            prober = asyncio.create_task(self.probe(session, stop))
            progress = asyncio.create_task(self.progress(stop))
            failure = asyncio.create_task(script(self))
            due, turn = 0.0, 0
            while due < seconds:
                wait = self.t0 + due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                task = asyncio.create_task(self.one(session, turn))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                due += rng.expovariate(self.rate)
                turn += 1
            moments = await failure
            if tasks:
                await asyncio.wait(list(tasks))
            stop.set()
            await prober
            await progress
        return moments

    async def progress(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 2.0)
            except TimeoutError:
                pass
            statuses = Counter(r.status for r in self.results)
            up = ", ".join(f"{n} {'up' if u else 'down'}" for n, u in sorted(self.up.items()))
            say(
                f"  {self.now():5.1f} s: answered {len(self.results)}, in flight {self.in_flight},"
                f" {dict(sorted(statuses.items()))}; {up}"
            )


# -- the report ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    what: str
    results: list[Result]
    rerouted: int
    moments: dict[str, float]  # seconds from the run's start
    notes: list[str]


def recovered_at(results: list[Result], since: float, window: float = 1.0) -> float | None:
    """The send time of the first request at or after `since` from which every request sent in the next
    `window` seconds was answered 200 (and there was one)."""
    ordered = sorted((r for r in results if r.sent >= since), key=lambda r: r.sent)
    last = ordered[-1].sent if ordered else since
    for i, first in enumerate(ordered):
        if first.sent + window > last:
            return None
        if first.status != 200:
            continue
        ok = True
        for r in ordered[i:]:
            if r.sent > first.sent + window:
                break
            if r.status != 200:
                ok = False
                break
        if ok:
            return first.sent
    return None


def statuses_of(results: list[Result]) -> Counter:
    out: Counter = Counter()
    for r in results:
        if r.status == 503:
            out["503 with Retry-After" if r.retry_after else "503 without Retry-After"] += 1
        elif r.status < 0:
            out["no answer"] += 1
        elif r.fallback:
            out["200 by the fallback"] += 1
        else:
            out[str(r.status)] += 1
    return out


def table(run: Run, budget_s: float, recover_from: str) -> tuple[list[str], bool]:
    results = run.results
    statuses = statuses_of(results)
    late = [r for r in results if r.status >= 0 and r.seconds > budget_s + 1.0]
    recovered = recovered_at(results, run.moments[recover_from])
    phases = [("before", -1e9, run.moments["fault"]), ("during", run.moments["fault"], run.moments["over"])]
    phases.append(("after", run.moments["over"], 1e9))
    keys = sorted(statuses, key=lambda k: (k == "no answer", k))
    lines = [
        f"### {run.name}: {run.what}",
        "",
        "| requests sent | " + " | ".join(keys) + " | without an answer |",
        "|---" * (len(keys) + 2) + "|",
        f"| {len(results)} | " + " | ".join(str(statuses[k]) for k in keys) + f" | {statuses['no answer']} |",
        "",
        "| phase (by send time) | sent | answers |",
        "|---|---|---|",
    ]
    for label, lo, hi in phases:
        part = [r for r in results if lo <= r.sent < hi]
        shown = ", ".join(f"{k} {v}" for k, v in sorted(statuses_of(part).items()))
        lines.append(f"| {label} | {len(part)} | {shown or '-'} |")
    slowest = max((r.seconds for r in results if r.status >= 0), default=0.0)
    recovery = f"{recovered - run.moments[recover_from]:.2f} s" if recovered is not None else "not within the run"
    lines += [
        "",
        f"- time to recover (from {SINCE[recover_from]} to the first 1 s of requests all answered 200): **{recovery}**",
        f"- slowest answer: {slowest:.2f} s; answers later than the budget plus 1 s: {len(late)}",
        f"- requests refused at connect by a stopped web process and sent to the other: {run.rerouted}",
        *[f"- {note}" for note in run.notes],
    ]
    bad = [r for r in results if r.status not in (200, 429, 503, 504)]
    bad += [r for r in results if r.status in (429, 503) and not r.retry_after]
    for body, n in Counter(r.body for r in bad).most_common(3):
        lines.append(f"- seen {n} times: `{body.decode(errors='replace')[:200]}`")
    refused = Counter((r.status, re.sub(r"\d+(\.\d+)?", "N", r.body.decode(errors="replace"))[:160]) for r in results)
    for (status, body), n in sorted(refused.items(), key=lambda item: -item[1]):
        if status != 200 and len(lines) < 40:
            lines.append(f"- {status} x{n}: `{body}`")
    ok = not bad and recovered is not None
    return lines, ok


# -- the runs ------------------------------------------------------------------------------------------------


async def fleet_state(url: str) -> dict[str, object]:
    import redis.asyncio as aioredis

    from serving.dataplane.transport import fleet

    client = aioredis.Redis.from_url(url)
    try:
        return {n.name: n for n in await fleet.read_fleet(client)}
    finally:
        await client.aclose()


def wait_until(what: str, check, deploy: Deployment, timeout: float = 300) -> float:  # noqa: ANN001
    started = time.monotonic()
    while not check():
        deploy.check()
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - started


def http(port: int, path: str, token: str, body: bytes | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=body,
        method="POST" if body is not None else "GET",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def serving(deploy: Deployment, token: str) -> bool:
    return all(http(port, f"/v2/models/{MODEL}/infer", token, BODY)[0] == 200 for port in deploy.ports.values())


async def placed(redis_url: str) -> str | None:
    """The one node that KEY is assigned to and loaded on, when no other node serves it; else None."""
    nodes = await fleet_state(redis_url)
    holders = [name for name, n in nodes.items() if KEY in n.assigned and KEY in n.hot]  # type: ignore[attr-defined]
    others = [n for name, n in nodes.items() if name not in holders]
    if len(nodes) == 2 and len(holders) == 1 and all(KEY not in n.ready for n in others):  # type: ignore[attr-defined]
        return holders[0]
    return None


async def hot_on(redis_url: str, name: str) -> bool:
    node = (await fleet_state(redis_url)).get(name)
    return node is not None and KEY in node.hot  # type: ignore[attr-defined]


def run_kill(a: argparse.Namespace, deploy: Deployment, load: Load, redis_url: str) -> Run:
    # One replica wanted: the placement reconciler (the Celery worker) loads it on one node, and the other
    # stops serving it. That node is the one killed; the other has to take the version over.
    manage(["shell", "-c", PLACE.format(replicas=1)], deploy.env)
    wait_until(
        f"{KEY} placed on one node and not served by the other",
        lambda: asyncio.run(placed(redis_url)) is not None,
        deploy,
        timeout=180,
    )
    victim = asyncio.run(placed(redis_url))
    assert victim is not None
    survivor = next(n for n in ("node-a", "node-b") if n != victim)
    skip = len(deploy.log(survivor))
    claimed_before = claimed(redis_url, survivor)

    async def script(load: Load) -> dict[str, float]:
        await asyncio.sleep(a.before)
        fault = load.now()
        say(f"kill -9 {victim} (it holds {KEY})")
        deploy.kill(victim, signal.SIGKILL)
        # the moment the other node took it: hot there
        while not await hot_on(redis_url, survivor) and load.now() < fault + a.after:
            await asyncio.sleep(0.1)
        taken = load.now()
        say(f"{survivor} holds {KEY} {taken - fault:.2f} s after the kill")
        return {"fault": fault, "over": taken}

    moments = load.run_sync(script, a.before + a.after)
    from serving.dataplane.transport import fleet

    loads = [float(s) for s in NODE_LOAD.findall(deploy.log(survivor)[skip:])]
    cold = f"{loads[0]:.2f} s" if loads else "no load logged"
    notes = [
        f"{survivor} held {KEY} (hot, in its heartbeat) {moments['over'] - moments['fault']:.2f} s after the kill;"
        f" its cold start: {cold}; the heartbeat timeout: {fleet.TTL_SECONDS} s",
        f"claimed by {survivor} from {victim}'s pending entries: {claimed(redis_url, survivor) - claimed_before}",
    ]
    deploy.node(victim)  # back for the runs after
    wait_until(f"{victim} back in the fleet", lambda: victim in asyncio.run(fleet_state(redis_url)), deploy)
    return Run(
        "kill -9 of the node holding the version", f"SIGKILL of {victim}", load.results, load.rerouted, moments, notes
    )


def claimed(redis_url: str, name: str) -> int:
    nodes = asyncio.run(fleet_state(redis_url))
    node = nodes.get(name)
    return int(node.counts.get("claimed", 0)) if node is not None else -1  # type: ignore[attr-defined]


def run_redis(a: argparse.Namespace, deploy: Deployment, load: Load, server: RedisServer) -> Run:
    async def script(load: Load) -> dict[str, float]:
        await asyncio.sleep(a.before)
        fault = load.now()
        say(f"stopping redis-server (port {server.port})")
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(a.redis_down)
        say("starting redis-server again, empty, on the same port")
        await asyncio.to_thread(server.start)
        return {"fault": fault, "over": load.now()}

    moments = load.run_sync(script, a.before + a.redis_down + a.after)
    deploy.check()  # the same processes: none exited
    notes = [f"Redis was away {moments['over'] - moments['fault']:.2f} s; every process is the one started before"]
    return Run(
        "Redis restart",
        f"redis-server stopped {a.redis_down:g} s, started again empty",
        load.results,
        load.rerouted,
        moments,
        notes,
    )


def run_gateway(a: argparse.Namespace, deploy: Deployment, load: Load, token: str) -> Run:
    async def script(load: Load) -> dict[str, float]:
        await asyncio.sleep(a.before)
        fault = load.now()
        # As the web Deployment does (platform/k8s/base/web.yaml): endpoints drop a terminating pod, and its
        # preStop sleep keeps it accepting until they have; only then does the process get SIGTERM.
        say(f"web-2 out of rotation; SIGTERM in {a.drain:g} s, then started again")
        load.out.add("web-2")
        await asyncio.sleep(a.drain)
        await asyncio.to_thread(deploy.kill, "web-2", signal.SIGTERM)
        stopped = load.now()
        deploy.web("web-2")
        while (await asyncio.to_thread(http, deploy.ports["web-2"], "/v2/health/ready", token))[0] != 200:
            await asyncio.sleep(0.1)
        load.out.discard("web-2")  # ready again: back in rotation, as a readiness probe would put it
        return {"fault": fault, "stopped": stopped, "over": load.now()}

    moments = load.run_sync(script, a.before + a.after)
    same = []
    for path, body in ((f"/v2/models/{MODEL}/ready", None), ("/v2/repository/index", b"{}")):
        answers = {name: http(port, path, token, body) for name, port in deploy.ports.items()}
        views = {name: (s, orjson.loads(b) if b else None) for name, (s, b) in answers.items()}
        same.append(f"`{path}` on both: {'the same' if len({orjson.dumps(v) for v in views.values()}) == 1 else views}")
        if path.endswith("ready"):
            same[-1] += f" ({answers['web-1'][0]})"
    after = [r for r in load.results if r.sent >= moments["over"]]
    per = {g: dict(sorted(statuses_of([r for r in after if r.gateway == g]).items())) for g in deploy.ports}
    notes = [
        f"web-2 taken out of rotation, SIGTERM {a.drain:g} s later; exited"
        f" {moments['stopped'] - moments['fault']:.2f} s after it was taken out; ready again"
        f" {moments['over'] - moments['stopped']:.2f} s after it stopped",
        *same,
        f"answers after web-2 was back, per web process: {per}",
    ]
    return Run("Gateway restart", "SIGTERM of web-2, then started again", load.results, load.rerouted, moments, notes)


# -- main ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.failures", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson arrivals)")
    p.add_argument("--before", type=float, default=8.0, help="seconds of load before each failure")
    p.add_argument("--after", type=float, default=20.0, help="seconds of load after it")
    p.add_argument("--redis-down", type=float, default=5.0, help="seconds Redis is away")
    p.add_argument("--drain", type=float, default=1.0, help="seconds out of rotation before SIGTERM (preStop)")
    p.add_argument("--no-answer-s", type=float, default=10.0, help="past the budget by this much: no answer")
    p.add_argument("--runs", default="kill,redis,gateway")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--epoch-scale", type=float, default=0.25, help="of the demo models' training: what is measured is not accuracy"
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("FERRY_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/ferry_bench_failures"),
        help="dropped and created again",
    )
    p.add_argument("--record", type=Path, default=None, help="write the failures section of this page")
    a = p.parse_args(argv)
    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    unknown = set(runs) - {"kill", "redis", "gateway"}
    if unknown:
        p.error(f"unknown runs: {sorted(unknown)}")
    return 0 if run(a, runs) else 1


def run(a: argparse.Namespace, runs: list[str]) -> bool:
    started = time.monotonic()
    load_before = os.getloadavg()
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-failures-"))
    redis_port = free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    server = RedisServer(redis_port, data_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "CELERY_", "REDIS_"))}
    env.update(
        {
            "FERRY_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": a.database_url,
            "DATABASE_CONN_MAX_AGE": "0",
            "REDIS_URL": redis_url,
            "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(50),  # the run's processes share it
            "CELERY_BROKER_URL": f"redis://127.0.0.1:{redis_port}/1",
            "CELERY_RESULT_BACKEND": f"redis://127.0.0.1:{redis_port}/1",
            "CELERY_TASK_ALWAYS_EAGER": "false",
            "FERRY_EMBEDDED_NODE": "false",
            "FERRY_TORCH_THREADS": "1",
            "FERRY_QUOTAS": "false",
        }
    )
    budget_ms = os.environ.get("FERRY_LATENCY_BUDGET_MS", "300")  # the platform's default unless set here
    env["FERRY_LATENCY_BUDGET_MS"] = budget_ms
    budget_s = int(budget_ms) / 1000
    done: list[tuple[Run, str]] = []
    try:
        server.start()
        fresh_database(a.database_url)
        manage(["migrate", "--noinput", "-v0"], env)
        say(f"training and registering {MODEL} and its fallback (epochs x{a.epoch_scale:g})")
        manage(["shell", "-c", SETUP.format(epoch_scale=a.epoch_scale)], env)
        manage(["ensure_demo_user"], env)
        unbind_quota(env)
        token = (data_dir / KEY_FILE).read_text().strip()
        with Deployment(env, data_dir) as deploy:
            deploy.web("web-1")
            deploy.web("web-2")
            deploy.node("node-a")
            deploy.node("node-b")
            deploy.celery("worker", ["worker", "-P", "solo", "-Q", "celery", "--without-gossip", "--without-mingle"])
            deploy.celery("beat", ["beat", "-s", str(data_dir / "celerybeat-schedule")])
            up = wait_until("both web processes and both nodes up", lambda: ready_all(deploy, token, redis_url), deploy)
            say(f"up in {up:.0f} s")
            wait_until(f"{MODEL} served by both web processes", lambda: serving(deploy, token), deploy, timeout=120)
            for name in runs:
                load = Load(dict(deploy.ports), token, a.rate, budget_s + a.no_answer_s, a.seed)
                say(f"-- run {name}: {a.rate:g} requests/s")
                if name == "kill":
                    done.append((run_kill(a, deploy, load, redis_url), "fault"))
                elif name == "redis":
                    done.append((run_redis(a, deploy, load, server), "over"))  # from Redis back
                else:
                    done.append((run_gateway(a, deploy, load, token), "fault"))
                deploy.check()
                wait_until(f"{MODEL} served again by both", lambda: serving(deploy, token), deploy, timeout=120)
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    lines: list[str] = []
    ok = True
    for one_run, since in done:
        part, fine = table(one_run, budget_s, since)
        lines += [*part, ""]
        ok = ok and fine
    load_after = os.getloadavg()
    head = [
        f"bench.failures: {a.rate:g} requests/s open loop on `{MODEL}`, no client deadline"
        f" (budget {budget_s * 1000:.0f} ms), {a.before:g} s before each failure and {a.after:g} s after;"
        f" {time.monotonic() - started:.0f} s in all",
        f"load average (1 min) at the start {load_before[0]:.1f}, at the end {load_after[0]:.1f}, on {os.cpu_count()}"
        " cores (the start's tells whether other work shared them)",
        "",
    ]
    print("\n".join(head + lines))
    if a.record is not None:
        splice(a.record, section(a, head + lines))
    return ok


def ready_all(deploy: Deployment, token: str, redis_url: str) -> bool:
    if not all(http(port, "/v2/health/ready", token)[0] == 200 for port in deploy.ports.values()):
        return False
    return {"node-a", "node-b"} <= set(asyncio.run(fleet_state(redis_url)))


def command(a: argparse.Namespace) -> str:
    return (
        f"python -m bench.failures --rate {a.rate:g} --before {a.before:g} --after {a.after:g}"
        f" --redis-down {a.redis_down:g} --runs {a.runs}"
    )


def section(a: argparse.Namespace, lines: list[str]) -> list[str]:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rev = report.commit()
    return [
        START,
        "## Failures under steady load",
        "",
        f"`{command(a)}` on {when}, commit {rev}.",
        "",
        *lines,
        END,
    ]


def splice(path: Path, lines: list[str]) -> None:
    text = path.read_text() if path.exists() else "# Failures in distributed mode\n\n"
    block = "\n".join(lines)
    if START in text and END in text:
        text = text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
    say(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
