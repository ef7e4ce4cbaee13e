"""The server under test: a fresh data dir, `manage.py serve` in its own process group, small HTTP helpers,
and readings taken from outside the server (its /metrics, its RSS)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.loadgen import log

ROOT = Path(__file__).resolve().parent.parent
# Every /v2 request the benchmarks send carries these; use_key() adds the data dir's API key.
HEADERS = {"Content-Type": "application/json"}
KEY_FILE = "demo-api-key"  # written by `manage.py ensure_demo_user` into FERRY_DATA_DIR
_T0 = time.monotonic()


def say(msg: str) -> None:
    log(f"[run {time.monotonic() - _T0:6.1f}s] {msg}")


def manage(args: list[str], env: dict[str, str], cwd: Path = ROOT) -> None:
    cmd = [sys.executable, "manage.py", *args]
    say(f"$ {' '.join(map(shlex.quote, cmd))}")
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"manage.py {args[0]} exited with {proc.returncode}")


# The demo tenant's quota for capacity runs: checked on every request, as in production, but far above
# what one machine can offer, so the quota never decides a measurement (bench.ratelimit measures quotas).
UNBINDING_QUOTA = [
    "requests_per_second=10000000",
    "burst=10000000",
    "max_in_flight=1000000",
    "monthly_requests=1000000000000",
]


def unbind_quota(env: dict[str, str], cwd: Path = ROOT) -> None:
    """Give the demo tenant UNBINDING_QUOTA, where the checkout has quotas (older revisions have none)."""
    if (cwd / "tenants" / "management" / "commands" / "set_quota.py").exists():
        manage(["set_quota", "demo", *UNBINDING_QUOTA], env, cwd=cwd)


def use_key(data_dir: Path) -> str | None:
    """Send the demo API key of `data_dir` (from `manage.py ensure_demo_user`) on every request from now on:
    HEADERS is updated in place, so the sweeps, probes and ramps that hold it send it too. None, and no
    header, where the data dir has no key (a revision from before API keys, in bench.compare)."""
    try:
        token = (data_dir / KEY_FILE).read_text().strip()
    except OSError:
        token = ""
    if token:
        HEADERS["Authorization"] = f"Bearer {token}"
    else:
        HEADERS.pop("Authorization", None)
    return token or None


def auth_headers() -> dict[str, str]:
    return {k: v for k, v in HEADERS.items() if k == "Authorization"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=auth_headers())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
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


# Every group start_group started, for a SIGTERM to stop (`_stop_and_end`).
_STARTED: list[subprocess.Popen[bytes]] = []


def start_group(argv: list[str], log_path: Path, env: dict[str, str], cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """`argv` in a process group of its own (stopped with `stop_groups`), its output appended to `log_path`.
    From the first one on, a SIGTERM to this run stops the groups it started before it ends the run."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # Python's default ends the run at once, and the servers, nodes and workers it started went on
        # serving. Raising from the handler instead (SystemExit, to unwind the `with` blocks) is not enough:
        # it can land in an event loop's protocol callback, which logs it and goes on (uvloop does). So the
        # handler stops the groups itself. Only over the default: a handler someone set is theirs.
        signal.signal(signal.SIGTERM, _stop_and_end)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _STARTED.append(proc)
    return proc


def _stop_and_end(signum: int, frame: object) -> None:
    """Stop the groups still running (SIGTERM, then SIGKILL after 10 s), then end as the default action
    would: killed by the signal. Not through Popen.wait: the signal may have come while this thread was
    inside one of these Popens' own wait or poll, holding the lock that wait takes."""
    signal.signal(signum, signal.SIG_IGN)  # a second one (`timeout` signals its whole group too) is the same
    groups = [proc.pid for proc in _STARTED if proc.returncode is None]
    for pgid in groups:
        _signal_group(pgid, signal.SIGTERM)
    until = time.monotonic() + 10.0
    while groups and time.monotonic() < until:
        time.sleep(0.1)
        groups = [pgid for pgid in groups if _group_left(pgid)]
    for pgid in groups:
        _signal_group(pgid, signal.SIGKILL)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_left(pgid: int) -> bool:
    """Whether anything of group `pgid` still runs; its leader, this process's child, is reaped first."""
    try:
        os.waitpid(pgid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_groups(procs: list[subprocess.Popen[bytes]], grace_s: float = 20.0) -> list[subprocess.Popen[bytes]]:
    """Stop each process's group, started with start_new_session: SIGTERM to all of them first (they stop
    together), then SIGKILL to any that has not exited `grace_s` after. Returns the processes that needed it."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    killed = []
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed.append(proc)
    return killed


class Server:
    """`manage.py serve` in its own process group, always terminated on exit (SIGTERM, then SIGKILL)."""

    def __init__(
        self, env: dict[str, str], port: int, log_path: Path, cwd: Path = ROOT, launcher: list[str] | None = None
    ) -> None:
        self.env, self.port, self.log_path, self.cwd = env, port, log_path, cwd
        self.launcher = launcher or [sys.executable, "manage.py", "serve"]  # what takes --host/--port
        self.proc: subprocess.Popen[bytes] | None = None
        self.base = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        cmd = [*self.launcher, "--host", "127.0.0.1", "--port", str(self.port)]
        say(f"$ {' '.join(cmd)}  (log: {self.log_path})")
        self.proc = start_group(cmd, self.log_path, self.env, self.cwd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        say("stopping the server (SIGTERM)")
        if stop_groups([self.proc]):
            say("server did not stop in 20 s: SIGKILL")

    def pids(self) -> tuple[int, ...]:
        return (self.proc.pid,) if self.proc else ()

    def rss_kib(self) -> dict[str, int]:
        """VmRSS and VmHWM (peak RSS over the process's life) from /proc/<pid>/status, in KiB."""
        return proc_memory(self.proc.pid) if self.proc else {}

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, models: tuple[str, ...], timeout: float = 180.0) -> None:
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


def proc_memory(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])  # "12345 kB"
    except (OSError, ValueError, IndexError):
        pass
    return out


# -------------------------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s+(\S+)", re.M)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(base: str) -> str | None:
    try:
        status, text = http_get(base + "/metrics")
    except OSError:
        return None
    return text.decode(errors="replace") if status == 200 else None


def counters(text: str | None, names: tuple[str, ...]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(metric, sorted labels): value} for the labelled samples of the named metrics."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for name, labels, value in _SAMPLE.findall(text or ""):
        if name in names:
            out[(name, tuple(sorted(_LABEL.findall(labels))))] = float(value)
    return out


def batch_totals(base: str, model: str) -> tuple[float, float] | None:
    """(sum, count) of ferry_batch_size over every series labelled model=<model>; None when absent."""
    text = scrape(base)
    return parse_batch_totals(text, model) if text is not None else None


def parse_batch_totals(text: str, model: str) -> tuple[float, float] | None:
    totals = {"sum": 0.0, "count": 0.0}
    found = False
    for (name, labels), value in counters(text, ("ferry_batch_size_sum", "ferry_batch_size_count")).items():
        if ("model", model) in labels:
            totals[name.rsplit("_", 1)[1]] += value
            found = True
    return (totals["sum"], totals["count"]) if found else None


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
