"""What a person may see and change, per tenant: the one place the registry API, the tenant API and the
console scope their queries and check roles.

Anything the caller may not see is answered as if it did not exist (404); something it sees but may not
change is a 403 naming the role it lacks, in the tenant that owns the object.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet
from django.http import Http404
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.viewsets import GenericViewSet

from serving.api.pagination import BoundedLimitOffsetPagination
from tenants.models import Role, Tenant, has_role


def member_tenant_ids(user: Any) -> list[int]:
    if not getattr(user, "is_authenticated", False):
        return []
    return [m.tenant_id for m in user.memberships.all()]


def visible_models(user: Any, queryset: QuerySet | None = None) -> QuerySet:
    """The models `user` may see: platform models, public ones, its tenants' own and those shared with
    them. Platform staff see every model."""
    from serving.models import Model, Visibility

    queryset = Model.objects.all() if queryset is None else queryset
    if not getattr(user, "is_authenticated", False):
        return queryset.none()
    if user.is_staff:
        return queryset
    mine = member_tenant_ids(user)
    shared = Model.shared_with.through.objects.filter(tenant_id__in=mine).values("model_id")
    return queryset.filter(
        Q(tenant__isnull=True)
        | Q(visibility=Visibility.PUBLIC)
        | Q(tenant_id__in=mine)
        | Q(visibility=Visibility.SHARED, pk__in=shared)
    )


def visible_tenants(user: Any) -> QuerySet:
    """The tenants `user` belongs to (every tenant for platform staff)."""
    if not getattr(user, "is_authenticated", False):
        return Tenant.objects.none()
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(memberships__user=user)


def tenant_or_404(user: Any, slug: str) -> Tenant:
    """The tenant `slug` if `user` belongs to it (or is staff); otherwise the same 404 as no such tenant."""
    tenant = visible_tenants(user).filter(slug=slug).first()
    if tenant is None:
        raise Http404(f"no tenant '{slug}'")
    return tenant


def can_write(user: Any, role: str, tenant: Tenant | int | None) -> bool:
    """Whether `user` may make a change that needs `role` on something `tenant` owns; a platform object
    (no tenant) is changed by platform staff only."""
    if tenant is None:
        return bool(getattr(user, "is_staff", False))
    return has_role(user, role, tenant)


# A shadow report shows the inputs and outputs of live requests (rollout.shadow_report): its owner's
# engineers read it (and approvers, admins, platform staff above them), not everyone who sees the model.
SHADOW_REPORT_ROLE = Role.ENGINEER


def shadow_report_refusal(user: Any, model: Any) -> str | None:
    """Why `user` may not read the shadow report of `model` (a model it sees), or None when it may. The API
    and the console answer it as a 403: the model is visible, so naming the missing role tells nothing new."""
    if can_write(user, SHADOW_REPORT_ROLE, model.tenant_id):
        return None
    if model.tenant_id is None:
        return "reading a platform model's shadow report needs platform staff"
    return f"reading a shadow report needs the {SHADOW_REPORT_ROLE} role in the tenant that owns the model"


def require(user: Any, role: str, tenant: Tenant | int | None, doing: str) -> None:
    """403 unless `can_write`; the message names what is missing."""
    if can_write(user, role, tenant):
        return
    if tenant is None:
        raise PermissionDenied(f"{doing} of a platform object needs platform staff")
    raise PermissionDenied(f"{doing} needs the {role} role in the tenant that owns it")


class TenantScopedViewSet(GenericViewSet):
    """The base of every /api/ viewset: `scope(queryset)` narrows each query to what the caller may see, so
    no endpoint can forget to; `require(role, tenant)` checks a role in the tenant that owns an object."""

    pagination_class = BoundedLimitOffsetPagination
    parser_classes = [JSONParser]

    def scope(self, queryset: QuerySet) -> QuerySet:
        raise NotImplementedError

    def get_queryset(self) -> QuerySet:
        if getattr(self, "swagger_fake_view", False):  # schema generation: no caller, no URL kwargs
            return super().get_queryset().none()
        return self.scope(super().get_queryset())

    def require(self, role: str, tenant: Tenant | int | None, doing: str = "this change") -> None:
        require(self.request.user, role, tenant, doing)


class TenantNestedViewSet(TenantScopedViewSet):
    """A viewset under /api/tenants/{slug}/: the tenant must be one the caller belongs to (404 otherwise),
    and each action needs the role `roles` names for it in that tenant, checked before the body is read
    (403), so a caller without it learns nothing from validation errors."""

    roles: dict[str, str] = {}
    default_role: str = Role.ADMIN

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        try:
            self.tenant = tenant_or_404(request.user, self.kwargs["slug"])
        except Http404 as exc:
            raise NotFound(str(exc)) from None
        role = self.roles.get(self.action or "", self.default_role)
        if role == "staff":
            if not request.user.is_staff:
                raise PermissionDenied("deciding needs platform staff")
        elif not has_role(request.user, role, self.tenant):
            raise PermissionDenied(f"this needs the {role} role in tenant '{self.tenant.slug}'")

    def scope(self, queryset: QuerySet) -> QuerySet:
        return queryset.filter(tenant=self.tenant)
