"""The sandboxed runtime process (serving.dataplane.node.runtime_process, runtime_worker, sandbox), with real child
processes: the same answers as the inline runtime, a dead or hung child fails its batch and is replaced, and
from inside the child the platform's files, environment and network cannot be reached, even by a model
whose graph reads a file (`aten::from_file`)."""

from __future__ import annotations

import inspect
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from django.conf import settings
from torch import nn

from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.metrics import metrics
from serving.dataplane.node import runtime_process, sandbox
from serving.dataplane.node.runtime import ModelRuntime, RuntimeFailure, load_module
from serving.dataplane.node.runtime_process import IsolatedRuntime, inspect_operators
from serving.demo import save_artifact
from tests.test_runtime import BF16_IN, BF16_OUT, BF16Scores

CPU = torch.device("cpu")
X = TensorSpec("input", "FP32", (64,))
SCORES = TensorSpec("scores", "FP32", (10,))
TOKENS = TensorSpec("tokens", "INT64", (-1,))
SCORES2 = TensorSpec("scores", "FP32", (2,))
# load_module's keyword for leaving the operator check out (serving.dataplane.node.operator_check), once it has one:
# the tests of the sandbox alone run a model that check would refuse.
HAS_OPERATOR_CHECK = "check_operators" in inspect.signature(load_module).parameters
UNCHECKED = {"check_operators": False} if HAS_OPERATOR_CHECK else {}
PG_SOCKET = "/run/postgresql/.s.PGSQL.5432"


class Spin(nn.Module):
    """Computes for as many rounds as its first input value says: a batch that takes as long as asked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(int(x[0, 0].item())):
            y = torch.tanh(y @ torch.ones(64, 64) / 64.0)
        return y[:, :10]


class ReadsAFile(nn.Module):
    """Returns the first 40 bytes of a file as its scores: what the security review registered."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stolen = torch.from_file(self.path, False, 10, dtype=torch.float32)
        return stolen.view(1, 10).expand(x.shape[0], 10)


def failures(reason: str) -> float:
    return metrics.RUNTIME_PROCESS_FAILURES.labels(reason)._value.get()


@pytest.fixture(scope="module")
def isolated_digits(model_files) -> Iterator[IsolatedRuntime]:  # noqa: ANN001
    runtime = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    yield runtime
    runtime.close()


def embedded_secret() -> Path:
    """Embedded mode's key file in the data directory, where a process without SECRET_KEY writes its own; the
    suite runs with SECRET_KEY set (scripts/test.sh), so it is written here when the data directory lacks it."""
    secret = Path(settings.DATA_DIR) / "secret_key"
    if not secret.exists():
        secret.write_text(secrets.token_urlsafe(50))
        secret.chmod(0o600)
    return secret


@pytest.fixture
def secret_reader(tmp_path: Path) -> Path:
    path = tmp_path / "reads_secret.pt"
    save_artifact(ReadsAFile(str(embedded_secret())), "torchscript", torch.zeros(2, 64), path)
    return path


def test_the_isolated_runtime_answers_as_the_inline_one(model_files, isolated_digits, digits_samples) -> None:  # noqa: ANN001
    inline = ModelRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
    inline.load()
    requests = [{"input": digits_samples[0][i : i + n]} for i, n in ((0, 1), (5, 3), (20, 7))]
    for mine, theirs in zip(isolated_digits.run(requests), inline.run(requests), strict=True):
        np.testing.assert_allclose(mine["scores"], theirs["scores"], rtol=1e-5, atol=1e-6)
    assert isolated_digits.memory_bytes == inline.memory_bytes > 0
    assert not isolated_digits.module  # the module lives in the child only


@pytest.mark.parametrize("case", ["digits_export", "tokens"])
def test_the_isolated_runtime_answers_as_the_inline_one_for_export_and_variable_lengths(model_files, case) -> None:  # noqa: ANN001
    fmt, inputs, outputs = (
        ("torch_export", [X], [SCORES]) if case == "digits_export" else ("torchscript", [TOKENS], [SCORES2])
    )
    path = getattr(model_files, case)
    rng = np.random.default_rng(3)
    if case == "tokens":  # variable lengths: bucketed and padded in the parent, as inline
        requests = [{"tokens": rng.integers(0, 50, (1, n)).astype(np.int64)} for n in (3, 8, 2, 30)]
    else:
        requests = [{"input": rng.random((n, 64), dtype=np.float32)} for n in (1, 4)]
    inline = ModelRuntime(path, fmt, inputs, outputs, CPU)
    inline.load()
    isolated = IsolatedRuntime(path, fmt, inputs, outputs, CPU)
    try:
        isolated.load()
        for mine, theirs in zip(isolated.run(requests), inline.run(requests), strict=True):
            np.testing.assert_allclose(mine["scores"], theirs["scores"], rtol=1e-5, atol=1e-6)
        assert isolated.profile([1, 2], repeats=1).keys() == {1, 2}
    finally:
        isolated.close()


def test_a_child_killed_mid_batch_fails_that_batch_and_a_fresh_child_serves_the_next(tmp_path: Path) -> None:
    path = tmp_path / "spin.pt"
    save_artifact(Spin(), "torchscript", torch.zeros(2, 64), path)
    runtime = IsolatedRuntime(path, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        first = runtime.process.pid
        died = failures("died")
        long_batch = np.full((1, 64), 1e7, np.float32)  # rounds enough to outlast the kill below
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                runtime.predict([long_batch])
            except BaseException as exc:  # noqa: BLE001 (the test inspects it)
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(0.5)  # the batch is on its way or computing; either way the child dies under it
        os.kill(first, signal.SIGKILL)
        thread.join(timeout=60)
        # then that batch fails as a model failure does, saying why, and is counted
        assert len(outcome) == 1 and isinstance(outcome[0], RuntimeFailure), outcome
        assert "runtime process exited" in str(outcome[0])
        assert failures("died") == died + 1
        # and the next batch is served by a fresh child
        out = runtime.predict([np.zeros((2, 64), np.float32)])
        assert out[0].shape == (2, 10)
        assert runtime.process.pid != first
    finally:
        runtime.close()


def test_a_child_that_does_not_answer_in_time_is_killed_and_its_batch_fails(tmp_path: Path) -> None:
    path = tmp_path / "spin.pt"
    save_artifact(Spin(), "torchscript", torch.zeros(2, 64), path)
    runtime = IsolatedRuntime(path, "torchscript", [X], [SCORES], CPU, timeout_s=1)
    runtime.load()
    try:
        pid = runtime.process.pid
        timeouts = failures("timeout")
        with pytest.raises(RuntimeFailure, match="did not answer within 1 s"):
            runtime.predict([np.full((1, 64), 1e7, np.float32)])
        assert failures("timeout") == timeouts + 1
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    finally:
        runtime.close()


def test_inside_the_child_the_platforms_files_env_and_network_are_out_of_reach(
    model_files,
    isolated_digits,
    monkeypatch,  # noqa: ANN001
) -> None:
    data_dir = Path(settings.DATA_DIR)
    secret = embedded_secret()
    database = data_dir / "ferry.sqlite3"
    database.write_bytes(b"SQLite format 3\0")  # embedded mode's database lives here (these tests use PostgreSQL)
    store = Path(settings.FERRY_ARTIFACT_ROOT)
    store.mkdir(parents=True, exist_ok=True)
    (Path(settings.BASE_DIR) / "var").mkdir(exist_ok=True)  # embedded mode's default data dir; a fresh clone lacks it
    paths = [
        str(data_dir),
        str(secret),
        str(database),
        str(store),
        str(model_files.tokens),
        str(model_files.digits),
        str(Path(settings.BASE_DIR) / "manage.py"),
        str(Path(settings.BASE_DIR) / "var"),
        "/etc/shadow",
        "/root",
    ]
    for path in paths:  # each is there for this process to open: the probe below can fail
        assert os.path.exists(path), path
    with socket.create_connection(("127.0.0.1", 5432), timeout=5):
        pass  # PostgreSQL answers this process
    targets = [("127.0.0.1", 5432)]
    if Path(PG_SOCKET).exists():  # and on its Unix socket, which Landlock alone does not stop a connect to
        with socket.socket(socket.AF_UNIX) as unix:
            unix.connect(PG_SOCKET)
        targets.append((PG_SOCKET, 0))
    # and through /proc: the node's (this process's) environment, memory and view of the data directory, the
    # zygote's environment, another runtime process's: all there for this process to open
    node, zygote = os.getpid(), runtime_process.zygote().process.pid
    other = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
    other.load()
    through_proc = [
        f"/proc/{node}/environ",
        f"/proc/{node}/mem",
        f"/proc/{node}/root{secret}",
        f"/proc/{node}/cwd",
        f"/proc/{zygote}/environ",
        f"/proc/{other.process.pid}/environ",
        f"/proc/{other.process.pid}/mem",
    ]
    for path in through_proc:
        os.close(os.open(path, os.O_RDONLY))
    paths += through_proc
    reachable = str(Path(settings.BASE_DIR) / "serving" / "dataplane" / "node" / "runtime.py")
    try:
        answer = isolated_digits.probe([*paths, reachable], targets)
    finally:
        other.close()
    # then nothing of the platform's opens, while the serving package does (the probe works)
    assert answer["opened"] == [reachable], answer
    # and no connection to PostgreSQL gets through, by TCP or by its Unix socket
    assert answer["connected"] == [] and "127.0.0.1:5432" in answer["connect_failed"], answer
    # and its environment holds none of the platform's settings or credentials, as it says and as the kernel shows
    shown = Path(f"/proc/{isolated_digits.process.pid}/environ").read_bytes().decode().split("\0")
    for environ in (answer["environ"], shown):
        names = {e.split("=", 1)[0] for e in environ if e}
        assert not names & {"SECRET_KEY", "DATABASE_URL", "REDIS_URL", "FERRY_NODE_TOKEN", "FERRY_DATA_DIR"}
        assert not [e for e in environ if settings.SECRET_KEY in e]
        assert not [n for n in names if n.startswith("FERRY_")]
    # and from outside, its root shows no data directory contents
    outside = Path(f"/proc/{isolated_digits.process.pid}/root") / data_dir.relative_to("/")
    assert not outside.exists() or not {"secret_key", "ferry.sqlite3"} & set(os.listdir(outside))
    # and the layers that apply here are recorded: each of them (tests/test_audit_fixes_sandbox.py says which),
    # nothing skipped but what is known to be optional
    applied = isolated_digits.confinement["applied"]
    assert "clean-env" in applied and "no-new-privs" in applied and "rlimit-fsize" in applied
    assert sandbox.missing_walls(sandbox.Confinement(applied=applied)) == []
    assert set(isolated_digits.confinement["skipped"]) <= sandbox.OPTIONAL_LAYERS
    if os.geteuid() == 0:
        assert "mount-namespace" in applied and "uid:65534" in applied


def test_the_parents_credentials_in_its_environment_do_not_reach_the_child(model_files, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FERRY_NODE_TOKEN", "node-token-that-must-not-leak")
    monkeypatch.setenv("DATABASE_URL", "postgres://user:password-that-must-not-leak@db/ferry")
    runtime = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
    runtime.load()
    try:
        environ = "\n".join(runtime.probe()["environ"])
        assert "must-not-leak" not in environ
    finally:
        runtime.close()


def test_a_model_that_reads_the_secret_key_gets_nothing_from_the_sandbox(secret_reader: Path) -> None:
    secret = embedded_secret().read_bytes()[:40]
    # given that in the web process itself this model would return the secret key's bytes (the finding)
    inline = ModelRuntime(secret_reader, "torchscript", [X], [SCORES], CPU)
    inline.load(**UNCHECKED)
    assert inline.predict([np.zeros((1, 64), np.float32)])[0].tobytes() == secret
    # when it runs in the sandbox (with the operator check left out, so the sandbox alone stands)
    runtime = IsolatedRuntime(secret_reader, "torchscript", [X], [SCORES], CPU, check_operators=False)
    try:
        try:
            runtime.load()
        except RuntimeFailure as refused:  # no operator check keyword yet: scripting alone may not refuse it
            pytest.fail(f"the sandbox should load it and fail its batch, not refuse it: {refused}")
        with pytest.raises(RuntimeFailure) as failed:
            runtime.predict([np.zeros((1, 64), np.float32)])
        # then its batch fails naming the error, and the secret appears in no answer
        message = str(failed.value)
        assert "from_file" in message or "No such file" in message or "ermission" in message, message
        assert secret.decode(errors="replace")[:20] not in message
        assert runtime.process.alive()  # a model failure, not a dead child
    finally:
        runtime.close()


def test_inspect_operators_lists_the_graphs_operators_from_a_sandboxed_child(secret_reader, model_files) -> None:  # noqa: ANN001
    # with the child's read of the code as data left out, so that the compiled listing itself is seen
    names = inspect_operators(secret_reader.read_bytes(), "torchscript", check_code=False)
    assert "aten::from_file" in names and names == sorted(names)
    assert "aten::from_file" not in inspect_operators(model_files.digits.read_bytes(), "torchscript")
    # with it (the default), the child refuses that archive before compiling it
    with pytest.raises(RuntimeFailure, match=r"\(refused\): operator not allowed: aten::from_file"):
        inspect_operators(secret_reader.read_bytes(), "torchscript")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_isolated_runtime_runs_confined_on_cuda(model_files, digits_samples) -> None:  # noqa: ANN001
    # given the digits model in a runtime process on the GPU, every layer of the sandbox applied (on an H200,
    # Landlock without the process's own /proc/self/task rule left CUDA unable to start: error 304)
    runtime = IsolatedRuntime(model_files.digits, "torchscript", [X], [SCORES], torch.device("cuda"))
    runtime.load()
    try:
        inline = ModelRuntime(model_files.digits, "torchscript", [X], [SCORES], CPU)
        inline.load()
        x = digits_samples[0][:16]
        # when it runs a batch / then it answers as the CPU does, Landlock and the drop of privileges applied
        (mine,) = runtime.run([{"input": x}])
        (theirs,) = inline.run([{"input": x}])
        np.testing.assert_allclose(mine["scores"], theirs["scores"], rtol=1e-3, atol=1e-3)
        applied = runtime.confinement["applied"]
        assert any(a.startswith("landlock-fs") for a in applied) and "no-new-privs" in applied, applied
        assert runtime.memory_bytes > 0
    finally:
        runtime.close()


OWN_PROC_CHILD = r"""
import os, sys, threading
from pathlib import Path
from serving.dataplane.node import sandbox
record = sandbox.Confinement()
root = Path(sys.argv[1])
sandbox.landlock_filesystem(
    sandbox.readable_paths(root, "cuda"), sandbox.device_paths("cuda"), record, own=sandbox.own_writable_paths("cuda")
)
def attempt(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
        return "written"
    except OSError as exc:
        return type(exc).__name__
worker = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
worker.start()
print(attempt(f"/proc/self/task/{worker.native_id}/comm", "named"))
print(attempt(f"/proc/{os.getppid()}/oom_score_adj", "1000"))
print(attempt(f"/proc/{os.getppid()}/comm", "renamed"))
print(attempt(sys.argv[2], "stolen"))
"""


def test_the_cuda_rule_lets_the_runtime_write_its_own_threads_proc_entries_and_nothing_else(tmp_path: Path) -> None:
    # given a process under the runtime's Landlock rules for CUDA, which lets it write beneath its own
    # /proc/self/task (the driver writes its threads' entries as it starts)
    outside = tmp_path / "written-by-the-child"
    env = sandbox.clean_environment(Path(__file__).resolve().parent.parent)
    # when it writes its own thread's name, then its parent's /proc entries, then a file
    result = subprocess.run(
        [sys.executable, "-c", OWN_PROC_CHILD, env["PYTHONPATH"], str(outside)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # then only the first is written: the rule reaches no other process's entries, the platform's included
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["written", "PermissionError", "PermissionError", "PermissionError"], result
    assert not outside.exists()


def test_the_isolated_runtime_carries_bf16_both_ways(tmp_path: Path) -> None:
    # given a model computing in bfloat16, inline and in a child (BF16 crosses to it and back as its bits)
    path = tmp_path / "bf16.pt"
    save_artifact(BF16Scores(), "torchscript", torch.zeros(2, 4, dtype=torch.bfloat16), path)
    inline = ModelRuntime(path, "torchscript", [BF16_IN], [BF16_OUT], CPU)
    inline.load()
    isolated = IsolatedRuntime(path, "torchscript", [BF16_IN], [BF16_OUT], CPU)
    values = torch.tensor([[1.5, -float("inf"), 0.1, 3.0]], dtype=torch.bfloat16)
    try:
        isolated.load()
        # when both predict / then the child's answer is the inline one's, bit for bit, checked in the parent
        (mine,) = isolated.predict([values.view(torch.uint16).numpy().copy()])
        (theirs,) = inline.predict([values.view(torch.uint16).numpy().copy()])
        assert mine.dtype == np.uint16
        np.testing.assert_array_equal(mine, theirs)
    finally:
        isolated.close()
