"""Tenants, the roles their people hold, and the API keys their applications call /v2 with."""

from django.conf import settings
from django.db import models
from django.db.models.signals import post_save
from django.dispatch import receiver


class Role(models.TextChoices):
    """A person's role in one tenant; each includes the ones before it. Platform staff (is_staff) sit
    above every tenant."""

    VIEWER = "viewer"  # reads the tenant's models, usage and quota
    ENGINEER = "engineer"  # registers models and versions, starts rollouts
    APPROVER = "approver"  # approves promotions
    ADMIN = "admin"  # manages the tenant's people, API keys, visibility; requests quota increases


class PromotionPolicy(models.TextChoices):
    APPROVAL = "approval", "approval required"
    ENGINEERS = "engineers", "engineers may promote"


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    slug = models.SlugField(max_length=50, unique=True)
    allow_self_approval = models.BooleanField(
        default=False,
        help_text="whether the person who started a rollout may approve it alone",
    )
    # Who may change a model's stable version. Under APPROVAL every change goes through an approval (a
    # rollout's, or a promotion request's); only a platform admin changes the policy.
    promotion_policy = models.CharField(
        max_length=20,
        choices=PromotionPolicy.choices,
        default=PromotionPolicy.APPROVAL,
        help_text="approval: every change of a stable version needs an approver; engineers: engineers may promote",
    )
    # Whether this tenant's requests, mirrored to another tenant's shadow, may be stored there as samples
    # (inputs and outputs). Off: they count in that shadow's aggregates only.
    share_shadow_samples = models.BooleanField(
        default=False,
        help_text="whether other tenants' shadow reports may keep samples of this tenant's traffic",
    )
    # Whether this tenant's requests to public models may be answered from, and fill, the response cache's
    # entries shared by the tenants that opted in (serving.dataplane.gateway.cache). Off: its own entries only.
    share_response_cache = models.BooleanField(
        default=False,
        help_text="whether cached answers of public models may be shared with other tenants that opted in",
    )
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


ROLE_RANK = {Role.VIEWER: 0, Role.ENGINEER: 1, Role.APPROVER: 2, Role.ADMIN: 3}


def role_in(user: object, tenant: Tenant | int | None) -> str | None:
    """The user's role in `tenant` (a Tenant or its id), or None when not a member."""
    if tenant is None or not getattr(user, "is_authenticated", False):
        return None
    tenant_id = tenant if isinstance(tenant, int) else tenant.pk
    for m in user.memberships.all():  # type: ignore[attr-defined]
        if m.tenant_id == tenant_id:
            return m.role
    return None


def has_role(user: object, role: str, tenant: Tenant | int | None = None) -> bool:
    """Whether `user` holds at least `role` in `tenant`. Platform staff hold every role everywhere.
    Without a tenant: in some tenant (for pages that list only what the user's tenants own)."""
    if not getattr(user, "is_authenticated", False):
        return False
    if getattr(user, "is_staff", False):
        return True
    needed = ROLE_RANK[Role(role)]
    if tenant is not None:
        held = role_in(user, tenant)
        return held is not None and ROLE_RANK[Role(held)] >= needed
    return any(ROLE_RANK[Role(m.role)] >= needed for m in user.memberships.all())  # type: ignore[attr-defined]


class Tier(models.IntegerChoices):
    """Admission's priority tier for a tenant's requests (1 runs first; see serving.policies.batching.tier_share)."""

    HIGH = 1
    STANDARD = 2
    LOW = 3


class Quota(models.Model):
    """A tenant's limits. Rates and in-flight are enforced per request on the data plane (from the routing
    snapshot, so a change is in force within seconds); counts and memory at registration."""

    tenant = models.OneToOneField(Tenant, on_delete=models.CASCADE, related_name="quota")
    requests_per_second = models.PositiveIntegerField(default=1000)
    burst = models.PositiveIntegerField(default=2000, help_text="token bucket depth, in requests")
    max_in_flight = models.PositiveIntegerField(default=512)
    monthly_requests = models.PositiveBigIntegerField(default=100_000_000)
    max_models = models.PositiveIntegerField(default=50)
    max_versions = models.PositiveIntegerField(default=200)
    max_accelerator_bytes = models.PositiveBigIntegerField(
        default=16 * 1024**3, help_text="accelerator memory its private models may take, in bytes"
    )
    priority = models.PositiveSmallIntegerField(choices=Tier.choices, default=Tier.HIGH)
    # The plan's own latency budget: it may only lower the platform's (FERRY_LATENCY_BUDGET_MS); the gateway
    # takes the least of the platform's, the version's and this one (RoutingSnapshot.budget_ms).
    latency_budget_ms = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="its requests' latency budget in ms, where lower than the platform's; empty: the platform's",
    )
    updated_at = models.DateTimeField(auto_now=True)

    LIMITS = (
        "requests_per_second",
        "burst",
        "max_in_flight",
        "monthly_requests",
        "max_models",
        "max_versions",
        "max_accelerator_bytes",
        "priority",
        "latency_budget_ms",
    )
    NULLABLE = frozenset({"latency_budget_ms"})  # limits that may be cleared (None: the platform's default)

    def __str__(self) -> str:
        return f"quota of {self.tenant}"

    def limits(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in self.LIMITS}


class QuotaRequest(models.Model):
    """A tenant admin's request to change its quota, decided by platform staff."""

    class State(models.TextChoices):
        PENDING = "pending"
        APPROVED = "approved"
        REJECTED = "rejected"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quota_requests")
    changes = models.JSONField(help_text="the requested limits, by Quota field name")
    justification = models.TextField(max_length=2000)
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    requested_at = models.DateTimeField(auto_now_add=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_note = models.TextField(max_length=2000, blank=True)

    class Meta:
        ordering = ["-requested_at"]

    def __str__(self) -> str:
        return f"quota request #{self.pk} of {self.tenant} ({self.state})"


class AuditEntry(models.Model):
    """Who changed what, when, with the state before and after. Written by `tenants.audit.record`."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    actor_name = models.CharField(max_length=150, help_text="kept if the user is deleted")
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit")
    action = models.CharField(max_length=50, help_text="e.g. key.create, quota.approve, role.change")
    target = models.CharField(max_length=200, help_text="what was changed, e.g. 'key fy_ab12cd34'")
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-at", "-pk"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor_name} {self.action} {self.target}"


@receiver(post_save, sender=Tenant)
def _every_tenant_has_a_quota(sender: type, instance: Tenant, created: bool, **kwargs: object) -> None:
    if created and not kwargs.get("raw"):
        Quota.objects.get_or_create(tenant=instance)
