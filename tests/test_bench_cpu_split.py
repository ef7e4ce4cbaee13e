"""bench.cpu_split: which kind of process the cores went to, from /proc readings (synthetic ones here, and one
real run of the sampler)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from bench import cpu_split
from bench.cpu_split import CpuSplit, Proc, kinds, split

SERVE = "python manage.py serve --host 127.0.0.1 --port 8000 --workers 2"
SPAWN = "python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=7) --multiprocessing-fork"
RUNTIME = "python -m serving.dataplane.node.runtime_worker --zygote --fd 19"


def table(**cpu: float) -> dict[int, Proc]:
    """A process table: the bench (10), the web supervisor (20) and its worker (21), a node (30), its runtime
    zygote (31) and a runtime under that (32), Redis (40), something unknown (50) and its child (51)."""
    rows = {
        10: (1, "python -m bench.overload_distributed"),
        20: (10, SERVE),
        21: (20, SPAWN),
        30: (10, "python manage.py runnode --name node-a"),
        31: (30, RUNTIME),
        32: (31, RUNTIME),
        40: (1, "redis-server 127.0.0.1:6379"),
        50: (1, "/usr/sbin/sshd"),
        51: (50, "bash"),
    }
    return {pid: Proc(ppid, cmd, cpu.get(f"p{pid}", 0.0)) for pid, (ppid, cmd) in rows.items()}


def test_a_process_is_its_command_lines_kind_else_its_parents() -> None:
    # given a bench, a web server with a worker, a node with its runtime processes, Redis and an unknown tree
    of = kinds(table(), generator=10)
    # then each is named by its command line, a worker by its parent's, the generator by its pid
    assert of == {
        10: "generator",
        20: "web",
        21: "web",
        30: "node",
        31: "runtime",
        32: "runtime",
        40: "redis",
        50: "other",
        51: "other",
    }


def test_the_split_is_the_cores_each_kind_used_between_two_readings() -> None:
    before = table(p21=10.0, p31=1.0, p32=5.0, p40=2.0)
    # given half a second in which the web worker used 0.4 s, the runtime 0.2 s and Redis 0.05 s
    after = table(p21=10.4, p31=1.0, p32=5.2, p40=2.05)
    # and a runtime process that started meanwhile and used 0.1 s
    after[33] = Proc(31, RUNTIME, 0.1)
    cores = split(before, after, 0.5, generator=10)
    # then the cores' worth of each kind over the half second, the new process counted from zero
    assert cores == pytest.approx({"web": 0.8, "runtime": 0.6, "redis": 0.1})
    # and a pid reused by another process (another parent) counts from zero too, not from the old one's time
    after[40] = Proc(50, "redis-server 127.0.0.1:6379", 0.05)
    assert split(before, after, 0.5, generator=10)["redis"] == pytest.approx(0.1)


def test_by_window_averages_the_samples_that_ended_within_each_step() -> None:
    cpu = CpuSplit(generator=0, samples=[(1.5, {"web": 1.0}), (2.0, {"web": 0.5, "node": 0.2}), (3.0, {"web": 0.2})])
    # given steps of [1, 2] and [2, 3] seconds, and one no sample ended within
    means = cpu.by_window([(1.0, 2.0), (2.0, 3.0), (3.0, 4.0)])
    # then each step's mean is over its own samples; a kind missing from a sample counts 0 there
    assert means[0] == pytest.approx({"web": 0.75, "node": 0.1})
    assert means[1] == pytest.approx({"web": 0.2})
    assert means[2] == {}
    # and the page's table has a column per kind seen, in a fixed order, and each step's total
    assert cpu_split.table([0.5, 1.0], means[:2]) == [
        "| step | node | web | all |",
        "|---|---|---|---|",
        "| 0.5x | 0.10 | 0.75 | 0.85 |",
        "| 1x | 0.00 | 0.20 | 0.20 |",
    ]
    # and a page's lines: the paragraph, then the table; none for steps that carry no cores (an older result)
    steps = [{"multiplier": 0.5, "cores": means[0]}, {"multiplier": 1.0, "cores": means[1]}]
    lines = cpu_split.step_lines(steps)
    assert lines[0].startswith("Where the cores went") and lines[2:6] == cpu_split.table([0.5, 1.0], means[:2])
    assert cpu_split.step_lines([{"multiplier": 1.0}]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_sampler_process_reports_the_cores_this_process_burns() -> None:
    # given the sampler beside this process, which spins for a second and a half
    cpu = CpuSplit()
    with cpu.running():
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            pass
    # then its samples put CPU under "generator" (this process), and its own under "sampler"
    assert cpu.samples, "no sample in 1.5 s"
    assert max(cores.get("generator", 0.0) for _, cores in cpu.samples) > 0.05  # a busy machine gives it less
    assert os.getpid() == cpu.generator
