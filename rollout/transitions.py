"""The rollout state machine. Every transition is one transaction that locks the rollout's row first, so two
evaluations (two beat ticks, a tick and a person) are applied one after the other, and the second sees the
state the first left: it finds the step just begun, or the rollout ended, and does nothing. Routing changes go
through `serving.actions` (validated, audited, published at commit); each transition writes its own audit entry.

    shadowing -> canary step 0 -> ... -> canary step n-1 -> awaiting approval -> promoted
    any active state -> rolled back (a gate failed, a person, no evidence in time) | rejected | cancelled
    the last step passes with the approval already given -> promoted

`actor` is the person acting (their role is checked here, for the API and the console alike), or None for
the system: the periodic evaluator and commands.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from rollout import gates
from rollout.evidence import gather
from rollout.models import Approval, Rollout, RolloutState
from serving.actions import RegistrationError, set_routing
from serving.actions import promote as promote_version
from serving.models import Model, ModelVersion, State
from tenants import audit
from tenants.models import Role
from tenants.scoping import can_write

MAX_VERDICTS = 100  # decisive verdicts kept per rollout (a rollout has a handful of steps)


class RolloutError(Exception):
    """A transition refused: 403 (the role), 404, 409 (not from this state), 400 (bad settings)."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def check_steps(steps: object) -> list[int]:
    """Canary shares in percent: integers in 1..100, strictly increasing, at most 20, the last 100."""
    if not isinstance(steps, list) or not steps or len(steps) > 20:
        raise RolloutError("steps must be a list of 1 to 20 percentages", 400)
    if any(type(s) is not int or not 1 <= s <= 100 for s in steps):
        raise RolloutError("steps must be whole percentages from 1 to 100", 400)
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise RolloutError("steps must increase", 400)
    if steps[-1] != 100:
        raise RolloutError("the last step must be 100: promotion hands the candidate all traffic", 400)
    return steps


def _require(actor: Any, role: str, model: Model, doing: str) -> None:
    if actor is not None and not can_write(actor, role, model.tenant_id):
        who = "platform staff" if model.tenant_id is None else f"the {role} role in the tenant that owns the model"
        raise RolloutError(f"{doing} needs {who}", 403)


def _target(rollout: Rollout) -> str:
    return f"rollout #{rollout.pk} of model {rollout.model.name} version {rollout.candidate}"


def _audit(rollout: Rollout, actor: Any, action: str, before: dict, **extra: object) -> None:
    audit.record(
        actor,
        f"rollout.{action}",
        _target(rollout),
        tenant=rollout.model.tenant,
        before=before,
        after={**rollout.summary(), **extra},
    )


def _weights(rollout: Rollout, percent: float) -> dict[int, float]:
    share = percent / 100
    return {rollout.candidate: share, rollout.baseline: 1 - share}


def _route(model: Model, actor: Any, weights: dict[int, float]) -> None:
    try:
        set_routing(model=model, actor=actor, rollout_weights=weights)
    except ValidationError as exc:  # a version the weights name is no longer live
        raise RolloutError(f"cannot route model '{model.name}': {'; '.join(exc.messages)}", 409) from None
    except RegistrationError as exc:  # the policy's check (rollout.approval): the step's share is what it allows
        raise RolloutError(exc.message, exc.status) from None


def _shadow(model: Model, actor: Any, candidate: int | None) -> None:
    """Mirror the model's live requests to the candidate (entering shadowing), or stop (the rollout ends)."""
    from django.conf import settings

    try:
        if candidate is None:
            set_routing(model=model, actor=actor, shadow_version=None)
        else:
            set_routing(
                model=model,
                actor=actor,
                shadow_version=candidate,
                shadow_fraction=settings.FERRY_ROLLOUT_SHADOW_FRACTION,
            )
    except ValidationError as exc:
        raise RolloutError(f"cannot shadow model '{model.name}': {'; '.join(exc.messages)}", 409) from None


def _locked(rollout_id: int) -> Rollout:
    try:
        return (
            Rollout.objects.select_for_update(of=("self",)).select_related("model", "model__tenant").get(pk=rollout_id)
        )
    except Rollout.DoesNotExist:
        raise RolloutError(f"no rollout #{rollout_id}", 404) from None


def start(
    *,
    model: Model,
    candidate: int,
    actor: Any = None,
    steps: list[int] | None = None,
    shadow_seconds: int = 600,
    bake_seconds: int = 600,
    step_timeout_seconds: int = 3600,
    thresholds: gates.Thresholds | None = None,
    now: datetime | None = None,
) -> Rollout:
    """Begin rolling `candidate` out against the model's stable version: shadowing, or the first canary step
    at once when `shadow_seconds` is 0."""
    now = now or timezone.now()
    steps = check_steps(steps if steps is not None else [1, 5, 25, 50, 100])
    thresholds = thresholds or gates.Thresholds()
    _require(actor, Role.ENGINEER, model, "starting a rollout")
    with transaction.atomic():
        model = Model.objects.select_for_update(of=("self",)).select_related("tenant").get(pk=model.pk)
        if model.stable_version is None:
            raise RolloutError(f"model '{model.name}' has no stable version to roll out against: promote one first")
        if candidate == model.stable_version:
            raise RolloutError(f"version {candidate} is already the stable version of '{model.name}'")
        state = ModelVersion.objects.filter(model=model, version=candidate).values_list("state", flat=True).first()
        if state is None:
            raise RolloutError(f"model '{model.name}' has no version {candidate}", 404)
        if state != State.READY:
            raise RolloutError(
                f"version {candidate} of '{model.name}' is {state}: only a ready version can be rolled out"
            )
        active = Rollout.objects.active().filter(model=model).first()
        if active is not None:
            raise RolloutError(f"model '{model.name}' has an active rollout (#{active.pk}, {active.state})")
        rollout = Rollout(
            model=model,
            candidate=candidate,
            baseline=model.stable_version,
            started_by=actor if _person(actor) else None,
            steps=steps,
            shadow_seconds=shadow_seconds,
            bake_seconds=bake_seconds,
            step_timeout_seconds=step_timeout_seconds,
            started_at=now,
            phase_started_at=now,
            max_error_rate_increase=thresholds.max_error_rate_increase,
            max_p99_ratio=thresholds.max_p99_ratio,
            p99_slack_ms=thresholds.p99_slack_ms,
            min_agreement=thresholds.min_agreement,
            min_requests=thresholds.min_requests,
            min_compared=thresholds.min_compared,
        )
        try:
            with transaction.atomic():
                rollout.save()
        except IntegrityError:  # another start won the race past the check above
            raise RolloutError(f"model '{model.name}' has an active rollout") from None
        _audit(
            rollout,
            actor,
            "start",
            {"stable_version": model.stable_version},
            steps=steps,
            baseline=rollout.baseline,
            candidate=candidate,
        )
        if shadow_seconds == 0:
            _enter_step(rollout, 0, actor, now)
        else:
            _shadow(model, actor, candidate)
    return rollout


def _person(actor: Any) -> bool:
    return bool(getattr(actor, "is_authenticated", False))


def _enter_step(rollout: Rollout, index: int, actor: Any, now: datetime) -> None:
    before = rollout.summary()
    rollout.state, rollout.step, rollout.phase_started_at = RolloutState.CANARY, index, now
    rollout.save(update_fields=["state", "step", "phase_started_at", "updated_at"])
    _route(rollout.model, actor, _weights(rollout, rollout.steps[index]))
    _audit(rollout, actor, "step", before)


def _finish(rollout: Rollout, state: str, actor: Any, reason: str, now: datetime) -> None:
    """End the rollout. Every end but promotion hands all unpinned traffic back to the baseline."""
    before = rollout.summary()
    if state == RolloutState.PROMOTED:
        try:
            promote_version(model=rollout.model, version=rollout.candidate, actor=actor, by_rollout=rollout.pk)
        except RegistrationError as exc:
            raise RolloutError(exc.message, 409) from None
    else:
        model = Model.objects.get(pk=rollout.model_id)
        if model.rollout_weights:
            _route(model, actor, {})
    model = Model.objects.get(pk=rollout.model_id)
    if model.shadow_version == rollout.candidate:  # the comparison it started ends with it
        _shadow(model, actor, None)
    rollout.state, rollout.reason, rollout.finished_at = state, reason[:2000], now
    rollout.save(update_fields=["state", "reason", "finished_at", "updated_at"])
    action = {
        RolloutState.PROMOTED: "promote",
        RolloutState.ROLLED_BACK: "roll_back",
        RolloutState.REJECTED: "reject",
        RolloutState.CANCELLED: "cancel",
    }[state]
    _audit(rollout, actor, action, before, reason=rollout.reason)


def _keep(rollout: Rollout, entry: dict) -> None:
    rollout.verdicts = [*rollout.verdicts, entry][-MAX_VERDICTS:]
    rollout.last_verdict = entry
    rollout.save(update_fields=["verdicts", "last_verdict", "updated_at"])


def _after_last_step(rollout: Rollout, actor: Any, now: datetime) -> None:
    if rollout.approved:
        _finish(rollout, RolloutState.PROMOTED, actor, "every step passed; approved beforehand", now)
        return
    before = rollout.summary()
    rollout.state, rollout.phase_started_at = RolloutState.AWAITING_APPROVAL, now
    rollout.save(update_fields=["state", "phase_started_at", "updated_at"])
    _audit(rollout, actor, "await_approval", before)


def _next(rollout: Rollout, actor: Any, now: datetime) -> None:
    if rollout.state == RolloutState.SHADOWING:
        _enter_step(rollout, 0, actor, now)
    elif rollout.step is not None and rollout.step + 1 < len(rollout.steps):
        _enter_step(rollout, rollout.step + 1, actor, now)
    else:
        _after_last_step(rollout, actor, now)


def _drifted(rollout: Rollout) -> str:
    """Why the registry no longer matches the rollout (someone promoted or retired a version outside it)."""
    model = rollout.model
    model.refresh_from_db(fields=["stable_version", "rollout_weights"])
    if model.stable_version != rollout.baseline:
        return f"the stable version changed outside the rollout (to {model.stable_version})"
    state = ModelVersion.objects.filter(model=model, version=rollout.candidate).values_list("state", flat=True).first()
    if state != State.READY:
        return f"version {rollout.candidate} is {state or 'gone'}"
    return ""


def judge(rollout: Rollout, now: datetime) -> tuple[gates.Verdict, dict]:
    """The gates' verdict on the current phase, and the verdict entry a rollout keeps."""
    phase = gates.SHADOW if rollout.state == RolloutState.SHADOWING else gates.CANARY
    evidence, windows = gather(
        model_name=rollout.model.name,
        baseline=rollout.baseline,
        candidate=rollout.candidate,
        since=rollout.phase_started_at,
        fallback_since=rollout.started_at,
        min_requests=rollout.min_requests,
        with_usage=phase == gates.CANARY,
    )
    verdict = gates.judge(phase, evidence, rollout.thresholds())
    entry = {
        "at": now.isoformat(),
        "phase": phase,
        "state": rollout.state,
        "step": rollout.step,
        "percent": rollout.percent,
        **verdict.to_dict(),
        "windows": windows,
    }
    return verdict, entry


def _waiting(verdict: gates.Verdict) -> str:
    return "; ".join(f"{r.gate}: {r.reason}" for r in verdict.results if r.status == gates.NO_DATA)


def _failure_reason(verdict: gates.Verdict) -> str:
    return "; ".join(f"gate {r.gate} failed: {r.reason}" for r in verdict.failed)


def evaluate(rollout_id: int, *, now: datetime | None = None) -> Rollout:
    """One evaluation of an active rollout (what the periodic task runs): a failing gate rolls it back, a
    phase whose gates pass after its bake time moves on, a phase without enough evidence past the step
    timeout rolls back; otherwise only the latest verdict is kept."""
    now = now or timezone.now()
    with transaction.atomic():
        rollout = _locked(rollout_id)
        if not rollout.active:
            return rollout
        drift = _drifted(rollout)
        if drift:
            _finish(rollout, RolloutState.CANCELLED, None, drift, now)
            return rollout
        verdict, entry = judge(rollout, now)
        elapsed = (now - rollout.phase_started_at).total_seconds()
        bake = rollout.shadow_seconds if rollout.state == RolloutState.SHADOWING else rollout.bake_seconds
        if verdict.outcome == gates.FAIL:
            _keep(rollout, {**entry, "action": "roll_back"})
            _finish(rollout, RolloutState.ROLLED_BACK, None, _failure_reason(verdict), now)
        elif rollout.state == RolloutState.AWAITING_APPROVAL:
            rollout.last_verdict = entry
            rollout.save(update_fields=["last_verdict", "updated_at"])
        elif verdict.outcome == gates.PASS and elapsed >= bake:
            _keep(rollout, {**entry, "action": "advance"})
            _next(rollout, None, now)
        elif verdict.outcome == gates.NO_DATA and elapsed >= rollout.step_timeout_seconds:
            _keep(rollout, {**entry, "action": "roll_back"})
            _finish(
                rollout,
                RolloutState.ROLLED_BACK,
                None,
                f"not enough evidence after {rollout.step_timeout_seconds} s ({_waiting(verdict)})",
                now,
            )
        else:
            rollout.last_verdict = entry
            rollout.save(update_fields=["last_verdict", "updated_at"])
    return rollout


def _active(rollout_id: int, doing: str, allowed: tuple[str, ...] = RolloutState.active()) -> Rollout:
    rollout = _locked(rollout_id)
    if rollout.state not in allowed:
        raise RolloutError(f"cannot {doing} rollout #{rollout.pk}: it is {rollout.state}", 409)
    return rollout


def advance(*, rollout: Rollout, actor: Any, now: datetime | None = None) -> Rollout:
    """Move to the next phase now, without waiting out the bake time or for evidence; a gate that fails on
    the evidence there is still rolls the rollout back instead. The one move that needs the gates to pass is
    the promotion itself (the last step of a rollout approved beforehand): a canary that cannot be judged is
    not promoted, so without the evidence it is a 409 (an approver may still `promote`, by their decision)."""
    now = now or timezone.now()
    _require(actor, Role.ENGINEER, rollout.model, "advancing a rollout")
    with transaction.atomic():
        rollout = _active(rollout.pk, "advance", (RolloutState.SHADOWING, RolloutState.CANARY))
        verdict, entry = judge(rollout, now)
        if verdict.outcome == gates.FAIL:
            _keep(rollout, {**entry, "action": "roll_back", "by": _name(actor)})
            _finish(rollout, RolloutState.ROLLED_BACK, actor, _failure_reason(verdict), now)
        elif verdict.outcome == gates.NO_DATA and _promotes_next(rollout):
            raise RolloutError(
                f"rollout #{rollout.pk} is approved, so leaving its last step promotes it, and its gates have not"
                f" judged the step yet ({_waiting(verdict)}): wait for the evidence, or an approver promotes it"
            )
        else:
            _keep(rollout, {**entry, "action": "advance", "by": _name(actor)})
            _next(rollout, actor, now)
    return rollout


def _promotes_next(rollout: Rollout) -> bool:
    """Whether the next phase is the promotion: the last canary step of a rollout approved beforehand."""
    last = rollout.state == RolloutState.CANARY and rollout.step is not None and rollout.step + 1 >= len(rollout.steps)
    return last and rollout.approved


def _name(actor: Any) -> str:
    return actor.get_username() if _person(actor) else "system"


def approval_satisfied(rollout: Rollout) -> bool:
    """Someone other than the starter approved, or the starter did and the tenant allows that."""
    approvers = set(rollout.approvals.values_list("user_id", flat=True))
    if approvers - {rollout.started_by_id}:
        return True
    tenant = rollout.model.tenant
    return bool(approvers) and tenant is not None and tenant.allow_self_approval


def approve(*, rollout: Rollout, actor: Any, note: str = "", now: datetime | None = None) -> Rollout:
    """Record `actor`'s approval. Once the tenant's rule is met the rollout is approved: promoted now if it
    awaits approval, else when its last step passes."""
    now = now or timezone.now()
    _require(actor, Role.APPROVER, rollout.model, "approving a rollout")
    with transaction.atomic():
        rollout = _active(rollout.pk, "approve")
        tenant = rollout.model.tenant
        if (
            _person(actor)
            and actor.pk == rollout.started_by_id
            and not (tenant is not None and tenant.allow_self_approval)
        ):
            raise RolloutError("the person who started a rollout cannot approve it: another approver must", 403)
        if rollout.approvals.filter(user=actor).exists():
            return rollout
        before = rollout.summary()
        Approval.objects.create(
            rollout=rollout, user=actor if _person(actor) else None, username=_name(actor), note=note[:2000]
        )
        rollout.approved = approval_satisfied(rollout)
        rollout.save(update_fields=["approved", "updated_at"])
        _audit(rollout, actor, "approve", before, note=note[:2000])
        if rollout.approved and rollout.state == RolloutState.AWAITING_APPROVAL:
            _finish(rollout, RolloutState.PROMOTED, actor, f"approved by {_name(actor)}", now)
    return rollout


def promote(*, rollout: Rollout, actor: Any, now: datetime | None = None) -> Rollout:
    """Promote the candidate now, skipping the steps left; needs the approval the tenant requires."""
    now = now or timezone.now()
    _require(actor, Role.APPROVER, rollout.model, "promoting a rollout")
    with transaction.atomic():
        rollout = _active(rollout.pk, "promote")
        if not rollout.approved:
            raise RolloutError(f"rollout #{rollout.pk} is not approved yet: an approver must approve it first")
        _finish(rollout, RolloutState.PROMOTED, actor, f"promoted by {_name(actor)}", now)
    return rollout


def reject(*, rollout: Rollout, actor: Any, note: str = "", now: datetime | None = None) -> Rollout:
    now = now or timezone.now()
    _require(actor, Role.APPROVER, rollout.model, "rejecting a rollout")
    with transaction.atomic():
        rollout = _active(rollout.pk, "reject")
        _finish(
            rollout, RolloutState.REJECTED, actor, f"rejected by {_name(actor)}" + (f": {note}" if note else ""), now
        )
    return rollout


def roll_back(*, rollout: Rollout, actor: Any, note: str = "", now: datetime | None = None) -> Rollout:
    now = now or timezone.now()
    _require(actor, Role.ENGINEER, rollout.model, "rolling back a rollout")
    with transaction.atomic():
        rollout = _active(rollout.pk, "roll back")
        _finish(
            rollout,
            RolloutState.ROLLED_BACK,
            actor,
            f"rolled back by {_name(actor)}" + (f": {note}" if note else ""),
            now,
        )
    return rollout


def cancel(*, rollout: Rollout, actor: Any, now: datetime | None = None) -> Rollout:
    now = now or timezone.now()
    _require(actor, Role.ENGINEER, rollout.model, "cancelling a rollout")
    with transaction.atomic():
        rollout = _active(rollout.pk, "cancel")
        _finish(rollout, RolloutState.CANCELLED, actor, f"cancelled by {_name(actor)}", now)
    return rollout


def active_ids() -> list[int]:
    return list(Rollout.objects.active().order_by("pk").values_list("pk", flat=True))
