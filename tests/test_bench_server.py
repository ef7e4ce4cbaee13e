"""bench.server's process groups: a run stopped by SIGTERM (`timeout`, `kill`) stops the groups it started.
Real processes: a run that starts a group, then is sent SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bench.server import ROOT

# A bench run in miniature: it starts a sleeping process group with start_group and prints its pid, then
# waits in an event loop, as the benches do (their `with` blocks stop the groups when they end in time). It is
# the source of a child interpreter: its imports are that program's header, not function-local ones here.
RUN = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from bench.server import start_group

    proc = start_group([sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]), {})
    print(proc.pid, flush=True)
    asyncio.run(asyncio.sleep(600))
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill 0: it has exited, and only waits for its parent's wait.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["kill", "timeout"])
def test_a_run_stopped_by_sigterm_stops_the_group_it_started(tmp_path: Path, how: str) -> None:
    # Given a run that started a process group and waits: alone, or under `timeout` (which signals the run,
    # then its whole process group, the run included, a second time)
    argv = [sys.executable, "-c", RUN, str(tmp_path / "child.log")]
    if how == "timeout":
        argv = ["timeout", "3", *argv]
    run = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        assert run.stdout is not None
        child = int(run.stdout.readline())
        assert alive(child)
        # When it is sent SIGTERM
        if how == "kill":
            run.send_signal(signal.SIGTERM)
        # Then it ends as the signal's default would, and the group it started is gone
        assert run.wait(timeout=60) == (-signal.SIGTERM if how == "kill" else 124)
        until = time.monotonic() + 30
        while alive(child) and time.monotonic() < until:
            time.sleep(0.1)
        assert not alive(child)
    finally:
        if run.poll() is None:
            run.kill()
        if child and alive(child):
            os.killpg(child, signal.SIGKILL)
