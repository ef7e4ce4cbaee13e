"""A tenant's promotion policy (tenants.models.PromotionPolicy): whether every change of its models' stable
versions needs an approver (rollout.approval, rollout.promotion) or engineers may promote. It is the
platform's rule for the tenant, not the tenant's own: only platform staff change it, audited."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from tenants import audit
from tenants.models import PromotionPolicy, Tenant


class PolicyError(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def set_promotion_policy(*, tenant: Tenant, policy: str, actor: Any) -> Tenant:
    """Set the policy. 403 for anyone but platform staff (an operator's code passes no actor: the system);
    400 for a policy that does not exist. Audited as `tenant.promotion_policy`."""
    if actor is not None and not getattr(actor, "is_staff", False):
        raise PolicyError("changing a tenant's promotion policy needs platform staff", 403)
    if policy not in PromotionPolicy.values:
        raise PolicyError(f"unknown promotion policy {policy!r}; policies are {', '.join(PromotionPolicy.values)}", 400)
    with transaction.atomic():
        tenant = Tenant.objects.select_for_update().get(pk=tenant.pk)
        if tenant.promotion_policy == policy:
            return tenant
        before = {"promotion_policy": tenant.promotion_policy}
        tenant.promotion_policy = policy
        tenant.save(update_fields=["promotion_policy"])
        audit.record(
            actor,
            "tenant.promotion_policy",
            f"tenant {tenant.slug}",
            tenant=tenant,
            before=before,
            after={"promotion_policy": policy},
        )
    return tenant
