"""PostgreSQL stopped under a running distributed deployment, with real processes: a throwaway PostgreSQL
(initdb and pg_ctl from this machine, on a spare port, so the shared server stays up), one web process
(`manage.py serve`, FERRY_EMBEDDED_NODE=false, quotas in Redis) and one `manage.py runnode`.

Inference keeps answering 200 from the last routing snapshot (API keys and models in it, quotas in Redis),
and nodes can still fetch artifacts by sha256; control-plane requests answer 503 JSON with Retry-After
rather than a 500; once PostgreSQL is back, both
work again in the same processes, with Django's persistent connections (DATABASE_CONN_MAX_AGE=60)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.conftest import free_port
from tests.test_streams_processes import (
    REDIS_URL,
    ROOT,
    Proc,
    _env,
    digits,
    ready_on,
    redis_db,  # noqa: F401 (a fixture)
    stop_all,
    wait_for,
    web_ready,
)

PG_BIN = Path(os.environ.get("FERRY_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))
SETUP = """
from django.contrib.auth import get_user_model
from tests.conftest import mint_key, register
from pathlib import Path
import os
register(Path(os.environ["DIGITS"]), "digits", max_batch_size=8, max_queue_delay_ms=2)
get_user_model().objects.create_user("ops", password="ops-password", is_staff=True)
print("KEY", mint_key())
"""


class Postgres:
    """A throwaway cluster in its own folder, run as the postgres user when this runs as root (initdb
    refuses root)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.dir = Path(tempfile.mkdtemp(prefix="ferry-pg-"))
        self.data = self.dir / "data"
        self.prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.prefix:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.start()
        subprocess.run(
            [str(PG_BIN / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "ferry"],
            check=True,
            capture_output=True,
        )

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/ferry"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.prefix, str(PG_BIN / tool), *args], check=True, capture_output=True, cwd=self.dir)

    def start(self) -> None:
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.dir / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def postgres() -> Iterator[Postgres]:
    if not (PG_BIN / "initdb").exists():
        pytest.skip(f"no PostgreSQL binaries in {PG_BIN} (set FERRY_TEST_PG_BIN)")
    server = Postgres(free_port())
    yield server
    server.remove()


def env_for(postgres: Postgres, home: Path) -> dict[str, str]:
    return {
        **_env(REDIS_URL, home),
        "DATABASE_URL": postgres.url,
        "DATABASE_CONN_MAX_AGE": "60",
        "FERRY_ARTIFACT_ROOT": str(home.parent / "store"),
        "FERRY_QUOTAS": "true",
        "FERRY_NODE_TOKEN": TOKEN,
    }


def manage(postgres: Postgres, tmp_path: Path, *args: str, extra: dict[str, str] | None = None) -> str:
    home = tmp_path / "setup"
    home.mkdir(exist_ok=True)
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**env_for(postgres, home), **(extra or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def spawn(name: str, args: list[str], postgres: Postgres, tmp_path: Path, port: int = 0) -> Proc:
    home = tmp_path / name
    home.mkdir(exist_ok=True)
    log_path = tmp_path / f"{name}.log"
    with log_path.open("a") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env_for(postgres, home),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return Proc(name, proc, log_path, port)


def control(web: Proc, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=30)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


TOKEN = "outage-node-token"
BASIC = {"Authorization": "Basic " + base64.b64encode(b"ops:ops-password").decode()}
SESSION = {"Cookie": "sessionid=abcdefghijklmnopqrstuvwxyz012345"}  # any session: reading it needs the database


def test_inference_survives_postgres_stopped_and_the_control_plane_recovers(
    redis_db,  # noqa: F811 (a fixture)
    postgres,
    model_files,
    tmp_path,
) -> None:
    # given a deployment on its own PostgreSQL: migrated, a model registered, an API key and an engineer
    manage(postgres, tmp_path, "migrate", "--noinput")
    out = manage(postgres, tmp_path, "shell", "-c", SETUP, extra={"DIGITS": str(model_files.digits)})
    key = next(line.split()[1] for line in out.splitlines() if line.startswith("KEY "))
    port = free_port()
    procs = [
        spawn("web", ["serve", "--host", "127.0.0.1", "--port", str(port)], postgres, tmp_path, port),
        spawn(
            "node-a", ["runnode", "--name", "node-a", "--accelerator", "a10g", "--memory", "4GiB"], postgres, tmp_path
        ),
    ]
    web, _node = procs
    try:
        wait_for("the node ready", lambda: ready_on(redis_db, "node-a", "digits:1"), procs)
        wait_for("the web process ready", lambda: web_ready(web), procs)
        resp, _ = digits(web, key)
        assert resp.status == 200, resp.body
        status, _, body = control(web, "GET", "/api/models/", BASIC)
        assert status == 200, body

        # when PostgreSQL stops
        postgres.stop()
        # then inference answers 200 from the snapshot, past the loops that read the database (registry
        # fingerprint every 2 s, API keys' last use every 5 s)
        statuses: Counter[int] = Counter()
        until = time.monotonic() + 8
        while time.monotonic() < until:
            resp, _ = digits(web, key)
            statuses[resp.status] += 1
        assert set(statuses) == {200}, statuses
        # and the control plane answers a clear 503 JSON with Retry-After: DRF (HTTP Basic), a Django view
        # (the console, reading a session), and the upload door (credentials checked before the body)
        for method, path, headers in (
            ("GET", "/api/models/", BASIC),
            ("GET", "/api/models/", SESSION),
            ("GET", "/console/models/", SESSION),
            ("POST", "/api/models/digits/versions/", BASIC),
        ):
            status, head, body = control(web, method, path, headers)
            assert status == 503, (method, path, status, body[:300])
            assert head.get("content-type", "").startswith("application/json"), head
            assert "error" in orjson.loads(body), body
            assert head.get("retry-after"), head
        # and a node can still fetch an artifact by sha256 (the endpoint reads no table)
        sha = hashlib.sha256(model_files.digits.read_bytes()).hexdigest()
        status, _, body = control(web, "GET", f"/internal/artifacts/{sha}", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and body == model_files.digits.read_bytes(), status

        # when PostgreSQL starts again
        postgres.start()
        # then the same processes serve the control plane again, and inference never stopped
        deadline = time.monotonic() + 20
        while (status := control(web, "GET", "/api/models/", BASIC)[0]) != 200:
            assert status == 503 and time.monotonic() < deadline, status
            time.sleep(0.2)
        status, _, body = control(web, "GET", "/api/models/", BASIC)
        assert status == 200 and b"digits" in body, body
        for _ in range(10):
            resp, _ = digits(web, key)
            assert resp.status == 200, resp.body
        for proc in procs:
            proc.alive()
    finally:
        stop_all(procs, tail=8000)
