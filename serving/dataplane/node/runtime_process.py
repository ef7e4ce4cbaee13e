"""The node's side of the sandboxed runtime process: `IsolatedRuntime`, a ModelRuntime whose model runs in a
child process confined by serving.dataplane.node.sandbox (serving.dataplane.node.runtime_worker is the child).

Tenant artifacts are code: a TorchScript graph can call operators that read files (`aten::from_file`), so it
must not run in a process holding the platform's files and credentials. The parent keeps everything else of
ModelRuntime (assemble, split, padding buckets, example batches, profiling: profiled through the channel,
as the node will see it); only `load` and `predict` cross to the child. The artifact's bytes are read here,
from the file the node's artifact reader verified, hashed again and sent only if they match the artifact's
sha256, on every load (a child that died is replaced by loading again); the child never gets a path into
the store. One child per loaded version. Every wait on the child has a deadline: a child that dies or does not
answer in time fails that batch (or load) with RuntimeFailure, is counted (metrics.RUNTIME_PROCESS_FAILURES)
and logged, and the next call starts a fresh one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from django.conf import settings
from prometheus_client import Counter

from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.metrics import metrics
from serving.dataplane.node import artifact_cache, runtime_channel, sandbox
from serving.dataplane.node.runtime import ModelRuntime, RuntimeFailure, to_torch

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[3]
# Directories nothing in the runtime needs, covered in its mount namespace besides the configured ones: scratch
# space, and /run, whose Unix sockets (PostgreSQL's, Redis's) Landlock (ABI <= 7) does not stop a connect to.
SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/var/run")
MAX_OUTPUT_BYTES = 1024**3  # what one batch's answer may carry back from the child
STDERR_LINE = 2000
SHA256_NAME = re.compile(r"[0-9a-f]{64}")

# Runtime processes started without a layer of their confinement (sandbox.OPTIONAL_LAYERS aside), by layer: a
# node whose kernel or user cannot give one (no Landlock, no namespaces); each is logged at WARNING too.
CONFINEMENT_SKIPPED = Counter(
    "ferry_runtime_confinement_skipped",
    "Sandboxed runtime processes started without a confinement layer (seccomp, never used, aside), by layer",
    ["layer"],
)


def hidden_paths() -> list[str]:
    """What the child's mount namespace covers: the data directory (secret_key, the SQLite database), the
    artifact store and cache, the scratch directories; never one that holds what the child must read."""
    needed = [PROJECT_ROOT / "serving", Path(sys.prefix), Path(sys.base_prefix)]
    paths = [
        Path(settings.DATA_DIR),
        Path(settings.FERRY_ARTIFACT_ROOT),
        Path(settings.FERRY_ARTIFACT_CACHE_DIR),
        *map(Path, SCRATCH_DIRS),
    ]
    kept = []
    for path in paths:
        path = path.resolve()
        if any(n.resolve().is_relative_to(path) for n in needed):
            log.warning("not hiding %s from the runtime process: it holds the interpreter or the code", path)
            continue
        if str(path) not in kept:
            kept.append(str(path))
    return kept


class Zygote:
    """The forking parent of this process's runtime processes (runtime_worker.zygote), started on first use:
    each runtime process is forked from it with torch imported and warmed, instead of paying the imports
    (seconds of CPU) on every load. It runs with the runtime's clean environment and never holds an artifact."""

    def __init__(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "serving.dataplane.node.runtime_worker",
                    "--zygote",
                    "--fd",
                    str(child.fileno()),
                ],
                env=sandbox.clean_environment(PROJECT_ROOT),
                cwd="/",
                pass_fds=(child.fileno(),),
                close_fds=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # the node decides when it ends, not a terminal's Ctrl-C
            )
        finally:
            child.close()
        self.sock = parent
        self.owner = os.getpid()  # a forked copy of this process must start its own
        self.lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop_zygote, self.process, parent)
        threading.Thread(
            target=_forward_stderr,
            args=(self.process, self.process.pid),
            daemon=True,
            name="ferry-runtime-zygote-stderr",
        ).start()

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.process.poll() is None

    def fork(self, timeout_s: float) -> tuple[socket.socket, int, int]:
        """A new runtime process: its channel, pid and pidfd."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with self.lock:
                self.sock.settimeout(timeout_s)
                socket.send_fds(self.sock, [b"f"], [child.fileno()])
                message, fds, _, _ = socket.recv_fds(self.sock, 16, 1)
        except OSError as exc:  # a timeout included: a zygote that does not answer is replaced
            parent.close()
            self.stop()
            raise RuntimeFailure(f"the runtime zygote did not fork: {type(exc).__name__}: {exc}") from None
        finally:
            child.close()
        if len(message) != 4 or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            parent.close()
            self.stop()
            raise RuntimeFailure("the runtime zygote exited")
        return parent, struct.unpack("=i", message)[0], fds[0]

    def stop(self) -> None:
        self._finalizer()


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    global _zygote
    with _zygote_lock:
        if _zygote is None or not _zygote.alive():
            if _zygote is not None and _zygote.owner == os.getpid():
                metrics.RUNTIME_PROCESS_FAILURES.labels("zygote").inc()
                log.error("the runtime zygote exited (%s); starting a fresh one", _zygote.process.returncode)
            _zygote = Zygote()
        return _zygote


def _stop_zygote(process: subprocess.Popen, sock: socket.socket) -> None:
    sock.close()  # its loop reads EOF and it exits
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


class RuntimeProcess:
    """One confined child (forked by the zygote) and its channel. Watched and signalled through a pidfd, so a
    pid the kernel reused can never be killed by mistake."""

    def __init__(self, device: torch.device, threads: int, start_timeout_s: float, fmt: str = "torchscript") -> None:
        metrics.RUNTIME_PROCESS_STARTS.inc()
        self.sock, self.pid, self.pidfd = zygote().fork(start_timeout_s)
        self.lock = threading.Lock()  # one exchange at a time on the channel
        self._finalizer = weakref.finalize(self, _reap, self.pidfd, self.sock)
        try:
            ready = self.call(
                {
                    "op": "init",
                    "hidden": hidden_paths(),
                    "project_root": str(PROJECT_ROOT),
                    "device": str(device),
                    "threads": threads,
                    "format": fmt,
                    # No filesystem or no network wall: the child refuses to run tenant code (sandbox.require_walls).
                    "require_walls": not settings.FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX,
                },
                timeout_s=start_timeout_s,
            )[0]
        except RuntimeFailure:
            self.close()
            raise
        self.confinement = report_confinement(self.pid, ready)

    def alive(self) -> bool:
        return not _exited(self.pidfd, 0)

    def call(
        self, header: dict, arrays: Sequence[np.ndarray] = (), *, timeout_s: float, max_bytes: int = MAX_OUTPUT_BYTES
    ) -> tuple[dict, list[np.ndarray]]:
        """One request and its answer within `timeout_s`; RuntimeFailure when the child refuses, dies, breaks the
        framing or does not answer in time (then it is killed)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            try:
                runtime_channel.send(self.sock, header, arrays, deadline=deadline)
                reply, out = runtime_channel.recv(self.sock, deadline=deadline, max_bytes=max_bytes)
            except runtime_channel.ChannelTimeout:
                self._failed("timeout", f"did not answer within {timeout_s:g} s")
            except runtime_channel.ChannelClosed:
                self._failed("died", "exited")
            except runtime_channel.ChannelError as exc:
                self._failed("protocol", f"broke the channel's framing ({exc})")
        if not reply.get("ok"):
            raise RuntimeFailure(str(reply.get("error", "the runtime process refused"))[:4000])
        return reply, out

    def _failed(self, reason: str, what: str) -> None:
        self.kill()
        metrics.RUNTIME_PROCESS_FAILURES.labels(reason).inc()
        log.error("runtime process %d %s", self.pid, what)
        raise RuntimeFailure(f"the model's runtime process {what}")

    def kill(self) -> None:
        if self._finalizer.alive:
            _kill(self.pidfd, self.pid)

    def close(self) -> None:
        """Ask the child to exit; kill it when it is busy or does not go at once."""
        if self._finalizer.alive and self.alive() and self.lock.acquire(blocking=False):
            try:
                runtime_channel.send(self.sock, {"op": "exit"}, deadline=time.monotonic() + 1)
                _exited(self.pidfd, 2)
            except (runtime_channel.ChannelClosed, runtime_channel.ChannelTimeout):
                pass
            finally:
                self.lock.release()
        self._finalizer()


def report_confinement(pid: int, ready: dict) -> dict:
    """A runtime process's confinement as its ready message tells it: each skipped layer but the optional ones
    (sandbox.OPTIONAL_LAYERS) counted (ferry_runtime_confinement_skipped_total) and logged at WARNING."""
    confinement = {"applied": list(ready.get("applied", [])), "skipped": dict(ready.get("skipped", {}))}
    weak = {k: v for k, v in confinement["skipped"].items() if k not in sandbox.OPTIONAL_LAYERS}
    for layer in weak:
        CONFINEMENT_SKIPPED.labels(layer).inc()
    if weak:
        log.warning(
            "runtime process %d runs tenant code without: %s",
            pid,
            "; ".join(f"{layer} ({why})" for layer, why in weak.items()),
        )
    else:
        log.debug("runtime process %d confined: %s", pid, confinement)
    return confinement


def _exited(pidfd: int, timeout_s: float) -> bool:
    """Whether the process has exited, waiting up to `timeout_s` (a pidfd turns readable when it does)."""
    return bool(select.select([pidfd], [], [], timeout_s)[0])


def _kill(pidfd: int, pid: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return  # gone already
    if not _exited(pidfd, 5):
        log.error("runtime process %d did not exit after SIGKILL", pid)


def _reap(pidfd: int, sock: socket.socket) -> None:
    """When a runtime process is closed, or dropped without close(): it goes, and its descriptors with it."""
    sock.close()
    if not _exited(pidfd, 0):
        _kill(pidfd, -1)
    os.close(pidfd)


def _forward_stderr(process: subprocess.Popen, pid: int) -> None:
    """The child's stderr to this process's log, line by line (bounded): tracebacks of a failed start."""
    for line in process.stderr:  # type: ignore[union-attr]
        text = line.decode(errors="replace").rstrip()[:STDERR_LINE]
        if text:
            log.warning("runtime process %d: %s", pid, text)
    process.stderr.close()  # type: ignore[union-attr]


class IsolatedRuntime(ModelRuntime):
    """A ModelRuntime (same interface for the node and validation) whose module lives in a sandboxed child."""

    def __init__(
        self,
        path: Path,
        fmt: str,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        device: torch.device,
        *,
        threads: int | None = None,
        timeout_s: float | None = None,
        start_timeout_s: float | None = None,
        check_operators: bool = True,
        sha256: str | None = None,
    ) -> None:
        super().__init__(path, fmt, inputs, outputs, device)
        # What the artifact's bytes must hash to at every load: given, or the file's name where the file is in a
        # content-addressed store (the artifact store's `<sha[:2]>/<sha256>`, a node's cache: what the node's
        # artifact reader returns), else what they hashed to at the first load.
        self.sha256 = sha256 or (Path(path).name if SHA256_NAME.fullmatch(Path(path).name) else None)
        # The artifact's file, open from the first load until release: a reload after the child died reads
        # these bytes even where the node's cache has deleted the file since (to make room), or replaced it.
        self._artifact: BinaryIO | None = None
        # False only in tests of the sandbox alone: the operator check (serving.dataplane.node.operator_check) is off.
        self.check_operators = check_operators
        # The child's intra-op threads: what this process was configured with (configure_torch_threads).
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.timeout_s = timeout_s if timeout_s is not None else settings.FERRY_RUNTIME_TIMEOUT_S
        self.start_timeout_s = (
            start_timeout_s if start_timeout_s is not None else settings.FERRY_RUNTIME_START_TIMEOUT_S
        )
        self.process: RuntimeProcess | None = None
        self._released = True
        self._on_host = False

    @property
    def loaded(self) -> bool:
        return not self._released

    @property
    def confinement(self) -> dict:
        return self.process.confinement if self.process is not None else {}

    def load(self, source: object = None) -> None:
        """Start a fresh child, confined, and load the artifact's bytes into it, once they hash to the artifact's
        sha256 (on every load: the first, and each reload after a child died)."""
        started = time.perf_counter()
        data = self._verified_bytes()
        self._close_process()
        process = RuntimeProcess(self.device, self.threads, self.start_timeout_s, self.fmt)
        try:
            reply, _ = process.call(
                {
                    "op": "load",
                    "format": self.fmt,
                    "inputs": [s.to_dict() for s in self.inputs],
                    "outputs": [s.to_dict() for s in self.outputs],
                    "check_operators": self.check_operators,
                    "allowed_namespaces": list(settings.FERRY_ALLOWED_OPERATOR_NAMESPACES),
                },
                [np.frombuffer(data, dtype=np.uint8)],
                timeout_s=self.start_timeout_s,
            )
        except BaseException:
            process.close()
            raise
        self.process = process
        self._released = False
        self._on_host = False
        self.memory_bytes = int(reply.get("memory_bytes", 0))
        self.load_seconds = time.perf_counter() - started

    def _verified_bytes(self) -> bytes:
        """The artifact's bytes from its open file, refused (RuntimeFailure, counted in
        ferry_artifact_refused_total{where="runtime"}) unless they hash to `sha256`."""
        try:
            if self._artifact is None:
                self._artifact = Path(self.path).open("rb")
            self._artifact.seek(0)
            data = self._artifact.read()
        except OSError as exc:
            raise RuntimeFailure(f"cannot read the artifact: {exc.strerror}") from None
        digest = hashlib.sha256(data).hexdigest()  # without the GIL: a 4 GB artifact takes seconds
        if self.sha256 is None:
            self.sha256 = digest
        elif digest != self.sha256:
            artifact_cache.REFUSED.labels("runtime").inc()
            log.error("artifact %s: the bytes of %s hash to %s: refused", self.sha256, self.path, digest)
            raise RuntimeFailure(f"artifact {self.sha256}: the bytes read do not hash to its sha256; refused")
        return data

    def _live(self) -> RuntimeProcess:
        """The child, started afresh (and the artifact loaded again) when the last one died or timed out."""
        if self._released:
            raise RuntimeFailure("model is not loaded")
        process = self.process
        if process is None or not process.alive():
            log.warning("runtime process for %s is gone; starting a fresh one", self.path)
            on_host = self._on_host
            self.load()
            if on_host:
                self.to_host()
            process = self.process
        return process  # type: ignore[return-value]

    def predict(self, batch: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Run one assembled batch in the child; its answer is checked here against the signature again (the
        child is not trusted to have checked)."""
        _, produced = self._live().call({"op": "predict"}, batch, timeout_s=self.timeout_s)
        if len(produced) != len(self.outputs):
            raise RuntimeFailure(f"model returned {len(produced)} outputs, signature declares {len(self.outputs)}")
        return [self._check(spec, to_torch(a, spec)) for spec, a in zip(self.outputs, produced, strict=True)]

    def to_host(self) -> None:
        if self.process is not None and self.device.type == "cuda":
            self.process.call({"op": "to_host"}, timeout_s=self.start_timeout_s)
        self._on_host = True

    def to_device(self) -> None:
        if self.process is not None and self.device.type == "cuda":
            self._live().call({"op": "to_device"}, timeout_s=self.start_timeout_s)
        self._on_host = False

    def memory(self) -> dict:
        """The child's own report: the model's bytes and the process's resident set."""
        return self._live().call({"op": "memory"}, timeout_s=self.timeout_s)[0]

    def probe(self, paths: Sequence[str] = (), connect: Sequence[tuple[str, int]] = ()) -> dict:
        """From inside the child: which paths open and which TCP addresses connect (for tests)."""
        return self._live().call(
            {"op": "probe", "paths": list(paths), "connect": [list(c) for c in connect]}, timeout_s=self.timeout_s
        )[0]

    def release(self) -> None:
        self._released = True
        self._close_process()
        if self._artifact is not None:
            self._artifact.close()
            self._artifact = None

    def close(self) -> None:
        self.release()

    def _close_process(self) -> None:
        if self.process is not None:
            self.process.close()
            self.process = None


def inspect_operators(data: bytes, fmt: str, *, timeout_s: float | None = None, check_code: bool = True) -> list[str]:
    """The sorted operator names of every method graph of an artifact, loaded in a fresh sandboxed child (the
    registration check: the artifact is not loaded in the web process). The child reads a TorchScript
    archive's code as data first and refuses (RuntimeFailure) one naming a denied operator, before compiling
    it; `check_code=False` leaves that out, for tests of the listing."""
    timeout = timeout_s if timeout_s is not None else settings.FERRY_RUNTIME_START_TIMEOUT_S
    process = RuntimeProcess(torch.device("cpu"), 1, timeout, fmt)
    try:
        reply, _ = process.call(
            {
                "op": "operators",
                "format": fmt,
                "check_operators": check_code,
                "allowed_namespaces": list(settings.FERRY_ALLOWED_OPERATOR_NAMESPACES),
            },
            [np.frombuffer(data, dtype=np.uint8)],
            timeout_s=timeout,
        )
    finally:
        process.close()
    return [str(name) for name in reply.get("operators", [])]


def make_runtime(
    path: Path, fmt: str, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec], device: torch.device
) -> ModelRuntime:
    """The runtime FERRY_RUNTIME_ISOLATION asks for: sandboxed (`process`, the default) or in this process
    (`inline`, unsafe: only for contrast benchmarks; config/settings.py refuses it unless FERRY_DEBUG is on)."""
    if settings.FERRY_RUNTIME_ISOLATION == "inline":
        return ModelRuntime(path, fmt, inputs, outputs, device)
    return IsolatedRuntime(path, fmt, inputs, outputs, device)


def warn_if_inline() -> None:
    """At a data plane's start: say loudly where tenant code runs with less than the whole sandbox."""
    if settings.FERRY_RUNTIME_ISOLATION == "inline":
        log.warning(
            "FERRY_RUNTIME_ISOLATION=inline: tenant model code runs in this process, with its files and"
            " credentials (UNSAFE; for contrast benchmarks only)"
        )
    if settings.FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX:
        log.warning(
            "FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX=true: tenant model code runs even where the runtime process has"
            " no filesystem or no network wall (UNSAFE: it may read the data directory and reach the databases)"
        )


__all__ = ["IsolatedRuntime", "RuntimeProcess", "inspect_operators", "make_runtime", "hidden_paths"]
