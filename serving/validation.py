"""Validation of a registered version: load it, run example batches, check the signature, profile it.

The model runs where the node runs it: in a sandboxed runtime process (serving.dataplane.node.runtime_process),
never in the web process, unless FERRY_RUNTIME_ISOLATION=inline."""

from __future__ import annotations

import logging

import torch
from django.db import transaction
from django.db.models import Q

from rollout import approval
from serving import artifacts, quota_counts
from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node.node import warmup_sizes
from serving.dataplane.node.runtime import ModelRuntime, RuntimeFailure, pick_device, to_torch
from serving.dataplane.node.runtime_process import make_runtime
from serving.errors import NOT_LOADED
from serving.models import Model, ModelVersion, State
from serving.publish import version_entry
from tenants.models import AuditEntry

log = logging.getLogger(__name__)

# The audit actions after which a model's name is free again for the tenant (serving.api.views).
RELEASES_NAME = ("model.delete", "model.rename")


# The states a validation starts from: registered, or validating where a worker died mid-run and Celery
# (acks_late) delivers the task again. Any other means someone decided since (retired) or it ran already.
STARTS_FROM = (State.REGISTERED, State.VALIDATING)


def validate(version: ModelVersion) -> ModelVersion:
    """Move a version to READY with a latency profile and footprint, or to FAILED with the reason. A version
    in no state validation starts from is left as it is, and so is one that left VALIDATING while the model
    ran (retired meanwhile): validation takes minutes, and its verdict must not undo a person's decision."""
    if not _begin(version):
        return version
    runtime: ModelRuntime | None = None
    try:
        inputs = [TensorSpec.from_dict(d) for d in version.inputs]
        outputs = [TensorSpec.from_dict(d) for d in version.outputs]
        runtime = make_runtime(
            artifacts.local_reader()(version.artifact_id), version.format, inputs, outputs, pick_device()
        )
        runtime.load()
        entry = version_entry(version, version.model.name)
        # profile() runs every size through predict(), which checks each output's dtype and shape.
        profile = runtime.profile(warmup_sizes(entry), repeats=5)
        _check_batch_independence(runtime)
    except Exception as exc:  # whatever the artifact does, the answer is FAILED with a reason
        reason = getattr(exc, "message", None) or str(exc)
        log.warning("validation of %s failed: %s", version, reason)
        with transaction.atomic():
            if _still_validating(version):
                version.mark(State.FAILED, reason[:2000])
        return version
    finally:
        if runtime is not None:
            runtime.release()  # a sandboxed runtime's process exits
    version.latency_profile = {str(k): v for k, v in profile.items()}
    version.memory_bytes = runtime.memory_bytes
    version.load_seconds = runtime.load_seconds
    with transaction.atomic():
        if not _still_validating(version):
            return version
        version.state = State.READY
        version.failure_reason = ""
        try:
            quota_counts.check_accelerator_bytes(version.model, version.memory_bytes or 0)
        except quota_counts.QuotaFull as full:
            # Ready but not loaded: the tenant loads it (repository load) once it has room.
            version.loaded = False
            version.failure_reason = f"{NOT_LOADED}{full.message}"
        version.save(
            update_fields=[
                "latency_profile",
                "memory_bytes",
                "load_seconds",
                "state",
                "failure_reason",
                "loaded",
                "updated_at",
            ]
        )
        _stable_if_first(version)
    return version


def _begin(version: ModelVersion) -> bool:
    """Mark `version` VALIDATING if its state is one validation starts from, under its row lock (so a retire
    at the same moment comes before or after, never in between); False, and `version` refreshed, if not."""
    with transaction.atomic():
        state = _locked_state(version)
        if state not in STARTS_FROM:
            log.info("validation of %s not started: it is %s", version, state or "gone")
            _refresh(version)
            return False
        version.mark(State.VALIDATING)
    return True


def _still_validating(version: ModelVersion) -> bool:
    """Inside the caller's transaction, lock `version`'s row and say whether it is still VALIDATING, the
    only state a verdict may replace; if not (retired while the model ran), refresh `version` and say so."""
    state = _locked_state(version)
    if state == State.VALIDATING:
        return True
    log.info("validation of %s finished but not recorded: it is %s now", version, state or "gone")
    _refresh(version)
    return False


def _locked_state(version: ModelVersion) -> str | None:
    return ModelVersion.objects.select_for_update().filter(pk=version.pk).values_list("state", flat=True).first()


def _refresh(version: ModelVersion) -> None:
    try:
        version.refresh_from_db()
    except ModelVersion.DoesNotExist:  # deleted with its model meanwhile: nothing left to say
        pass


def _stable_if_first(version: ModelVersion) -> None:
    """A model's first ready version becomes its stable version (one that had none: its first version, or
    the first to pass after earlier ones failed or were retired). Every later version waits for a promotion
    or a rollout, so registering it moves no traffic. The row lock orders two validations finishing at once.
    Where the tenant requires approval (rollout.approval) only a model that never had a ready version, under
    a name no model of its tenant gave up before, gets one this way: otherwise retiring the stable version
    while a new one validates, or deleting the model and registering the name again, would put a version in
    front of the name's callers with nobody approving; it waits for an approved promotion instead."""
    model = Model.objects.select_for_update().get(pk=version.model_id)
    if (
        model.stable_version is None
        and approval.needs_approval(model)
        and (_served_before(model, version) or name_released(model.tenant_id, model.name, model.pk))
    ):
        return
    if model.stable_version is None:
        model.stable_version = version.version
        model.save(update_fields=["stable_version", "updated_at"])
        version.model.stable_version = version.version


def _served_before(model: Model, version: ModelVersion) -> bool:
    """Whether another version of `model` ever passed validation: ready now, or retired with the latency
    profile only a passed validation records."""
    others = ModelVersion.objects.filter(model=model).exclude(pk=version.pk)
    return others.filter(Q(state=State.READY) | ~Q(latency_profile={})).exists()


def name_released(tenant_id: int | None, name: str, model_id: int | None = None) -> bool:
    """Whether a model of tenant `tenant_id` (other than `model_id`) gave up `name` before: deleted, or
    renamed to another name. The audit log is the record (`model.delete`, `model.rename`, written in the
    change's transaction, each with the model's id), so nothing else has to remember a name after its model
    has gone."""
    if tenant_id is None:
        return False
    entries = AuditEntry.objects.filter(tenant_id=tenant_id, action__in=RELEASES_NAME, target=f"model {name}")
    return any((before or {}).get("model") != model_id for before in entries.values_list("before", flat=True))


def rename_refusal(model: Model, name: str) -> str | None:
    """Why `model` may not be renamed to `name`, or None. Under "approval required", a model with a stable
    version may not take a name another model of its tenant gave up (deleted or renamed away): callers
    address models by name, so its stable version, which no approver put in front of that name's callers,
    would answer them. Its own earlier name it may take back. The API (409) and /admin/ (a form error) both
    ask here."""
    if (
        model.stable_version is not None
        and approval.needs_approval(model)
        and name_released(model.tenant_id, name, model.pk)
    ):
        return (
            f"a model of this tenant served as {name!r} before, and the tenant requires an approval for every"
            " change of a stable version: register versions under that name and have one promoted instead"
        )
    return None


def _check_batch_independence(runtime: ModelRuntime) -> None:
    """Rows must not influence each other: batching would otherwise change answers."""
    batch = runtime.example_batch(4, seed=1)
    together = runtime.predict(batch)
    alone = runtime.predict([a[:1] for a in batch])
    for spec, joint, single in zip(runtime.outputs, together, alone, strict=True):
        if spec.datatype == "BF16":  # its bits: compared as its values, within a couple of bfloat16's steps
            together_row, alone_row = to_torch(joint[:1], spec).float(), to_torch(single, spec).float()
            same = torch.allclose(together_row, alone_row, rtol=1e-2, atol=1e-3)
        elif joint.dtype.kind == "f":
            same = torch.allclose(torch.from_numpy(joint[:1]), torch.from_numpy(single), rtol=1e-3, atol=1e-4)
        else:
            same = bool((joint[:1] == single).all())
        if not same:
            raise RuntimeFailure(f"output {spec.name!r} of row 0 changes when batched with other rows")
