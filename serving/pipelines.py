"""The registry's side of pipelines: register one (checked against the models its tenant may see, audited),
and build the routing snapshot's entries for them.

The graph and its check are `serving.policies.pipeline`'s; the executor is the data plane's
(`serving.dataplane.gateway.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import IntegrityError, transaction
from django.db.models import Q

from serving import quota_counts
from serving.dataplane.gateway.snapshot import ModelEntry, PipelineEntry, PipelineVersionEntry, VersionEntry
from serving.dataplane.http.protocol import TensorSpec
from serving.errors import RegistrationError
from serving.models import (
    MODEL_NAME,
    PIPELINE_VERSIONS_SERVED,
    PIPELINE_VISIBILITIES,
    RESERVED_NAMES,
    Model,
    ModelVersion,
    Pipeline,
    PipelineVersion,
    State,
    Visibility,
    lock_name,
)
from serving.policies.pipeline import Checked, ModelSignature, PipelineError, Signature, check, to_tensor
from tenants import audit


class PipelineRegistrationError(Exception):
    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _signature(specs: list[dict]) -> Signature:
    return dict(to_tensor(d) for d in specs)


def _visible_models(tenant_id: int | None):  # noqa: ANN202
    """The models a pipeline of `tenant_id` may use: platform and public models, its own, those shared with it."""
    q = Q(tenant__isnull=True) | Q(visibility=Visibility.PUBLIC)
    if tenant_id is not None:
        q |= Q(tenant_id=tenant_id) | Q(visibility=Visibility.SHARED, shared_with__pk=tenant_id)
    return Model.objects.filter(q).distinct()


def registry_signatures(
    tenant_id: int | None, bound: dict[str, int] | None = None
) -> Callable[[str, int | None], ModelSignature | None]:
    """A step's signature as the registry holds it: the pinned version, else the stable one; None for a model
    the tenant may not see (the check words that as it words an unknown one). `bound` collects the id of
    each model a step names (`PipelineVersion.step_models`)."""

    def signatures(name: str, version: int | None) -> ModelSignature | None:
        model = _visible_models(tenant_id).filter(name=name).first()
        if model is None:
            return None
        if bound is not None:
            bound[name] = model.pk
        number = version if version is not None else model.stable_version
        row = None
        if number is not None:
            row = ModelVersion.objects.filter(model=model, version=number, state=State.READY).first()
        if row is None:
            what = f"version {version} of its model is not ready" if version else "its model has no ready version"
            raise PipelineError(what, step=name)
        return ModelSignature(_signature(row.inputs), _signature(row.outputs), row.max_batch_size)

    return signatures


def uses(model: ModelEntry, tenant_id: int | None) -> bool:
    """Whether a pipeline of `tenant_id` may use `model` (a platform pipeline: platform and public models)."""
    if tenant_id is None:
        return model.tenant_id is None or model.visibility == Visibility.PUBLIC
    return model.visible_to(tenant_id)


def snapshot_signatures(
    models: dict[str, ModelEntry],
    tenant_id: int | None,
    bound: dict[str, int | None] | None = None,
    ids: dict[str, int] | None = None,
) -> Callable[[str, int | None], ModelSignature | None]:
    """The same, from the snapshot's entries: the check `build_snapshot` repeats, so a pipeline whose model
    has since changed its signature or gone private is marked broken instead of failing per request. With
    `bound` (a version's `step_models`) and `ids` (each model's id by name), a name that another model holds
    now (the step's was deleted or renamed, then the name taken) is refused too: the step is bound to the
    model its check saw, not to whoever holds the name."""

    def signatures(name: str, version: int | None) -> ModelSignature | None:
        model = models.get(name)
        if model is None or not uses(model, tenant_id):
            return None
        if bound is not None and ids is not None and bound.get(name) != ids.get(name):
            raise PipelineError(
                "the model of this name is not the one this version was registered with: register a new version",
                step=name,
            )
        number = version if version is not None else model.routes.stable
        entry = model.versions.get(number) if number is not None else None
        if entry is None or entry.state != "ready":
            raise PipelineError("its model has no ready version" if version is None else "version not ready", name)
        return ModelSignature(
            {s.name: to_tensor(s.to_dict())[1] for s in entry.inputs},
            {s.name: to_tensor(s.to_dict())[1] for s in entry.outputs},
            entry.batching.max_batch_size,
        )

    return signatures


def _public(model: Model) -> bool:
    """Whether every tenant sees `model`: a public or a platform one."""
    return model.tenant_id is None or model.visibility == Visibility.PUBLIC


def _fallback_fits(checked: Checked, fallback: Model) -> bool:
    row = None
    if fallback.stable_version is not None:
        row = ModelVersion.objects.filter(model=fallback, version=fallback.stable_version, state=State.READY).first()
    if row is None:
        return False
    return _signature(row.inputs) == checked.inputs and _signature(row.outputs) == checked.outputs


class _Keep:
    """The type of `KEEP`."""


KEEP = _Keep()  # a setting a new version leaves as the pipeline has it (a new pipeline: the default)


def current_settings(name: str, tenant_id: int | None) -> tuple[str, str | None]:
    """The visibility and fallback's name a new version of pipeline `name` keeps when its registration names
    neither: the pipeline's own, if `tenant_id`'s; a new pipeline's defaults (private, none) otherwise."""
    pipeline = Pipeline.objects.select_related("fallback").filter(name=name, tenant_id=tenant_id).first()
    if pipeline is None:
        return Visibility.PRIVATE, None
    return pipeline.visibility, pipeline.fallback.name if pipeline.fallback else None


def register_pipeline(
    *,
    name: str,
    spec: object,
    tenant: object | None,
    visibility: str | _Keep = KEEP,
    description: str = "",
    fallback: str | None | _Keep = KEEP,
    actor: object = None,
) -> PipelineVersion:
    """Check `spec` against the models `tenant` may see and store it as the next version of pipeline `name`
    (created if new), with its audit entry. `visibility` and `fallback` left as `KEEP` stay the pipeline's
    (`current_settings`). `PipelineRegistrationError`: 422 for a graph that does not connect (naming the step
    and tensor), 409 for a name a model or another tenant's pipeline holds, 429 for the tenant's quota (a new
    pipeline counts as a model, a served version as a version)."""
    try:
        MODEL_NAME(name)
    except Exception:
        raise PipelineRegistrationError(
            "a pipeline's name is a model name: letters, digits, '_', '.', '-'", 400
        ) from None
    tenant_id = getattr(tenant, "pk", None)
    if isinstance(visibility, _Keep) or isinstance(fallback, _Keep):
        kept = current_settings(name, tenant_id)
        visibility = kept[0] if isinstance(visibility, _Keep) else visibility
        fallback = kept[1] if isinstance(fallback, _Keep) else fallback
    if visibility not in dict(PIPELINE_VISIBILITIES):
        # "shared" names no tenants for a pipeline (it has no shared_with): it would serve as private.
        raise PipelineRegistrationError("a pipeline's visibility is private or public", 400)
    bound: dict[str, int] = {}
    try:
        checked = check(spec, registry_signatures(tenant_id, bound))
    except PipelineError as exc:
        raise PipelineRegistrationError(exc.message) from None
    if visibility == Visibility.PUBLIC:
        # Its steps run as the caller: a public pipeline over a model some callers cannot see would fail them.
        narrow = Model.objects.filter(name__in=checked.models, tenant__isnull=False).exclude(
            visibility=Visibility.PUBLIC
        )
        first = next((m for m in checked.models if m in set(narrow.values_list("name", flat=True))), None)
        if first is not None:
            step = next(n.name for n in checked.root.steps() if n.model == first)
            raise PipelineRegistrationError(f"step '{step}': a public pipeline's steps must be public models")
    fallback_model = None
    if fallback:
        fallback_model = _visible_models(tenant_id).filter(name=fallback).first()
        if fallback_model is None:
            raise PipelineRegistrationError("fallback: no model of that name is visible to this pipeline's tenant")
        if visibility == Visibility.PUBLIC and not _public(fallback_model):
            # Whoever sees the pipeline must be able to see its fallback: the API and console name it.
            raise PipelineRegistrationError("fallback: a public pipeline's fallback must be a public model")
        if not _fallback_fits(checked, fallback_model):
            raise PipelineRegistrationError("fallback: its ready version does not take and give the pipeline's tensors")
    inputs = [t.to_dict(n) for n, t in checked.inputs.items()]
    outputs = [t.to_dict(n) for n, t in checked.outputs.items()]
    for d in inputs + outputs:
        TensorSpec.from_dict(d)  # the data plane parses requests with these: they must be specs it takes
    try:
        with transaction.atomic():
            lock_name(name)  # orders this against a model taking the name (serving.actions, the registry API)
            if Model.objects.filter(name=name).exists():
                raise PipelineRegistrationError(f"the name {name!r} is not available; choose another name", 409)
            pipeline = Pipeline.objects.select_for_update().filter(name=name).first()
            if pipeline is not None and pipeline.tenant_id != tenant_id:
                raise PipelineRegistrationError(f"the name {name!r} is not available; choose another name", 409)
            if pipeline is None and name in RESERVED_NAMES:
                reserved = f"the name {name!r} is reserved: the inference protocol's paths use it"
                raise PipelineRegistrationError(reserved, 400)
            if pipeline is None:
                pipeline = Pipeline.objects.create(
                    name=name, tenant=tenant, visibility=visibility, description=description, fallback=fallback_model
                )
                quota_counts.check_new_pipeline(pipeline)
            else:
                pipeline.visibility, pipeline.fallback = visibility, fallback_model
                pipeline.description = description or pipeline.description
                pipeline.save(update_fields=["visibility", "fallback", "description", "updated_at"])
            if pipeline.versions.count() < PIPELINE_VERSIONS_SERVED:  # else the oldest served one stops being
                quota_counts.check_new_version(tenant_id)
            last = pipeline.versions.order_by("-version").values_list("version", flat=True).first() or 0
            row = PipelineVersion.objects.create(
                pipeline=pipeline,
                version=last + 1,
                spec=spec,
                inputs=inputs,
                outputs=outputs,
                step_models={m: bound[m] for m in checked.models},
            )
            audit.record(
                actor,
                "pipeline.register",
                f"pipeline {name}",
                tenant=tenant,  # type: ignore[arg-type]
                after={"version": row.version, "spec": spec, "visibility": visibility, "fallback": fallback},
            )
    except RegistrationError as exc:  # the tenant's quota (quota_counts.QuotaFull, 429)
        raise PipelineRegistrationError(exc.message, exc.status) from None
    except IntegrityError:
        raise PipelineRegistrationError(f"the name {name!r} is not available; choose another name", 409) from None
    return row


def step_models(spec: object) -> set[str]:
    """Every model name a stored spec's steps name (walked as JSON: a spec stored before a rule still reads)."""
    names: set[str] = set()
    if isinstance(spec, dict):
        if isinstance(spec.get("model"), str):
            names.add(spec["model"])
        for value in spec.values():
            names |= step_models(value)
    elif isinstance(spec, list):
        for value in spec:
            names |= step_models(value)
    return names


def implicit_steps(spec: object, hidden: set[str]) -> set[str]:
    """The names of the steps of `spec` named after a model in `hidden`: a model step without a `name` is
    named by its model, so its step name is that model's name too."""
    names: set[str] = set()
    if isinstance(spec, dict):
        model = spec.get("model")
        if isinstance(model, str) and model in hidden and spec.get("name") in (None, "", model):
            names.add(model)
        for value in spec.values():
            names |= implicit_steps(value, hidden)
    elif isinstance(spec, list):
        for value in spec:
            names |= implicit_steps(value, hidden)
    return names


def redact_spec(spec: object, hidden: set[str]) -> object:
    """`spec` with the models in `hidden` (those the reader may not see) unsaid: such a step's `model` is
    null, a step named after it loses the name, and a reference to that step's tensors (`S.X`) reads
    `hidden.X`. The graph's shape, the other steps and the tensors stay."""
    return _redact(spec, hidden, implicit_steps(spec, hidden))


def _redact(value: object, hidden: set[str], steps: set[str]) -> object:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "model" and isinstance(item, str) and item in hidden:
                out[key] = None
            elif key == "name" and item in steps and value.get("model") == item:
                out[key] = None
            elif key == "inputs" and isinstance(item, dict) and "model" in value:
                out[key] = {k: _reference(v, steps) for k, v in item.items()}
            else:
                out[key] = _redact(item, hidden, steps)
        return out
    if isinstance(value, list):
        return [_redact(item, hidden, steps) for item in value]
    return value


def _reference(reference: object, steps: set[str]) -> object:
    if not isinstance(reference, str):
        return reference
    head, dot, rest = reference.partition(".")
    return f"hidden.{rest}" if dot and head in steps else reference


def delete_pipeline(*, pipeline: Pipeline, actor: object = None) -> None:
    with transaction.atomic():
        audit.record(actor, "pipeline.delete", f"pipeline {pipeline.name}", tenant=pipeline.tenant)
        pipeline.delete()


def snapshot_entries(models: dict[str, ModelEntry]) -> dict[str, PipelineEntry]:
    """The routing snapshot's pipelines: each one's latest `PIPELINE_VERSIONS_SERVED` versions, re-checked
    against the models as published. A version is broken when a step's model is gone, out of sight, not the
    model it was registered with, or no longer takes or gives the tensors the version was registered with
    (the check on each step's stable version, or the version it pins); the fallback is left out when its
    stable version no longer takes and gives the latest version's tensors."""
    ids = dict(Model.objects.values_list("name", "pk"))
    entries = {}
    for pipeline in Pipeline.objects.select_related("fallback").prefetch_related("versions"):
        if pipeline.name in models:  # a model took the name first (a raw save): the model wins
            continue
        versions = {}
        served = sorted(pipeline.versions.all(), key=lambda row: row.version)[-PIPELINE_VERSIONS_SERVED:]
        for row in served:
            inputs = tuple(TensorSpec.from_dict(d) for d in row.inputs)
            outputs = tuple(TensorSpec.from_dict(d) for d in row.outputs)
            max_rows = 1
            try:
                checked = check(row.spec, snapshot_signatures(models, pipeline.tenant_id, row.step_models, ids))
                _same_signature(checked, inputs, outputs)
                max_rows, broken = checked.max_rows, ""
            except PipelineError as exc:
                broken = exc.message
            versions[row.version] = PipelineVersionEntry(
                version=row.version, spec=row.spec, inputs=inputs, outputs=outputs, broken=broken, max_rows=max_rows
            )
        if not versions:
            continue
        latest = versions[max(versions)]
        entries[pipeline.name] = PipelineEntry(
            name=pipeline.name,
            description=pipeline.description,
            versions=versions,
            latest=latest.version,
            tenant_id=pipeline.tenant_id,
            visibility=pipeline.visibility,
            fallback=_served_fallback(pipeline, models, latest),
        )
    return entries


def _same_signature(checked: Checked, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> None:
    """`PipelineError` naming the first tensor the steps now take or give otherwise than the version was
    registered with: served as registered, each call would be refused step by step, or answer another shape."""
    for taking, derived, stored in ((True, checked.inputs, inputs), (False, checked.outputs, outputs)):
        now = {name: TensorSpec.from_dict(t.to_dict(name)) for name, t in derived.items()}
        then = {spec.name: spec for spec in stored}
        for name in sorted(set(now) | set(then)):
            if now.get(name) != then.get(name):
                verb = "take" if taking else "give"
                raise PipelineError(
                    f"registered to {verb} {_said(then.get(name))}, its steps' models now {verb}"
                    f" {_said(now.get(name))}: register a new version",
                    tensor=name,
                )


def _said(spec: TensorSpec | None) -> str:
    return f"{spec.datatype} {list(spec.shape)}" if spec is not None else "no such tensor"


def _served_fallback(pipeline: Pipeline, models: dict[str, ModelEntry], latest: PipelineVersionEntry) -> str | None:
    """The pipeline's fallback as registration checked it, as published: visible to the pipeline's tenant
    (public, for a public pipeline), its stable version ready and taking and giving the latest version's
    tensors. None when it no longer is: a fallback that cannot answer the call would only fail it again."""
    if pipeline.fallback is None:
        return None
    model = models.get(pipeline.fallback.name)
    if model is None or not uses(model, pipeline.tenant_id):
        return None
    if pipeline.visibility == Visibility.PUBLIC and not (model.tenant_id is None or model.visibility == "public"):
        return None
    stable: VersionEntry | None = model.versions.get(model.routes.stable) if model.routes.stable is not None else None
    if stable is None or stable.state != "ready":
        return None
    fits = {s.name: s for s in stable.inputs} == {s.name: s for s in latest.inputs} and {
        s.name: s for s in stable.outputs
    } == {s.name: s for s in latest.outputs}
    return model.name if fits else None
