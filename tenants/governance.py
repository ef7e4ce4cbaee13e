"""Who is in a tenant with which role, and changes to its quota: requested by a tenant admin, decided by
platform staff. Each workflow runs in one transaction with its audit entry (`tenants.audit.record`).
"""

from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from tenants import audit
from tenants.models import Membership, Quota, QuotaRequest, Role, Tenant, Tier

# The largest value each limit's column holds (PositiveIntegerField / PositiveBigIntegerField).
_INT_MAX = 2**31 - 1
_BIG_MAX = 2**63 - 1
LIMIT_BOUNDS = {
    "requests_per_second": (1, _INT_MAX),
    "burst": (1, _INT_MAX),
    "max_in_flight": (1, _INT_MAX),
    "monthly_requests": (1, _BIG_MAX),
    "max_models": (1, _INT_MAX),
    "max_versions": (1, _INT_MAX),
    "max_accelerator_bytes": (1, _BIG_MAX),
    "priority": (min(Tier.values), max(Tier.values)),
    # ms; above the platform's budget it changes nothing (a plan may only lower it), and ten minutes is
    # already far past any budget the platform would run with.
    "latency_budget_ms": (1, 600_000),
}
assert set(LIMIT_BOUNDS) == set(Quota.LIMITS)


class GovernanceError(Exception):
    """A request that cannot be met, with the status to answer (400 bad input, 409 conflicts with state)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


# --- members --------------------------------------------------------------------------------------------


def set_role(*, tenant: Tenant, user: object, role: str, actor: object) -> Membership:
    """Add `user` to `tenant` with `role`, or change the role they hold."""
    if role not in Role.values:
        raise GovernanceError(f"unknown role {role!r}; roles are {', '.join(Role.values)}")
    with transaction.atomic():
        membership = Membership.objects.select_for_update().filter(tenant=tenant, user=user).first()
        before = {"role": membership.role} if membership else None
        if membership is None:
            membership = Membership.objects.create(tenant=tenant, user=user, role=role)
        elif membership.role != role:
            _keep_an_admin(membership, losing=role != Role.ADMIN)
            membership.role = role
            membership.save(update_fields=["role"])
        else:
            return membership
        audit.record(
            actor,
            "role.add" if before is None else "role.change",
            f"member {_name(user)}",
            tenant=tenant,
            before=before,
            after={"role": role},
        )
    return membership


def remove_member(*, membership: Membership, actor: object) -> None:
    with transaction.atomic():
        membership = Membership.objects.select_for_update().select_related("user", "tenant").get(pk=membership.pk)
        _keep_an_admin(membership, losing=True)
        before = {"role": membership.role}
        membership.delete()
        audit.record(
            actor,
            "role.remove",
            f"member {_name(membership.user)}",
            tenant=membership.tenant,
            before=before,
            after=None,
        )


def _keep_an_admin(membership: Membership, *, losing: bool) -> None:
    """A tenant keeps at least one admin: otherwise nobody but staff could manage its keys and people."""
    if not losing or membership.role != Role.ADMIN:
        return
    admins = Membership.objects.select_for_update().filter(tenant_id=membership.tenant_id, role=Role.ADMIN)
    if not admins.exclude(pk=membership.pk).exists():
        raise GovernanceError("a tenant keeps at least one admin: make another member admin first", 409)


def _name(user: object) -> str:
    return user.get_username()  # type: ignore[attr-defined]


# --- quotas ---------------------------------------------------------------------------------------------


def clean_changes(changes: object) -> dict[str, int | None]:
    """Requested limits: Quota field names to integers within each limit's bounds (priority tier 1..3);
    None for a limit that may be cleared (`Quota.NULLABLE`: the plan's latency budget, back to the platform's)."""
    if not isinstance(changes, dict) or not changes:
        raise GovernanceError(f"changes must name at least one limit of {', '.join(Quota.LIMITS)}")
    cleaned = {}
    for name, value in changes.items():
        if name not in LIMIT_BOUNDS:
            raise GovernanceError(f"unknown limit {name!r}; limits are {', '.join(Quota.LIMITS)}")
        low, high = LIMIT_BOUNDS[name]
        if value is None and name in Quota.NULLABLE:
            cleaned[name] = None
            continue
        if type(value) is not int or not low <= value <= high:
            raise GovernanceError(f"{name} must be an integer from {low} to {high}")
        cleaned[name] = value
    return {name: cleaned[name] for name in Quota.LIMITS if name in cleaned}


def request_quota(*, tenant: Tenant, changes: object, justification: str, actor: object) -> QuotaRequest:
    cleaned = clean_changes(changes)
    justification = (justification or "").strip()
    if not justification:
        raise GovernanceError("a quota request needs a justification")
    if len(justification) > 2000:
        raise GovernanceError("the justification is limited to 2000 characters")
    with transaction.atomic():
        request = QuotaRequest.objects.create(
            tenant=tenant, changes=cleaned, justification=justification, requested_by=actor
        )
        audit.record(
            actor,
            "quota.request",
            f"quota request #{request.pk}",
            tenant=tenant,
            before=Quota.objects.get_or_create(tenant=tenant)[0].limits(),
            after=cleaned,
        )
    return request


def decide(*, request: QuotaRequest, approve: bool, note: str, actor: object) -> QuotaRequest:
    """Approve (the changes become the tenant's quota) or reject a pending request. The data plane reads
    quotas from the routing snapshot, republished when this commits."""
    if len(note or "") > 2000:
        raise GovernanceError("the note is limited to 2000 characters")
    with transaction.atomic():
        request = QuotaRequest.objects.select_for_update().select_related("tenant").get(pk=request.pk)
        if request.state != QuotaRequest.State.PENDING:
            raise GovernanceError(f"quota request #{request.pk} is already {request.state}", 409)
        request.state = QuotaRequest.State.APPROVED if approve else QuotaRequest.State.REJECTED
        request.decided_by, request.decided_at, request.decision_note = actor, timezone.now(), note or ""
        request.save()
        target = f"quota request #{request.pk}"
        if not approve:
            audit.record(
                actor,
                "quota.reject",
                target,
                tenant=request.tenant,
                before={"state": "pending"},
                after={"state": request.state, "note": request.decision_note},
            )
            return request
        # Validated again: the limits' bounds may have changed since it was filed.
        quota, before = _apply_limits(request.tenant, clean_changes(request.changes))
        audit.record(
            actor,
            "quota.approve",
            target,
            tenant=request.tenant,
            before=before,
            after={**quota.limits(), "note": request.decision_note},
        )
    return request


def _apply_limits(tenant: Tenant, cleaned: dict[str, int | None]) -> tuple[Quota, dict[str, int | None]]:
    """Lock the tenant's quota, set `cleaned` on it and save; returns it with its limits before. The save
    republishes the routing snapshot on commit (serving.signals), so the data plane holds the new limits."""
    quota, _ = Quota.objects.select_for_update().get_or_create(tenant=tenant)
    before = quota.limits()
    for name, value in cleaned.items():
        setattr(quota, name, value)
    quota.save()
    return quota, before


def set_quota(*, tenant: Tenant, changes: object, actor: object) -> Quota:
    """Set limits directly (platform staff, or an operator's command): validated like a request, audited,
    and in force once the routing snapshot republishes on commit."""
    cleaned = clean_changes(changes)
    with transaction.atomic():
        quota, before = _apply_limits(tenant, cleaned)
        audit.record(actor, "quota.set", f"quota of {tenant.slug}", tenant=tenant, before=before, after=quota.limits())
    return quota


# --- tenant settings ------------------------------------------------------------------------------------


def set_shadow_sharing(*, tenant: Tenant, share: bool, actor: object) -> Tenant:
    """Let other tenants' shadow reports keep samples (inputs and outputs) of this tenant's requests, or stop
    it; its admin decides. In force once the routing snapshot republishes on commit (serving.signals): the
    gateway decides per mirrored request (serving.dataplane.gateway.shadow.may_keep_sample). Samples kept before
    stay until pruned."""
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
        if tenant.share_shadow_samples == share:
            return tenant
        tenant.share_shadow_samples = share
        tenant.save(update_fields=["share_shadow_samples"])
        audit.record(
            actor,
            "tenant.shadow_samples",
            f"tenant {tenant.slug}",
            tenant=tenant,
            before={"share_shadow_samples": not share},
            after={"share_shadow_samples": share},
        )
    return tenant
