"""Registry workflows that span models: register a version, load or unload a model."""

from __future__ import annotations

from typing import BinaryIO

from django.core.exceptions import ValidationError
from django.db import transaction

from rollout import approval
from rollout.models import Rollout
from serving import artifacts, model_names, quota_counts
from serving.dataplane.gateway.snapshot import RoutingSnapshot
from serving.dataplane.http.protocol import TensorSpec
from serving.errors import NOT_LOADED, RegistrationError
from serving.models import MODEL_NAME, RESERVED_NAMES, ROUTING_FIELDS, Model, ModelVersion, Pipeline, State, lock_name
from serving.policies.batching import BatchingConfig
from serving.publish import publish_snapshot
from serving.validation import validate as run_validation
from tenants import audit


def check_signature(specs: list[dict], what: str) -> list[dict]:
    if not isinstance(specs, list) or not specs:
        raise RegistrationError(f"{what} must be a non-empty list of tensor specs")
    seen = set()
    cleaned = []
    for raw in specs:
        try:
            spec = TensorSpec.from_dict(raw)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RegistrationError(f"{what}: {exc}") from None
        if spec.name in seen:
            raise RegistrationError(f"{what}: duplicate tensor name {spec.name!r}")
        seen.add(spec.name)
        cleaned.append(spec.to_dict())
    return cleaned


def register_version(
    *,
    model_name: str,
    artifact_file: BinaryIO,
    fmt: str,
    inputs: list[dict],
    outputs: list[dict],
    sha256: str | None = None,
    task: str | None = None,
    description: str | None = None,
    metrics: dict | None = None,
    validate: str,
    tenant: object | None = None,
    tenant_id: int | None = None,
    owner_only: bool = False,
    **batching: object,
) -> ModelVersion:
    """Store the artifact, create the next version of the model (creating the model if new, owned by
    `tenant`, a Tenant, or `tenant_id`; neither: a platform model) and validate it: "sync" validates
    before returning, "none" leaves it registered for the caller to queue. To queue the validation task
    after commit, call `serving.tasks.register_and_validate` instead: the registry's actions never import
    tasks. The owner's quota of models and versions is checked (RegistrationError 429 when full).
    A name a pipeline holds is not available for a new model (409, the words of a taken name). With
    `owner_only` (the API's upload, which checked the owner before reading the body) an existing model
    must be the given tenant's: one created meanwhile by another is the same 409."""
    if tenant is not None:
        tenant_id = tenant.pk  # type: ignore[attr-defined]
    if validate not in ("sync", "none"):
        raise ValueError(f"validate must be sync or none, not {validate!r} (queued: tasks.register_and_validate)")
    try:
        MODEL_NAME(model_name)
    except ValidationError as exc:
        raise RegistrationError(f"model name {model_name!r}: {exc.messages[0]}") from None
    inputs = check_signature(inputs, "inputs")
    outputs = check_signature(outputs, "outputs")
    batching = {k: v for k, v in batching.items() if v is not None}
    _check_batching(batching)
    try:
        artifact = artifacts.store(artifact_file, expected_sha256=sha256)
    except artifacts.ArtifactRejected as exc:
        raise RegistrationError(exc.message, exc.status) from None
    with transaction.atomic():
        lock_name(model_name)  # orders this against a pipeline taking the name (serving.pipelines)
        existing = Model.objects.select_for_update().filter(name=model_name).first()
        if existing is None and Pipeline.objects.filter(name=model_name).exists():
            raise RegistrationError(model_names.not_available(model_name), 409)
        if existing is None and model_name in RESERVED_NAMES:
            raise RegistrationError(f"model name {model_name!r} is reserved: the inference protocol's paths use it")
        if existing is not None and owner_only and existing.tenant_id != tenant_id:
            raise RegistrationError(model_names.not_available(model_name), 409)
        model, created = Model.objects.select_for_update().get_or_create(
            name=model_name,
            defaults={"task": task or "classification", "description": description or "", "tenant_id": tenant_id},
        )
        if created:
            quota_counts.check_new_model(model)
        quota_counts.check_new_version(model.tenant_id)
        if not created and (task or description):
            model.task = task or model.task
            model.description = description if description is not None else model.description
            model.save()
        version = ModelVersion(
            model=model,
            version=model.next_version_number(),
            artifact=artifact,
            format=fmt,
            inputs=inputs,
            outputs=outputs,
            metrics=metrics or {},
            **batching,
        )
        try:
            version.full_clean(exclude=["model", "artifact"])
        except ValidationError as exc:
            raise RegistrationError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from None
        version.save()
    if validate == "sync":
        run_validation(version)
    return version


def _check_batching(batching: dict) -> None:
    defaults = {f.name: f.default for f in ModelVersion._meta.get_fields() if hasattr(f, "default")}
    merged = {
        k: batching.get(k, defaults[k])
        for k in ("max_batch_size", "max_queue_delay_ms", "max_queue_size", "preferred_batch_sizes")
    }
    preferred = merged["preferred_batch_sizes"]
    if callable(preferred):
        preferred = preferred()
    if not isinstance(preferred, list | tuple) or not all(isinstance(p, int) for p in preferred):
        raise RegistrationError("preferred_batch_sizes must be a list of integers")
    try:
        BatchingConfig(
            max_batch_size=int(merged["max_batch_size"]),
            max_queue_delay=float(merged["max_queue_delay_ms"]) / 1000.0,
            max_queue_size=int(merged["max_queue_size"]),
            preferred_batch_sizes=tuple(preferred),
        )
    except (ValueError, TypeError) as exc:
        raise RegistrationError(f"batching: {exc}") from None


def sharing_state(model: Model) -> dict:
    """What the audit log keeps of a model's visibility."""
    return {"visibility": model.visibility, "shared_with": sorted(model.shared_with.values_list("slug", flat=True))}


def set_visibility(
    *, model: Model, visibility: str | None = None, shared_with: list | None = None, actor: object = None
) -> Model:
    """Change who may see `model` (None leaves that part alone), with its audit entry, in one transaction."""
    with transaction.atomic():
        before = sharing_state(model)
        if visibility is not None and visibility != model.visibility:
            model.visibility = visibility
            model.save(update_fields=["visibility", "updated_at"])
        if shared_with is not None and set(shared_with) != set(model.shared_with.all()):
            model.shared_with.set(shared_with)
        after = sharing_state(model)
        if after != before:
            audit.record(
                actor, "model.visibility", f"model {model.name}", tenant=model.tenant, before=before, after=after
            )
    return model


def set_loaded(*, model_name: str, loaded: bool) -> RoutingSnapshot:
    """The repository extension's load/unload: the desired state of every live version of a model.
    Loading a tenant's private model must fit its accelerator memory quota (RegistrationError 429)."""
    with transaction.atomic():
        if loaded:
            model = Model.objects.filter(name=model_name).first()
            if model is not None:
                ready = ModelVersion.objects.filter(model=model, state=State.READY)
                needs = sum(v.memory_bytes or 0 for v in ready)
                quota_counts.check_accelerator_bytes(model, needs, excluding_model=True)
        live = ModelVersion.objects.filter(model__name=model_name).exclude(state=State.RETIRED)
        live.update(loaded=loaded)
        if loaded:  # a version validation left unloaded for want of quota is loaded now
            live.filter(failure_reason__startswith=NOT_LOADED).update(failure_reason="")
    return publish_snapshot()


def promote(
    *, model: Model, version: int, actor: object = None, by_rollout: int | None = None, by_request: int | None = None
) -> Model:
    """Make `version` the model's stable version: all unpinned traffic the other rules leave goes to it.
    The rollout weights end with it (they split traffic between the old stable and a canary); tenant pins
    and experiment arms stay. Only a ready version can be promoted (RegistrationError 409 otherwise).
    While a rollout of the model is active only that rollout promotes (`by_rollout`, its id): a direct
    promotion would skip its gates and approval, so it is refused with 409 naming the rollout.
    Where the owning tenant requires approval (rollout.approval) only an approved rollout (`by_rollout`) or
    an accepted promotion request (`by_request`, rollout.promotion) promotes; anything else is a 409."""
    with transaction.atomic():
        model = Model.objects.select_for_update().get(pk=model.pk)
        target = ModelVersion.objects.filter(model=model, version=version).first()
        if target is None:
            raise RegistrationError(f"model '{model.name}' has no version {version}", 404)
        # The model's row lock orders this against a rollout starting (which locks it too).
        active = Rollout.objects.active().filter(model=model).exclude(pk=by_rollout).first()
        if active is not None:
            raise RegistrationError(
                f"model '{model.name}' has an active rollout (#{active.pk}, {active.state}, version"
                f" {active.candidate}): promote through it (its gates and approval) or end it first",
                409,
            )
        if target.state != State.READY:
            raise RegistrationError(
                f"version {version} of '{model.name}' is {target.state}: only a ready version can be promoted", 409
            )
        if (
            version != model.stable_version
            and approval.needs_approval(model)
            and not approval.rollout_approves(model, version, by_rollout)
            and not approval.request_approves(model, version, by_request)
        ):
            raise RegistrationError(
                f"the tenant that owns '{model.name}' requires an approval for every change of its stable version:"
                " roll the version out, or request its promotion for an approver to accept",
                409,
            )
        before = model.routing_state()
        model.stable_version = version
        model.rollout_weights = {}
        after = model.routing_state()
        if after != before:
            model.save(update_fields=["stable_version", "rollout_weights", "updated_at"])
            audit.record(
                actor,
                "model.promote",
                f"model {model.name} version {version}",
                tenant=model.tenant,
                before=before,
                after=after,
            )
    return model


def set_routing(*, model: Model, actor: object = None, **rules: object) -> Model:
    """Replace some of `model`'s routing rules (`rollout_weights`, `experiment_arms`, `tenant_versions`,
    `shadow_version`, `shadow_fraction`, keyword-named; the stable version changes by `promote`), validated
    by `Model.clean` and audited, in one transaction. Invalid rules: django's ValidationError, nothing
    changed; traffic to an unapproved version the tenant's policy does not allow (rollout.approval):
    RegistrationError 409, nothing changed. Clearing the shadow version without naming a fraction stops
    the mirroring too."""
    unknown = set(rules) - set(ROUTING_FIELDS)
    if unknown:
        raise TypeError(f"set_routing() got unknown rules {sorted(unknown)}")
    if "shadow_version" in rules and rules["shadow_version"] is None and "shadow_fraction" not in rules:
        rules["shadow_fraction"] = 0.0
    with transaction.atomic():
        model = Model.objects.select_for_update().get(pk=model.pk)
        before = model.routing_state()
        for field, value in rules.items():
            # JSON keys are strings: store them so, whichever way the caller wrote them.
            setattr(model, field, {str(k): v for k, v in value.items()} if isinstance(value, dict) else value)
        model.clean()
        after = model.routing_state()
        if after != before and approval.needs_approval(model):
            why = approval.unapproved_traffic(model, before, after)
            if why:
                raise RegistrationError(
                    f"the tenant that owns '{model.name}' requires an approval: {why}; roll it"
                    " out (its gates set the weights) or have its promotion approved",
                    409,
                )
        if after != before:
            model.save(update_fields=[*rules, "updated_at"])
            audit.record(actor, "model.routing", f"model {model.name}", tenant=model.tenant, before=before, after=after)
    return model
