"""Tenants and the roles their people hold. API keys and quotas build on these."""

from django.conf import settings
from django.db import models


class Role(models.TextChoices):
    VIEWER = "viewer"
    ENGINEER = "engineer"  # registers models, starts rollouts
    OPERATOR = "operator"  # approves promotions, sets quotas


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=50, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.VIEWER)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="unique_membership")]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


ROLE_RANK = {Role.VIEWER: 0, Role.ENGINEER: 1, Role.OPERATOR: 2}


def has_role(user: object, role: str) -> bool:
    """Staff may do anything; others need a membership of at least `role` in some tenant."""
    if not getattr(user, "is_authenticated", False):
        return False
    if getattr(user, "is_staff", False):
        return True
    needed = ROLE_RANK[Role(role)]
    return any(ROLE_RANK[Role(m.role)] >= needed for m in user.memberships.all())  # type: ignore[attr-defined]
