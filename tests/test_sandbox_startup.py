"""The sandbox's start-up check (sandbox.self_check): `manage.py runnode` and `celery worker` build the runtime
process's walls once as they start, and exit 1 saying why where they cannot be built (a pod that may not
unshare on a kernel older than Landlock ABI 4), instead of starting healthy and failing every load and
validation. This machine can build them, so the failing kernel is simulated in the check's child: unshare
refused and Landlock's network rules unavailable, as on Linux 6.1 in a pod without CAP_SYS_ADMIN."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management.base import CommandError

from config import celery as celery_config
from serving.dataplane.node import runtime_process, sandbox
from serving.management.commands import runnode

ROOT = Path(__file__).resolve().parent.parent

# The self-check's child on an old kernel in a pod: every unshare refused (EPERM), Landlock at ABI 3 (files only).
OLD_KERNEL_CHILD = f"""
import sys
from serving.dataplane.node import sandbox
sandbox._unshare = lambda flags: {errno.EPERM}
def abi3(record):
    record.skipped["landlock-net"] = "Landlock ABI 3 < 4"
sandbox.landlock_network_and_scope = abi3
sys.exit(sandbox._self_check_main(sys.argv[1]))
"""
OLD_KERNEL = ("-c", OLD_KERNEL_CHILD)
# The same, for a whole process started by a test: the patch made before the command runs.
PATCH_CHECK = f"from serving.dataplane.node import sandbox; sandbox.SELF_CHECK = {OLD_KERNEL!r}"


def check(required: bool = True) -> sandbox.Confinement:
    return sandbox.self_check(
        hidden=runtime_process.hidden_paths(),
        project_root=runtime_process.PROJECT_ROOT,
        device="cpu",
        required=required,
    )


def test_the_check_builds_both_walls_on_this_machine() -> None:
    record = check()
    assert sandbox.missing_walls(record) == []
    assert "landlock-net" in record.applied and "mount-namespace" in record.applied
    assert set(record.skipped) <= sandbox.OPTIONAL_LAYERS


def test_the_check_refuses_where_the_kernel_cannot_build_the_network_wall(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(sandbox, "SELF_CHECK", OLD_KERNEL)
    with pytest.raises(sandbox.ConfinementError) as refused:
        check()
    message = str(refused.value)
    assert "no network wall" in message
    assert "Landlock ABI 3 < 4" in message and "Operation not permitted" in message
    assert sandbox.PARTIAL_SANDBOX_SETTING in message


def test_the_opt_out_lets_the_check_pass_and_records_the_missing_wall(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(sandbox, "SELF_CHECK", OLD_KERNEL)
    record = check(required=False)
    assert "network-wall" in record.skipped
    assert "filesystem-wall" not in record.skipped  # Landlock's filesystem rules applied


def test_runnode_check_refuses_or_warns_as_the_setting_says(monkeypatch, settings, caplog) -> None:  # noqa: ANN001
    monkeypatch.setattr(sandbox, "SELF_CHECK", OLD_KERNEL)
    settings.FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX = False
    with pytest.raises(CommandError, match="cannot be built on this machine: no network wall"):
        runnode.check_sandbox("cpu")
    settings.FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX = True
    with caplog.at_level(logging.WARNING):
        runnode.check_sandbox("cpu")
    assert "network-wall" in caplog.text


def test_inline_isolation_runs_no_check(monkeypatch, settings) -> None:  # noqa: ANN001
    monkeypatch.setattr(sandbox, "SELF_CHECK", OLD_KERNEL)
    settings.FERRY_RUNTIME_ISOLATION = "inline"
    runnode.check_sandbox("cpu")  # no runtime process to confine: nothing to refuse


def run(tmp_path: Path, code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "FERRY_DATA_DIR": str(tmp_path),
        # Nothing listens there: both commands must stop before they connect to anything.
        "REDIS_URL": "redis://127.0.0.1:9/0",
        "FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX": "false",
    }
    return subprocess.run(
        [sys.executable, "-c", f"{PATCH_CHECK}\n{code}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_runnode_exits_1_at_start_where_the_walls_cannot_be_built(tmp_path: Path) -> None:
    done = run(
        tmp_path,
        "import os, sys, django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'config.settings')\n"
        "from django.core.management import execute_from_command_line\n"
        "execute_from_command_line(['manage.py', 'runnode', '--metrics-port', '0', '--name', 'old-kernel'])\n",
    )
    assert done.returncode == 1, done.stderr
    assert "the model sandbox cannot be built on this machine: no network wall" in done.stderr
    assert "Landlock ABI >= 4" in done.stderr
    assert "node old-kernel:" not in done.stdout  # it never came up


def test_the_celery_worker_exits_1_at_start_where_the_walls_cannot_be_built(tmp_path: Path) -> None:
    done = run(
        tmp_path,
        "import sys\n"
        "from celery.__main__ import main\n"
        "sys.argv = ['celery', '-A', 'config', 'worker', '-P', 'solo', '--without-mingle', '--without-gossip']\n"
        "main()\n",
    )
    assert done.returncode == 1, done.stderr
    assert "ferry worker: the model sandbox cannot be built on this machine" in done.stderr
    assert "no network wall" in done.stderr and "Landlock ABI >= 4" in done.stderr


def test_a_worker_of_other_queues_only_is_not_checked(monkeypatch) -> None:  # noqa: ANN001
    # The autoscaler's worker (-Q autoscale) runs no validation, so no model: it starts where walls cannot be built
    monkeypatch.setattr(sandbox, "SELF_CHECK", OLD_KERNEL)
    celery_config.check_sandbox(conf=celery_config.app.conf, options={"queues": ["autoscale"]})
    # while a worker of the default queue, where validation runs, does not
    with pytest.raises(SystemExit, match="every validation would fail: no network wall"):
        celery_config.check_sandbox(conf=celery_config.app.conf, options={"queues": ["celery", "autoscale"]})
