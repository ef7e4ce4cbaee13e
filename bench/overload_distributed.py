"""The overload benchmark (bench.overload) in distributed mode: the same capacity search and ramp, served by
two web processes (`manage.py serve --workers 2`, FERRY_EMBEDDED_NODE=false, one port), two `manage.py runnode`
processes, a Celery worker and Celery beat, on PostgreSQL and Redis.

    .venv/bin/python -m bench.overload_distributed [--quick] [--models digits-wide,digits]
        [--database-url postgres://postgres@127.0.0.1:5432/ferry_overload] [--redis-url redis://127.0.0.1:6379/8]
        [--broker-url redis://127.0.0.1:6379/9] [--capacity 1900] [--record docs/benchmarks/overload.md]

The database is dropped and created again; the Redis databases are emptied of Ferry's keys. The clients send no
deadline of their own (the platform's 300 ms budget applies) unless bench.overload's settings say otherwise.
Admission is on: the gateways refuse before the stream on the load the nodes publish
(serving.dataplane.transport.load_view), the nodes on arrival. The server-side counters are one web
process's (a scrape reaches one of the two); the statuses are the clients'.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import cpu_split, overload
from bench.fleet200 import clear_redis, fresh_database
from bench.overload_report import checks
from bench.run import setup_data_dir
from bench.server import ROOT, Server, free_port, proc_memory, say, start_group, stop_groups

NODES = ("node-a", "node-b")


class Deployment(Server):
    """What bench.overload's ramp needs of a server (`base`, `rss_kib`, `wait_ready`), over six processes."""

    def __init__(self, env: dict[str, str], port: int, logs: Path) -> None:
        super().__init__(env, port, logs / "web.log")
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        say(f"$ {' '.join(argv)}  (log: {self.logs / name}.log)")
        proc = start_group(argv, self.logs / f"{name}.log", self.env)
        self.procs[name] = proc
        return proc

    def __enter__(self) -> Deployment:
        py = sys.executable
        self.proc = self._start(
            "web", [py, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "2"]
        )
        for name in NODES:
            self._start(name, [py, "manage.py", "runnode", "--name", name, "--accelerator", "cpu", "--memory", "2GiB"])
        celery = [py, "-m", "celery", "-A", "config"]
        self._start("worker", [*celery, "worker", "-P", "solo", "-Q", "celery", "--without-gossip", "--without-mingle"])
        self._start("beat", [*celery, "beat", "-s", str(self.logs / "celerybeat-schedule")])
        return self

    def __exit__(self, *exc: object) -> None:
        stop_groups(list(self.procs.values()))

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode})")

    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs.values())

    def rss_kib(self) -> dict[str, int]:
        """The processes' VmRSS and VmHWM summed (the web process's workers are its children: not counted)."""
        total: dict[str, int] = {}
        for proc in self.procs.values():
            for key, value in proc_memory(proc.pid).items():
                total[key] = total.get(key, 0) + value
        return total


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_commit() -> str:
    """The commit the run starts from, and what the working tree changes in the code that runs (serving/,
    bench/, config/), if anything: taken as the run starts, not as it ends."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", "serving", "bench", "config"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    ).stdout.split("\n")  # fmt: skip
    paths = [line[3:] for line in changed if line.strip()]
    return f"`{head.strip()}`" + (f", with uncommitted changes to {', '.join(paths)}" if paths else ", clean tree")


def _verdict(ok: bool | None) -> str:
    return "reading" if ok is None else ("PASS" if ok else "FAIL")


def row(res: overload.RampResult, step: dict[str, Any]) -> str:
    answers = max(1, step.get("answers", 0))
    seconds = max(step.get("seconds", 1.0), 1e-9)
    reasons = ", ".join(f"{k} {v / seconds:.0f}" for k, v in sorted(step.get("shed_by_reason", {}).items()))
    return (
        f"| {step['multiplier']:g}x | {step['offered_rps']:.0f} | {step['admitted_rps']:.0f}"
        f" ({step['fallback_rps']:.0f}) | {step['shed_rps']:.0f}{f' ({reasons})' if reasons else ''}"
        f" | {step['t504_rps']:.1f}"
        f" ({100 * step.get('t504', 0) / answers:.1f}%) | {step.get('t500', 0)} | {step['goodput_rps']:.0f}"
        f" | {step['p50_ms']:.0f} | {step['p99_ms']:.0f} | {step.get('refusals_without_retry_after', 0)}"
        f" | {step.get('send_lag_p99_ms', math.nan):.0f} / {step.get('loop_lag_p99_ms', math.nan):.0f} |"
    )


HEADING = "## Distributed mode: two web processes, two nodes"


def section(
    results: list[overload.RampResult],
    command: str,
    started: str,
    commit: str,
    loads: list[str],
    heading: str = HEADING + " (issue 19)",
    about: tuple[str, ...] = (),
) -> str:
    lines = [
        heading,
        "",
        *about,
        f"Command: `{command}`. Date (UTC): {started}. Commit: {commit}.",
        f"Load average (1, 5, 15 min) before and after: {loads[0]} / {loads[-1]} (the load the run brings counts in",
        "the second: before it tells whether other work shared the cores).",
        "The generator shares the cores: *generator late* is how late it sent (from the schedule) and how late its",
        "event loop ran a 5 ms timer, which bounds how late it read an answer that had arrived; latencies run from",
        "the schedule, so both are in them.",
        "",
    ]
    for res in results:
        if res.error:
            lines += [f"**{res.label}**: failed: {res.error}", ""]
            continue
        sent = "each request carries its deadline" if getattr(res, "client_deadline", True) else "no client deadline"
        lines += [
            f"**{res.label}**: capacity {res.capacity:.0f} req/s ({res.capacity_source}); {sent}; goodput is a 200",
            f"within {res.deadline_ms} ms.",
            "",
            "| step | offered/s | admitted/s (fallback) | shed/s (reasons) | 504/s (share) | 500s | goodput/s | p50 ms"
            " | p99 ms | 503/429 without Retry-After | generator late p99 ms (send / loop) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *(row(res, step) for step in res.steps),
            "",
            "| check | measured | target | verdict |",
            "|---|---|---|---|",
            *(f"| {name} | {measured} | {target} | {_verdict(ok)} |" for name, measured, target, ok in checks(res)),
            "",
        ]
        lines += cpu_split.step_lines(res.steps)
        if res.server_counters:
            lines += [
                "Server counters over the ramp (Δ from `/metrics` of the web process a scrape reached, one of two): "
                + "; ".join(f"`{k}` {v:,.0f}" for k, v in sorted(res.server_counters.items()))
                + ".",
                "",
            ]
    return "\n".join(lines) + "\n"


def splice(path: Path, text: str, head: str = HEADING) -> None:
    """Replace the page's section that starts with `head` (the distributed one by default), or add it at the end."""
    old = path.read_text() if path.exists() else ""
    start = old.find(head)
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + text)
        return
    end = old.find("\n## ", start + len(head))
    path.write_text(old[:start] + text + (old[end + 1 :] if end >= 0 else ""))


def main(argv: list[str] | None = None) -> int:
    from bench.loadgen import arun

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bench.overload's quick settings (shorter steps)")
    p.add_argument("--models", default=f"{overload.WIDE_MODEL},{overload.FAST_MODEL}")
    p.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/ferry_overload")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/8")
    p.add_argument("--broker-url", default="redis://127.0.0.1:6379/9")
    p.add_argument("--ramp-step", type=float, help="seconds per ramp step")
    p.add_argument(
        "--capacity", type=float, help="req/s the ramp's multipliers are of, for every model (default: searched)"
    )
    p.add_argument("--record", type=Path, help="splice the section into this page (docs/benchmarks/overload.md)")
    a = p.parse_args(argv)
    s = overload.OverloadSettings.for_mode(a.quick)
    if a.ramp_step:
        s.step_s = a.ramp_step
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    commit = run_commit()
    loads = [load_average()]
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-overload-distributed-"))
    env = {k: v for k, v in os.environ.items() if k not in ("FERRY_QUOTA_REDIS_URL",)}
    env.update(
        {
            "FERRY_DATA_DIR": str(data_dir),
            "PYTHONUNBUFFERED": "1",
            "DATABASE_URL": a.database_url,
            "DATABASE_CONN_MAX_AGE": "0",
            "REDIS_URL": a.redis_url,
            "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(50),  # the run's processes share it
            "CELERY_BROKER_URL": a.broker_url,
            "CELERY_RESULT_BACKEND": a.broker_url,
            "CELERY_TASK_ALWAYS_EAGER": "false",
            "FERRY_EMBEDDED_NODE": "false",
            "FERRY_TORCH_THREADS": "1",
            "FERRY_ADMISSION": "true",
            "FERRY_LATENCY_BUDGET_MS": str(getattr(s, "budget_ms", 300)),
        }
    )
    results: list[overload.RampResult] = []
    try:
        fresh_database(a.database_url)
        for url in (a.redis_url, a.broker_url):
            clear_redis(url)
        setup_data_dir(env, None, True)  # migrate, the demo models, the demo user's key, its quota lifted
        with Deployment(env, free_port(), data_dir) as deploy:
            models = tuple(m for m in a.models.split(",") if m)
            deploy.wait_ready((*models, overload.FALLBACK_MODEL), timeout=600)
            for model in models:
                label = f"{model}, distributed, admission on"
                try:
                    if a.capacity:
                        cap, source = a.capacity, "given (--capacity)"
                    else:
                        cap, source = arun(overload.measure_capacity(deploy.base, model, s)), "measured here"
                    results.append(arun(overload.ramp(deploy, model, cap, source, True, s, label)))
                except Exception as exc:  # the other model's ramp still says something
                    say(f"{label}: {type(exc).__name__}: {exc}")
                    results.append(
                        overload.RampResult(
                            label, model, True, 0, "", s.deadline_ms, error=f"{type(exc).__name__}: {exc}"
                        )
                    )
                deploy.check()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    loads.append(load_average())
    command = "python -m bench.overload_distributed " + " ".join(argv if argv is not None else sys.argv[1:])
    text = section(results, command.strip(), started, commit, loads)
    print(text)
    if a.record is not None:
        splice(a.record, text)
    return 0 if results and not any(r.error for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
