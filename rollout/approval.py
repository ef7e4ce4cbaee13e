"""What a tenant's promotion policy lets through without an approver (tenants.models.PromotionPolicy).

Under "approval required" every change of a model's stable version goes through an approval: a rollout's
(rollout.transitions, gated and approved) or an accepted promotion request's (rollout.promotion). Traffic
set by hand is held to the same rule: a version no approval has put in front of callers gets no more of
the traffic than a running rollout of it gives it now. `serving.actions.promote` and `set_routing` call
these checks, so every path that changes routing (API, console, commands, code) meets them.

Platform models (no tenant) are changed by platform staff only and have no policy; under "engineers may
promote" engineers promote and route directly.
"""

from __future__ import annotations

from collections.abc import Mapping

from rollout.models import PromotionRequest, PromotionState, Rollout, RolloutState
from tenants.models import PromotionPolicy, Tenant

TOLERANCE = 1e-6  # weights are floats that do not add up exactly (rollout.routing.WEIGHT_TOLERANCE)


def needs_approval(model: object) -> bool:
    """Whether changing `model`'s stable version, or sending traffic to an unapproved version, needs an
    approval. Reads the tenant from the database: a policy changed a moment ago is the one in force."""
    tenant_id = getattr(model, "tenant_id", None)
    if tenant_id is None:
        return False
    policy = Tenant.objects.filter(pk=tenant_id).values_list("promotion_policy", flat=True).first()
    return policy != PromotionPolicy.ENGINEERS


def rollout_approves(model: object, version: int, rollout_id: int | None) -> bool:
    """Whether rollout `rollout_id` of `model` is approved for promoting `version` (defence in depth: only
    rollout.transitions passes one, and only for an approved rollout)."""
    return (
        rollout_id is not None
        and Rollout.objects.filter(pk=rollout_id, model=model, candidate=version, approved=True).exists()
    )


def request_approves(model: object, version: int, request_id: int | None) -> bool:
    """Whether promotion request `request_id` is the accepted one for `version` of `model`."""
    return (
        request_id is not None
        and PromotionRequest.objects.filter(
            pk=request_id, model=model, version=version, state=PromotionState.ACCEPTED
        ).exists()
    )


def approved_versions(model: object) -> set[int]:
    """Versions an approval has put in front of callers: the stable version, those a rollout promoted and
    those an accepted promotion request made stable. A rollout cancelled, rolled back or rejected after its
    approval approves nothing: the approval was for promotion at the end of its gated steps."""
    stable = getattr(model, "stable_version", None)
    promoted = Rollout.objects.filter(model=model, state=RolloutState.PROMOTED).values_list("candidate", flat=True)
    accepted = PromotionRequest.objects.filter(model=model, state=PromotionState.ACCEPTED).values_list(
        "version", flat=True
    )
    return {*promoted, *accepted, *([stable] if stable is not None else [])}


def allowed_share(model: object, version: int, approved: set[int]) -> float:
    """The share of traffic `version` may be given by hand: all of it once approved, else what the model's
    running rollout of it gives it now (its canary step), else none."""
    if version in approved:
        return 1.0
    rollout = Rollout.objects.active().filter(model=model, candidate=version).first()
    return rollout.percent / 100 if rollout is not None else 0.0


def unapproved_traffic(model: object, before: Mapping[str, object], after: Mapping[str, object]) -> str:
    """Why the routing change from `before` to `after` (Model.routing_state dicts) sends a version more
    traffic than the policy allows without an approval; "" when it does not. Only increases count, so a
    change that leaves (or lowers) what an earlier policy allowed is not refused for it.

    A version's share is bounded by its experiment arm plus its rollout weight (the arms are chosen first,
    the weights only when the arm's version cannot serve); a tenant pin gives it all of that tenant's
    traffic, so it needs the version approved (or rolled out to 100%)."""
    approved = approved_versions(model)
    old, new = _shares(before), _shares(after)
    for version in sorted(new):
        if new[version] > old.get(version, 0.0) + TOLERANCE:
            allowed = allowed_share(model, version, approved)
            if new[version] > allowed + TOLERANCE:
                return (
                    f"version {version} is not approved: by hand it may take {allowed:.0%} of the traffic,"
                    f" not {new[version]:.0%}"
                )
    old_pins = {str(k): v for k, v in (before.get("tenant_versions") or {}).items()}  # type: ignore[union-attr]
    for tenant, version in sorted((after.get("tenant_versions") or {}).items()):  # type: ignore[union-attr]
        if old_pins.get(str(tenant)) != version and allowed_share(model, int(version), approved) < 1 - TOLERANCE:
            return f"version {version} is not approved: a tenant pin would send it all of tenant {tenant}'s traffic"
    return ""


def _shares(state: Mapping[str, object]) -> dict[int, float]:
    shares: dict[int, float] = {}
    for rule in ("rollout_weights", "experiment_arms"):
        for version, share in (state.get(rule) or {}).items():  # type: ignore[union-attr]
            shares[int(version)] = shares.get(int(version), 0.0) + float(share)
    return shares
