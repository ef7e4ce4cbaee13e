"""Packing across a fleet of real processes: one web process (`manage.py serve`, FERRY_EMBEDDED_NODE=false)
and two `runnode` processes whose memory budgets hold a few versions each, on the test PostgreSQL database
and Redis (FERRY_TEST_REDIS_URL).

- More versions asked for than the fleet holds: cold versions are loaded on demand, idle ones evicted
  (least recently used first), and the nodes' heartbeats and `/v2/repository/index` show it.
- Versions no node can hold (an accelerator type no node has, more memory than any node has) are
  answered 503 with the reason, shown unavailable with it in the index, and never tried again.
- `bench.fleet200`, small: an open-loop Zipf stream over more versions than the fleet holds, every
  request answered.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
import redis
import torch
from django.db import connection

from serving.dataplane.transport import fleet
from serving.demo import save_artifact
from tests.conftest import mint_key, register
from tests.test_inference_http import call
from tests.test_streams_processes import (
    REDIS_URL,
    ROOT,
    Proc,
    redis_db,
    start,
    start_web,
    stop_all,
    wait_for,
    web_ready,
)

__all__ = ["redis_db"]  # the fixture, shared with tests.test_streams_processes

HOLD = 3  # versions each node's budget holds
COLD = 12  # versions asked for after start-up, one after another: four times what a node holds
TIMEOUT_MS = 20_000  # a busy shared machine loads slowly; this is about what is loaded, not how fast
BODY = orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]})


def tiny_models(tmp_path: Path, count: int) -> list[Path]:
    """`count` distinct small models (64 -> 32 -> 10, each its own weights: its own artifact)."""
    paths = []
    for number in range(1, count + 1):
        torch.manual_seed(number)
        module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).eval()
        path = tmp_path / f"tiny-{number}.pt"
        save_artifact(module, "torchscript", torch.zeros(2, 64), path)
        paths.append(path)
    return paths


def start_node(name: str, tmp_path: Path, budget: int) -> Proc:
    return start(
        name,
        ["runnode", "--name", name, "--accelerator", "a10g", "--memory", str(budget), "--labels", f"zone={name}"],
        tmp_path,
        REDIS_URL,
    )


def nodes(client: redis.Redis) -> dict[str, fleet.NodeInfo]:
    out = {}
    for name in ("node-a", "node-b"):
        raw = client.hgetall(fleet.node_key(name))
        if raw:
            out[name] = fleet.NodeInfo.from_hash(raw)
    return out


def index(web: Proc, key: str) -> dict[str, dict]:
    resp = call(web, "POST", "/v2/repository/index", {}, auth=key)
    assert resp.status == 200, resp.body
    return {f"{row['name']}:{row['version']}": row for row in resp.json()}


def test_cold_versions_load_on_demand_evicting_idle_ones_and_unschedulable_ones_say_why(
    transactional_db,
    redis_db,
    tmp_path,  # noqa: ANN001
) -> None:
    from serving.models import ModelVersion

    paths = tiny_models(tmp_path, HOLD + COLD + 2)
    versions = [
        register(path, "packed", max_batch_size=8, max_queue_delay_ms=1, default_timeout_ms=TIMEOUT_MS)
        for path in paths
    ]
    footprint = max(v.memory_bytes for v in versions)
    budget = HOLD * footprint
    # Two versions no node can hold: one allowed only on h100s (the nodes are a10gs), one that needs more
    # memory than any node has. Set before the processes start: the first snapshot carries it.
    wrong_type, too_big = versions[-2], versions[-1]
    ModelVersion.objects.filter(pk=wrong_type.pk).update(accelerators=["h100"])
    ModelVersion.objects.filter(pk=too_big.pk).update(min_memory_bytes=1024**4)
    key = mint_key()
    procs = [
        start_web(tmp_path, REDIS_URL),
        start_node("node-a", tmp_path, budget),
        start_node("node-b", tmp_path, budget),
    ]
    web = procs[0]
    try:
        wait_for("both nodes in the fleet", lambda: len(nodes(redis_db)) == 2, procs)
        wait_for("the web process ready", lambda: web_ready(web), procs)
        wait_for(
            "both nodes holding their budget", lambda: all(len(n.hot) == HOLD for n in nodes(redis_db).values()), procs
        )

        # -- given two nodes, each holding what its budget allows
        before = nodes(redis_db)
        for info in before.values():
            assert (info.memory_budget, info.memory_used) == (budget, HOLD * footprint), info
        started = set().union(*(n.hot for n in before.values()))

        # -- when versions not loaded anywhere are asked for, one after another
        cold = [f"packed:{v.version}" for v in versions[:-2] if f"packed:{v.version}" not in started][:COLD]
        assert len(cold) == COLD, (started, cold)
        seen_ready = set()
        for name in cold:
            version = name.split(":")[1]
            resp = call(web, "POST", f"/v2/models/packed/versions/{version}/infer", BODY, auth=key)
            # then each is loaded on demand and served
            assert resp.status == 200, (name, resp.status, resp.body)
            # and the repository index shows it ready (the node announces a load at once)
            wait_for(
                f"{name} READY in the index", lambda n=name: index(web, key)[n]["state"] == "READY", procs, timeout=10
            )
            seen_ready.add(name)

        # then idle versions were evicted to make room, least recently used first: no node holds more than its
        # budget, and the versions asked for longest ago are cold again
        wait_for(
            "heartbeats after the last load",
            lambda: sum(n.counts.get("loads", 0) for n in nodes(redis_db).values()) >= COLD + 2 * HOLD,
            procs,
            timeout=10,
        )
        after = nodes(redis_db)
        for name, info in after.items():
            assert len(info.hot) <= HOLD and info.memory_used <= info.memory_budget, (name, info)
            assert info.counts["evictions"] == info.counts["loads"] - HOLD, (name, info.counts)
        evictions = sum(n.counts["evictions"] for n in after.values())
        assert evictions >= COLD, {n: i.counts for n, i in after.items()}
        hot = set().union(*(n.hot for n in after.values()))
        assert len(hot) <= 2 * HOLD
        rows = index(web, key)
        evicted = [name for name in sorted(seen_ready | started) if name not in hot]
        assert len(evicted) >= COLD + HOLD - 2 * HOLD, (hot, evicted)
        for name in evicted:  # each shown cold, with what the next request does about it
            assert rows[name]["state"] == "UNAVAILABLE", rows[name]
            assert rows[name]["reason"].startswith("cold"), rows[name]
        for name in hot:
            assert rows[name]["state"] == "READY", rows[name]
        # and the first of them was evicted for a later one (the node logs why)
        logs = "".join(proc.log() for proc in procs[1:])
        assert re.search(r"evicting packed:\d+ \(idle since [0-9.]+ s\): LRU: room for packed:\d+", logs), logs[-3000:]
        # and an evicted version is loaded again when asked for
        again = evicted[0].split(":")[1]
        resp = call(web, "POST", f"/v2/models/packed/versions/{again}/infer", BODY, auth=key)
        assert resp.status == 200, resp.body

        # -- when versions no node can hold are asked for, several times
        for version, constraint in ((wrong_type.version, "accelerator"), (too_big.version, "min_memory")):
            name = f"packed:{version}"
            for _ in range(3):
                resp = call(web, "POST", f"/v2/models/packed/versions/{version}/infer", BODY, auth=key)
                # then each answer is 503 with the reason, at once
                assert resp.status == 503, resp.body
                message = resp.json()["error"]
                assert f"unschedulable ({constraint})" in message, message
            # and the index shows it unavailable, with the reason
            row = index(web, key)[name]
            assert row["state"] == "UNAVAILABLE" and row["reason"].startswith(f"unschedulable ({constraint})"), row
            # and the nodes' heartbeats carry it as a failure
            for info in nodes(redis_db).values():
                assert info.failures[name].startswith(f"unschedulable ({constraint})"), info.failures
                assert name not in info.ready
        # and neither node ever tried again: one verdict per version per node, however many requests came
        time.sleep(fleet.HEARTBEAT_SECONDS * 2)
        for proc in procs[1:]:
            lines = [line for line in proc.log().splitlines() if "unschedulable (" in line and " ERROR " in line]
            assert len(lines) == 2, (proc.name, lines)
        for proc in procs:
            proc.alive()
    finally:
        stop_all(procs, tail=5000)


@pytest.mark.django_db  # only for the test database's connection settings; the benchmark makes its own
def test_the_fleet200_benchmark_small_every_request_answered(tmp_path) -> None:  # noqa: ANN001
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}_fleet200"
    plot = tmp_path / "fleet.png"
    env = {**os.environ, "FERRY_TORCH_THREADS": "1"}
    try:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.fleet200",
                "--versions",
                "16",
                "--hold",
                "4",
                "--rate",
                "12",
                "--duration",
                "12",
                "--timeout-ms",
                "5000",
                "--database-url",
                url,
                "--redis-url",
                REDIS_URL,
                "--plot",
                str(plot),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        import psycopg

        with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db["NAME"]}_fleet200" WITH (FORCE)')
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "every request answered 200 or 503 with Retry-After: yes" in run.stdout, run.stdout
    # the stream went over more versions than the fleet holds: versions were loaded and evicted on demand
    loads = [int(n) for n in re.findall(r"loads (\d+), evictions \d+", run.stdout)]
    evictions = [int(n) for n in re.findall(r"loads \d+, evictions (\d+)", run.stdout)]
    assert len(loads) == 2 and sum(loads) > 0 and sum(evictions) > 0, run.stdout
    assert re.search(r"hot-version hit rate: [0-9.]+%", run.stdout), run.stdout
    assert re.search(r"cold-load latency on the nodes .*p50 \d+ ms, p99 \d+ ms", run.stdout), run.stdout
    assert re.search(r"/v2/repository/index at the end: READY \d+", run.stdout), run.stdout
    assert plot.stat().st_size > 10_000
