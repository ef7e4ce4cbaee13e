"""Tenants, the roles their people hold, and the API keys their applications call /v2 with."""

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


class ApiKey(models.Model):
    """An application's credential for /v2. The token (`fy_<prefix>_<secret>`, see `tenants.keys`) is
    shown once at creation and never stored: only its prefix, in the clear, and the HMAC of its secret."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=10, unique=True)  # unique: indexed
    digest = models.CharField(max_length=64, help_text="HMAC-SHA256 of the secret under the pepper, hex")
    scopes = models.JSONField(default=list, help_text='subset of ["infer", "manage"]')
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    # Bumped by every save (revocation included): the embedded refresh watches it. last_used_at is
    # written with QuerySet.update, which leaves it alone, so use alone does not rebuild the snapshot.
    updated_at = models.DateTimeField(auto_now=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="empty: never")
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["tenant__name", "name"]

    def __str__(self) -> str:
        return f"{self.name} (fy_{self.prefix}_…) @ {self.tenant}"

    @property
    def active(self) -> bool:
        from django.utils import timezone

        return self.revoked_at is None and (self.expires_at is None or self.expires_at > timezone.now())


ROLE_RANK = {Role.VIEWER: 0, Role.ENGINEER: 1, Role.OPERATOR: 2}


def has_role(user: object, role: str) -> bool:
    """Staff may do anything; others need a membership of at least `role` in some tenant."""
    if not getattr(user, "is_authenticated", False):
        return False
    if getattr(user, "is_staff", False):
        return True
    needed = ROLE_RANK[Role(role)]
    return any(ROLE_RANK[Role(m.role)] >= needed for m in user.memberships.all())  # type: ignore[attr-defined]
