"""Direct promotions under the tenant's promotion policy (tenants.models.PromotionPolicy).

"Engineers may promote": an engineer's promotion changes the stable version at once, as it always did.
"Approval required": it files a promotion request instead, and the stable version changes only when an
approver of the tenant accepts it. The person who filed it cannot accept it unless the tenant allows
self-approval (as with rollouts, rollout.transitions.approve). A request is for one change, from the stable
version it was filed against: if the stable version has changed since, accepting it is refused (409) and it
is rejected and filed again, so nobody approves a change they were not shown.

Each step is one transaction with its audit entry; the promotion itself goes through
`serving.actions.promote(by_request=...)`, which checks the request is the accepted one.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.utils import timezone

from rollout import approval
from rollout.models import PromotionRequest, PromotionState, Rollout
from serving.actions import RegistrationError
from serving.actions import promote as promote_version
from serving.models import Model, ModelVersion, State
from tenants import audit
from tenants.models import Role
from tenants.scoping import can_write


class PromotionError(Exception):
    """A promotion or a decision refused: 403 (the role, self-approval), 404, 409 (the state)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _require(actor: Any, role: str, model: Model, doing: str) -> None:
    if actor is not None and not can_write(actor, role, model.tenant_id):
        who = "platform staff" if model.tenant_id is None else f"the {role} role in the tenant that owns the model"
        raise PromotionError(f"{doing} needs {who}", 403)


def _person(actor: Any) -> bool:
    return bool(getattr(actor, "is_authenticated", False))


def _name(actor: Any) -> str:
    return actor.get_username() if _person(actor) else "system"


def _target(request: PromotionRequest) -> str:
    return f"promotion request #{request.pk} of model {request.model.name} version {request.version}"


def promote_or_request(*, model: Model, version: int, actor: Any, note: str = "") -> Model | PromotionRequest:
    """An engineer's direct promotion: the model, promoted, where the tenant lets engineers promote; else
    the promotion request filed for an approver."""
    _require(actor, Role.ENGINEER, model, "promoting a version")
    if approval.needs_approval(model):
        return request(model=model, version=version, actor=actor, note=note)
    try:
        return promote_version(model=model, version=version, actor=actor)
    except RegistrationError as exc:
        raise PromotionError(exc.message, exc.status) from None


def request(*, model: Model, version: int, actor: Any, note: str = "", now: datetime | None = None) -> PromotionRequest:
    """File a request to make `version` stable. Refused (409) for a version that is not ready or is stable
    already, while a rollout of the model is active (it promotes through its own approval), and while
    another request of the model is pending (one decision at a time)."""
    _require(actor, Role.ENGINEER, model, "requesting a promotion")
    with transaction.atomic():
        model = Model.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=model.pk)
        state = ModelVersion.objects.filter(model=model, version=version).values_list("state", flat=True).first()
        if state is None:
            raise PromotionError(f"model '{model.name}' has no version {version}", 404)
        if state != State.READY:
            raise PromotionError(
                f"version {version} of '{model.name}' is {state}: only a ready version can be promoted"
            )
        if version == model.stable_version:
            raise PromotionError(f"version {version} is already the stable version of '{model.name}'")
        active = Rollout.objects.active().filter(model=model).first()
        if active is not None:
            raise PromotionError(
                f"model '{model.name}' has an active rollout (#{active.pk}, {active.state}, version"
                f" {active.candidate}): promote through it (its gates and approval) or end it first"
            )
        pending = PromotionRequest.objects.filter(model=model, state=PromotionState.PENDING).first()
        if pending is not None:
            raise PromotionError(
                f"model '{model.name}' has a pending promotion request (#{pending.pk}, version"
                f" {pending.version}): an approver decides it first"
            )
        promotion = PromotionRequest(
            model=model,
            version=version,
            baseline=model.stable_version,
            requested_by=actor if _person(actor) else None,
            requester_name=_name(actor),
            note=note[:2000],
            requested_at=now or timezone.now(),
        )
        try:
            with transaction.atomic():
                promotion.save()
        except IntegrityError:  # another request won the race past the check above
            raise PromotionError(f"model '{model.name}' has a pending promotion request") from None
        audit.record(
            actor,
            "promotion.request",
            _target(promotion),
            tenant=model.tenant,
            before={"stable_version": model.stable_version},
            after={**promotion.summary(), "note": note},
        )
    return promotion


def may_accept(request: PromotionRequest, actor: Any) -> bool:
    """Whether `actor` may accept `request` on the self-approval rule (the role is checked apart)."""
    if not (_person(actor) and actor.pk == request.requested_by_id):
        return True
    tenant = request.model.tenant
    return tenant is not None and tenant.allow_self_approval


def _locked(request_id: int, doing: str) -> PromotionRequest:
    try:
        request = (
            PromotionRequest.objects.select_for_update(of=("self",))
            .select_related("model", "model__tenant")
            .get(pk=request_id)
        )
    except PromotionRequest.DoesNotExist:
        raise PromotionError(f"no promotion request #{request_id}", 404) from None
    if request.state != PromotionState.PENDING:
        raise PromotionError(f"cannot {doing} promotion request #{request.pk}: it is {request.state}")
    return request


def _decide(request: PromotionRequest, actor: Any, state: str, note: str, now: datetime | None) -> None:
    request.state, request.decision_note = state, note[:2000]
    request.decided_by = actor if _person(actor) else None
    request.decider_name, request.decided_at = _name(actor), now or timezone.now()
    request.save(update_fields=["state", "decision_note", "decided_by", "decider_name", "decided_at"])


def accept(*, request: PromotionRequest, actor: Any, note: str = "", now: datetime | None = None) -> PromotionRequest:
    """Accept: the version becomes stable now. 403 for the requester (unless the tenant allows
    self-approval); 409 when the request was decided already, the stable version has changed since it was
    filed, or the promotion itself is refused (a rollout started since, the version no longer ready)."""
    _require(actor, Role.APPROVER, request.model, "accepting a promotion request")
    with transaction.atomic():
        request = _locked(request.pk, "accept")
        if not may_accept(request, actor):
            raise PromotionError("the person who requested a promotion cannot accept it: another approver must", 403)
        model = Model.objects.select_for_update(of=("self",)).get(pk=request.model_id)
        if model.stable_version != request.baseline:
            raise PromotionError(
                f"the stable version of '{model.name}' is {model.stable_version} now, not"
                f" {request.baseline} as when the request was filed: reject it and file it again"
            )
        before = request.summary()
        _decide(request, actor, PromotionState.ACCEPTED, note, now)
        try:
            promote_version(model=model, version=request.version, actor=actor, by_request=request.pk)
        except RegistrationError as exc:
            raise PromotionError(exc.message, 409) from None
        audit.record(
            actor,
            "promotion.accept",
            _target(request),
            tenant=model.tenant,
            before=before,
            after={**request.summary(), "note": request.decision_note},
        )
    return request


def reject(*, request: PromotionRequest, actor: Any, note: str = "", now: datetime | None = None) -> PromotionRequest:
    """Reject: nothing changes. The requester may reject (withdraw) their own request if they are an
    approver; accepting it is what the self-approval rule guards."""
    _require(actor, Role.APPROVER, request.model, "rejecting a promotion request")
    with transaction.atomic():
        request = _locked(request.pk, "reject")
        before = request.summary()
        _decide(request, actor, PromotionState.REJECTED, note, now)
        audit.record(
            actor,
            "promotion.reject",
            _target(request),
            tenant=request.model.tenant,
            before=before,
            after={**request.summary(), "note": request.decision_note},
        )
    return request
