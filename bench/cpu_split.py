"""Where the cores went during a run: CPU by kind of process, sampled from /proc by a process of its own.

The overload benchmarks run the server, its nodes and the load generator on the same cores, and what a step
can serve depends on how the cores were shared out. `CpuSplit` starts `python -m bench.cpu_split` beside the
run, which reads every process's CPU time from /proc every PERIOD_S and writes, per sample, the cores' worth
each kind of process used since the last one; `by_window` averages them over the run's steps. A process of
its own, not a thread: a thread of the generator would take its GIL for each read of /proc, and the generator
times what it measures on that loop.

A process's kind comes from its command line (KINDS, first match); a process none matches (a multiprocessing
child, a resource tracker) is its parent's kind, and "other" when that is unknown too. `--generator PID`
names the load generator, whatever its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PERIOD_S = 0.5
# (kind, a substring of the command line), first match wins.
KINDS = (
    ("sampler", "bench.cpu_split"),  # this module's own process: its cost is shown, not hidden in another's
    ("runtime", "serving.dataplane.node.runtime_worker"),
    ("node host", "manage.py nodehost"),
    ("node", "manage.py runnode"),
    ("web", "manage.py serve"),
    ("celery", "celery"),
    ("redis", "redis-server"),
    ("postgres", "postgres"),
)
OTHER = "other"
GENERATOR = "generator"


@dataclass(frozen=True, slots=True)
class Proc:
    ppid: int
    cmdline: str
    cpu_s: float  # user + system, this process's own threads


def read_procs(root: Path = Path("/proc")) -> dict[int, Proc]:
    """Every process readable now; one that exits while it is read is left out."""
    tick = os.sysconf("SC_CLK_TCK")
    procs = {}
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        procs[int(entry.name)] = Proc(int(stat[1]), cmdline, (int(stat[11]) + int(stat[12])) / tick)
    return procs


def kinds(procs: dict[int, Proc], generator: int | None = None) -> dict[int, str]:
    """Each process's kind: its command line's (KINDS), else its nearest classified ancestor's."""
    own: dict[int, str | None] = {}
    for pid, proc in procs.items():
        own[pid] = GENERATOR if pid == generator else next((k for k, s in KINDS if s in proc.cmdline), None)
    found: dict[int, str] = {}

    def kind(pid: int, depth: int = 0) -> str:
        if pid in found:
            return found[pid]
        mine = own.get(pid)
        if mine is None:
            parent = procs[pid].ppid if pid in procs else 0
            mine = kind(parent, depth + 1) if parent in procs and depth < 16 else OTHER
        found[pid] = mine
        return mine

    for pid in procs:
        kind(pid)
    return found


def split(
    before: dict[int, Proc], after: dict[int, Proc], seconds: float, generator: int | None = None
) -> dict[str, float]:
    """Cores' worth of CPU by kind between two readings `seconds` apart (a process new since `before` counts
    from zero: a runtime process started meanwhile)."""
    of = kinds(after, generator)
    cores: dict[str, float] = {}
    for pid, proc in after.items():
        used = proc.cpu_s - (before[pid].cpu_s if pid in before and before[pid].ppid == proc.ppid else 0.0)
        if used > 0:
            cores[of[pid]] = cores.get(of[pid], 0.0) + used / seconds
    return cores


@dataclass
class CpuSplit:
    """The sampler beside a block: `samples` once it ends, (wall time at the sample's end, {kind: cores})."""

    generator: int = field(default_factory=os.getpid)
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    @contextlib.contextmanager
    def running(self) -> Iterator[CpuSplit]:
        with tempfile.NamedTemporaryFile(prefix="ferry-cpu-split-", suffix=".jsonl", delete=False) as out:
            path = Path(out.name)
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.cpu_split", "--out", str(path), "--generator", str(self.generator)],
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            yield self
        finally:
            proc.terminate()
            proc.wait(10)
            for line in path.read_text().splitlines():
                doc = json.loads(line)
                self.samples.append((doc.pop("at"), doc))
            path.unlink(missing_ok=True)

    def by_window(self, windows: list[tuple[float, float]]) -> list[dict[str, float]]:
        """Per (start, end) wall-time window, the mean cores by kind over the samples that ended within it."""
        means = []
        for start, end in windows:
            inside = [cores for at, cores in self.samples if start < at <= end]
            kinds_seen = sorted({k for cores in inside for k in cores})
            means.append({k: sum(c.get(k, 0.0) for c in inside) / len(inside) for k in kinds_seen} if inside else {})
        return means


def table(multipliers: list[float], cores: list[dict[str, float]]) -> list[str]:
    """A markdown table: a row per step (its multiplier), a column per kind seen, in KINDS' order, and the total."""
    order = [GENERATOR, *(k for k, _ in KINDS), OTHER]
    seen = [k for k in order if any(k in c for c in cores)]
    lines = [
        "| step | " + " | ".join(seen) + " | all |",
        "|---|" + "---|" * (len(seen) + 1),
    ]
    for m, c in zip(multipliers, cores, strict=True):
        cells = [f"{c.get(k, 0.0):.2f}" for k in seen]
        lines.append(f"| {m:g}x | " + " | ".join(cells) + f" | {sum(c.values()):.2f} |")
    return lines


def step_lines(steps: list[dict]) -> list[str]:
    """A benchmark page's paragraph and table of where the cores went, from ramp steps that carry "cores" (none
    carry them: nothing)."""
    cores = [step.get("cores") or {} for step in steps]
    if not any(cores):
        return []
    return [
        f"Where the cores went ({os.cpu_count()} in all), by kind of process, each step's mean: CPU time read from"
        f" `/proc` every {PERIOD_S:g} s by `bench.cpu_split`, a process beside the run (its own share is *sampler*).",
        "",
        *table([step["multiplier"] for step in steps], cores),
        "",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="JSON lines: {at: wall time, kind: cores, ...}")
    p.add_argument("--generator", type=int, help="the load generator's pid")
    p.add_argument("--period", type=float, default=PERIOD_S)
    a = p.parse_args(argv)
    before, t0 = read_procs(), time.monotonic()
    with a.out.open("a") as out:
        while True:
            time.sleep(a.period)
            after, t1 = read_procs(), time.monotonic()
            cores = split(before, after, t1 - t0, a.generator)
            out.write(json.dumps({"at": time.time(), **{k: round(v, 4) for k, v in cores.items()}}) + "\n")
            out.flush()
            before, t0 = after, t1


if __name__ == "__main__":
    raise SystemExit(main())
