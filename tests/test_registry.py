"""Tests for the model registry on PostgreSQL: register_version, validation, the artifact store,
the routing snapshot, version choice and the Celery validation task."""

from __future__ import annotations

import hashlib
import io
import stat
from pathlib import Path

import pytest
import torch

from rollout.routing import RouteError, choose_version
from serving import artifacts
from serving.actions import RegistrationError, register_version
from serving.models import Artifact, Model, ModelVersion, State
from serving.publish import build_snapshot
from serving.tasks import register_and_validate
from tests.conftest import DIGITS_IO, TOKENS_IO, register

pytestmark = pytest.mark.django_db


@pytest.fixture
def store_root(settings, tmp_path: Path) -> Path:
    """A store of this test's own, so its files can be counted."""
    root = tmp_path / "store"
    settings.FERRY_ARTIFACT_ROOT = root
    return root


def store_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def register_unvalidated(path: Path, name: str, **kwargs: object) -> ModelVersion:
    """Register with validation queued for after commit (which never comes inside a test transaction)."""
    io_ = kwargs.pop("io", DIGITS_IO)
    with path.open("rb") as f:
        return register_and_validate(
            model_name=name,
            artifact_file=f,
            fmt=kwargs.pop("fmt", "torchscript"),
            inputs=io_["inputs"],
            outputs=io_["outputs"],
            **kwargs,
        )


# --- good artifacts become READY -----------------------------------------------------------------------


@pytest.mark.parametrize(("attr", "fmt"), [("digits", "torchscript"), ("digits_export", "torch_export")])
def test_good_artifact_becomes_ready_with_profile_and_footprint(model_files, attr: str, fmt: str) -> None:
    # given a working digits classifier
    # when it is registered and validated with max_batch_size 8
    version = register(getattr(model_files, attr), "digits", fmt=fmt, max_batch_size=8)
    version.refresh_from_db()
    # then it is READY with no failure reason
    assert version.state == State.READY, version.failure_reason
    assert version.failure_reason == ""
    assert version.format == fmt
    # and its latency profile covers batch sizes 1 and 8 with positive times
    assert {"1", "8"} <= set(version.latency_profile)
    assert all(seconds > 0 for seconds in version.latency_profile.values())
    # and its footprint and load time were measured
    assert version.memory_bytes > 0
    assert version.load_seconds is not None and version.load_seconds >= 0
    # and the artifact row records the stored bytes
    data = getattr(model_files, attr).read_bytes()
    assert version.artifact_id == hashlib.sha256(data).hexdigest()
    assert version.artifact.size_bytes == len(data)


class NudgedWhenBatched(torch.nn.Module):
    """BF16 in and out; batched, its answers move by `nudge` (relative), as a GPU's kernels for one row and for
    four may round a bfloat16 result differently."""

    def __init__(self, nudge: float) -> None:
        super().__init__()
        self.nudge = nudge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 1.0 + self.nudge if x.shape[0] > 1 else 1.0
        return torch.log_softmax(x, dim=-1) * factor


BF16_IO = {
    "inputs": [{"name": "x", "datatype": "BF16", "shape": [16]}],
    "outputs": [{"name": "scores", "datatype": "BF16", "shape": [16]}],
}


@pytest.mark.parametrize(("nudge", "ready"), [(0.0, True), (0.004, True), (0.1, False)])
def test_a_bf16_model_is_validated_on_its_values(tmp_path: Path, nudge: float, ready: bool) -> None:
    # given a model computing in bfloat16 whose batched answers move by `nudge`
    path = tmp_path / "bf16.pt"
    torch.jit.save(torch.jit.script(NudgedWhenBatched(nudge)), str(path))
    # when registered and validated (its example inputs and outputs travel as BF16's bits)
    version = register(path, f"bf16-{int(nudge * 1000)}", io=BF16_IO, max_batch_size=4)
    # then a bfloat16 step or so is no dependence between rows; a tenth is
    assert (version.state == State.READY) is ready, version.failure_reason
    if not ready:
        assert "output 'scores' of row 0 changes when batched" in version.failure_reason


def test_variable_length_model_becomes_ready(model_files) -> None:
    version = register(model_files.tokens, "tokens", io=TOKENS_IO, max_batch_size=4, preferred_batch_sizes=[3])
    assert version.state == State.READY, version.failure_reason
    assert {"1", "2", "3", "4"} == set(version.latency_profile)


def test_versions_are_numbered_per_model(model_files) -> None:
    # given three registrations of model "a" interleaved with one of model "b"
    a1 = register_unvalidated(model_files.digits, "a")
    a2 = register_unvalidated(model_files.digits, "a")
    b1 = register_unvalidated(model_files.digits, "b")
    a3 = register_unvalidated(model_files.digits, "a")
    # then each model counts its own versions from 1
    assert [a1.version, a2.version, a3.version] == [1, 2, 3]
    assert b1.version == 1
    assert list(ModelVersion.objects.filter(model__name="a").values_list("version", flat=True)) == [1, 2, 3]
    # and async validation waits for the commit: the versions are only registered so far
    assert {v.state for v in ModelVersion.objects.all()} == {State.REGISTERED}


def test_task_and_description_are_kept_and_updated(model_files) -> None:
    # given a model registered with a task and description
    register_unvalidated(model_files.digits, "m", task="regression", description="first")
    # when a later version gives a new description only
    register_unvalidated(model_files.digits, "m", description="second")
    # then the task stays and the description changes
    model = Model.objects.get(name="m")
    assert (model.task, model.description) == ("regression", "second")


# --- failures become FAILED with a reason ----------------------------------------------------------------


def test_not_a_zip_is_rejected_at_upload(model_files, store_root: Path) -> None:
    # when a file that is not an archive is registered
    with pytest.raises(RegistrationError) as caught:
        register(model_files.not_a_zip, "nz")
    # then it is refused as unprocessable, nothing is created, nothing is left on disk
    assert caught.value.status == 422
    assert "not a zip" in caught.value.message
    assert not Model.objects.filter(name="nz").exists()
    assert not Artifact.objects.exists()
    assert store_files(store_root) == []


@pytest.mark.parametrize("fmt", ["torchscript", "torch_export"])
def test_a_zip_that_is_not_a_model_is_rejected_at_upload(model_files, store_root: Path, fmt: str) -> None:
    # when a zip whose pickle torch could not read is registered, as either format
    with pytest.raises(RegistrationError) as caught:
        register(model_files.corrupt_zip, "broken", fmt=fmt, max_batch_size=2)
    # then the upload check refuses it, saying why, and nothing is created or stored
    assert caught.value.status == 422
    assert caught.value.message.startswith("archive refused:") and "malformed pickle" in caught.value.message
    assert not Model.objects.filter(name="broken").exists() and not Artifact.objects.exists()
    assert store_files(store_root) == []


@pytest.mark.parametrize(
    ("attr", "fmt", "reason"),
    [
        ("digits_export", "torchscript", "cannot load torchscript artifact"),  # torch.export as TorchScript
        ("digits", "torch_export", "cannot load torch_export artifact"),  # TorchScript labelled torch.export
    ],
)
def test_unloadable_artifact_becomes_failed(model_files, attr: str, fmt: str, reason: str) -> None:
    # when an archive that does not load as its declared format is registered
    version = register(getattr(model_files, attr), f"bad-{attr}", fmt=fmt, max_batch_size=2)
    version.refresh_from_db()
    # then the version exists but FAILED, saying why
    assert version.state == State.FAILED
    assert reason in version.failure_reason
    assert version.latency_profile == {}
    assert version.memory_bytes is None


def test_wrong_output_dtype_becomes_failed_naming_the_dtype(model_files) -> None:
    version = register(model_files.wrong_dtype, "wrong-dtype", max_batch_size=2)
    version.refresh_from_db()
    assert version.state == State.FAILED
    assert "int64" in version.failure_reason and "FP32" in version.failure_reason


def test_signature_that_does_not_match_the_model_becomes_failed(model_files) -> None:
    # given a 64-input model declared with 32 inputs
    io_ = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [32]}], "outputs": DIGITS_IO["outputs"]}
    # when registered
    version = register(model_files.digits, "mismatch", io=io_, max_batch_size=2)
    version.refresh_from_db()
    # then validation fails because the model raised on the declared shape
    assert version.state == State.FAILED
    assert "model raised" in version.failure_reason


def test_declared_output_shape_that_does_not_match_becomes_failed(model_files) -> None:
    io_ = {"inputs": DIGITS_IO["inputs"], "outputs": [{"name": "scores", "datatype": "FP32", "shape": [3]}]}
    version = register(model_files.digits, "shape-mismatch", io=io_, max_batch_size=2)
    assert version.state == State.FAILED
    assert "signature says [-1, 3]" in version.failure_reason


def test_model_failing_only_on_some_inputs_still_becomes_ready(model_files) -> None:
    # given a model that raises on negative input only: the example batch is non-negative, so it passes
    version = register(model_files.fails_on_negative, "fails", max_batch_size=2)
    assert version.state == State.READY, version.failure_reason


# --- upload checks -------------------------------------------------------------------------------------


def test_sha256_is_checked_when_given(model_files, store_root: Path) -> None:
    data = model_files.digits.read_bytes()
    good = hashlib.sha256(data).hexdigest()
    # when the declared sha256 is wrong
    with pytest.raises(RegistrationError) as caught:
        register_version(
            model_name="sha",
            artifact_file=io.BytesIO(data),
            fmt="torchscript",
            sha256="0" * 64,
            validate="none",
            **DIGITS_IO,
        )
    # then it is a bad request and nothing is stored
    assert caught.value.status == 400
    assert "sha256 mismatch" in caught.value.message
    assert store_files(store_root) == []
    assert not Model.objects.filter(name="sha").exists()
    # and the right one (in any case) is accepted
    version = register_version(
        model_name="sha",
        artifact_file=io.BytesIO(data),
        fmt="torchscript",
        sha256=good.upper(),
        validate="none",
        **DIGITS_IO,
    )
    assert version.artifact_id == good


def test_artifact_over_the_size_limit_is_refused(model_files, settings, store_root: Path) -> None:
    # given a limit smaller than the artifact
    settings.FERRY_MAX_ARTIFACT_BYTES = 1000
    assert model_files.digits.stat().st_size > 1000
    # when it is registered
    with pytest.raises(RegistrationError) as caught:
        register(model_files.digits, "big")
    # then it is refused as too large and no partial upload is left behind
    assert caught.value.status == 413
    assert "1000 byte limit" in caught.value.message
    assert store_files(store_root) == []
    assert not Model.objects.filter(name="big").exists()


def test_empty_artifact_is_refused(store_root: Path) -> None:
    with pytest.raises(RegistrationError) as caught:
        register_version(
            model_name="empty", artifact_file=io.BytesIO(b""), fmt="torchscript", validate="none", **DIGITS_IO
        )
    assert caught.value.status == 400
    assert store_files(store_root) == []


def test_same_bytes_are_stored_once(model_files, store_root: Path) -> None:
    # when the same artifact is registered twice, under two models
    v1 = register_unvalidated(model_files.digits, "one")
    v2 = register_unvalidated(model_files.digits, "two")
    # then both versions point at one Artifact row and one file, named by its hash
    assert v1.artifact_id == v2.artifact_id
    assert Artifact.objects.count() == 1
    files = store_files(store_root)
    assert files == [artifacts.path_for(v1.artifact_id)]
    assert files[0].name == v1.artifact_id and files[0].parent.name == v1.artifact_id[:2]
    assert files[0].read_bytes() == model_files.digits.read_bytes()


def test_stored_file_is_read_only(model_files, store_root: Path) -> None:
    version = register_unvalidated(model_files.digits, "ro")
    mode = stat.S_IMODE(artifacts.path_for(version.artifact_id).stat().st_mode)
    assert mode == 0o444


def _tamper(path: Path) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verified_path_detects_a_tampered_file(model_files, store_root: Path) -> None:
    # given a stored artifact
    version = register_unvalidated(model_files.digits, "tamper")
    sha = version.artifact_id
    assert artifacts.verified_path(sha) == artifacts.path_for(sha)
    # when one byte of it changes on disk
    _tamper(artifacts.path_for(sha))
    # then reading it is refused as corrupt
    with pytest.raises(artifacts.ArtifactRejected) as caught:
        artifacts.verified_path(sha)
    assert caught.value.status == 503
    assert "corrupt" in caught.value.message


def test_uploading_the_same_bytes_again_repairs_a_damaged_stored_file(model_files, store_root: Path) -> None:
    # given a stored artifact that was damaged on disk after upload
    first = register_unvalidated(model_files.digits, "repair", max_batch_size=2)
    sha = first.artifact_id
    _tamper(artifacts.path_for(sha))
    # when the same, correct bytes are registered again
    second = register(model_files.digits, "repair", max_batch_size=2)
    # then the store holds the good copy again, still read-only, and the new version is READY
    assert second.artifact_id == sha
    assert artifacts.verified_path(sha).read_bytes() == model_files.digits.read_bytes()
    assert stat.S_IMODE(artifacts.path_for(sha).stat().st_mode) == 0o444
    assert second.state == State.READY, second.failure_reason
    assert store_files(store_root) == [artifacts.path_for(sha)]


def test_verified_path_detects_a_missing_file(store_root: Path) -> None:
    with pytest.raises(artifacts.ArtifactRejected) as caught:
        artifacts.verified_path("ab" * 32)
    assert caught.value.status == 503
    assert "missing" in caught.value.message


def test_validation_of_a_tampered_artifact_fails(model_files, store_root: Path) -> None:
    # given a registered, not yet validated version whose file was then altered
    version = register_unvalidated(model_files.digits, "tampered", max_batch_size=2)
    _tamper(artifacts.path_for(version.artifact_id))
    # when it is validated
    from serving.validation import validate

    validate(version)
    version.refresh_from_db()
    # then it FAILED because the bytes no longer match their hash
    assert version.state == State.FAILED
    assert "corrupt" in version.failure_reason


# --- bad names, signatures and batching parameters ------------------------------------------------------


@pytest.mark.parametrize("name", ["", "-lead", ".hidden", "has space", "a/b", "x" * 101, "caf\u00e9", "semi;colon"])
def test_bad_model_names_are_refused(model_files, name: str, store_root: Path) -> None:
    with pytest.raises(RegistrationError) as caught:
        register(model_files.digits, name)
    assert caught.value.status == 400
    assert "model name" in caught.value.message
    assert not Model.objects.exists()
    assert store_files(store_root) == []


@pytest.mark.parametrize("name", ["a", "digits-v2.1_final", "X" * 100, "0abc"])
def test_good_model_names_are_accepted(model_files, name: str) -> None:
    assert register_unvalidated(model_files.digits, name).model.name == name


@pytest.mark.parametrize(
    ("batching", "message"),
    [
        ({"max_batch_size": 8, "preferred_batch_sizes": [4, 16]}, "preferred batch size 16 is outside"),
        ({"max_batch_size": 0}, "max_batch_size must be at least 1"),
        ({"max_queue_delay_ms": -1.0}, "max_queue_delay must not be negative"),
        ({"max_queue_size": 0}, "max_queue_size must be at least 1"),
        ({"preferred_batch_sizes": "4"}, "preferred_batch_sizes must be a list of integers"),
        ({"preferred_batch_sizes": [2.5]}, "preferred_batch_sizes must be a list of integers"),
        ({"preferred_batch_sizes": [64]}, "preferred batch size 64 is outside"),  # default max is 32
        ({"max_batch_size": "many"}, "batching"),
    ],
)
def test_bad_batching_parameters_are_refused(model_files, batching: dict, message: str, store_root: Path) -> None:
    with pytest.raises(RegistrationError) as caught:
        register(model_files.digits, "batching", **batching)
    assert caught.value.status == 400
    assert message in caught.value.message
    assert not Model.objects.exists()
    assert store_files(store_root) == []


def test_field_validation_after_upload_rolls_back_the_model(model_files) -> None:
    # given a default timeout the model field rejects (checked after the artifact is stored)
    with pytest.raises(RegistrationError) as caught:
        register(model_files.digits, "timeout", default_timeout_ms=0)
    # then it is a bad request and the model created for it was rolled back
    assert caught.value.status == 400
    assert "default_timeout_ms" in caught.value.message
    assert not Model.objects.filter(name="timeout").exists()


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ([], "inputs must be a non-empty list"),
        ({"name": "input"}, "inputs must be a non-empty list"),
        ([{"name": "input", "datatype": "FP99", "shape": [64]}], "unsupported datatype 'FP99'"),
        ([{"name": "input", "datatype": "FP32"}], "missing 'shape'"),
        ([{"name": "input", "datatype": "FP32", "shape": [-2]}], "shape must be a list"),
        (["input"], "tensor spec must be an object"),
        (
            [{"name": "x", "datatype": "FP32", "shape": [1]}, {"name": "x", "datatype": "FP32", "shape": [1]}],
            "duplicate tensor name 'x'",
        ),
    ],
)
def test_bad_signatures_are_refused(model_files, inputs: object, message: str) -> None:
    with pytest.raises(RegistrationError) as caught:
        register(model_files.digits, "sig", io={"inputs": inputs, "outputs": DIGITS_IO["outputs"]})
    assert caught.value.status == 400
    assert message in caught.value.message


# --- routing snapshot and version choice ---------------------------------------------------------------


@pytest.fixture
def three_versions(model_files) -> tuple[ModelVersion, ModelVersion, ModelVersion]:
    """Model "routed": v1 and v2 READY, v3 FAILED (wrong dtype)."""
    v1 = register(model_files.digits, "routed", max_batch_size=2)
    v2 = register(model_files.digits_export, "routed", fmt="torch_export", max_batch_size=2)
    v3 = register(model_files.wrong_dtype, "routed", max_batch_size=2)
    assert [v1.state, v2.state, v3.state] == [State.READY, State.READY, State.FAILED]
    return v1, v2, v3


def test_snapshot_includes_live_versions_and_excludes_retired(three_versions) -> None:
    v1, v2, v3 = three_versions
    # given version 1 retired
    v1.retire()
    # when the snapshot is built
    snapshot = build_snapshot()
    entry = snapshot.models["routed"]
    # then it holds versions 2 and 3, only 2 servable
    assert sorted(entry.versions) == [2, 3]
    assert [v.version for v in entry.servable_versions()] == [2]
    assert [v.key for v in snapshot.hosted_versions()] == ["routed:2"]
    # and an entry carries what the data plane needs
    e2 = entry.versions[2]
    assert e2.format == "torch_export" and e2.artifact_sha256 == v2.artifact_id
    assert e2.batching.max_batch_size == 2
    assert set(e2.latency_profile) == {1, 2} and all(s > 0 for s in e2.latency_profile.values())
    assert entry.versions[3].state == "failed" and "int64" in entry.versions[3].failure_reason


def test_snapshot_names_the_fallback_and_serials_increase(model_files) -> None:
    register_unvalidated(model_files.digits, "big")
    register_unvalidated(model_files.digits, "small")
    Model.objects.filter(name="big").update(fallback=Model.objects.get(name="small"))
    first = build_snapshot()
    second = build_snapshot()
    assert first.models["big"].fallback == "small"
    assert first.models["small"].fallback is None
    assert second.serial > first.serial
    # registered-but-unvalidated versions are listed, not servable
    assert first.models["big"].versions[1].state == "registered"
    assert first.hosted_versions() == []


def test_choose_version_picks_the_stable_version(three_versions) -> None:
    # given v1, v2 ready and v3 failed: v1, ready first, is stable
    model = build_snapshot().models["routed"]
    assert model.routes.stable == 1
    # then an unpinned request goes to v1, not to the newer v2 nobody promoted
    assert choose_version(model).version == 1
    # and a pinned request goes where it is pinned
    assert choose_version(model, pinned=1).version == 1


def test_choose_version_unknown_pinned_version_is_404(three_versions) -> None:
    model = build_snapshot().models["routed"]
    with pytest.raises(RouteError) as caught:
        choose_version(model, pinned=9)
    assert caught.value.status == 404
    assert "no version 9" in caught.value.message


def test_choose_version_failed_pinned_version_is_503(three_versions) -> None:
    model = build_snapshot().models["routed"]
    with pytest.raises(RouteError) as caught:
        choose_version(model, pinned=3)
    assert caught.value.status == 503
    assert "failed" in caught.value.message and "int64" in caught.value.message


def test_choose_version_unloaded_versions_are_503(three_versions) -> None:
    # given every version unloaded
    ModelVersion.objects.filter(model__name="routed").update(loaded=False)
    model = build_snapshot().models["routed"]
    # then a pinned ready-but-unloaded version is unavailable, saying so
    with pytest.raises(RouteError) as caught:
        choose_version(model, pinned=2)
    assert caught.value.status == 503 and "unloaded" in caught.value.message
    # and so is the model as a whole
    with pytest.raises(RouteError) as caught:
        choose_version(model)
    assert caught.value.status == 503 and "no ready version" in caught.value.message


def test_choose_version_never_falls_over_to_an_unpromoted_version(three_versions) -> None:
    # given the stable v1 unloaded, v2 ready but never promoted
    ModelVersion.objects.filter(model__name="routed", version=1).update(loaded=False)
    # then unpinned traffic is refused (503), not sent to v2
    with pytest.raises(RouteError) as caught:
        choose_version(build_snapshot().models["routed"])
    assert caught.value.status == 503 and "stable version 1 is unloaded" in caught.value.message


def test_choose_version_retired_pinned_version_is_404(three_versions) -> None:
    three_versions[0].retire()
    with pytest.raises(RouteError) as caught:
        choose_version(build_snapshot().models["routed"], pinned=1)
    assert caught.value.status == 404


# --- the Celery task -------------------------------------------------------------------------------------


def test_celery_task_validates_a_version(model_files) -> None:
    from serving.tasks import validate_version

    # given a registered, unvalidated version
    version = register_unvalidated(model_files.digits, "celery", max_batch_size=2)
    assert version.state == State.REGISTERED
    # when the task runs (eagerly, in this process)
    result = validate_version.apply(args=[version.pk])
    # then it reports and stores READY
    assert result.get() == State.READY
    version.refresh_from_db()
    assert version.state == State.READY and version.latency_profile


def test_async_registration_validates_on_commit_with_eager_celery(
    model_files, django_capture_on_commit_callbacks
) -> None:
    # given Celery in eager mode (the test settings without REDIS_URL; see the test below)
    # when a version is registered with async validation and the transaction commits
    with django_capture_on_commit_callbacks(execute=True):
        version = register_unvalidated(model_files.wrong_dtype, "celery-async", max_batch_size=2)
        version.refresh_from_db()
        assert version.state == State.REGISTERED
    # then the queued task ran and the version reached its final state
    version.refresh_from_db()
    assert version.state == State.FAILED
    assert "int64" in version.failure_reason


def test_celery_is_eager_in_the_test_settings(settings) -> None:
    from config.celery import app

    # make test sets no REDIS_URL: tasks run in-process
    assert settings.REDIS_URL == ""
    assert settings.CELERY_TASK_ALWAYS_EAGER is True
    assert app.conf.task_always_eager is True
