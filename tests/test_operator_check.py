"""The operator allow-list (serving.dataplane.node.operator_check): torch's standard networks pass, and a model
that calls an operator reaching outside its tensors is refused at registration (422) and at load.

Each hostile TorchScript module is first loaded with the check switched off and run, to show that its
payload really reads the secret (or writes the file): the refusals below are of models that really do so.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient
from torch import nn

from serving.dataplane.node import archive_check, operator_check
from serving.dataplane.node.runtime import RuntimeFailure, load_module
from serving.demo import Digits, TokenSentiment, WideDigits, save_artifact
from serving.models import Artifact, Model, ModelVersion
from tenants.models import Membership, Role, Tenant
from tests.test_artifact_safety import edit_json, read_members, write_members

CPU = torch.device("cpu")
SECRET = b"the platform's secret key"
assert len(SECRET) == 25  # the size the scripted readers ask for (scripted code reads no globals)
VECTOR_IO = {
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
}

# A custom operator library, as a platform could load into its nodes: allowed only when the admin names it.
_LIBRARY = torch.library.Library("ferrytest", "DEF")
_LIBRARY.define("double(Tensor x) -> Tensor")
_LIBRARY.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")


# --- hostile TorchScript modules ------------------------------------------------------------------------


def _read(path: str, size: int) -> torch.Tensor:
    return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)


class ReadsInForward(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.size = 25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_file(self.path, shared=False, size=self.size, dtype=torch.uint8)


class Leaker(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    @torch.jit.export
    def leak(self) -> torch.Tensor:
        return torch.from_file(self.path, shared=False, size=25, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ReadsInSubmoduleMethod(nn.Module):
    """forward never calls it; the method is compiled into the archive and callable once loaded."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.inner = Leaker(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class ReadsInFunction(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _read(self.path, 25)


class ReadsInLoop(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(25, dtype=torch.uint8)
        for i in range(3):
            if i == 2:
                out = torch.from_file(self.path, shared=False, size=25, dtype=torch.uint8)
        return out


class ReadsInSetstate(nn.Module):
    """Reads the file while torch.jit.load unpickles it; forward hands the bytes out."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.stolen = torch.zeros(25, dtype=torch.uint8)

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.path, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.path = state[0]
        self.training = state[1]
        self.stolen = torch.from_file(self.path, shared=False, size=25, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stolen


@torch.jit.script
class Writer:
    """A TorchScript class whose `__setstate__` writes a file: it runs while loading, and nothing in the
    module's methods calls it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __getstate__(self) -> str:
        return self.path

    def __setstate__(self, path: str) -> None:
        self.path = path
        torch.save(torch.ones(1), path)


@torch.jit.script
class Reader:
    """A TorchScript class whose `__setstate__` reads a file when the archive loads; no module method calls it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.data = torch.zeros(1, dtype=torch.uint8)

    def __getstate__(self) -> str:
        return self.path

    def __setstate__(self, path: str) -> None:
        self.path = path
        self.data = torch.from_file(path, size=1, dtype=torch.uint8)  # kept, or TorchScript drops the call


class ReadsInClassSetstate(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.reader = Reader(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class WritesInClassSetstate(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.writer = Writer(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class SavesInForward(nn.Module):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.save(x, self.path)
        return x


def _forked(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Forks(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        future = torch.jit.fork(_forked, x)
        return x + torch.jit.wait(future)


class CallsCustomOperator(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ferrytest.double(x)


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret_key"
    path.write_bytes(SECRET)
    return path


def scripted(module: nn.Module, path: Path) -> Path:
    torch.jit.save(torch.jit.script(module), str(path))
    return path


def refusal(path: Path, fmt: str = "torchscript") -> str:
    with pytest.raises(RuntimeFailure, match=rf"cannot load {fmt} artifact \(refused\): operator not allowed") as e:
        load_module(path, fmt, CPU)
    return str(e.value)


READERS = {
    "forward": (ReadsInForward, lambda m: m(torch.zeros(1))),
    "submodule_method": (ReadsInSubmoduleMethod, lambda m: m.inner.leak()),
    "function": (ReadsInFunction, lambda m: m(torch.zeros(1))),
    "loop_and_if": (ReadsInLoop, lambda m: m(torch.zeros(1))),
    "setstate": (ReadsInSetstate, lambda m: m(torch.zeros(1))),
}


@pytest.mark.parametrize("case", sorted(READERS))
def test_a_torchscript_module_reading_a_file_is_refused_at_load(case: str, secret: Path, tmp_path: Path) -> None:
    build, leak = READERS[case]
    archive = scripted(build(str(secret)), tmp_path / f"{case}.pt")
    # given a module that, unchecked, hands out the secret
    unchecked = load_module(archive, "torchscript", CPU, check_operators=False)
    assert bytes(leak(unchecked).tolist()) == SECRET
    # the module alone (no compilation unit: its methods inlined) shows the call too
    assert "aten::from_file" in operator_check.torchscript_operators(unchecked)
    # then the checked load refuses it, naming the operator
    assert refusal(archive).endswith("operator not allowed: aten::from_file")


def test_a_file_write_in_a_class_setstate_or_in_forward_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "written"
    in_class = scripted(WritesInClassSetstate(str(marker)), tmp_path / "class.pt")
    marker.unlink(missing_ok=True)
    load_module(in_class, "torchscript", CPU, check_operators=False)
    assert marker.exists(), "the class's __setstate__ does not run on load, so the test proves nothing"
    marker.unlink()
    # the checked load refuses it before anything runs: its code is read as data before it is compiled, so the
    # __setstate__ that writes the file never runs
    assert "aten::save" in refusal(in_class)
    assert not marker.exists()

    in_forward = scripted(SavesInForward(str(tmp_path / "forward-written")), tmp_path / "forward.pt")
    assert "aten::save" in refusal(in_forward)
    assert not (tmp_path / "forward-written").exists()


def test_fork_is_refused(tmp_path: Path) -> None:
    assert "prim::fork" in refusal(scripted(Forks(), tmp_path / "fork.pt"))


def test_a_custom_namespace_is_refused_unless_the_admin_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = scripted(CallsCustomOperator(), tmp_path / "custom.pt")
    monkeypatch.delenv(operator_check.NAMESPACES_ENV, raising=False)
    assert refusal(archive).endswith("operator not allowed: ferrytest::double")
    monkeypatch.setenv(operator_check.NAMESPACES_ENV, "other, ferrytest")
    module = load_module(archive, "torchscript", CPU)
    assert torch.equal(module(torch.ones(2)), torch.full((2,), 2.0))
    # an allowed namespace does not let the denied operators of another one back in
    assert operator_check.refused({"ferrytest::double", "aten::from_file"}, ["ferrytest"]) == ["aten::from_file"]


# --- every file-name operator torch registers is refused ----------------------------------------------


def test_every_registered_operator_taking_a_file_name_is_refused() -> None:
    """Fails when a torch upgrade adds such an operator to an allowed namespace."""
    file_args = re.compile(r"file|path|dir", re.IGNORECASE)
    taking_files = {
        schema.name
        for schema in torch._C._jit_get_all_schemas()
        if operator_check.namespace_of(schema.name) in operator_check.ALLOWED_NAMESPACES
        and any("str" in str(a.type) and file_args.search(a.name) for a in schema.arguments)
    }
    assert {"aten::from_file", "aten::save"} <= taking_files
    assert operator_check.refused(taking_files, ()) == sorted(taking_files)


# --- standard networks pass ---------------------------------------------------------------------------


class EncoderStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.gru = nn.GRU(16, 16, batch_first=True)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(x)
        y, _ = self.gru(y)
        return self.encoder(y)


class StaticQuantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant = torch.ao.quantization.QuantStub()
        self.conv = nn.Conv2d(1, 2, 3)
        self.relu = nn.ReLU()
        self.linear = nn.Linear(18, 2)
        self.dequant = torch.ao.quantization.DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.linear(self.relu(self.conv(self.quant(x))).flatten(1)))


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.1),
        nn.Flatten(),
        nn.Linear(64, 10),
        nn.Softmax(dim=1),
    )


def static_quantized() -> nn.Module:
    model = StaticQuantized().eval()
    model.qconfig = torch.ao.quantization.get_default_qconfig("fbgemm")
    prepared = torch.ao.quantization.prepare(model)
    prepared(torch.rand(4, 1, 5, 5))
    return torch.ao.quantization.convert(prepared)


def standard_torchscript() -> dict[str, torch.jit.ScriptModule]:
    dynamic = torch.ao.quantization.quantize_dynamic(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), {nn.Linear}, dtype=torch.qint8
    )
    dynamic_lstm = torch.ao.quantization.quantize_dynamic(nn.LSTM(8, 8), {nn.LSTM}, dtype=torch.qint8)
    conv = convnet().eval()
    return {
        "digits": torch.jit.script(Digits(16, 2).eval()),
        "digits_wide": torch.jit.script(WideDigits(4, 2).eval()),
        "token_sentiment": torch.jit.script(TokenSentiment().eval()),
        "convnet": torch.jit.script(conv),
        "encoders": torch.jit.script(EncoderStack().eval()),
        "dynamic_quantized_linear": torch.jit.script(dynamic),
        "dynamic_quantized_lstm": torch.jit.script(dynamic_lstm),
        "static_quantized": torch.jit.script(static_quantized()),
        "traced": torch.jit.trace(nn.Sequential(nn.Linear(4, 4), nn.GELU()), torch.rand(2, 4)),
        "frozen": torch.jit.freeze(torch.jit.script(conv)),
    }


def test_standard_torchscript_networks_pass(model_files, tmp_path: Path) -> None:
    for name, module in standard_torchscript().items():
        path = tmp_path / f"{name}.pt"
        torch.jit.save(module, str(path))
        # the read of their code as data (before compiling) passes them
        assert archive_check.check_archive(path, allowed_namespaces=()) == "zip", name
        with path.open("rb") as f:
            _, operators = operator_check.load_torchscript(f, CPU)
        assert "aten::warn" in operators or name != "encoders"  # the walk reaches torch.nn's checks
        assert operator_check.refused(operators, ()) == [], name
    for path in (model_files.digits, model_files.tokens, model_files.wrong_dtype, model_files.fails_on_negative):
        load_module(path, "torchscript", CPU)
    # optimize_for_inference's MKLDNN graphs do not survive torch.jit.save in torch 2.13: checked in memory
    optimized = torch.jit.optimize_for_inference(torch.jit.script(convnet().eval()))
    assert operator_check.refused(operator_check.torchscript_operators(optimized), ()) == []


class Branches(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))


def program_json(path: Path) -> dict:
    members = read_members(path)
    return json.loads(next(data for name, data in members.items() if name.endswith("models/model.json")))


def test_standard_export_programs_pass(model_files, tmp_path: Path) -> None:
    cases = {
        "digits": (Digits(16, 2), torch.zeros(2, 64)),
        "convnet": (nn.Sequential(nn.Unflatten(1, (1, 8, 8)), convnet()), torch.zeros(2, 64)),
        "encoders": (EncoderStack(), torch.zeros(2, 5, 16)),
        "cond": (Branches(), torch.zeros(2, 3)),
    }
    for name, (module, example) in cases.items():
        path = tmp_path / f"{name}.pt2"
        if name == "cond":
            torch.export.save(torch.export.export(module.eval(), (example,)), str(path))
        else:
            save_artifact(module.eval(), "torch_export", example, path)
        operators = operator_check.export_operators(program_json(path))
        assert operators and operator_check.refused(operators, ()) == [], name
        load_module(path, "torch_export", CPU)
    assert "higher_order::cond" in operators and "aten::sin" in operators  # subgraphs are walked
    load_module(model_files.digits_export, "torch_export", CPU)


# --- torch.export programs ------------------------------------------------------------------------------


class AddsZeros(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.zeros(4)


def with_target(base: Path, out: Path, target: str, inputs: list[dict]) -> Path:
    """`base` with its aten.zeros call replaced by `target` called with `inputs`."""
    members = read_members(base)

    def edit(doc: dict) -> None:
        (node,) = [n for n in doc["graph_module"]["graph"]["nodes"] if n["target"] == "torch.ops.aten.zeros.default"]
        node["target"], node["inputs"] = target, inputs

    edit_json(members, "models/model.json", edit)
    return write_members(out, members)


def file_calling_export(base: Path, marker: Path, out: Path) -> Path:
    """aten.from_file(marker, shared=True, size=4): creates the file (and would read an existing one)."""
    return with_target(
        base,
        out,
        "torch.ops.aten.from_file.default",
        [
            {"name": "filename", "arg": {"as_string": str(marker)}, "kind": 1},
            {"name": "shared", "arg": {"as_bool": True}, "kind": 1},
            {"name": "size", "arg": {"as_int": 4}, "kind": 1},
        ],
    )


@pytest.fixture
def zeros_export(tmp_path: Path) -> Path:
    path = tmp_path / "zeros.pt2"
    torch.export.save(torch.export.export(AddsZeros(), (torch.zeros(2, 4),)), str(path))
    return path


def test_an_export_program_calling_from_file_is_refused_by_the_archive_check(
    zeros_export: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "created"
    hostile = file_calling_export(zeros_export, marker, tmp_path / "from_file.pt2")
    # given an archive that stock torch loads and runs, creating the file
    with hostile.open("rb") as f:
        torch.export.load(f).module()(torch.zeros(2, 4))
    assert marker.exists(), "the edited program does not call from_file, so the test proves nothing"
    marker.unlink()
    # then the data-level check refuses it, and so does the loader, before anything runs
    with pytest.raises(archive_check.ArchiveRefused, match="operator not allowed: aten::from_file"):
        archive_check.check_archive(hostile, allowed_namespaces=())
    assert refusal(hostile, "torch_export").endswith("operator not allowed: aten::from_file")
    assert not marker.exists()
    # the first wall alone: the operator check switched off, the program loads
    load_module(hostile, "torch_export", CPU, check_operators=False)


def custom_export(base: Path, out: Path) -> Path:
    return with_target(
        base, out, "torch.ops.ferrytest.double.default", [{"name": "x", "arg": {"as_tensor": {"name": "x"}}, "kind": 1}]
    )


def test_an_export_custom_namespace_is_refused_unless_allowed(zeros_export: Path, tmp_path: Path) -> None:
    custom = custom_export(zeros_export, tmp_path / "custom.pt2")
    with pytest.raises(archive_check.ArchiveRefused, match="operator not allowed: ferrytest::double"):
        archive_check.check_archive(custom, allowed_namespaces=())
    assert archive_check.check_archive(custom, allowed_namespaces=["ferrytest"]) == "torch_export"


# --- registration -------------------------------------------------------------------------------------


def upload(client: APIClient, path: Path, fmt: str, name: str) -> object:
    artifact = io.BytesIO(path.read_bytes())
    artifact.name = path.name
    return client.post(
        f"/api/models/{name}/versions/",
        {
            "format": fmt,
            "artifact": artifact,
            "max_batch_size": 2,
            "inputs": json.dumps(VECTOR_IO["inputs"]),
            "outputs": json.dumps(VECTOR_IO["outputs"]),
        },
        format="multipart",
    )


@pytest.fixture
def engineer_client(db) -> APIClient:  # noqa: ANN001
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    bob = User.objects.create_user("bob", "bob@example.org")
    Membership.objects.create(user=bob, tenant=tenant, role=Role.ENGINEER)
    client = APIClient()
    client.force_login(bob)
    return client


def test_registration_refuses_operators_with_422_and_stores_nothing(
    engineer_client: APIClient, secret: Path, zeros_export: Path, tmp_path: Path, settings
) -> None:  # noqa: ANN001
    settings.FERRY_ARTIFACT_ROOT = tmp_path / "store"
    settings.FERRY_ALLOWED_OPERATOR_NAMESPACES = []
    marker = tmp_path / "created"
    cases = [
        (scripted(ReadsInForward(str(secret)), tmp_path / "reads.pt"), "torchscript", "aten::from_file"),
        (scripted(ReadsInSubmoduleMethod(str(secret)), tmp_path / "method.pt"), "torchscript", "aten::from_file"),
        (scripted(SavesInForward(str(tmp_path / "w")), tmp_path / "saves.pt"), "torchscript", "aten::save"),
        # only a TorchScript class's __setstate__ calls it, on a file the sandboxed child may read (its own code):
        # the registration's inspection must walk the whole compilation unit, not the module's methods
        (
            scripted(ReadsInClassSetstate(archive_check.__file__), tmp_path / "class.pt"),
            "torchscript",
            "aten::from_file",
        ),
        (file_calling_export(zeros_export, marker, tmp_path / "ff.pt2"), "torch_export", "aten::from_file"),
        # (a TorchScript archive calling ferrytest::double does not even compile in the sandboxed child, which
        # loads no such library: it registers and fails validation; its load-time refusal is tested above)
        (custom_export(zeros_export, tmp_path / "custom.pt2"), "torch_export", "ferrytest::double"),
    ]
    for path, fmt, operator in cases:
        response = upload(engineer_client, path, fmt, "leaky")
        assert response.status_code == 422, response.content
        assert response.json()["error"] == f"archive refused: operator not allowed: {operator}"
    assert not marker.exists()
    assert not Artifact.objects.exists() and not ModelVersion.objects.exists() and not Model.objects.exists()
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    # the admin's namespace setting lets the custom operator register
    settings.FERRY_ALLOWED_OPERATOR_NAMESPACES = ["ferrytest"]
    assert upload(engineer_client, cases[-1][0], "torch_export", "custom").status_code == 201


def test_bytes_inspected_before_are_checked_again_without_a_second_sandboxed_compile(
    engineer_client: APIClient, secret: Path, tmp_path: Path, settings, monkeypatch
) -> None:  # noqa: ANN001
    from collections import OrderedDict

    from serving import artifacts
    from serving.dataplane.node import runtime_process

    settings.FERRY_ARTIFACT_ROOT = tmp_path / "store"
    settings.FERRY_ALLOWED_OPERATOR_NAMESPACES = []
    monkeypatch.setattr(artifacts, "_inspected", OrderedDict())
    inspected: list[int] = []
    real = runtime_process.inspect_operators

    def counting(data: bytes, fmt: str, **kwargs: object) -> list[str]:
        inspected.append(len(data))
        return real(data, fmt, **kwargs)

    monkeypatch.setattr(runtime_process, "inspect_operators", counting)
    reads = scripted(ReadsInForward(str(secret)), tmp_path / "reads.pt")
    fine = scripted(Digits(8, 1), tmp_path / "fine.pt")
    # an archive whose code names a denied operator is refused before any compile (its code read as data)
    response = upload(engineer_client, reads, "torchscript", "leaky")
    assert response.status_code == 422, response.content
    assert response.json()["error"] == "archive refused: operator not allowed: aten::from_file"
    assert inspected == []
    # given a policy that refuses an operator only the compiled code shows (prim::GetAttr: no name in the code)
    monkeypatch.setitem(operator_check.DENIED, "prim::GetAttr", "a stand-in for what only compiling finds")
    # when the same archive is uploaded twice / then both are refused for its operator, from one compile
    for _ in range(2):
        response = upload(engineer_client, fine, "torchscript", "fine")
        assert response.status_code == 422, response.content
        assert response.json()["error"] == "archive refused: operator not allowed: prim::GetAttr"
    assert len(inspected) == 1
    # and once the policy allows it, the same bytes uploaded twice are two versions, from that same compile
    monkeypatch.delitem(operator_check.DENIED, "prim::GetAttr")
    assert upload(engineer_client, fine, "torchscript", "fine").status_code == 201
    assert upload(engineer_client, fine, "torchscript", "fine").status_code == 201
    assert len(inspected) == 1 and ModelVersion.objects.filter(model__name="fine").count() == 2
    # the memo is bounded: past INSPECTED_MAX the oldest entries go, and their bytes are compiled again
    monkeypatch.setattr(artifacts, "INSPECTED_MAX", 1)
    torch.manual_seed(1)
    other = scripted(Digits(8, 1), tmp_path / "other.pt")
    assert upload(engineer_client, other, "torchscript", "other").status_code == 201
    assert len(inspected) == 2 and len(artifacts._inspected) == 1
    assert upload(engineer_client, fine, "torchscript", "fine").status_code == 201
    assert len(inspected) == 3
