"""Embedded mode with several web processes, with real processes: `manage.py serve --workers 2` and no Redis.

`serve` starts the node host (`manage.py nodehost`), which loads the models and keeps the quotas, then two web
processes sharing the port (serving.dataplane.transport.host_link). On the test PostgreSQL database, one
deployment, checked in turn:

- both web processes and the host are up, and inference is answered;
- a tenant's rate is its rate across both web processes, not twice it;
- `kill -9` of the node host: every request is answered (200, or 503 with Retry-After while it is away, never a
  hang or a 500), `serve` starts it again, and serving resumes in the same web processes.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import orjson
from django.conf import settings as django_settings
from django.db import connection

from tests.conftest import free_port, mint_key, register, tenant
from tests.test_inference_http import digits_request
from tests.test_streams_processes import ROOT, Proc, stop_all, wait_for

BODY = orjson.dumps(digits_request(np.ones((1, 64), np.float32)))
NO_ANSWER_S = 30


def start_serve(tmp_path: Path, port: int, **extra_env: str) -> Proc:
    db = connection.settings_dict
    data_dir = tmp_path / "data"
    data_dir.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "FERRY_NODE_SOCKET", "FERRY_EMBEDDED_NODE")}
    env.update(
        {
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "DATABASE_CONN_MAX_AGE": "0",
            "SECRET_KEY": django_settings.SECRET_KEY,
            "FERRY_DATA_DIR": str(data_dir),
            "FERRY_ARTIFACT_ROOT": str(django_settings.FERRY_ARTIFACT_ROOT),
            "FERRY_TORCH_THREADS": "1",
            "FERRY_LOOP_LAG_TARGET_MS": "60000",
            "FERRY_MAX_LOOP_LAG_MS": "60000",
            "FERRY_MAX_FRONTEND_WAIT_MS": "60000",
            "PYTHONUNBUFFERED": "1",
            **extra_env,
        }
    )
    log_path = tmp_path / "serve.log"
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Proc("serve", proc, log_path, port)


def post(port: int, key: str, path: str = "/v2/models/digits/infer") -> tuple[int, dict[str, str], bytes]:
    """A fresh connection per request, so the kernel hands them to either web process. Status -1: no answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=NO_ANSWER_S)
    try:
        conn.request(
            "POST", path, body=BODY, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
        )
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    except OSError:
        return -1, {}, b""
    finally:
        conn.close()


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0
    finally:
        conn.close()


def children(pid: int) -> dict[int, str]:
    """Every descendant of `pid` with its command line."""
    parent: dict[int, int] = {}
    cmdline: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline[int(entry)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found[child] = cmdline.get(child, "")
                frontier.append(child)
    return found


def host_pid(serve: Proc) -> int | None:
    hosts = [p for p, cmd in children(serve.proc.pid).items() if " nodehost " in f" {cmd} "]
    return hosts[0] if hosts else None


def web_pids(serve: Proc) -> list[int]:
    return [p for p, cmd in children(serve.proc.pid).items() if "multiprocessing" in cmd and "spawn_main" in cmd]


def test_two_web_processes_share_one_node_host_and_one_quota_and_outlive_it(
    transactional_db,  # noqa: ANN001
    model_files,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
) -> None:
    # One deployment for both checks: each start imports torch and Django in four processes.
    register(model_files.digits, "digits", max_batch_size=8, max_queue_delay_ms=2)
    key = mint_key()
    other = mint_key("other")  # the kill's clients: a tenant with the default quota, far above their rate
    # 5 requests a second with a burst of 10: within the first second, at most about 15 are admitted in all.
    quota = tenant().quota
    quota.requests_per_second, quota.burst, quota.max_in_flight = 5, 10, 100
    quota.save()
    port = free_port()
    serve = start_serve(tmp_path, port, FERRY_QUOTAS="true")
    try:
        wait_for("serve ready", lambda: get(port, "/v2/health/ready") == 200, [serve])
        assert len(web_pids(serve)) == 2, children(serve.proc.pid)
        assert host_pid(serve) is not None, children(serve.proc.pid)
        wait_for("digits answered", lambda: post(port, key)[0] == 200, [serve])
        time.sleep(3)  # the bucket fills again
        assert_one_quota(port, key)
        assert_the_host_is_started_again(serve, port, other)
    finally:
        stop_all([serve])


def assert_one_quota(port: int, key: str) -> None:
    results: list[tuple[int, dict[str, str]]] = []
    lock = threading.Lock()

    def burst() -> None:
        for _ in range(4):
            status, headers, _ = post(port, key)
            with lock:
                results.append((status, headers))

    started = time.monotonic()
    threads = [threading.Thread(target=burst) for _ in range(12)]  # 48 requests, 12 connections at a time
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    counts = Counter(status for status, _ in results)
    assert set(counts) <= {200, 429}, counts
    allowed = 10 + 5 * elapsed + 2  # the burst, the refill while sending, one in flight at each edge
    assert counts[200] <= allowed, (counts, elapsed)  # per-process quotas admit about twice this
    assert counts[429] > 0, counts
    assert all("retry-after" in headers for status, headers in results if status == 429)


def assert_the_host_is_started_again(serve: Proc, port: int, key: str) -> None:
    """kill -9 of the node host under load: every request answered 200 or 503 with Retry-After, never a
    hang or a 500; `serve` starts it again, and the same web processes serve on."""
    first = host_pid(serve)
    webs = sorted(web_pids(serve))
    assert first is not None
    answers: list[tuple[float, int, bool, float]] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            status, headers, body = post(port, key)
            answers.append((sent, status, "retry-after" in headers, time.monotonic() - sent))
            if status == 200:
                assert orjson.loads(body)["model_name"] == "digits"
            time.sleep(0.02)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(2)
    killed_at = time.monotonic()
    os.kill(first, signal.SIGKILL)
    wait_for("the node host started again", lambda: (host_pid(serve) or first) != first, [serve])
    wait_for(
        "digits answered 200 again",
        lambda: any(sent > killed_at and status == 200 for sent, status, _, _ in answers[-20:]),
        [serve],
    )
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join()
    statuses = Counter(status for _, status, _, _ in answers)
    assert set(statuses) <= {200, 503}, statuses  # no hang (-1), no 500
    assert statuses[503] > 0, statuses  # the kill was seen, and answered
    assert all(retry for _, status, retry, _ in answers if status == 503)
    # The same web processes serve on: they reconnected; nothing restarted them.
    assert sorted(web_pids(serve)) == webs
    assert max(took for _, _, _, took in answers) < NO_ANSWER_S
