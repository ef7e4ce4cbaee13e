"""Every Ferry benchmark in one run: writes docs/benchmarks.md, docs/bench-latency.png and
docs/bench-batching.png.

    .venv/bin/python -m bench.run [--quick]

Order matters: the raw model loop and the load generator's own ceiling are measured first, while no
server is running, so they do not compete for cores; then a fresh data dir is set up, the server is
started, and each model is swept with the open-loop generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench import capacity, loadgen, raw
from bench.loadgen import LoadResult, log
from bench.report import (
    MAX_ERROR_RATIO,
    P99_BUDGET_MS,
    SERVED_MODELS,
    WIDE,
    WIDE_OFF,
    Settings,
    Sweep,
    fmt,
    plot,
    ratios,
    verdict,
    write_report,
)

ROOT = Path(__file__).resolve().parent.parent
_T0 = time.monotonic()
HEADERS = {"Content-Type": "application/json"}


def say(msg: str) -> None:
    log(f"[run {time.monotonic() - _T0:6.1f}s] {msg}")


# -------------------------------------------------------------------------------------------- machine


class OtherCpu:
    """Cores' worth of CPU used by *other* processes while the block runs: /proc/stat less this process
    (and its waited children) and less `pids` (e.g. the server). On a shared 2-core box a busy neighbour
    silently halves a measurement, so the report states this figure."""

    def __init__(self, pids: tuple[int, ...] = ()) -> None:
        self.pids = pids
        self.cores: float | None = None

    def __enter__(self) -> OtherCpu:
        self._start = self._sample()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._sample()
        if self._start and end:
            (busy0, own0, t0), (busy1, own1, t1) = self._start, end
            self.cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)

    def _sample(self) -> tuple[float, float, float] | None:
        tick = os.sysconf("SC_CLK_TCK")
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            own = 0
            for pid in self.pids:
                # utime stime cutime cstime; the command name may hold spaces, so split after ")".
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                own += sum(int(v) for v in stat[11:15])
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(fields[:3]) + sum(fields[5:7])  # user nice system irq softirq (not steal)
        t = os.times()
        mine = t.user + t.system + t.children_user + t.children_system
        return busy / tick, mine + own / tick, time.monotonic()


def machine_facts(threads: int) -> dict[str, str]:
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": f"{threads} (FERRY_TORCH_THREADS={os.environ.get('FERRY_TORCH_THREADS', 'unset')})",
        "platform": platform.platform(),
    }


def command_line() -> str:
    env = (
        f"FERRY_TORCH_THREADS={os.environ['FERRY_TORCH_THREADS']} "
        if os.environ.get("FERRY_TORCH_THREADS")
        else ""
    )
    return env + " ".join([".venv/bin/python", "-m", "bench.run", *map(shlex.quote, sys.argv[1:])])


# -------------------------------------------------------------------------------------------- server


def manage(args: list[str], env: dict[str, str]) -> None:
    cmd = [sys.executable, "manage.py", *args]
    say(f"$ {' '.join(map(shlex.quote, cmd))}")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"manage.py {args[0]} exited with {proc.returncode}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def http_post(url: str, body: bytes, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=HEADERS, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class Server:
    """`manage.py serve` in its own process group, always terminated on exit (SIGTERM, then SIGKILL)."""

    def __init__(self, env: dict[str, str], port: int, log_path: Path) -> None:
        self.env, self.port, self.log_path = env, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        cmd = [sys.executable, "manage.py", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        say(f"$ {' '.join(cmd)}  (log: {self.log_path})")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        say("stopping the server (SIGTERM)")
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            say("server did not stop in 20 s: SIGKILL")
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def pids(self) -> tuple[int, ...]:
        return (self.proc.pid,) if self.proc else ()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, models: tuple[str, ...], timeout: float = 120.0) -> None:
        pending = ["/v2/health/ready", *(f"/v2/models/{m}/ready" for m in models)]
        start = time.monotonic()
        last_note = 0.0
        while pending:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            elapsed = time.monotonic() - start
            if elapsed > timeout:
                raise RuntimeError(f"not ready after {timeout:.0f} s: {pending}\n{self.log_tail()}")
            try:
                status, _ = http_get(self.base + pending[0], timeout=2.0)
            except OSError:
                status = 0
            if status == 200:
                say(f"ready: {pending.pop(0)} ({elapsed:.1f}s)")
                continue
            if elapsed - last_note >= 5.0:
                last_note = elapsed
                say(f"waiting for {pending[0]} (last answer: {status or 'no connection'}, {elapsed:.0f}s)")
            time.sleep(0.5)


_SERIES = re.compile(r"^ferry_batch_size_(sum|count)\{([^}]*)\}\s+(\S+)", re.M)


def batch_totals(base: str, model: str) -> tuple[float, float] | None:
    """(sum, count) of ferry_batch_size over every series labelled model=<model>; None when absent."""
    status, text = http_get(base + "/metrics")
    return parse_batch_totals(text.decode(errors="replace"), model) if status == 200 else None


def parse_batch_totals(text: str, model: str) -> tuple[float, float] | None:
    totals = {"sum": 0.0, "count": 0.0}
    found = False
    for kind, labels, value in _SERIES.findall(text):
        if re.search(r'(?:^|,)\s*model="' + re.escape(model) + '"', labels):
            totals[kind] += float(value)
            found = True
    return (totals["sum"], totals["count"]) if found else None


# -------------------------------------------------------------------------------------------- bodies


def infer_body(data: list[float]) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": data}]}
    ).encode()


def digits_body() -> bytes:
    from sklearn.datasets import load_digits

    return infer_body([float(v) for v in load_digits().data[0]])


def mlp_body() -> bytes:
    import numpy as np

    return infer_body([round(float(v), 4) for v in np.random.default_rng(0).uniform(0.0, 16.0, 64)])


# -------------------------------------------------------------------------------------------- sweeps


async def sweep(base: str, model: str, body: bytes, s: Settings) -> Sweep:
    url = f"{base}/v2/models/{model}/infer"
    out = Sweep(model)
    status, payload = http_post(url, body)
    if status != 200:
        out.error = f"sanity request answered {status}: {payload[:300]!r}"
        say(f"{model}: {out.error}")
        return out
    # A closed-loop burst only seeds the sweep's first rate; 64 in flight lets batches of 32 form.
    out.probe_rps = await capacity.probe_capacity(url, body, HEADERS, concurrency=64, duration=s.probe_seconds)
    say(f"{model}: closed-loop probe {out.probe_rps:.1f} req/s")
    if out.probe_rps <= 0:
        out.error = "no successful responses under a closed-loop probe"
        return out
    await asyncio.sleep(3.0)  # let the probe's backlog drain before timing anything

    async def before() -> tuple[float, float] | None:
        return batch_totals(base, model)

    async def after(r: LoadResult, snap: tuple[float, float] | None) -> None:
        now = batch_totals(base, model)
        if snap and now and now[1] > snap[1]:
            r.extra["mean_batch"] = (now[0] - snap[0]) / (now[1] - snap[1])
            r.extra["batches"] = now[1] - snap[1]
        if "mean_batch" in r.extra:
            say(f"{model}: mean batch {r.extra['mean_batch']:.2f} over {r.extra['batches']:.0f} batches")

    # In the smoke run the open-loop pass rate landed at 0.5-0.65 x the closed-loop probe.
    factor = 1.3
    start = max(1.0, 0.4 * out.probe_rps)
    out.best, out.steps = await capacity.find_max_rate(
        url,
        body,
        HEADERS,
        start=start,
        stop=50_000.0,  # climb until a step fails: a closed-loop probe can badly underestimate (unbatched)
        p99_budget_ms=P99_BUDGET_MS,
        max_error_ratio=MAX_ERROR_RATIO,
        duration=s.step,
        warmup=s.warmup,
        factor=factor,
        refine_steps=s.refine_steps,
        min_rate=start / factor**4,
        before_step=before,
        after_step=after,
    )
    await asyncio.sleep(2.0)
    return out


async def sweep_all(base: str, s: Settings) -> dict[str, Sweep]:
    bodies = {"digits": digits_body(), "digits-small": digits_body(), WIDE: mlp_body(), WIDE_OFF: mlp_body()}
    results: dict[str, Sweep] = {}
    for model in SERVED_MODELS:
        say(f"===== sweeping {model} =====")
        try:
            results[model] = await sweep(base, model, bodies[model], s)
        except Exception as exc:  # one broken model must not lose the others' figures
            results[model] = Sweep(model, error=f"{type(exc).__name__}: {exc}")
            say(f"{model}: {results[model].error}")
    return results


# -------------------------------------------------------------------------------------------- main


class Phases:
    """Wall time per phase, for the report: the whole run has to stay well under 15 minutes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str) -> Phases:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t = time.monotonic()
        say(f"===== {self._name} =====")

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._name] = time.monotonic() - self._t


def setup_data_dir(env: dict[str, str], model_path: Path) -> None:
    manage(["migrate", "--noinput"], env)
    manage(["build_demo_models"], env)
    common = ["--format", "torchscript", "--input", "input:FP32:64", "--output", "scores:FP32:10"]
    common += ["--task", "classification"]
    for name, max_batch, delay in ((WIDE, "32", "10"), (WIDE_OFF, "1", "0")):
        manage(["register_model", name, str(model_path), *common, "--max-batch-size", max_batch,
                "--max-queue-delay-ms", delay], env)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short steps: a smoke run, not numbers to publish")
    p.add_argument("--threads", type=int, help="set FERRY_TORCH_THREADS for raw and served runs alike")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the report and plots go")
    p.add_argument("--json", type=Path, help="also write every measurement as JSON here")
    p.add_argument("--keep-data", action="store_true", help="keep the temporary FERRY_DATA_DIR")
    a = p.parse_args(argv)
    if a.threads is not None:
        os.environ["FERRY_TORCH_THREADS"] = str(a.threads)
    s = Settings.for_mode(a.quick)
    phase = Phases()
    facts = machine_facts(raw.configure_threads())
    say(f"{facts}")
    data_dir = Path(tempfile.mkdtemp(prefix="ferry-bench-"))
    env = {**os.environ, "FERRY_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    say(f"FERRY_DATA_DIR={data_dir}")
    ok = False
    try:
        from bench.models import build_wide_mlp, save_torchscript

        with phase("raw model throughput (no server running)"):
            model_path = save_torchscript(build_wide_mlp(), data_dir / "wide-mlp.pt")
            with OtherCpu() as other:
                raw_rows = raw.measure(model_path, [64], seconds=s.raw_seconds)
        facts["other processes' CPU during raw"] = _cores(other.cores)
        with phase("load generator ceiling (no server running)"):
            ceiling, ceiling_steps = loadgen.arun(
                capacity.measure_ceiling(p99_budget_ms=P99_BUDGET_MS, max_error_ratio=MAX_ERROR_RATIO,
                                        duration=s.ceiling_step, warmup=s.warmup, refine_steps=s.refine_steps)
            )  # fmt: skip
        with phase("fresh data dir: migrate, build_demo_models, register_model x2"):
            setup_data_dir(env, model_path)
        with Server(env, free_port(), data_dir / "server.log") as server:
            with phase("server start"):
                server.wait_ready(SERVED_MODELS)
            with phase("served sweeps"), OtherCpu(server.pids()) as other:
                sweeps = loadgen.arun(sweep_all(server.base, s))
        facts["other processes' CPU during sweeps"] = _cores(other.cores, "besides server and generator")
        wide = sweeps.get(WIDE)
        if wide is not None and wide.mean_batch:
            # The server has stopped: time the raw model at the batch size the server actually formed.
            size = round(wide.mean_batch)
            if size not in {r.batch_size for r in raw_rows}:
                with phase(f"raw model throughput at the served mean batch {size} (server stopped)"):
                    raw_rows = sorted(raw_rows + raw.measure(model_path, [64], [size], seconds=s.raw_seconds),
                                      key=lambda r: r.batch_size)

        rt = ratios(raw_rows, sweeps)
        a.docs.mkdir(parents=True, exist_ok=True)
        write_report(a.docs / "benchmarks.md", facts, s, ceiling, ceiling_steps, raw_rows, sweeps, rt,
                     phase.seconds, a.quick, command_line(), time.monotonic() - _T0)  # fmt: skip
        plot(a.docs, raw_rows, sweeps)
        if a.json:
            a.json.write_text(
                json.dumps(_as_json(facts, ceiling, ceiling_steps, raw_rows, sweeps, rt), indent=2)
            )
        _summary(ceiling, sweeps, rt)
        ok = True
    finally:
        if ok and not a.keep_data:
            shutil.rmtree(data_dir, ignore_errors=True)
        else:
            say(f"data dir kept: {data_dir}")
    say(f"done in {(time.monotonic() - _T0) / 60:.1f} min")
    return 0


def _cores(cores: float | None, note: str = "") -> str:
    if cores is None:
        return "n/a"
    if cores > 0.2:
        say(f"WARNING: other processes used {cores:.2f} cores {note}: figures may be depressed")
    return f"{cores:.2f} cores {note} (should be ~0)".replace("  ", " ")


def _as_json(
    facts: dict[str, str], ceiling: LoadResult | None, ceiling_steps: list[LoadResult],
    raw_rows: list[raw.RawRow], sweeps: dict[str, Sweep], rt: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    served = {
        m: {"best": sw.best.to_dict() if sw.best else None, "error": sw.error, "probe_rps": sw.probe_rps,
            "steps": [r.to_dict() for r in sw.steps]}
        for m, sw in sweeps.items()
    }  # fmt: skip
    return {
        "machine": facts, "command": command_line(), "ceiling": ceiling.to_dict() if ceiling else None,
        "ceiling_steps": [r.to_dict() for r in ceiling_steps], "raw": [r.to_dict() for r in raw_rows],
        "ratios": rt, "served": served,
    }  # fmt: skip


def _summary(ceiling: LoadResult | None, sweeps: dict[str, Sweep], rt: dict[str, Any]) -> None:
    say("===== summary =====")
    say(f"generator ceiling: {fmt(ceiling.achieved_rate if ceiling else None, ',.0f')} req/s")
    for m, sw in sweeps.items():
        b = sw.best
        say(
            f"{m}: "
            + (
                f"{b.achieved_rate:,.1f} req/s p50 {b.p50_ms:.1f} ms p99 {b.p99_ms:.1f} ms mean batch "
                f"{fmt(sw.mean_batch, '.2f')}"
                if b
                else f"n/a {sw.error}"
            )
        )
    say(
        f"served/raw(mean batch): {verdict(rt.get('efficiency'))}; "
        f"speedup ratio: {verdict(rt.get('speedup_ratio'))}"
    )


if __name__ == "__main__":
    sys.exit(main())
