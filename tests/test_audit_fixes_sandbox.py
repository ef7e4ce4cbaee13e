"""The model-isolation audit's findings, each with a test that fails without its fix: a runtime process with no
filesystem or no network wall refuses to run tenant code; a reload after a child died re-checks the artifact's
sha256 (and survives the cache deleting the file); a TorchScript archive's code is read for denied operators
before anything of it is compiled or runs; an upload whose operators could not be inspected is refused, and
`inline` isolation needs FERRY_DEBUG; the child's stderr is not the node's log; the admin's operator namespaces
reach the child."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient
from torch import nn

from serving.dataplane.metrics import metrics
from serving.dataplane.node import archive_check, artifact_cache, operator_check, runtime_process, sandbox
from serving.dataplane.node.runtime import RuntimeFailure
from serving.dataplane.node.runtime_process import IsolatedRuntime, inspect_operators
from serving.demo import save_artifact
from serving.models import Artifact, ModelVersion
from tenants.models import Membership, Role, Tenant
from tests.test_operator_check import ReadsInForward, upload
from tests.test_runtime_sandbox import SCORES, X

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


# --- 1. no filesystem or no network wall: tenant code does not run ---------------------------------------------

CONFINE_CHILD = r"""
import ctypes, errno, json, os, sys
from pathlib import Path
import landlock
from serving.dataplane.node import sandbox

hidden, secret, mode, root = sys.argv[1:5]
if mode in ("no-layers", "no-layers-allowed"):
    # as a kernel without Landlock and a user who may not unshare would have it: every wall's layer fails
    sandbox._unshare = lambda flags: errno.EPERM
    def unavailable():
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
    landlock.landlock_abi_version = unavailable
elif mode == "no-cap-sys-admin" and os.geteuid() == 0:
    # root without CAP_SYS_ADMIN, as in a container's default: unshare of the namespaces alone is refused
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(header), data) == 0
    data[0].effective &= ~(1 << 21)
    data[0].permitted &= ~(1 << 21)
    assert libc.capset(ctypes.byref(header), data) == 0
    assert libc.unshare(0x00020000) != 0, "CAP_SYS_ADMIN was not dropped"
try:
    record = sandbox.confine(
        hidden=[hidden], project_root=Path(root), device="cpu", channel_fd=2,
        walls_required=mode != "no-layers-allowed",
    )
except sandbox.ConfinementError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
try:
    read = open(secret).read()
except OSError as exc:
    read = type(exc).__name__
print(json.dumps({**record.as_dict(), "read": read, "euid": os.geteuid()}))
"""


@pytest.fixture
def hidden_secret() -> Iterator[tuple[Path, Path]]:
    """A directory any user can read (so that a read refused below is the sandbox's doing, not the file mode's),
    holding a 'secret'."""
    directory = Path(tempfile.mkdtemp(prefix="ferry-walls-", dir="/tmp"))
    directory.chmod(0o755)
    secret = directory / "secret_key"
    secret.write_text("the platform's secret")
    secret.chmod(0o644)
    try:
        yield directory, secret
    finally:
        secret.unlink()
        directory.rmdir()


def confine_in_child(mode: str, hidden: Path, secret: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CONFINE_CHILD, str(hidden), str(secret), mode, str(ROOT)],
        env=sandbox.clean_environment(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_with_neither_layer_of_a_wall_the_runtime_process_refuses_to_run_model_code(hidden_secret) -> None:  # noqa: ANN001
    hidden, secret = hidden_secret
    # given a process where neither the namespaces nor Landlock apply (the audit's Docker case)
    # when it confines itself / then it refuses, naming both missing walls and why each layer was skipped
    refused = confine_in_child("no-layers", hidden, secret)["refused"]
    assert "no filesystem and no network wall" in refused, refused
    assert "namespaces: " in refused and "landlock: unavailable" in refused
    assert sandbox.PARTIAL_SANDBOX_SETTING in refused
    # and what the opt-out allows is what it says: that process reads the secret (so the refusal matters)
    allowed = confine_in_child("no-layers-allowed", hidden, secret)
    assert allowed["read"] == "the platform's secret"
    assert {"filesystem-wall", "network-wall", "namespaces", "landlock"} <= set(allowed["skipped"])


def test_root_without_cap_sys_admin_gets_its_namespaces_through_a_user_namespace(hidden_secret) -> None:  # noqa: ANN001
    hidden, secret = hidden_secret
    # given root without CAP_SYS_ADMIN (as non-root: the user namespace path it always takes)
    record = confine_in_child("no-cap-sys-admin", hidden, secret)
    # then it enters the namespaces through a user namespace, as nobody, and the directory is covered
    assert "refused" not in record, record
    for layer in ("user-namespace", "mount-namespace", "network-namespace", "hidden:1", "no-capabilities"):
        assert layer in record["applied"], record
    assert record["read"] in ("FileNotFoundError", "PermissionError"), record
    if os.geteuid() == 0:
        assert record["euid"] == sandbox.NOBODY and f"uid:{sandbox.NOBODY}" in record["applied"], record
    # and Landlock applies too: the refused unshare's errno does not make the binding think it unavailable
    assert any(layer.startswith("landlock-fs") for layer in record["applied"]), record
    assert set(record["skipped"]) <= sandbox.OPTIONAL_LAYERS, record


@pytest.mark.parametrize(
    ("applied", "missing"),
    [
        (["mount-namespace", "network-namespace"], []),
        (["landlock-fs:abi7", "landlock-net"], []),
        (["mount-namespace", "landlock-net"], []),
        (["landlock-fs:abi3"], ["network"]),
        (["network-namespace"], ["filesystem"]),
        (["clean-env", "no-new-privs"], ["filesystem", "network"]),
    ],
)
def test_a_wall_is_either_of_its_layers(applied: list[str], missing: list[str]) -> None:
    record = sandbox.Confinement(applied=list(applied), skipped={"landlock-net": "Landlock ABI 3 < 4"})
    assert sandbox.missing_walls(record) == missing
    if missing:
        with pytest.raises(sandbox.ConfinementError, match="Landlock ABI 3 < 4"):
            sandbox.require_walls(record)
        sandbox.require_walls(record, required=False)
        assert {f"{wall}-wall" for wall in missing} <= set(record.skipped)
    else:
        sandbox.require_walls(record)


def test_the_node_logs_and_counts_each_skipped_layer_but_the_optional_ones(caplog) -> None:  # noqa: ANN001
    counted = runtime_process.CONFINEMENT_SKIPPED.labels("landlock-net")
    before = counted._value.get()
    with caplog.at_level(logging.DEBUG, logger=runtime_process.__name__):
        runtime_process.report_confinement(1, {"applied": ["mount-namespace"], "skipped": {"seccomp": "not used"}})
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        runtime_process.report_confinement(7, {"skipped": {"seccomp": "x", "landlock-net": "Landlock ABI 3 < 4"}})
    assert counted._value.get() == before + 1
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "runtime process 7" in warning.getMessage() and "landlock-net (Landlock ABI 3 < 4)" in warning.getMessage()


def test_on_this_machine_every_layer_applies(model_files) -> None:  # noqa: ANN001
    """The CI machine (root, Landlock ABI >= 6) gives the runtime process every layer: a skipped one other than
    those known to be optional means the sandbox lost a layer there."""
    runtime = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        skipped, applied = runtime.confinement["skipped"], runtime.confinement["applied"]
        assert set(skipped) <= sandbox.OPTIONAL_LAYERS, skipped
        layers = {layer.split(":", 1)[0] for layer in applied}
        expected = {"mount-namespace", "network-namespace", "ipc-namespace", "landlock-fs", "landlock-net"}
        expected |= {"landlock-scope", "no-new-privs", "rlimit-fsize", "stderr-closed"}
        assert expected <= layers, applied
        assert ("uid" in layers) if os.geteuid() == 0 else ("user-namespace" in layers), applied
    finally:
        runtime.close()


# --- 2. a reload checks the bytes' sha256 again, from the file it verified ------------------------------------


def content_addressed(directory: Path, source: Path) -> Path:
    """`source` stored as the store and a node's cache store it: `<sha[:2]>/<sha256>`, read-only."""
    data = source.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    path = directory / sha[:2] / sha
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    path.chmod(0o444)
    return path


def kill_child(runtime: IsolatedRuntime) -> int:
    pid = runtime.process.pid
    os.kill(pid, signal.SIGKILL)
    assert runtime_process._exited(runtime.process.pidfd, 30)
    return pid


def overwrite_in_place(path: Path, data: bytes) -> None:
    """New bytes in the same file (inode), as a tamperer with write access would put them."""
    path.chmod(0o644)
    with path.open("r+b") as f:
        f.truncate(0)
        f.write(data)


def refused_by_runtime() -> float:
    return artifact_cache.REFUSED.labels("runtime")._value.get()


def test_a_reload_after_the_cache_deleted_the_file_uses_the_verified_bytes(model_files, tmp_path: Path) -> None:  # noqa: ANN001
    path = content_addressed(tmp_path / "cache", model_files.digits)
    runtime = IsolatedRuntime(path, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        assert runtime.sha256 == path.name
        before = runtime.predict([np.ones((2, 64), np.float32)])[0]
        # given the cache deleted the file to make room, and the child died
        path.unlink()
        first = kill_child(runtime)
        # when the next batch reloads it / then a fresh child answers as before
        after = runtime.predict([np.ones((2, 64), np.float32)])[0]
        assert runtime.process.pid != first
        np.testing.assert_array_equal(before, after)
    finally:
        runtime.close()


@pytest.mark.parametrize("named_by_sha", [True, False])
def test_a_reload_refuses_bytes_changed_since_the_first_load(model_files, tmp_path: Path, named_by_sha: bool) -> None:  # noqa: ANN001
    if named_by_sha:
        path = content_addressed(tmp_path / "store", model_files.digits)
    else:  # a path not named by its hash: the bytes of the first load are the reference
        path = tmp_path / "digits.pt"
        path.write_bytes(model_files.digits.read_bytes())
    runtime = IsolatedRuntime(path, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        # given the file now holds another valid model (which the old reload would have loaded and served)
        other = tmp_path / "other.pt"
        save_artifact(nn.Sequential(nn.Linear(64, 10)), "torchscript", torch.zeros(2, 64), other)
        overwrite_in_place(path, other.read_bytes())
        refused = refused_by_runtime()
        kill_child(runtime)
        # when the next batch reloads / then it is refused, counted, and nothing answers with the other model
        with pytest.raises(RuntimeFailure, match="do not hash to its sha256; refused"):
            runtime.predict([np.ones((2, 64), np.float32)])
        assert refused_by_runtime() == refused + 1
    finally:
        runtime.close()


def test_bytes_that_do_not_hash_to_the_given_sha256_start_no_child(model_files) -> None:  # noqa: ANN001
    starts = metrics.RUNTIME_PROCESS_STARTS._value.get()
    runtime = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU, sha256="0" * 64)
    try:
        with pytest.raises(RuntimeFailure, match="do not hash to its sha256"):
            runtime.load()
        assert metrics.RUNTIME_PROCESS_STARTS._value.get() == starts and runtime.process is None
    finally:
        runtime.close()


# --- 3. a TorchScript archive's code is read for denied operators before anything compiles -------------------


def with_code(base: Path, out: Path, old: str, new: str) -> Path:
    """`base` with `old` replaced by `new` in its code (and the code's debug records left out)."""
    members = {}
    with zipfile.ZipFile(base) as z:
        for name in z.namelist():
            if name.endswith(".debug_pkl"):
                continue
            data = z.read(name)
            if name.endswith(".py"):
                assert old.encode() in data, name
                data = data.replace(old.encode(), new.encode())
            members[name] = data
    with zipfile.ZipFile(out, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return out


FROM_FILE = "torch.from_file("
READ_LINE = "_0 = torch.from_file(path, False, size, dtype=0)"
# Ways TorchScript code can name an operator other than `torch.<name>(`: each compiles (and calls it) in torch.
SPELLINGS = {
    "getattr": (FROM_FILE, 'getattr(torch, "from_file")(', "aten::from_file"),
    "alias": ("_0 = torch.from_file(", "f = torch.from_file\n    _0 = f(", "aten::from_file"),
    "ops_namespace": (FROM_FILE, "ops.aten.from_file(", "aten::from_file"),
    "getattr_of_ops": (FROM_FILE, 'getattr(getattr(ops, "aten"), "from_file")(', "aten::from_file"),
    "split_literal": (FROM_FILE, 'getattr(torch, "from" "_file")(', "aten::from_file"),
    "octal_escape": (FROM_FILE, 'getattr(torch, "fr\\157m_file")(', "aten::from_file"),
    "module_alias": (FROM_FILE, "torch.autograd.from_file(", "aten::from_file"),
    "print": (READ_LINE, "_0 = torch.zeros([1])\n    print(_0)", "prim::Print"),
    "prim_print": (READ_LINE, "_0 = torch.zeros([1])\n    ops.prim.Print(_0)", "prim::Print"),
    "manual_seed": (READ_LINE, "_0 = torch.zeros([1])\n    torch.manual_seed(1)", "aten::manual_seed"),
    "namespace": (READ_LINE, "_0 = ops._test.leaky_relu(torch.zeros([1]), 0.5)", "_test::leaky_relu"),
}


@pytest.fixture(scope="module")
def reader_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("reader") / "reads.pt"
    torch.jit.save(torch.jit.script(ReadsInForward("/nonexistent")), str(path))
    return path


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_spelling_of_a_refused_operator_is_refused_before_compiling(
    reader_archive: Path, tmp_path: Path, spelling: str
) -> None:
    old, new, operator = SPELLINGS[spelling]
    path = with_code(reader_archive, tmp_path / f"{spelling}.pt", old, new)
    # given code that torch compiles into a call of the operator (so the check below can fail)
    _, compiled = operator_check.load_torchscript(io.BytesIO(path.read_bytes()), CPU)
    assert operator in compiled, compiled
    # when the archive is checked as data / then it is refused, naming the operator
    with pytest.raises(archive_check.ArchiveRefused) as refused:
        archive_check.check_archive(path, allowed_namespaces=())
    assert operator in refused.value.reason, refused.value.reason


def test_an_allowed_namespace_passes_the_code_check(reader_archive: Path, tmp_path: Path) -> None:
    old, new, _ = SPELLINGS["namespace"]
    path = with_code(reader_archive, tmp_path / "custom.pt", old, new)
    assert archive_check.check_archive(path, allowed_namespaces=["_test"]) == "zip"


class LayerNamedSave(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.save = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.save(x)


class LayerNamedStore(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.store = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.store(x)


@pytest.mark.parametrize(
    ("module", "refused_as"), [(LayerNamedSave, "aten::save"), (LayerNamedStore, None)], ids=["save", "store"]
)
def test_the_word_check_refuses_an_attribute_named_like_a_denied_operator(
    tmp_path: Path, module: type[nn.Module], refused_as: str | None
) -> None:
    # Blunt on purpose (docs/security.md): the word is refused whether it names a call or an attribute, and a
    # rename passes.
    path = tmp_path / "layer.pt"
    torch.jit.save(torch.jit.script(module()), str(path))
    if refused_as is None:
        assert archive_check.check_archive(path, allowed_namespaces=()) == "zip"
        return
    with pytest.raises(archive_check.ArchiveRefused) as refused:
        archive_check.check_archive(path, allowed_namespaces=())
    assert refused_as in refused.value.reason, refused.value.reason


def torchscript_zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/version", b"3\n")
        for name, data in members.items():
            z.writestr(f"archive/{name}", data)
    return path


def test_code_torch_would_read_otherwise_than_python_and_unknown_torchbind_classes_are_refused(
    reader_archive: Path, tmp_path: Path
) -> None:
    cases = {
        # a carriage return: a line break to Python, maybe not to TorchScript's lexer
        "cr": (with_code(reader_archive, tmp_path / "cr.pt", FROM_FILE, "torch.zeros(\r"), "printable ASCII"),
        "syntax": (with_code(reader_archive, tmp_path / "syn.pt", FROM_FILE, "torch.zeros(("), "does not parse"),
        # an object of a TorchBind class outside the allowed namespaces, built (by C++) while the archive loads
        "torchbind_pickle": (
            torchscript_zip(
                tmp_path / "pg.pt",
                {"data.pkl": b"\x80\x02c__torch__.torch.classes.c10d\nProcessGroup\nq\x00)\x81q\x01."},
            ),
            "torch.classes.c10d.ProcessGroup",
        ),
        "torchbind_code": (
            with_code(
                reader_archive,
                tmp_path / "tb.pt",
                "  path : str\n",
                "  path : str\n  group : __torch__.torch.classes.c10d.ProcessGroup\n",
            ),
            "torch.classes.c10d.ProcessGroup",
        ),
        "stack_global": (
            torchscript_zip(tmp_path / "sg.pt", {"data.pkl": pickle.dumps(os.system, protocol=4)}),
            "STACK_GLOBAL",
        ),
    }
    for name, (path, reason) in cases.items():
        with pytest.raises(archive_check.ArchiveRefused, match=reason):
            archive_check.check_archive(path, allowed_namespaces=())
        # and with the operator check left out (tests of the sandbox alone) the code is not read
        assert archive_check.check_archive(path, check_operators=False) == "zip", name


# --- 4. an upload whose operators were not inspected is not stored; inline needs FERRY_DEBUG ------------------


@pytest.fixture
def engineer(db) -> APIClient:  # noqa: ANN001
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    bob = User.objects.create_user("bob", "bob@example.org")
    Membership.objects.create(user=bob, tenant=tenant, role=Role.ENGINEER)
    client = APIClient()
    client.force_login(bob)
    return client


def test_an_upload_whose_inspection_fails_is_refused_and_not_stored(
    engineer: APIClient,
    model_files,  # noqa: ANN001
    tmp_path: Path,
    settings,  # noqa: ANN001
) -> None:
    settings.FERRY_ARTIFACT_ROOT = tmp_path / "store"
    # given a TorchScript archive that passes the data check but does not load (its code is missing)
    with zipfile.ZipFile(model_files.digits) as z:
        members = {n: z.read(n) for n in z.namelist() if "/code/" not in n}
    broken = tmp_path / "no-code.pt"
    with zipfile.ZipFile(broken, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    assert archive_check.check_archive(broken, allowed_namespaces=()) == "zip"
    # when it is uploaded / then 422, saying its operators could not be inspected, and nothing is stored
    response = upload(engineer, broken, "torchscript", "broken")
    assert response.status_code == 422, response.content
    assert response.json()["error"].startswith("archive refused: its operators could not be inspected: ")
    assert not Artifact.objects.exists() and not ModelVersion.objects.exists()
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]


@pytest.mark.parametrize(("debug", "loads"), [("", False), ("false", False), ("true", True)])
def test_inline_isolation_is_refused_unless_debug(tmp_path: Path, debug: str, loads: bool) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env.update(FERRY_DATA_DIR=str(tmp_path), FERRY_RUNTIME_ISOLATION="inline", FERRY_DEBUG=debug)
    done = subprocess.run(
        [sys.executable, "-c", "import config.settings as s; print(s.FERRY_RUNTIME_ISOLATION)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if loads:
        assert done.returncode == 0 and done.stdout.strip() == "inline", done.stderr
    else:
        assert done.returncode != 0 and "only with FERRY_DEBUG=true" in done.stderr, done.stderr


# --- 5. the model's writes to stderr do not reach the node's log ------------------------------------------------


def test_the_runtime_processs_stderr_is_not_the_nodes_log(model_files) -> None:  # noqa: ANN001
    runtime = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        pid = runtime.process.pid
        zygote = runtime_process.zygote().process.pid
        # the zygote's stderr is the pipe the node logs (so the check below can fail) and the child's is not
        assert os.readlink(f"/proc/{zygote}/fd/2").startswith("pipe:")
        assert os.readlink(f"/proc/{pid}/fd/2") == "/dev/null"
        assert "stderr-closed" in runtime.confinement["applied"]
    finally:
        runtime.close()


# --- 6. the admin's operator namespaces reach the child -------------------------------------------------------


class CallsTestNamespace(nn.Module):
    """Calls an operator of torch's own `_test` namespace: registered in every torch process, not allowed by
    default."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops._test.leaky_relu(x, 0.5)[:, :10]


def test_the_admins_namespaces_reach_the_runtime_process(tmp_path: Path, settings) -> None:  # noqa: ANN001
    path = tmp_path / "custom.pt"
    save_artifact(CallsTestNamespace(), "torchscript", torch.zeros(2, 64), path)
    # given the namespace allowed on the node / when the child loads and inspects it / then it is allowed there
    settings.FERRY_ALLOWED_OPERATOR_NAMESPACES = ["_test"]
    assert "_test::leaky_relu" in inspect_operators(path.read_bytes(), "torchscript")
    runtime = IsolatedRuntime(path, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        out = runtime.predict([np.full((1, 64), -2.0, np.float32)])[0]
        np.testing.assert_allclose(out, np.full((1, 10), -1.0, np.float32))
    finally:
        runtime.close()
    # and without it, the child refuses it
    settings.FERRY_ALLOWED_OPERATOR_NAMESPACES = []
    refused = IsolatedRuntime(path, "torchscript", [X], [SCORES], CPU)
    try:
        with pytest.raises(RuntimeFailure, match="operator not allowed: _test::leaky_relu"):
            refused.load()
    finally:
        refused.close()
