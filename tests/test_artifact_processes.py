"""Artifacts reach a node on another machine, and a node's /metrics, with real processes: one web process
(`manage.py serve`, FERRY_EMBEDDED_NODE=false, FERRY_NODE_TOKEN) and a `manage.py runnode` whose data dir
and artifact root are its own, empty folders (it cannot read the web's disk), fetching from the web by
sha256 (FERRY_ARTIFACT_URL) into its cache, and serving Prometheus metrics on --metrics-port."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.conftest import free_port, mint_key, register
from tests.test_streams_processes import (
    REDIS_URL,
    ROOT,
    Proc,
    _env,
    digits,
    ready_on,
    redis_db,  # noqa: F401 (a fixture)
    start_web,
    stop_all,
    wait_for,
    web_ready,
)

TOKEN = "test-node-token"


def start_remote_node(name: str, tmp_path: Path, web: Proc, metrics_port: int) -> Proc:
    """A node that shares nothing on disk with the web process: its own data dir, artifact root and cache."""
    home = tmp_path / f"{name}-home"
    (home / "artifacts").mkdir(parents=True, exist_ok=True)
    env = {
        **_env(REDIS_URL, home),
        "FERRY_ARTIFACT_ROOT": str(home / "artifacts"),
        "FERRY_ARTIFACT_URL": f"http://127.0.0.1:{web.port}",
        "FERRY_NODE_TOKEN": TOKEN,
    }
    log_path = tmp_path / f"{name}.log"
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "runnode",
                "--name",
                name,
                "--accelerator",
                "a10g",
                "--memory",
                "24GiB",
                "--metrics-port",
                str(metrics_port),
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Proc(name, proc, log_path)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def web_live(web: Proc) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{web.port}/v2/health/live", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_a_node_without_the_webs_disk_fetches_checks_and_serves(
    transactional_db,
    redis_db,  # noqa: F811 (a fixture)
    model_files,
    tmp_path,
    monkeypatch,
) -> None:
    version = register(model_files.digits, "digits", max_batch_size=8, max_queue_delay_ms=2)
    sha = version.artifact_id
    key = mint_key()
    monkeypatch.setenv("FERRY_NODE_TOKEN", TOKEN)  # the web process's (start_web passes os.environ on)
    web = start_web(tmp_path, REDIS_URL)
    procs = [web]
    metrics_port = free_port()
    try:
        wait_for("the web process live", lambda: web_live(web), procs)
        node = start_remote_node("node-far", tmp_path, web, metrics_port)
        procs.append(node)
        cache = tmp_path / "node-far-home" / "artifact-cache" / sha[:2] / sha

        # given a node that cannot read the web's artifact store: it fetched by sha256, into its cache
        wait_for("the node ready with digits:1", lambda: ready_on(redis_db, "node-far", "digits:1"), procs)
        assert not any((tmp_path / "node-far-home" / "artifacts").iterdir())
        assert cache.read_bytes() == model_files.digits.read_bytes()
        # then it serves the version
        wait_for("the web process ready", lambda: web_ready(web), procs)
        for _ in range(5):
            resp, _ = digits(web, key)
            assert resp.status == 200, resp.body

        # and its /metrics says so: what it served, what is hot, its memory and the load's measured time
        samples = scrape(metrics_port)
        assert samples['ferry_node_stream_entries_total{outcome="served"}'] >= 5
        assert samples['ferry_node_version_hot{model="digits",version="1"}'] == 1
        assert samples['ferry_node_versions{state="hot"}'] == 1
        assert samples["ferry_node_memory_budget_bytes"] == 24 * 1024**3
        assert 0 < samples["ferry_node_memory_used_bytes"] <= 24 * 1024**3
        assert samples['ferry_node_version_load_seconds{model="digits",version="1"}'] > 0
        assert samples['ferry_artifact_fetches_total{outcome="fetched"}'] == 1
        assert samples['ferry_node_held_requests{model="digits",version="1"}'] == 0
        assert samples['ferry_compute_seconds_count{model="digits",version="1"}'] >= 1  # the data plane's own

        # when the cached file is tampered with while the node is down, and the node starts again
        node.stop()
        cache.chmod(0o644)
        cache.write_bytes(cache.read_bytes()[:-16] + b"\0" * 16)
        node = start_remote_node("node-far", tmp_path, web, metrics_port)
        procs[1] = node
        wait_for(
            "the restarted node ready",
            lambda: ready_on(redis_db, "node-far", "digits:1") and "does not hash to its name" in node.log(),
            procs,
        )
        # then the tampered bytes were refused, counted and logged, never loaded, and the artifact fetched again
        samples = scrape(metrics_port)
        assert samples['ferry_artifact_refused_total{where="cache"}'] == 1
        assert samples['ferry_artifact_fetches_total{outcome="fetched"}'] == 1
        assert cache.read_bytes() == model_files.digits.read_bytes()
        # and the web process routes to it again once its fleet view (re-read every 0.25 s) has it
        wait_for(
            "the web process serving through the restarted node",
            lambda: digits(web, key)[0].status == 200,
            procs,
            timeout=30,
        )
    finally:
        stop_all(procs)
