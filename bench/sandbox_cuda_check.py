"""Which layer of the runtime process's confinement keeps CUDA from starting (a device-machine diagnostic).

    python -m bench.sandbox_cuda_check [--landlock-only]

Each variant runs in a fresh interpreter set up as a runtime process is (the runtime's clean environment,
torch imported single-threaded, CUDA not yet touched), applies some of `serving.dataplane.node.sandbox`'s
layers, then makes a tensor on the device and synchronises. The variants: no layer, each layer alone, all
but each layer, and `confine` itself; then Landlock alone with one rule more than the sandbox gives
(`--landlock-only`: those and the first three). It prints one line a variant, then the device files' modes and owners
(a process dropped to nobody opens them as anyone would).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serving.dataplane.node import sandbox

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("namespaces", "landlock_fs", "landlock_net", "drop_privileges", "limit_resources")

CHILD = r"""
import os, sys, torch
import landlock
from pathlib import Path
from serving.dataplane.node import sandbox
layers = sys.argv[1].split(",") if sys.argv[1] else []
root = Path(sys.argv[2])
device = "cuda"
# what a runtime process hides (runtime_process.SCRATCH_DIRS), /tmp left out where this check's packages are
HIDDEN = ["/tmp/ferry-hidden-probe", "/var/tmp", "/dev/shm", "/run", "/var/run"]
record = sandbox.Confinement()
was_root = os.geteuid() == 0
try:
    if layers and layers[0].startswith("ll:"):  # Landlock as the sandbox applies it, plus the named rules
        fs = landlock.FSAccess
        write = fs.WRITE_FILE | fs.MAKE_REG | fs.MAKE_DIR | fs.MAKE_SOCK | fs.MAKE_FIFO | fs.MAKE_SYM
        write |= fs.REMOVE_FILE | fs.REMOVE_DIR | fs.TRUNCATE
        rights = {"read": fs.READ_FILE | fs.READ_DIR, "exec": fs.EXECUTE, "write": write, "all": fs(65535),
                  "ioctl": fs.READ_FILE | fs.WRITE_FILE | fs.IOCTL_DEV}
        ruleset = landlock.Ruleset()
        for path in sandbox.readable_paths(root, device):
            if os.path.exists(path):
                ruleset.allow(path, rules=fs.READ_FILE | fs.READ_DIR if os.path.isdir(path) else fs.READ_FILE)
        for path in sandbox.device_paths(device):
            if os.path.exists(path):
                ruleset.allow(path, rules=rights["ioctl"])
        for extra in layers[0][3:].split("+"):
            if extra:
                right, path = extra.split("@")
                if os.path.exists(path):
                    ruleset.allow(path, rules=rights[right] & (rights[right] if os.path.isdir(path) else
                                  fs.READ_FILE | fs.WRITE_FILE | fs.IOCTL_DEV | fs.EXECUTE | fs.TRUNCATE))
        ruleset.apply()
        record.applied.append(layers[0])
    elif layers == ["confine"]:
        record = sandbox.confine(hidden=HIDDEN, project_root=root, device=device, channel_fd=1)
    else:
        if "namespaces" in layers:
            sandbox.namespaces(HIDDEN, record)
        if "landlock_fs" in layers:
            own = sandbox.own_writable_paths(device)
            sandbox.landlock_filesystem(
                sandbox.readable_paths(root, device), sandbox.device_paths(device), record, own=own
            )
        if "landlock_net" in layers:
            sandbox.landlock_network_and_scope(record)
        if "drop_privileges" in layers:
            sandbox.drop_privileges(record)
        if "limit_resources" in layers:
            sandbox.limit_resources(record, dropped_root=was_root)
except Exception as exc:
    print(f"CONFINEMENT FAILED {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(2)
try:
    x = torch.ones(4, device=device) * 2
    torch.cuda.synchronize()
    if not layers:  # what CUDA opened and mapped, outside what the runtime may read
        readable = sandbox.readable_paths(root, device) + sandbox.device_paths(device)
        seen = set()
        for line in open("/proc/self/maps"):
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                seen.add(parts[5].strip())
        for fd in os.listdir("/proc/self/fd"):
            try:
                seen.add(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        def covered(p):
            return any(p == r or p.startswith(r.rstrip("/") + "/") for r in readable)
        outside = sorted(p for p in seen if p.startswith("/") and not covered(p))
        print(f"INFO opened or mapped outside the readable paths: {outside}", flush=True)
    print(f"OK sum={float(x.sum())} applied={record.applied} skipped={record.skipped}", flush=True)
except Exception as exc:
    print(f"CUDA FAILED {type(exc).__name__}: {str(exc).splitlines()[0]} applied={record.applied}", flush=True)
    raise SystemExit(1)
"""


def main() -> int:
    os.makedirs("/tmp/ferry-hidden-probe", exist_ok=True)
    env = sandbox.clean_environment(ROOT)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    variants = [("none", ""), ("confine", "confine"), ("only landlock_fs", "landlock_fs")]
    if "--landlock-only" not in sys.argv:
        variants += [(f"only {layer}", layer) for layer in LAYERS if layer != "landlock_fs"]
        variants += [(f"all but {layer}", ",".join(x for x in LAYERS if x != layer)) for layer in LAYERS]
        variants.append(("all five", ",".join(LAYERS)))
    # Landlock alone with a rule more than the sandbox gives (right@path): which one lets CUDA start
    extras = ["", "all@/", "write@/proc", "write@/proc/self", "write@/proc/self/task", "write@/proc/thread-self"]
    variants += [(f"landlock + {extra or 'nothing'}", "ll:" + extra) for extra in extras]
    failed = 0
    for name, layers in variants:
        try:
            out = subprocess.run(
                [sys.executable, "-c", CHILD, layers, str(ROOT)],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                cwd="/",
            )
            lines = (out.stdout.strip() or out.stderr.strip()).splitlines()
            line = lines[-1] if lines else f"(no output, exit {out.returncode})"
            for info in (x for x in lines if x.startswith("INFO")):
                print(f"[sandbox-cuda] {name:28s} {info[:2000]}", flush=True)
            failed += out.returncode != 0
        except subprocess.TimeoutExpired:
            line = "TIMED OUT"
            failed += 1
        print(f"[sandbox-cuda] {name:28s} {line[:400]}", flush=True)
    for path in sorted(Path("/dev").glob("nvidia*")):
        st = path.stat()
        print(f"[sandbox-cuda] {path} mode {oct(st.st_mode & 0o7777)} uid {st.st_uid} gid {st.st_gid}")
    print(f"[sandbox-cuda] readable: {sandbox.readable_paths(ROOT, 'cuda')}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
