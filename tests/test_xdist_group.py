"""The process tests' xdist group forms (tests/xdist_workers.py): a pytest run on two workers, as `make test`
runs, keeps every test of the named process modules on one worker, one after another.

It failed silently twice: the marker was added after pytest-xdist had read the markers, and pytest 9.2's
structured node ids drop the `@group` suffix xdist relies on (pytest-dev/pytest-xdist#1386). Either way the
suite still passed, with two deployments of real processes starving each other on two cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Two module names from the group (a test module's name is what puts it there) and one outside it.
GROUPED = ("test_fleet_processes", "test_shadow_processes")
ALONE = "test_elsewhere"
BODY = "\n".join(f"def test_{i}():\n    pass\n" for i in range(6))


def test_the_process_modules_run_on_one_worker_and_the_rest_spread(tmp_path: Path) -> None:
    for name in (*GROUPED, ALONE):
        (tmp_path / f"{name}.py").write_text(BODY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_XDIST_WORKER", None)  # the inner run is a controller of its own, not this worker
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.xdist_workers", "-p", "no:django", "-p", "no:randomly",
         "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    placed = re.findall(r"\[(gw\d+)\] .*?PASSED (\S+)", run.stdout)
    assert len(placed) == 18, run.stdout[-3000:]
    grouped = {(worker, test) for worker, test in placed if test.split("::")[0].removesuffix(".py") in GROUPED}
    assert len(grouped) == 12
    assert all(test.endswith("@processes") for _, test in grouped), sorted(grouped)
    assert len({worker for worker, _ in grouped}) == 1, sorted(grouped)
    others = [test for _, test in placed if test.startswith(ALONE)]
    assert len(others) == 6 and not any("@" in test for test in others)
