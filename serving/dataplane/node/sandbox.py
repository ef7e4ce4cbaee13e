"""Kernel confinement of the runtime process that runs tenant model code (serving.dataplane.node.runtime_worker).

A TorchScript or torch.export graph can call operators that touch the filesystem (`aten::from_file`,
`aten::save`...), so the process that runs one must not be able to reach anything of the platform's: the
data directory (secret_key, the SQLite database), the artifact store and cache (other versions' weights), the
network (PostgreSQL, Redis), the parent's environment. The layers, applied in the child in this order once its
imports are done (`confine`), each recorded by name in `Confinement.applied` or, where the kernel or the
user cannot have it, in `Confinement.skipped` with the reason:

1. `clean_environment` (parent side, at spawn): only what Python and torch need; no inherited descriptors but
   the channel (the parent spawns with close_fds, and `close_other_fds` closes anything else); cwd "/".
2. `namespaces`: a private mount namespace (with a user namespace when not root) where each hidden path is
   covered by an empty read-only tmpfs, so `/proc/<pid>/root/<data dir>` is empty from outside too; a
   network namespace with no interfaces up (no TCP, UDP or abstract Unix socket reaches the host's); an IPC
   namespace. Root without CAP_SYS_ADMIN (a container's default) moves to nobody first and tries again with
   a user namespace.
3. `landlock_filesystem`: read-only access beneath the interpreter's and torch's directories and the
   `serving` package only (never the project root, which holds var/), no write, no execve; device files the
   accelerator needs may be written and ioctl'ed, and on CUDA its own threads' /proc entries, which the
   driver writes as it starts (`own_writable_paths`). Through the `landlock` binding (filesystem rules only).
4. `landlock_network_and_scope`: a second Landlock layer, by ctypes because the binding knows only
   filesystem rules: TCP bind and connect denied (ABI >= 4), abstract Unix sockets and signals scoped to the
   domain (ABI >= 6).
5. `drop_privileges`: no_new_privs, then as root the move to nobody (supplementary groups cleared), which
   clears every capability; as non-root the capabilities the user namespace gave are dropped with capset.
6. `limit_resources`: no core dumps, no file writes (RLIMIT_FSIZE 0), a bound on processes where root was
   dropped (RLIMIT_NPROC counts every process and thread of the uid, so it is shared by all runtime children).

Two walls are required (`require_walls`): one on the filesystem (the mount namespace or Landlock's
filesystem rules) and one on the network (the network namespace or Landlock's TCP rules, ABI >= 4). With
neither layer of a pair, the process refuses to run tenant code (ConfinementError, and the load fails
saying why) unless the node's FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX says otherwise: without both filesystem
layers a model reads the data directory (secret_key, the SQLite database), without both network layers it
connects to PostgreSQL and Redis.

Not used: seccomp. libseccomp's own Python binding is not published on PyPI (what is there are one-person
repackagings), and a hand-written BPF filter is not a well-kept binding; the layers above already deny the
filesystem and network reach a syscall filter would, though not the kernel's syscall surface itself.

At a node's or worker's start, `self_check` builds the walls once in a throwaway child (`python -m
serving.dataplane.node.sandbox --self-check`), so a machine where they cannot be built (a pod that may not
unshare, on a kernel older than Linux 6.7, Landlock ABI < 4) stops the process there, saying why, instead of
starting healthy and failing every load.

The syscalls by ctypes (unshare(2), mount(2), capset(2), landlock_create_ruleset(2)) are the documented
Linux interfaces; Python 3.11's `os` has none of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import landlock
from landlock.plumbing import get_restrict_self

NOBODY = 65534
# RLIMIT_NPROC for the dropped uid: every runtime child's threads count against it (one child per version).
MAX_PROCESSES = 512

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39

# landlock_create_ruleset(2) is syscall 444 on every architecture (the unified syscall table).
SYS_LANDLOCK_CREATE_RULESET = 444
LANDLOCK_ACCESS_NET_BIND_TCP = 1 << 0
LANDLOCK_ACCESS_NET_CONNECT_TCP = 1 << 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
LANDLOCK_SCOPE_SIGNAL = 1 << 1
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# What the environment of the runtime process may hold: nothing of the platform's settings or credentials.
# One thread per BLAS/OpenMP pool at import: threads that exist before Landlock applies would be outside it,
# so the process stays single-threaded until confined and sets its intra-op threads afterwards.
_KEPT_ENV = ("LANG", "LC_ALL", "TZ", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LD_LIBRARY_PATH")
_SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


# Skipped layers that leave no wall missing: seccomp is never used (see above). Any other skipped layer is
# logged at WARNING by the node and counted (runtime_process), and tests expect none on the CI machine.
OPTIONAL_LAYERS = frozenset({"seccomp"})
# The layers that each make a wall: one of each pair must apply (`missing_walls`).
WALLS = {
    "filesystem": ("mount-namespace", "landlock-fs"),
    "network": ("network-namespace", "landlock-net"),
}
PARTIAL_SANDBOX_SETTING = "FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX"


class ConfinementError(RuntimeError):
    """A layer that should apply could not: the runtime process refuses to run model code."""


@dataclass
class Confinement:
    applied: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"applied": list(self.applied), "skipped": dict(self.skipped)}


def clean_environment(project_root: Path) -> dict[str, str]:
    """The runtime process's whole environment: PATH, the import path to this project, locale and device
    selection, single-threaded pools; never SECRET_KEY, DATABASE_URL, REDIS_URL, FERRY_NODE_TOKEN or any
    other FERRY_* setting."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "PYTHONPATH": str(project_root),
        "HOME": "/nonexistent",
        "PYTHONDONTWRITEBYTECODE": "1",
        **_SINGLE_THREADED,
    }
    env.update({k: os.environ[k] for k in _KEPT_ENV if k in os.environ})
    return env


def readable_paths(project_root: Path, device: str = "cpu") -> list[str]:
    """What the interpreter and torch read after confinement (lazy imports, shared libraries, CPU topology):
    the interpreter's prefixes and site-packages, the system's libraries, and this project's `serving`
    package only. On CUDA also /sys (the driver reads the PCI topology) and the driver's /etc files; that
    path is not exercised by the CI machine (no GPU): `bench/gpu_check.sh` checks it on one."""
    paths = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        "/usr",
        "/lib",
        "/lib64",
        "/etc/ld.so.cache",
        "/etc/localtime",
        "/proc",
        "/sys/devices/system/cpu",
        "/dev/urandom",
        str(project_root / "serving"),
    }
    paths.update(p for p in sys.path if p and "site-packages" in p)
    if device.startswith("cuda"):
        paths.update(("/sys", "/etc/nvidia", "/etc/OpenCL"))
    return sorted(paths)


def device_paths(device: str) -> list[str]:
    """Device files the runtime may open read-write (and ioctl): /dev/null always; on CUDA the driver's."""
    paths = ["/dev/null"]
    if device.startswith("cuda"):
        dev = Path("/dev")
        paths += sorted(str(p) for p in dev.glob("nvidia*"))
    return paths


def own_writable_paths(device: str) -> list[str]:
    """Files of the runtime process's own /proc entry it may write: on CUDA its threads' entries. Without
    this the CUDA driver's initialisation fails with error 304, "OS call failed", under Landlock alone (on
    an H200, 2026-12-04, bench.sandbox_cuda_check: every other layer left CUDA working; write rights on
    /proc/self/task let it start, on /proc/thread-self did not, so it writes another thread's entry: most
    likely it names the threads it starts, through their `comm`). The rule is on this process's own entry,
    opened when the ruleset is built, so no other process's /proc files (the platform's) become writable."""
    return ["/proc/self/task"] if device.startswith("cuda") else []


def single_threaded() -> bool:
    return len(os.listdir("/proc/self/task")) == 1


def close_other_fds(keep: Iterable[int]) -> None:
    """Close every descriptor but stdio and `keep` (the channel): nothing opened by the parent stays reachable."""
    kept = {0, 1, 2, *keep}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in kept:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, closed already


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> int:
    """unshare(2); 0, or the errno it failed with (then cleared: see `_clear_errno`)."""
    if _libc.unshare(flags) == 0:
        return 0
    err = ctypes.get_errno()
    _clear_errno()
    return err


def _clear_errno() -> None:
    """Zero ctypes' copy of errno, which it hands to the next foreign call. The `landlock` binding judges each
    of its calls by errno alone, not by the result: an errno left by an earlier failed call (an unshare refused
    here) would make Landlock look unavailable, and it would be skipped with the namespaces."""
    ctypes.set_errno(0)


def _set_dumpable(on: bool) -> None:
    _check(_libc.prctl(PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)")


def _become_nobody(record: Confinement) -> None:
    """As root: supplementary groups cleared, then gid and uid nobody, which clears every capability."""
    os.setgroups([])
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)
    record.applied.append(f"uid:{NOBODY}")


def namespaces(hidden: Sequence[str], record: Confinement) -> None:
    """Enter private mount, network and IPC namespaces (and a user namespace when not root, the kernel
    allowing), then cover each hidden directory with an empty read-only tmpfs. Root that may not unshare
    them (no CAP_SYS_ADMIN: a container's default) becomes nobody first and enters them with a user
    namespace, as a non-root user would."""
    if not single_threaded():
        raise ConfinementError("the runtime process has threads before confinement")
    root = os.geteuid() == 0
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC
    user_namespace = not root
    err = _unshare(flags | (CLONE_NEWUSER if user_namespace else 0))
    refused_as_root = ""
    if err and root:
        refused_as_root = f"unshare as root: {os.strerror(err)}; "
        _become_nobody(record)
        # Leaving root cleared the dumpable flag, which makes /proc/self root's: the maps below are written there.
        _set_dumpable(True)
        user_namespace = True
        err = _unshare(flags | CLONE_NEWUSER)
    if err:
        if refused_as_root:
            _set_dumpable(False)
        record.skipped["namespaces"] = f"{refused_as_root}unshare: {os.strerror(err)}"
        return
    if user_namespace:
        # The only uid inside is the caller's own; setgroups must be denied before a gid map is written.
        uid, gid = os.geteuid(), os.getegid()
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
        if refused_as_root:
            _set_dumpable(False)  # as a process that left root is: its /proc entries are not nobody's to read
        record.applied.append("user-namespace")
    record.applied += ["network-namespace", "ipc-namespace"]
    # Mounts made here must not propagate back to the host's namespace.
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    covered = []
    for path in hidden:
        if not os.path.isdir(path):
            continue
        _check(
            _libc.mount(
                b"tmpfs",
                os.fsencode(path),
                b"tmpfs",
                MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                b"size=4k,nr_inodes=1,mode=0555",
            ),
            f"mount tmpfs over {path}",
        )
        covered.append(path)
    record.applied.append("mount-namespace")
    record.applied.append(f"hidden:{len(covered)}")


def landlock_filesystem(
    read: Sequence[str], devices: Sequence[str], record: Confinement, own: Sequence[str] = ()
) -> None:
    """Landlock: read beneath `read`, read-write (and ioctl) on `devices`, read-write beneath `own` (the
    process's own /proc entries), nothing else; no execve anywhere."""
    _clear_errno()
    try:
        abi = landlock.landlock_abi_version()
    except OSError as exc:
        record.skipped["landlock"] = f"unavailable: {exc.strerror}"
        return
    if not single_threaded():
        raise ConfinementError("the runtime process has threads before Landlock applies")
    fs = landlock.FSAccess
    ruleset = landlock.Ruleset()  # handles every filesystem right this ABI knows
    read_file = fs.READ_FILE
    read_dir = fs.READ_FILE | fs.READ_DIR
    device = fs.READ_FILE | fs.WRITE_FILE | (fs.IOCTL_DEV if abi >= 5 else 0)
    for path in read:
        if os.path.exists(path):
            ruleset.allow(path, rules=read_dir if os.path.isdir(path) else read_file)
    for path in devices:
        if os.path.exists(path):
            ruleset.allow(path, rules=device)
    # The rights bench.sandbox_cuda_check found CUDA to start with beneath its threads' entries. Read and write
    # alone were not enough; which of truncate, create and remove it needs was not narrowed down (most likely
    # truncate: creating or removing a file is an operation procfs refuses anyway).
    own_rights = fs.READ_FILE | fs.READ_DIR | fs.WRITE_FILE | fs.TRUNCATE | fs.REMOVE_FILE | fs.REMOVE_DIR
    own_rights |= fs.MAKE_REG | fs.MAKE_DIR | fs.MAKE_SOCK | fs.MAKE_FIFO | fs.MAKE_SYM
    for path in own:
        if os.path.exists(path):
            ruleset.allow(path, rules=own_rights)
    ruleset.apply()  # sets no_new_privs first, as landlock_restrict_self(2) requires without CAP_SYS_ADMIN
    record.applied.append(f"landlock-fs:abi{abi}")


class _RulesetAttr(ctypes.Structure):
    """struct landlock_ruleset_attr (linux/landlock.h) with the network (ABI 4) and scope (ABI 6) fields."""

    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


def landlock_network_and_scope(record: Confinement) -> None:
    """A second Landlock layer: no TCP bind or connect (no rule allows a port), and no abstract Unix socket
    connection or signal outside this domain."""
    _clear_errno()
    try:
        abi = landlock.landlock_abi_version()
    except OSError as exc:
        record.skipped["landlock-net"] = f"Landlock unavailable: {exc.strerror}"
        return
    if abi < 4:
        record.skipped["landlock-net"] = f"Landlock ABI {abi} < 4"
        return
    attr = _RulesetAttr(0, LANDLOCK_ACCESS_NET_BIND_TCP | LANDLOCK_ACCESS_NET_CONNECT_TCP, 0)
    size = ctypes.sizeof(ctypes.c_uint64) * 2  # the ABI 4 struct, without `scoped`
    if abi >= 6:
        attr.scoped = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL
        size = ctypes.sizeof(attr)
    else:
        record.skipped["landlock-scope"] = f"Landlock ABI {abi} < 6"
    syscall = _libc.syscall
    syscall.restype = ctypes.c_long
    fd = syscall(
        ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)
    )
    if fd < 0:
        raise ConfinementError(f"landlock_create_ruleset (net): {os.strerror(ctypes.get_errno())}")
    try:
        get_restrict_self()(fd, 0)
    finally:
        os.close(fd)
    record.applied.append("landlock-net")
    if abi >= 6:
        record.applied.append("landlock-scope")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(record: Confinement) -> None:
    """no_new_privs; as root, become nobody (which clears every capability); otherwise drop the capabilities
    a user namespace gave (capset to nothing), so nothing can undo the mounts above."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    record.applied.append("no-new-privs")
    if os.geteuid() == 0:
        _become_nobody(record)
    else:
        header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
        data = (_CapData * 2)()
        _check(_libc.capset(ctypes.byref(header), data), "capset")
        record.applied.append("no-capabilities")
    if _effective_capabilities() != 0:
        raise ConfinementError("the runtime process kept capabilities")


def _effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return -1


def limit_resources(record: Confinement, dropped_root: bool) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    record.applied += ["rlimit-core", "rlimit-fsize"]
    if dropped_root:
        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
        record.applied.append("rlimit-nproc")


def missing_walls(record: Confinement) -> list[str]:
    """The walls (WALLS) none of whose layers applied."""
    applied = {layer.split(":", 1)[0] for layer in record.applied}
    return [wall for wall, layers in WALLS.items() if not applied.intersection(layers)]


def require_walls(record: Confinement, required: bool = True) -> None:
    """Refuse to go on without a filesystem and a network wall (ConfinementError naming what was skipped and
    why), unless `required` is false (the node's FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX): then each missing
    wall is recorded as skipped, for the node to log and count."""
    missing = missing_walls(record)
    if not missing:
        return
    if required:
        reasons = "; ".join(f"{k}: {v}" for k, v in record.skipped.items() if k not in OPTIONAL_LAYERS)
        raise ConfinementError(
            f"no {' and no '.join(missing)} wall ({reasons or 'no layer applied'}); tenant code does not run"
            f" without one (set {PARTIAL_SANDBOX_SETTING}=true on the node to run it anyway, unsafely)"
        )
    for wall in missing:
        record.skipped[f"{wall}-wall"] = f"none of {', '.join(WALLS[wall])}; allowed by {PARTIAL_SANDBOX_SETTING}"


def confine(
    *, hidden: Sequence[str], project_root: Path, device: str, channel_fd: int, walls_required: bool = True
) -> Confinement:
    """Every layer, in order. Call once the imports (and their lazily loaded pieces) are done, before any
    artifact arrives; raises ConfinementError rather than run half-confined where a layer failed midway, or
    where no filesystem or no network wall applied (`require_walls`)."""
    record = Confinement()
    close_other_fds([channel_fd])
    os.chdir("/")
    record.applied.append("clean-env")
    root = os.geteuid() == 0
    try:
        namespaces(hidden, record)
    except OSError as exc:
        raise ConfinementError(f"namespaces: {exc}") from None
    landlock_filesystem(
        readable_paths(project_root, device), device_paths(device), record, own=own_writable_paths(device)
    )
    landlock_network_and_scope(record)
    require_walls(record, walls_required)
    drop_privileges(record)
    limit_resources(record, dropped_root=root)
    record.skipped["seccomp"] = "not used (no well-kept binding; see serving.dataplane.node.sandbox)"
    return record


# What a machine needs for the walls, as a failed start-up check says it (docs/security.md, "Kernel requirements").
REQUIREMENT = (
    "the runtime process needs Landlock ABI >= 4 (Linux 6.7 or later) or leave to create user, mount and network"
    " namespaces (a pod's seccomp profile and capabilities usually deny them): see docs/security.md"
)
# The self-check's child: this module run with --self-check (tests replace it to confine as an old kernel would).
SELF_CHECK = ("-m", "serving.dataplane.node.sandbox", "--self-check")


def self_check(
    *, hidden: Sequence[str], project_root: Path, device: str, required: bool = True, timeout_s: float = 60.0
) -> Confinement:
    """Confine a throwaway child as a runtime process is confined (`confine`, same hidden paths, device and
    walls rule) and return what applied and what was skipped; ConfinementError, saying why, where the child
    refuses (no filesystem or no network wall and `required`), fails or does not answer within `timeout_s`.
    The child is a fresh interpreter with the runtime's clean environment that imports nothing but this
    module: a fraction of a second, and nothing of the caller's is inherited."""
    spec = json.dumps(
        {"hidden": list(hidden), "project_root": str(project_root), "device": device, "required": required}
    )
    try:
        done = subprocess.run(
            [sys.executable, *SELF_CHECK, spec],
            env=clean_environment(project_root),
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ConfinementError(f"the sandbox's self-check did not answer within {timeout_s:g} s") from None
    try:
        answer = json.loads(done.stdout.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        stderr = done.stderr.decode(errors="replace").strip()[-2000:]
        answer = {"ok": False, "error": f"the self-check exited {done.returncode} with no answer: {stderr}"}
    if not answer.get("ok"):
        raise ConfinementError(str(answer.get("error", "the self-check refused")))
    return Confinement(applied=list(answer.get("applied", [])), skipped=dict(answer.get("skipped", {})))


def _self_check_main(spec: str) -> int:
    """The self-check's child: `confine` itself, then print what applied (one JSON line on stdout, the channel
    `confine` keeps open) or why it refused."""
    args = json.loads(spec)
    try:
        record = confine(
            hidden=args["hidden"],
            project_root=Path(args["project_root"]),
            device=args["device"],
            channel_fd=1,
            walls_required=bool(args["required"]),
        )
    except Exception as exc:  # noqa: BLE001 (as runtime_worker: any failure to confine is a refusal, said why)
        error = str(exc) if isinstance(exc, ConfinementError) else f"{type(exc).__name__}: {exc}"
        print(json.dumps({"ok": False, "error": error}), flush=True)
        return 1
    print(json.dumps({"ok": True, **record.as_dict()}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--self-check"] or len(sys.argv) != 3:
        sys.exit("usage: python -m serving.dataplane.node.sandbox --self-check SPEC")
    sys.exit(_self_check_main(sys.argv[2]))
