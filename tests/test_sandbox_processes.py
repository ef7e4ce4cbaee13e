"""The sandboxed runtime in real deployments: embedded mode as `make run` starts it (`manage.py serve` on SQLite
under its own FERRY_DATA_DIR, no Redis, no PostgreSQL), whose in-process node runs each model in a confined
child; and registration over HTTP of the model the security review used (`aten::from_file`)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient

from serving.demo import save_artifact
from tenants.models import Membership, Role, Tenant
from tests.conftest import DIGITS_IO, free_port
from tests.test_runtime_sandbox import ReadsAFile
from tests.test_streams_processes import ROOT, Proc, digits, stop_all, wait_for, web_ready
from tests.xdist_workers import SUITE_LATENCY_BUDGET_MS

SETUP = """
import os
from pathlib import Path
from tests.conftest import mint_key, register
register(Path(os.environ["DIGITS"]), "digits", max_batch_size=8, max_queue_delay_ms=2)
print("KEY", mint_key())
"""
NODE_TOKEN = "embedded-node-token-that-must-not-reach-the-model"
WORKER = "serving.dataplane.node.runtime_worker"


def embedded_env(home: Path) -> dict[str, str]:
    """`make run`'s environment: no DATABASE_URL or REDIS_URL (SQLite and the in-memory layer), everything
    under FERRY_DATA_DIR (its secret_key included), plus a node token for the child not to see."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY") and not k.startswith("FERRY_")
    }
    return {
        **env,
        "FERRY_DATA_DIR": str(home),
        "FERRY_TORCH_THREADS": "1",
        "FERRY_NODE_TOKEN": NODE_TOKEN,
        "FERRY_LOOP_LAG_TARGET_MS": "60000",
        "FERRY_MAX_LOOP_LAG_MS": "60000",
        "FERRY_LATENCY_BUDGET_MS": SUITE_LATENCY_BUDGET_MS,
    }  # the FERRY_ variables above are dropped


def manage(home: Path, *args: str, extra: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**embedded_env(home), **(extra or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc/<pid>/task/*/children."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue  # the task ended meanwhile
            found += children
            todo += children
    return found


def runtime_children(pid: int) -> list[int]:
    """The runtime processes below `pid`: the worker's command line (forked by its zygote, which has the same
    one) and the name a runtime process gives itself."""
    kids = []
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            if WORKER in cmdline and Path(f"/proc/{child}/comm").read_text().strip() == "ferry-runtime":
                kids.append(child)
        except OSError:
            continue
    return kids


@pytest.fixture
def embedded(tmp_path: Path, model_files) -> Iterator[tuple[Proc, Path, str]]:  # noqa: ANN001
    home = tmp_path / "data"
    home.mkdir()
    manage(home, "migrate", "--noinput")
    out = manage(home, "shell", "-c", SETUP, extra={"DIGITS": str(model_files.digits)})
    key = next(line.split()[1] for line in out.splitlines() if line.startswith("KEY "))
    port = free_port()
    log_path = tmp_path / "web.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=embedded_env(home),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    web = Proc("web", proc, log_path, port)
    try:
        yield web, home, key
    finally:
        stop_all([web])


def test_embedded_modes_model_runs_in_a_child_that_sees_no_data_dir_and_no_secret(embedded) -> None:  # noqa: ANN001
    web, home, key = embedded
    wait_for("the web process ready", lambda: web_ready(web), [web])
    # given a request served (the model is loaded on the web process's in-process node)
    resp, _ = digits(web, key)
    assert resp.status == 200, resp.body
    deadline = time.monotonic() + 60
    while not (children := runtime_children(web.proc.pid)):
        assert time.monotonic() < deadline, "no runtime process under the web process:\n" + web.log()[-3000:]
        time.sleep(0.2)
    secret = (home / "secret_key").read_text().strip()
    # the web process itself sees its data directory (so the checks below can fail)
    assert {"secret_key", "ferry.sqlite3"} <= set(os.listdir(f"/proc/{web.proc.pid}/root{home}"))
    for child in children:
        # then the child's view of the data directory holds neither the secret key nor the database
        inside = Path(f"/proc/{child}/root{home}")
        assert not inside.exists() or not {"secret_key", "ferry.sqlite3"} & set(os.listdir(inside))
        # because the data directory itself is covered in its mount namespace (not only a parent of it)
        mounts = Path(f"/proc/{child}/mountinfo").read_text().splitlines()
        assert any(line.split()[4] == str(home) for line in mounts), mounts
        # and its environment holds no secret: not the key, not the node token, no database or Redis URL
        environ = Path(f"/proc/{child}/environ").read_bytes().decode(errors="replace")
        assert "SECRET_KEY" not in environ and secret not in environ and NODE_TOKEN not in environ
        assert "DATABASE_URL" not in environ and "FERRY_DATA_DIR" not in environ
        # and it holds no capability, and runs as another user than the web process (nobody, where that is
        # root) or, where the web process is not root, in a user namespace of its own
        status = dict(line.split(":", 1) for line in Path(f"/proc/{child}/status").read_text().splitlines())
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, status
        uid = status["Uid"].split()
        if os.geteuid() == 0:
            assert uid == ["65534"] * 4, uid
        else:
            assert os.readlink(f"/proc/{child}/ns/user") != os.readlink(f"/proc/{web.proc.pid}/ns/user")
        # and its stderr is not the web process's log
        assert os.readlink(f"/proc/{child}/fd/2") == "/dev/null"


@pytest.mark.skipif(
    importlib.util.find_spec("serving.dataplane.node.operator_check") is None,
    reason="needs the operator check at registration (serving.dataplane.node.operator_check, H2's part)",
)
@pytest.mark.django_db
def test_registering_the_model_that_reads_a_file_answers_422_naming_from_file(tmp_path: Path) -> None:
    """Passes once the operator allow-list (H2) checks registrations: the graph calls aten::from_file."""
    path = tmp_path / "reads.pt"
    save_artifact(ReadsAFile("/nonexistent/secret_key"), "torchscript", torch.zeros(2, 64), path)
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    bob = User.objects.create_user("bob", "bob@example.org")
    Membership.objects.create(user=bob, tenant=tenant, role=Role.ENGINEER)
    client = APIClient()
    client.force_login(bob)
    upload = io.BytesIO(path.read_bytes())
    upload.name = "model.pt"
    response = client.post(
        "/api/models/reads/versions/",
        {
            "format": "torchscript",
            "artifact": upload,
            "max_batch_size": 2,
            "inputs": json.dumps(DIGITS_IO["inputs"]),
            "outputs": json.dumps(DIGITS_IO["outputs"]),
        },
        format="multipart",
    )
    assert response.status_code == 422, response.content
    assert "aten::from_file" in response.json()["error"]
