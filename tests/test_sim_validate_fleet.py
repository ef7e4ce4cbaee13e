"""The distributed validation's short form (issue 20, item 5): real processes, then the simulator, judged.

One web process, two `runnode` processes, a Celery worker and beat, on the test PostgreSQL and Redis. Ten
versions of different sizes (`sim.validation_fleet.zipf_plan`: Chain models of 64 to 256 wide, 20 to 50
steps, largest batches 8 to 32), each autoscaled (one replica at least, two at most).

1. Calibration, before the compared traffic and with traffic of its own: each version's compute per batch
   from the nodes' /metrics (`ferry_compute_seconds` over `ferry_batch_size`) at batch one and under a closed
   loop of full batches; its footprint and load time from the nodes; then, the fleet back to one replica each
   and the autoscaler's history cleared, the overhead outside the node per request (`overheads`), measured
   again after the compared run and pooled.
2. The compared run: Zipf traffic on a fixed timetable (`sim.validation_fleet.arrivals`), with a step that the
   autoscaler answers with more replicas (the target utilisation set from the calibration so that the most
   popular version needs two by its profile; the others scale as the same target makes them).
3. The simulator, fed the calibration and the plan, `sim.validation_fleet.simulated`; `judge` must agree on
   every check. Marked `solo`: two nodes computing and the web process take this 2-core machine; with other
   work on it, the latencies drift between the calibration and the compared run and the test fails
   (docs/validation.md lists such runs).

It runs by default, in `make test`'s solo part: the short form, 20 s of compared traffic after a calibration of
10 versions (on this 2-core machine at a load average of 22, 91 s in the test's body, 73 s of setup and 10 s of
teardown: docs/validation.md). FERRY_VALIDATION_SECONDS lengthens the compared run
(the calibration stays as it is); FERRY_VALIDATION_RECORD names a JSON file to write the whole record to
(`python -m sim.validation_fleet` makes docs/validation.md of it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from django.conf import settings as django_settings
from django.test import override_settings
from prometheus_client.parser import text_string_to_metric_families

from autoscaling import tick
from autoscaling.models import ScalingPolicy
from bench.gil_contention import Chain
from serving.dataplane.gateway.snapshot import hub
from serving.dataplane.transport import fleet
from serving.demo import save_artifact
from serving.models import ModelVersion
from serving.policies.autoscale import replica_capacity
from serving.policies.batching import LatencyProfile
from serving.publish import publish_snapshot
from sim import validation_fleet as vf
from tests.conftest import celery_worker, free_port, mint_key, register
from tests.test_autoscale_processes import answers, start
from tests.test_celery_worker import BROKER
from tests.test_inference_http import call, digits_request
from tests.test_streams_processes import REDIS_URL, START_TIMEOUT_S, clear, stop_all, wait_for

# Solo: its latencies are the machine's as much as the code's, so it runs with nothing else of the suite beside
# it. The short form keeps the calibration and the compared run close in time (the overhead measured just
# before and just after), so a machine whose load drifts slowly moves both sides alike.
pytestmark = [pytest.mark.solo]

NODES = ["val-a", "val-b"]
MEMORY = 256 * 2**20
TOKEN = "validation-metrics-token"
QUEUE = 128
SECONDS = float(os.environ.get("FERRY_VALIDATION_SECONDS", "20"))
QUIET = 8  # calibration: requests one at a time per version (batch one)
FULL_S = 1.0  # calibration: seconds of a closed loop of full batches per version
OVERHEAD_S = 4.0  # calibration: seconds of traffic for the overhead, before and after the compared run
AUTOSCALE_ENV = {"FERRY_AUTOSCALE_SECONDS": "1", "FERRY_AUTOSCALE_SCHEDULING_DELAY_S": "1"}
NODE_ENV = {"FERRY_METRICS_TOKEN": TOKEN, "FERRY_TORCH_THREADS": "1"}
STEP_REPLICAS = 1.7  # what the top version's share of the step needs, by its calibrated profile


def plan() -> vf.RunPlan:
    # 24 then 72 requests a second: about a thousand answers in the short form, so a p99 (its tenth largest) moves
    # by sampling alone less than the judge's 20% (tests/test_sim_validate_judge.py measures how often)
    return vf.zipf_plan(10, rate=24.0, step_rate=72.0, step_at=SECONDS * 0.4, duration=SECONDS)


def scrape(port: int) -> dict[tuple[str, str], dict[str, float]]:
    """Per version key, the sums and counts of compute seconds, batch sizes and queue waits on one node."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("ferry_compute_seconds", "ferry_batch_size", "ferry_queue_wait_seconds"):
            continue
        for s in family.samples:
            if s.name.endswith(("_sum", "_count")) and "model" in s.labels:
                key = (s.labels["model"], s.labels["version"])
                out.setdefault(key, {})[s.name] = out.get(key, {}).get(s.name, 0.0) + s.value
    return out


def everything(ports: list[int]) -> dict[str, dict[str, float]]:
    """Per model (version 1), the sums and counts over every node: one scrape a node for all the versions."""
    out: dict[str, dict[str, float]] = {}
    for port in ports:
        for (model, version), values in scrape(port).items():
            if version == "1":
                mine = out.setdefault(model, {})
                for name, value in values.items():
                    mine[name] = mine.get(name, 0.0) + value
    return out


def phase(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, float]:
    """(mean rows per batch, mean compute seconds per batch, mean queue wait per request) between two scrapes."""

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    batches = max(d("ferry_batch_size_count"), 1.0)
    return (
        d("ferry_batch_size_sum") / batches,
        d("ferry_compute_seconds_sum") / max(d("ferry_compute_seconds_count"), 1.0),
        d("ferry_queue_wait_seconds_sum") / max(d("ferry_queue_wait_seconds_count"), 1.0),
    )


def heartbeats(client: redis.Redis) -> list[fleet.NodeInfo]:
    return [fleet.NodeInfo.from_hash(raw) for n in NODES if (raw := client.hgetall(fleet.node_key(n)))]


def replicas_ready(client: redis.Redis, keys: set[str]) -> int:
    return sum(len(keys & info.assigned & info.hot) for info in heartbeats(client))


def one(web, key: str, name: str, rows: int = 1) -> tuple[int, float]:  # noqa: ANN001
    body = digits_request(np.zeros((rows, 64), dtype=np.float32))
    sent = time.monotonic()
    resp = call(web, "POST", f"/v2/models/{name}/versions/1/infer", body, auth=key)
    return resp.status, time.monotonic() - sent


def calibrate(web, key: str, ports: list[int], p: vf.RunPlan, client: redis.Redis) -> dict:  # noqa: ANN001
    """The calibration run's profiles: per version, batch one (sequential requests), then full batches (a closed
    loop of max_batch_size callers); a line through the two (rows, compute) points is its profile at 1 and its
    largest batch. Footprints from the heartbeats, load times from what the nodes reported."""
    versions = {}
    last = everything(ports)  # the versions are calibrated one at a time: one's end is the next one's start
    for v in p.versions:
        t0 = last.get(v.name, {})
        quiet = [one(web, key, v.name) for _ in range(QUIET)]
        t1 = everything(ports).get(v.name, {})
        until = time.monotonic() + FULL_S

        def caller(name: str = v.name, until: float = until) -> int:
            n = 0
            while time.monotonic() < until:
                n += one(web, key, name)[0] == 200
            return n

        with ThreadPoolExecutor(v.max_batch_size) as pool:
            list(pool.map(lambda _: caller(), range(v.max_batch_size)))
        last = everything(ports)
        t2 = last.get(v.name, {})
        (b0, c0, _), (b1, c1, _) = phase(t0, t1), phase(t1, t2)
        top = v.max_batch_size
        if b1 > b0 + 0.5 and c1 > c0:
            slope = (c1 - c0) / (b1 - b0)
            profile = {1: max(c0, 1e-5), top: c0 + slope * (top - 1)}
        else:  # the batches did not grow, or a busy machine ran batch one slower than full ones: no slope to
            # draw, so the shape is the one validation measured at registration, scaled to this batch one
            registered = ModelVersion.objects.get(model__name=v.name, version=1).latency_profile
            shape = {int(b): float(t) for b, t in registered.items()}
            shape.setdefault(top, shape[max(shape)] * top / max(shape))  # linear past the largest measured
            profile = {b: max(c0, 1e-5) * t / shape[min(shape)] for b, t in shape.items() if b in (1, top)}
        assert all(status == 200 for status, _ in quiet), quiet
        versions[v.name] = {
            "profile_ms": {b: s * 1000 for b, s in profile.items()},
            "quiet": [b0, c0],
            "full": [b1, c1],
        }
    for info in heartbeats(client):
        for k, r in info.resident.items():
            name = k.rpartition(":")[0]
            if name in versions:
                versions[name]["memory_bytes"] = int(r["bytes"])
    for v in p.versions:
        version = ModelVersion.objects.get(model__name=v.name, version=1)
        # what the nodes reported after their loads (serving.wiring.write_placement), for this accelerator type
        here = (version.placement_measurements or {}).get("cpu", {})
        versions[v.name]["load_seconds"] = float(here.get("cold_start_seconds") or version.load_seconds or 1.0)
        versions[v.name].setdefault("memory_bytes", int(here.get("memory_bytes") or version.memory_bytes or 1 << 20))
    return {"versions": versions}


def overheads(web, key: str, ports: list[int], p: vf.RunPlan, client: redis.Redis) -> dict:  # noqa: ANN001
    """The rest of the calibration run, once the profiles are installed and the fleet is back to one replica
    each: OVERHEAD_S of traffic like the compared run (its rates, shares and step, another seed: the overhead on a
    busy machine grows with the rate, so both rates are sampled); each answer's
    latency at the client less the nodes' mean time per request (batch wait and compute) is a sample of the
    overhead outside the node."""
    start = everything(ports)
    before = [start.get(v.name, {}) for v in p.versions]
    sample = dataclasses.replace(p, seed=p.seed + 100, duration=OVERHEAD_S, step_at=OVERHEAD_S * 0.4)
    answered, _ = drive(web, key, sample, client)
    end = everything(ports)
    after = [end.get(v.name, {}) for v in p.versions]
    # a request's time on a node: its wait for a batch, then its batch's compute (means over the phase)
    waits = [phase(b, a)[2] for a, b in zip(after, before, strict=True)]
    computes = [phase(b, a)[1] for a, b in zip(after, before, strict=True)]
    counts = [
        a.get("ferry_queue_wait_seconds_count", 0.0) - b.get("ferry_queue_wait_seconds_count", 0.0)
        for a, b in zip(after, before, strict=True)
    ]
    node_ms = 1000 * sum((w + c) * n for w, c, n in zip(waits, computes, counts, strict=True)) / max(sum(counts), 1.0)
    overhead = [max(0.0, seconds * 1000 - node_ms) for _, status, seconds in answered if status == 200]
    return {"overhead_ms": overhead, "node_request_ms": node_ms}


def fresh_autoscaler(client: redis.Redis) -> None:
    """Forget the autoscaler's history (the calibration's traffic and its rises), under its lock, so the compared
    run starts from no history, as the simulated autoscaler does."""
    for _ in range(100):
        if client.set(tick.LOCK_KEY, "validation", nx=True, ex=5):
            try:
                client.delete(tick.STATE_KEY)
            finally:
                client.delete(tick.LOCK_KEY)
            return
        time.sleep(0.05)
    raise AssertionError("the autoscaler's lock stayed held")


def install(calibration: dict) -> None:
    """The calibrated profiles become the versions' own, published: the real autoscaler sizes by them, as the
    simulated one does."""
    for name, c in calibration["versions"].items():
        version = ModelVersion.objects.get(model__name=name, version=1)
        version.latency_profile = {str(b): ms / 1000 for b, ms in c["profile_ms"].items()}
        version.save(update_fields=["latency_profile", "updated_at"])
    held = hub.current
    with override_settings(REDIS_URL=REDIS_URL):
        publish_snapshot()
    hub.current = held


def drive(web, key: str, p: vf.RunPlan, client: redis.Redis) -> tuple[list, list]:  # noqa: ANN001
    """The compared run: every arrival of the timetable sent at its time, on a pool thread; replicas sampled."""
    timetable = vf.arrivals(p)
    keys = {f"{v.name}:1" for v in p.versions}
    results: list[tuple[float, int, float]] = []
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    began = time.monotonic()

    def sampler() -> None:
        while not stop.is_set():
            samples.append((time.monotonic() - began, replicas_ready(client, keys)))
            time.sleep(0.5)

    def send(at: float, index: int) -> None:
        status, seconds = one(web, key, p.versions[index].name)
        results.append((at, status, seconds))

    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    with ThreadPoolExecutor(QUEUE) as pool:
        for at, index in timetable:
            delay = began + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(send, at, index)
    stop.set()
    watcher.join(5)
    return results, samples


def register_plan(p: vf.RunPlan, tmp_path: Path) -> str:
    """Each version of the plan registered (one replica at least) and published; an API key for the traffic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # validation measures as each node computes, on one thread
    try:
        for v in p.versions:
            artifact = tmp_path / f"{v.name}.pt"
            save_artifact(Chain(v.width, v.layers).eval(), "torchscript", torch.zeros(1, 64), artifact)
            version = register(
                artifact, v.name, max_batch_size=v.max_batch_size, max_queue_size=QUEUE, default_timeout_ms=2000
            )
            version.min_replicas = 1
            version.save(update_fields=["min_replicas", "updated_at"])
    finally:
        torch.set_num_threads(threads)
    key = mint_key()
    held = hub.current
    with override_settings(REDIS_URL=REDIS_URL):
        publish_snapshot()
    hub.current = held
    return key


@pytest.fixture
def system(transactional_db, tmp_path: Path):  # noqa: ANN001, ANN201
    client = redis.Redis.from_url(REDIS_URL)
    broker = redis.Redis.from_url(BROKER)
    clear(client)
    broker.flushdb()
    p = plan()
    port = free_port()
    serve = ["manage.py", "serve", "--host", "127.0.0.1", "--port", str(port)]
    web = start("web", serve, tmp_path, FERRY_GRPC_PORT="0", **AUTOSCALE_ENV)
    web.port = port
    ports = [free_port() for _ in NODES]
    argv = ["manage.py", "runnode", "--accelerator", "cpu", "--memory", f"{MEMORY >> 20}MiB"]
    nodes = [
        start(n, [*argv, "--name", n, "--metrics-port", str(mp)], tmp_path, **AUTOSCALE_ENV, **NODE_ENV)
        for n, mp in zip(NODES, ports, strict=True)
    ]
    beat = start("beat", ["-m", "celery", "-A", "config", "beat", "-s", str(tmp_path / "beat-schedule")], tmp_path)
    procs = [web, *nodes, beat]
    try:
        with celery_worker(
            tmp_path,
            BROKER,
            REDIS_URL=REDIS_URL,
            CELERY_BROKER_URL=BROKER,
            FERRY_ARTIFACT_ROOT=str(django_settings.FERRY_ARTIFACT_ROOT),
            SECRET_KEY=django_settings.SECRET_KEY,
            **AUTOSCALE_ENV,
        ) as worker:
            # the versions are registered while the processes start (their imports take most of the setup)
            key = register_plan(p, tmp_path)
            wait_for("web answering", lambda: answers(web), procs, START_TIMEOUT_S)
            wait_for("both nodes up", lambda: len(heartbeats(client)) == 2, procs, START_TIMEOUT_S)
            try:
                yield client, web, key, ports, procs, p
            finally:
                t0 = time.monotonic()
                terminate(procs)  # before the worker's own stop, which the context's exit waits for
                worker.kill()  # its warm stop took 19 s here, its cold one 12: the run is over, nothing of it is kept
        print(f"worker stopped in {time.monotonic() - t0:.1f} s")
    finally:
        t0 = time.monotonic()
        terminate(procs)
        stop_all(procs, tail=3000, worker_log=tmp_path / "worker.log", worker_tail=3000)
        print(f"stopped in {time.monotonic() - t0:.1f} s")
        clear(client)
        broker.flushdb()
        client.close()
        broker.close()


def terminate(procs: list, grace: float = 5.0) -> None:
    """SIGTERM to every process still running, all at once (stopped one by one, each graceful stop would wait for
    the one before it), then SIGKILL to what is still running after `grace` seconds: the run is over, and a
    graceful drain here took 20 s."""
    for proc in procs:
        if proc.proc.poll() is None:
            proc.proc.terminate()
    until = time.monotonic() + grace
    for proc in procs:
        try:
            proc.proc.wait(timeout=max(until - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.proc.kill()


def test_the_simulator_agrees_with_two_real_nodes_on_zipf_traffic_with_a_step(system) -> None:  # noqa: ANN001
    client, web, key, ports, procs, p = system
    started_load = os.getloadavg()
    began = time.monotonic()
    phases: dict[str, float] = {}  # seconds from the test's start at the end of each phase, for the record

    def mark(name: str) -> None:
        phases[name] = round(time.monotonic() - began, 1)

    keys = {f"{v.name}:1" for v in p.versions}
    # given every version autoscaled, one replica each placed across the two nodes
    for v in p.versions:
        ScalingPolicy.objects.create(
            version=ModelVersion.objects.get(model__name=v.name, version=1), max_replicas=2, cool_down_seconds=60
        )
    wait_for("a replica of each", lambda: replicas_ready(client, keys) == len(keys), procs, 240)
    mark("placed")
    # when the calibration run measures each version's profile and the front end's cost
    calibration = calibrate(web, key, ports, p, client)
    mark("profiles")
    # and the target utilisation is set so the step needs two replicas of the top version by its profile
    top = p.versions[0]
    profile = LatencyProfile({int(b): ms / 1000 for b, ms in calibration["versions"][top.name]["profile_ms"].items()})
    capacity = replica_capacity(profile.estimate, top.max_batch_size, 0.3)
    assert capacity is not None
    target = top.share * p.step_rate / (STEP_REPLICAS * capacity.rate)
    install(calibration)
    ScalingPolicy.objects.update(target_utilisation=target)
    calibration |= {
        "target_utilisation": target,
        "scheduling_delay": 1.0,
        "max_queue_size": QUEUE,
        "overhead_seconds": OVERHEAD_S,
        "overhead_traffic": "at the compared run's rates, with its step (another seed)",
    }
    # and the autoscaler forgets the calibration: what it scaled up goes (no cool-down without a history)
    fresh_autoscaler(client)
    wait_for("one replica of each again", lambda: replicas_ready(client, keys) == len(keys), procs, 120)
    time.sleep(1)
    calibration |= overheads(web, key, ports, p, client)
    mark("overhead_before")
    fresh_autoscaler(client)
    wait_for("still one replica of each", lambda: replicas_ready(client, keys) == len(keys), procs, 120)
    fresh_autoscaler(client)
    loads_before = sum(i.counts.get("loads", 0) for i in heartbeats(client))
    # and the compared run sends its timetable
    answered, samples = drive(web, key, p, client)
    mark("compared")
    time.sleep(2)  # the nodes' next heartbeats carry the loads
    loads = sum(i.counts.get("loads", 0) for i in heartbeats(client)) - loads_before
    # and the overhead is measured once more after it (a shared machine drifts): the two calibrations, pooled,
    # bracket the compared run without being part of it
    after = overheads(web, key, ports, p, client)
    calibration["overhead_ms"] = calibration["overhead_ms"] + after["overhead_ms"]
    calibration["node_request_ms_after"] = after["node_request_ms"]
    mark("overhead_after")
    measured = vf.summarise_answers(answered, p) | {
        "replicas": vf.replicas_by_window(samples, p),
        "cold_starts": loads,
    }
    # then the simulator, fed the calibration and the same plan, agrees on every check
    sim = vf.simulated(p, calibration, nodes=len(NODES), memory_bytes=MEMORY)
    verdict = vf.judge(measured, sim)
    mark("simulated")
    record = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": [started_load, os.getloadavg()],
        "phases_s": phases,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "plan": vf.plan_doc(p),
        "calibration": calibration,
        "measured": measured,
        "simulated": sim,
        "verdict": verdict,
    }
    print(json.dumps({k: record[k] for k in ("phases_s", "measured", "simulated", "verdict")}, default=float))
    if out := os.environ.get("FERRY_VALIDATION_RECORD"):
        Path(out).write_text(json.dumps(record, indent=1, default=float))
    assert measured["refused"] == 0 or not math.isnan(measured["p50_ms"])
    assert all(verdict.values()), verdict
