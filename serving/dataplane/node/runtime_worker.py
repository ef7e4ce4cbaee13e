"""The sandboxed runtime process: `python -m serving.dataplane.node.runtime_worker --fd N`, started by
serving.dataplane.node.runtime_process with a clean environment and one socket (the channel, serving.dataplane.
runtime_channel).

It imports torch and what loading an artifact needs, loads a tiny built-in model to warm the lazy pieces,
confines itself (serving.dataplane.node.sandbox) and only then reports ready; the artifact comes later, as bytes
over the channel. It hosts one artifact at most: a process per version, so no model reads another's weights
in memory. Ops: load, predict, to_host, to_device, memory, operators, probe (tests look from inside), exit.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import io
import os
import signal
import socket
import struct
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch

from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node import archive_check, operator_check, runtime_channel, sandbox
from serving.dataplane.node.runtime import ModelRuntime, RuntimeFailure, configure_torch_threads, load_module

# Bounds on what one message may carry into this process (the parent is trusted, but a bug should not OOM).
MAX_MESSAGE_BYTES = 4 * 1024**3


PR_SET_NAME = 15
EXPORT_LOADER_MODULES = ("torch._export.serde.serialize", "torch.export.pt2_archive._package")


class _Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ x.t()).sum(dim=1, keepdim=True)


_warmed: set[str] = set()


def warm_up(fmt: str) -> None:
    """Load and run a tiny TorchScript model through the same loader, so what torch reads on first use is
    read before confinement; for a torch.export artifact, import its loader's modules too. Once per format
    (a child forked by the zygote inherits its warm-up)."""
    if fmt in _warmed:
        return
    _warmed.add(fmt)
    if fmt == "torch_export":
        # Imported here, not at the top: the torch.export loader's modules (runtime._load_exported_program's
        # own imports) take a third of this process's start, and only torch.export artifacts need them.
        for name in EXPORT_LOADER_MODULES:
            importlib.import_module(name)
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # torch's deprecation notices for jit, on every start otherwise
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(_Tiny()), buffer)
    module = load_module(buffer, "torchscript", torch.device("cpu"))
    with torch.inference_mode():
        module(torch.ones(2, 3))
    archive_check.check_archive(io.BytesIO(buffer.getvalue()))


def operators(
    data: bytes, fmt: str, device: torch.device, *, check_code: bool = True, allowed_namespaces: list[str] | None = None
) -> list[str]:
    """Sorted operator names of an artifact, allowed or not (the caller judges them). For TorchScript, every
    function its code compiles to (operator_check.load_torchscript keeps the compilation unit, so a class's
    `__setstate__` counts too), once the archive check has read its code as data and refused a denied name
    in it (archive_check.check_torchscript_code), before compiling runs any of it; `check_code=False` leaves
    that out, for tests of the listing. For torch.export, the calls of the deserialised program's graph."""
    if fmt == "torchscript":
        try:
            archive_check.check_archive(
                io.BytesIO(data), check_operators=check_code, allowed_namespaces=allowed_namespaces or ()
            )
        except archive_check.ArchiveRefused as exc:
            raise RuntimeFailure(f"cannot load torchscript artifact (refused): {exc.reason}") from None
        _, names = operator_check.load_torchscript(io.BytesIO(data), device)
        return sorted(names)
    module = load_module(io.BytesIO(data), fmt, device, check_operators=False)
    found: set[str] = set()
    for node in module.graph.nodes:
        if node.op == "call_function":
            schema = getattr(node.target, "_schema", None)
            found.add(schema.name if schema is not None else str(node.target))
    return sorted(found)


def probe(paths: list[str], connect: list[list]) -> dict:
    """Which of `paths` this process can open, which (host, port) it can connect to by TCP (a host that is a
    path: a Unix socket), its environment,
    and whether it can read its own /proc/self/environ."""
    opened, refused = [], {}
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            refused[path] = exc.strerror or type(exc).__name__
        else:
            os.close(fd)
            opened.append(path)
    connected, failed = [], {}
    for host, port in connect:
        name = host if str(host).startswith("/") else f"{host}:{port}"
        try:
            if name == host:  # a Unix socket's path
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
                    unix.settimeout(2)
                    unix.connect(host)
            else:
                with socket.create_connection((host, int(port)), timeout=2):
                    pass
            connected.append(name)
        except OSError as exc:
            failed[name] = exc.strerror or type(exc).__name__
    try:
        # Not readable once root was dropped: the process is then not dumpable, and its /proc files stay root's.
        Path("/proc/self/environ").read_bytes()
        proc_environ = True
    except PermissionError:
        proc_environ = False
    return {
        "opened": opened,
        "refused": refused,
        "connected": connected,
        "connect_failed": failed,
        "environ": [f"{k}={v}" for k, v in os.environ.items()],
        "proc_environ_readable": proc_environ,
    }


class Worker:
    def __init__(self, sock: socket.socket, device: torch.device) -> None:
        self.sock = sock
        self.device = device
        self.runtime: ModelRuntime | None = None

    def serve(self) -> None:
        while True:
            try:
                header, arrays = runtime_channel.recv(self.sock, max_bytes=MAX_MESSAGE_BYTES)
            except runtime_channel.ChannelClosed:
                return
            op = header.get("op")
            if op == "exit":
                return
            try:
                reply, out = self.handle(op, header, arrays)
            except RuntimeFailure as exc:
                reply, out = {"ok": False, "error": str(exc)}, []
            except Exception as exc:  # whatever the model does, the parent gets a reason and this process lives
                reply, out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, []
            runtime_channel.send(self.sock, reply, out)

    def handle(self, op: object, header: dict, arrays: list[np.ndarray]) -> tuple[dict, list[np.ndarray]]:
        if op == "predict":
            if self.runtime is None:
                raise RuntimeFailure("model is not loaded")
            return {"ok": True}, self.runtime.predict(arrays)
        if op == "load":
            if self.runtime is not None:
                raise RuntimeFailure("this runtime process already holds an artifact")
            inputs = [TensorSpec.from_dict(d) for d in header["inputs"]]
            outputs = [TensorSpec.from_dict(d) for d in header["outputs"]]
            runtime = ModelRuntime(None, header["format"], inputs, outputs, self.device)  # type: ignore[arg-type]
            # The namespaces the platform admin allows come from the node (FERRY_ALLOWED_OPERATOR_NAMESPACES): this
            # process's environment holds no FERRY_* setting.
            runtime.load(
                io.BytesIO(arrays[0].tobytes()),
                check_operators=bool(header.get("check_operators", True)),
                allowed_namespaces=[str(n) for n in header.get("allowed_namespaces", [])],
            )
            self.runtime = runtime
            return {"ok": True, "memory_bytes": runtime.memory_bytes, "load_seconds": runtime.load_seconds}, []
        if op == "operators":
            # The names of every operator, allowed or not: the caller judges them.
            names = operators(
                arrays[0].tobytes(),
                header["format"],
                self.device,
                check_code=bool(header.get("check_operators", True)),
                allowed_namespaces=[str(n) for n in header.get("allowed_namespaces", [])],
            )
            return {"ok": True, "operators": names}, []
        if op in ("to_host", "to_device"):
            if self.runtime is not None:
                self.runtime.to_host() if op == "to_host" else self.runtime.to_device()
            return {"ok": True}, []
        if op == "memory":
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            return {"ok": True, "memory_bytes": self.runtime.memory_bytes if self.runtime else 0, "rss_bytes": rss}, []
        if op == "probe":
            return {"ok": True, **probe(list(header.get("paths", [])), list(header.get("connect", [])))}, []
        raise RuntimeFailure(f"unknown op {op!r}")


def runtime(fd: int) -> int:
    """One runtime process on channel `fd`: told its device and format, warmed, confined, then serving."""
    sock = socket.socket(fileno=fd)
    header, _ = runtime_channel.recv(sock, deadline=time.monotonic() + 60)
    device = torch.device(header["device"])
    try:
        warm_up(str(header.get("format", "torchscript")))
        record = sandbox.confine(
            hidden=header["hidden"],
            project_root=Path(header["project_root"]),
            device=str(device),
            channel_fd=fd,
            walls_required=bool(header.get("require_walls", True)),
        )
        quiet_stderr(record)
    except Exception as exc:  # refuse to serve rather than run model code half-confined
        runtime_channel.send(sock, {"ok": False, "error": f"confinement failed: {type(exc).__name__}: {exc}"})
        return 1
    # No parent-death signal: it follows the thread that spawned this process (a load thread), not the node.
    # A node that dies closes its end of the channel, and the next read here ends this process.
    threads = configure_torch_threads(int(header["threads"]))  # pool threads start now, inside the confinement
    runtime_channel.send(sock, {"ok": True, "pid": os.getpid(), "threads": threads, **record.as_dict()})
    Worker(sock, device).serve()
    return 0


def quiet_stderr(record: sandbox.Confinement) -> None:
    """Point this process's stderr at /dev/null once it is confined: it is the zygote's, which the node logs
    line by line at WARNING, and model code can write to it (`aten::warn`, torch's C++ warnings). What this
    process has to say from here on goes over the channel."""
    null = os.open("/dev/null", os.O_WRONLY)
    try:
        os.dup2(null, 2)
    finally:
        os.close(null)
    warnings.simplefilter("ignore")  # and the warnings machinery does not spend time formatting them
    record.applied.append("stderr-closed")


def zygote(fd: int) -> int:
    """Fork runtime processes on request, so each starts with torch already imported (seconds of CPU saved
    per load). This process never receives an artifact: it imports and warms both loaders once, stays
    single-threaded (what fork, unshare(CLONE_NEWUSER) and Landlock need of the child), and for each request
    (one descriptor: the new child's channel) forks a child that runs `runtime` on it and answers the child's
    pid and a pidfd, through which the parent signals and watches the child without pid reuse races."""
    control = socket.socket(fileno=fd)
    _name(b"ferry-zygote")
    warm_up("torch_export")
    warm_up("torchscript")
    if not sandbox.single_threaded():
        return 1
    signal.signal(signal.SIGCHLD, _reap_children)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(control, 16, 1)
        except OSError:
            return 0
        if not message:
            return 0  # the node went away
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _name(b"ferry-runtime")
            try:
                code = runtime(fds[0])
            except BaseException:  # noqa: BLE001 (a forked child must never return into the zygote's loop)
                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(fds[0])
        pidfd = os.pidfd_open(pid)
        try:
            socket.send_fds(control, [struct.pack("=i", pid)], [pidfd])
        finally:
            os.close(pidfd)


def _name(comm: bytes) -> None:
    """The process's name in /proc/<pid>/comm (ps, tests): a forked child keeps the zygote's command line."""
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(comm), 0, 0, 0)


def _reap_children(signum: int, frame: object) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runtime_worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--zygote", action="store_true", help="fork runtime processes on request (see zygote)")
    args = parser.parse_args(argv)
    return zygote(args.fd) if args.zygote else runtime(args.fd)


if __name__ == "__main__":
    sys.exit(main())
