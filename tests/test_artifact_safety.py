"""Archives that would run code when torch loads them are refused at registration (422) and at load.

Each hostile archive starts as a real `torch.export.save` archive and is edited the way an attacker
would; its payload creates a marker file. The `hostile` fixture first proves each payload runs under
stock torch (`torch.export.load`, and `.module()` plus a call for the generated-code case), so the
refusals below are of archives that really are dangerous.
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from django.contrib.auth.models import User
from rest_framework.test import APIClient
from torch import nn

from serving.actions import RegistrationError, register_version
from serving.dataplane.node import runtime_worker
from serving.dataplane.node.runtime import RuntimeFailure, load_module
from serving.demo import save_artifact
from serving.models import Model, ModelVersion, State
from tenants.models import Membership, Role, Tenant
from tests.conftest import DIGITS_IO, register

CPU = torch.device("cpu")


class OpensMarker:
    """Unpickling this calls open(marker, "w"): the file appearing means the archive ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (str(self.marker), "w"))


def read_members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {info.filename: z.read(info.filename) for info in z.infolist()}


def write_members(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def member(members: dict[str, bytes], suffix: str) -> str:
    return next(name for name in members if name.endswith(suffix))


def edit_json(members: dict[str, bytes], suffix: str, edit: Callable[[dict], None]) -> None:
    name = member(members, suffix)
    doc = json.loads(members[name])
    edit(doc)
    members[name] = json.dumps(doc).encode()


def torch_saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# --- hostile archives, each built from a legitimate export -------------------------------------------


def pickled_weights(base: Path, marker: Path, out: Path) -> Path:
    """The weights config asks for a pickled weight: torch reads it with torch.load(weights_only=False)."""
    members = read_members(base)

    def edit(doc: dict) -> None:
        doc["config"]["0.weight"]["use_pickle"] = True

    edit_json(members, "data/weights/model_weights_config.json", edit)
    path_name = json.loads(members[member(members, "model_weights_config.json")])["config"]["0.weight"]["path_name"]
    members[member(members, f"data/weights/{path_name}")] = torch_saved(OpensMarker(marker))
    return write_members(out, members)


def opaque_constant(base: Path, marker: Path, out: Path) -> Path:
    """An `opaque_obj_` constant: torch reads it with pickle.loads."""
    members = read_members(base)
    root = member(members, "archive_format").split("/")[0]

    def edit(doc: dict) -> None:
        doc["config"]["evil"] = {
            "path_name": "opaque_obj_0",
            "is_param": False,
            "use_pickle": True,
            "tensor_meta": None,
        }

    edit_json(members, "data/constants/model_constants_config.json", edit)
    members[f"{root}/data/constants/opaque_obj_0"] = pickle.dumps(OpensMarker(marker))
    return write_members(out, members)


def sample_inputs_fallback(base: Path, marker: Path, out: Path) -> Path:
    """Sample inputs the weights_only unpickler refuses: torch retries them with weights_only=False."""
    members = read_members(base)
    members[member(members, "data/sample_inputs/model.pt")] = torch_saved(((OpensMarker(marker),), {}))
    return write_members(out, members)


def legacy_layout(base: Path, marker: Path, out: Path) -> Path:
    """The flat 2.7 layout: load_pt2 fails on it, and torch.export.load falls back to reading it with
    torch.load, retrying with weights_only=False."""
    program = read_members(base)
    return write_members(
        out,
        {
            "version": b"8.20",
            "serialized_exported_program.json": program[member(program, "models/model.json")],
            "serialized_state_dict.pt": b"",
            "serialized_constants.pt": torch_saved({"c": OpensMarker(marker)}),
            "serialized_example_inputs.pt": b"",
        },
    )


def sympy_expression(base: Path, marker: Path, out: Path) -> Path:
    """A shape expression: torch parses it with sympy.sympify, which evaluates it with eval."""
    members = read_members(base)
    done = []

    def edit(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr_str" and not done:
                    node[key] = f"open({str(marker)!r}, 'w') and {value}"
                    done.append(key)
                else:
                    edit(value)
        elif isinstance(node, list):
            for item in node:
                edit(item)

    edit_json(members, "models/model.json", edit)
    assert done, "the base program has no symbolic shape"
    return write_members(out, members)


def generated_code_name(base: Path, marker: Path, out: Path) -> Path:
    """A parameter name that closes the string FX writes it into (getattr(self, "<name>")) in the
    Python source of forward: the rest of the name runs as code when the model is called. No dots:
    torch splits names on them."""
    evil = (
        f'weight") is None or getattr(__import__("builtins"), "open")(getattr(bytes, "fromhex")('
        f'"{str(marker).encode().hex()}"), "w") is None or getattr(self, "x'
    )
    assert "." not in evil
    members = read_members(base)

    def rename_spec(doc: dict) -> None:
        for spec in doc["graph_module"]["signature"]["input_specs"]:
            if spec.get("parameter", {}).get("parameter_name") == "0.bias":
                spec["parameter"]["parameter_name"] = f"0.{evil}"

    def rename_weight(doc: dict) -> None:
        doc["config"][f"0.{evil}"] = doc["config"].pop("0.bias")

    edit_json(members, "models/model.json", rename_spec)
    edit_json(members, "data/weights/model_weights_config.json", rename_weight)
    return write_members(out, members)


@dataclass
class Hostile:
    path: Path
    marker: Path
    reason: str  # a fragment of the refusal


BUILDERS: dict[str, tuple[Callable[[Path, Path, Path], Path], str]] = {
    "pickled_weights": (pickled_weights, "use_pickle"),
    "opaque_constant": (opaque_constant, "custom and opaque objects are unpickled"),
    "sample_inputs_fallback": (sample_inputs_fallback, "which a tensor pickle does not"),
    "legacy_layout": (legacy_layout, "legacy torch.export layout"),
    "sympy_expression": (sympy_expression, "calls 'open'"),
    "generated_code_name": (generated_code_name, "names reach generated code"),
}


def stock_torch_runs(path: Path) -> None:
    """What torch.export.load users do: load, build the module, call it."""
    try:
        with path.open("rb") as f:
            torch.export.load(f).module()(torch.zeros(2, 64))
    except Exception:  # noqa: BLE001 - the payloads break the program after they run; only the marker matters
        pass


@pytest.fixture(scope="session")
def base_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("safety") / "base.pt2"
    torch.manual_seed(0)
    save_artifact(nn.Sequential(nn.Linear(64, 10)), "torch_export", torch.zeros(2, 64), path)
    return path


@pytest.fixture(scope="session")
def hostile(base_export: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Hostile]:
    folder = tmp_path_factory.mktemp("hostile")
    built = {}
    for case, (build, reason) in BUILDERS.items():
        marker = folder / f"{case}-ran"
        path = build(base_export, marker, folder / f"{case}.pt2")
        stock_torch_runs(path)
        assert marker.exists(), f"{case}: the payload does not run under stock torch, so the test proves nothing"
        marker.unlink()
        built[case] = Hostile(path, marker, reason)
    return built


CASES = sorted(BUILDERS)


# --- registration ---------------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize("case", CASES)
def test_registration_refuses_the_archive_with_422_and_the_reason(hostile: dict[str, Hostile], case: str) -> None:
    archive = hostile[case]
    archive.marker.unlink(missing_ok=True)
    with archive.path.open("rb") as f, pytest.raises(RegistrationError) as refused:
        register_version(
            model_name=f"hostile-{case.replace('_', '-')}",
            artifact_file=f,
            fmt="torch_export",
            inputs=DIGITS_IO["inputs"],
            outputs=DIGITS_IO["outputs"],
            validate="sync",
        )
    assert refused.value.status == 422
    assert archive.reason in refused.value.message
    assert not archive.marker.exists()
    assert not ModelVersion.objects.exists()


@pytest.mark.django_db
def test_upload_over_http_answers_422_with_the_reason(hostile: dict[str, Hostile]) -> None:
    tenant = Tenant.objects.create(name="Acme", slug="acme")
    bob = User.objects.create_user("bob", "bob@example.org")
    Membership.objects.create(user=bob, tenant=tenant, role=Role.ENGINEER)
    client = APIClient()
    client.force_login(bob)
    archive = hostile["pickled_weights"]
    upload = io.BytesIO(archive.path.read_bytes())
    upload.name = "model.pt2"
    response = client.post(
        "/api/models/digits/versions/",
        {
            "format": "torch_export",
            "artifact": upload,
            "max_batch_size": 2,
            "inputs": json.dumps(DIGITS_IO["inputs"]),
            "outputs": json.dumps(DIGITS_IO["outputs"]),
        },
        format="multipart",
    )
    assert response.status_code == 422, response.content
    assert "use_pickle" in response.json()["error"]
    assert not archive.marker.exists()
    assert not Model.objects.exists()


def test_an_unknown_member_or_graph_call_is_refused(base_export: Path, tmp_path: Path) -> None:
    """Members and calls this check cannot vouch for: an AOTInductor library (load_pt2 loads it as
    native code), and a graph call that imports a module by name at run time."""
    members = read_members(base_export)
    root = member(members, "archive_format").split("/")[0]
    members[f"{root}/data/aotinductor/model/model.so"] = b"\x7fELF"
    aoti = write_members(tmp_path / "aoti.pt2", members)

    members = read_members(base_export)

    def add_call(doc: dict) -> None:
        doc["graph_module"]["graph"]["nodes"].insert(
            0,
            {
                "target": "torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch",
                "inputs": [{"name": "a", "arg": {"as_string": "antigravity.Fn"}, "kind": 1}],
                "outputs": [],
                "metadata": {},
                "is_hop_single_tensor_return": None,
                "name": "imports",
            },
        )

    edit_json(members, "models/model.json", add_call)
    call = write_members(tmp_path / "call.pt2", members)
    for path, reason in ((aoti, "AOTInductor"), (call, "is not an operator")):
        with pytest.raises(RuntimeFailure, match=rf"cannot load torch_export artifact \(refused\): .*{reason}"):
            load_module(path, "torch_export", CPU)


# --- load -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_load_module_refuses_the_archive_without_running_it(hostile: dict[str, Hostile], case: str) -> None:
    archive = hostile[case]
    archive.marker.unlink(missing_ok=True)
    with pytest.raises(RuntimeFailure, match=r"cannot load torch_export artifact \(refused\)") as refused:
        module = load_module(archive.path, "torch_export", CPU)
        module(torch.zeros(2, 64))
    assert archive.reason in str(refused.value)
    assert not archive.marker.exists()


# --- legitimate archives --------------------------------------------------------------------------


@pytest.mark.django_db
def test_legit_torchscript_and_export_register_and_load_without_unpickling(
    model_files, base_export: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conftest artifacts (serving.demo.save_artifact) register, validate and load with every
    Python unpickling entry point torch.export.load uses made to fail: in this process (registration's
    checks here) and in the code the sandboxed runtime process runs for registration (its `operators` and
    `load` ops), run here too, since a patch made here does not reach that child."""
    reference = torch.export.load(str(model_files.digits_export)).module()
    x = torch.rand(3, 64)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("unpickled while loading")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch._C, "_pickle_load_obj", forbidden)
    with pytest.raises(AssertionError, match="unpickled"):  # the patches bite
        torch.load(io.BytesIO(b""))

    script = register(model_files.digits, "digits")
    export = register(model_files.digits_export, "digits-export", fmt="torch_export")
    assert (script.state, export.state) == (State.READY, State.READY), (script.failure_reason, export.failure_reason)
    # the runtime process's side of that registration: inspection and validation's load, as its Worker does them
    for path, fmt in ((model_files.digits, "torchscript"), (model_files.digits_export, "torch_export")):
        arrays = [np.frombuffer(path.read_bytes(), dtype=np.uint8)]
        reply, _ = runtime_worker.Worker(None, CPU).handle("operators", {"format": fmt}, arrays)  # type: ignore[arg-type]
        assert "aten::linear" in reply["operators"] or "aten::addmm" in reply["operators"], reply
        header = {"format": fmt, "inputs": DIGITS_IO["inputs"], "outputs": DIGITS_IO["outputs"]}
        worker = runtime_worker.Worker(None, CPU)  # type: ignore[arg-type]
        assert worker.handle("load", header, arrays)[0]["ok"]
        assert worker.runtime.predict([x.numpy()])[0].shape == (3, 10)

    module = load_module(model_files.digits_export, "torch_export", CPU)
    assert torch.allclose(module(x), reference(x))
    assert load_module(model_files.digits, "torchscript", CPU)(x).shape == (3, 10)
    assert load_module(base_export, "torch_export", CPU)(x).shape == (3, 10)
