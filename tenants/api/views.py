"""The tenant API: a caller's tenants, their members, API keys, quota and quota requests, and the audit log.

Everything under /api/tenants/{slug}/ is a `TenantNestedViewSet`: another tenant's slug is a 404, a role
too low in this one a 403, checked before the body is read.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from serving.api.serializers import TENANT_SLUG_PATTERN
from serving.api.views import errors
from tenants.actions import KeyRequestError, create_key, revoke_key
from tenants.api.promotion_policy import PromotionPolicyMixin
from tenants.api.serializers import (
    USERNAME_PATTERN,
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeySerializer,
    AuditEntrySerializer,
    DecisionSerializer,
    MemberCreateSerializer,
    MemberSerializer,
    QuotaRequestCreateSerializer,
    QuotaRequestSerializer,
    QuotaSerializer,
    RoleSerializer,
    TenantSerializer,
    TenantUpdateSerializer,
)
from tenants.governance import GovernanceError, decide, remove_member, request_quota, set_role, set_shadow_sharing
from tenants.models import ApiKey, AuditEntry, Membership, Quota, QuotaRequest, Role, Tenant, has_role
from tenants.scoping import TenantNestedViewSet, TenantScopedViewSet, visible_tenants

SLUG = OpenApiParameter(
    "slug",
    {"type": "string", "pattern": f"^{TENANT_SLUG_PATTERN}$", "maxLength": 50},
    OpenApiParameter.PATH,
    description="the tenant's slug",
    examples=[OpenApiExample("the demo tenant", value="demo")],
)
PREFIX = OpenApiParameter(
    "prefix",
    {"type": "string", "pattern": "^[A-Za-z0-9]{10}$"},
    OpenApiParameter.PATH,
    description="the key's prefix: the 10 characters after fy_",
)
USERNAME = OpenApiParameter(
    "username",
    {"type": "string", "pattern": f"^{USERNAME_PATTERN}$", "maxLength": 150},
    OpenApiParameter.PATH,
    description="the member's username",
    examples=[OpenApiExample("the demo admin", value="admin")],
)
REQUEST_ID = OpenApiParameter(
    "id",
    {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
    OpenApiParameter.PATH,
    description="the quota request's id",
)
E404 = "No such tenant (or one the caller is not in), or no such object in it."


class Refused(APIException):
    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def refused(error: GovernanceError | KeyRequestError) -> APIException:
    if isinstance(error, GovernanceError):
        return Refused(error.message, error.status)
    return ValidationError(str(error))


@extend_schema_view(
    list=extend_schema(responses={200: TenantSerializer(many=True), **errors(400, 403)}),
    retrieve=extend_schema(parameters=[SLUG], responses={200: TenantSerializer, **errors(403, 404, e404=E404)}),
)
class TenantViewSet(PromotionPolicyMixin, TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The caller's tenants, with the role it holds in each (platform staff see every tenant)."""

    queryset = Tenant.objects.order_by("name")
    serializer_class = TenantSerializer
    lookup_field = "slug"
    lookup_value_regex = TENANT_SLUG_PATTERN

    def scope(self, queryset: QuerySet) -> QuerySet:
        return queryset & visible_tenants(self.request.user)

    @extend_schema(
        parameters=[SLUG],
        request=TenantUpdateSerializer,
        responses={200: TenantSerializer, **errors(400, 403, 404, 413, 415, e404=E404)},
    )
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Change the tenant's settings (admin): whether other tenants' shadow reports may keep samples of its
        requests. Audited."""
        tenant = self.get_object()
        if not has_role(request.user, Role.ADMIN, tenant):  # before the body is read
            raise PermissionDenied(f"this needs the {Role.ADMIN} role in tenant '{tenant.slug}'")
        form = TenantUpdateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        if "share_shadow_samples" in form.validated_data:
            tenant = set_shadow_sharing(
                tenant=tenant, share=form.validated_data["share_shadow_samples"], actor=request.user
            )
        return Response(TenantSerializer(tenant, context=self.get_serializer_context()).data)


@extend_schema(parameters=[SLUG])
@extend_schema_view(
    list=extend_schema(responses={200: MemberSerializer(many=True), **errors(400, 403, 404, e404=E404)}),
    retrieve=extend_schema(parameters=[USERNAME], responses={200: MemberSerializer, **errors(403, 404, e404=E404)}),
)
class MemberViewSet(TenantNestedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The tenant's people and their roles: every member reads them; admins change them."""

    queryset = Membership.objects.select_related("user").order_by("user__username")
    serializer_class = MemberSerializer
    lookup_field = "user__username"
    lookup_url_kwarg = "username"
    lookup_value_regex = USERNAME_PATTERN
    roles = {"list": Role.VIEWER, "retrieve": Role.VIEWER}

    @extend_schema(
        request=MemberCreateSerializer,
        responses={
            201: MemberSerializer,
            **errors(
                400,
                403,
                404,
                409,
                413,
                415,
                e400="Malformed, or no such user.",
                e404=E404,
                e409="The user is a member already.",
            ),
        },
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Add a user to the tenant with a role (admin)."""
        form = MemberCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        user = get_user_model().objects.filter(username=form.validated_data["username"]).first()
        if user is None:
            raise ValidationError({"username": ["no such user"]})
        if Membership.objects.filter(tenant=self.tenant, user=user).exists():
            raise Refused(f"{user.get_username()} is a member already; change their role instead", 409)
        try:
            membership = set_role(tenant=self.tenant, user=user, role=form.validated_data["role"], actor=request.user)
        except GovernanceError as exc:
            raise refused(exc) from None
        return Response(MemberSerializer(membership).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        parameters=[USERNAME],
        request=RoleSerializer,
        responses={
            200: MemberSerializer,
            **errors(400, 403, 404, 409, 413, 415, e404=E404, e409="The tenant would be left without an admin."),
        },
    )
    def partial_update(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Change a member's role (admin)."""
        membership = self.get_object()
        form = RoleSerializer(data=request.data, partial=True)
        form.is_valid(raise_exception=True)
        if "role" not in form.validated_data:
            return Response(MemberSerializer(membership).data)
        try:
            membership = set_role(
                tenant=self.tenant, user=membership.user, role=form.validated_data["role"], actor=request.user
            )
        except GovernanceError as exc:
            raise refused(exc) from None
        return Response(MemberSerializer(membership).data)

    @extend_schema(
        parameters=[USERNAME],
        responses={204: None, **errors(403, 404, 409, e404=E404, e409="The tenant would be left without an admin.")},
    )
    def destroy(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Remove a member (admin)."""
        try:
            remove_member(membership=self.get_object(), actor=request.user)
        except GovernanceError as exc:
            raise refused(exc) from None
        return Response(status=status.HTTP_204_NO_CONTENT)


@extend_schema(parameters=[SLUG])
@extend_schema_view(
    list=extend_schema(responses={200: ApiKeySerializer(many=True), **errors(400, 403, 404, e404=E404)}),
    retrieve=extend_schema(parameters=[PREFIX], responses={200: ApiKeySerializer, **errors(403, 404, e404=E404)}),
)
class ApiKeyViewSet(TenantNestedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The tenant's API keys (admin). The token is in the create response only."""

    queryset = ApiKey.objects.select_related("created_by")
    serializer_class = ApiKeySerializer
    lookup_field = "prefix"
    lookup_value_regex = "[A-Za-z0-9]{10}"

    @extend_schema(
        request=ApiKeyCreateSerializer,
        responses={
            201: ApiKeyCreatedSerializer,
            **errors(
                400,
                403,
                404,
                413,
                415,
                e400="Malformed: a name, one or more scopes, an expiry in the future.",
                e404=E404,
            ),
        },
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Create a key; the response carries its token, shown this once."""
        form = ApiKeyCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            key, token = create_key(tenant=self.tenant, created_by=request.user, **form.validated_data)
        except KeyRequestError as exc:
            raise refused(exc) from None
        data = ApiKeyCreatedSerializer(key).data
        data["token"] = token
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(parameters=[PREFIX], request=None, responses={200: ApiKeySerializer, **errors(403, 404, e404=E404)})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Revoke the key (idempotent): serving refuses it within seconds."""
        key = revoke_key(key=self.get_object(), actor=request.user)
        return Response(ApiKeySerializer(key).data)


@extend_schema(parameters=[SLUG])
class QuotaViewSet(TenantNestedViewSet):
    """The tenant's limits (every member reads them; staff change them by approving requests)."""

    queryset = Quota.objects.all()
    serializer_class = QuotaSerializer
    default_role = Role.VIEWER

    @extend_schema(responses={200: QuotaSerializer, **errors(403, 404, e404=E404)})
    def retrieve(self, request: Request, *args: object, **kwargs: object) -> Response:
        quota, _ = Quota.objects.get_or_create(tenant=self.tenant)
        return Response(QuotaSerializer(quota).data)


@extend_schema(parameters=[SLUG])
@extend_schema_view(
    list=extend_schema(responses={200: QuotaRequestSerializer(many=True), **errors(400, 403, 404, e404=E404)}),
    retrieve=extend_schema(
        parameters=[REQUEST_ID], responses={200: QuotaRequestSerializer, **errors(403, 404, e404=E404)}
    ),
)
class QuotaRequestViewSet(TenantNestedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Requests to change the tenant's quota: admins file them, platform staff decide them."""

    queryset = QuotaRequest.objects.select_related("requested_by", "decided_by")
    serializer_class = QuotaRequestSerializer
    lookup_value_regex = "[1-9][0-9]{0,9}"
    roles = {"list": Role.VIEWER, "retrieve": Role.VIEWER, "approve": "staff", "reject": "staff"}

    def get_object(self) -> QuotaRequest:
        if int(self.kwargs["pk"]) > 2**31 - 1:  # a number no row can have; the database would refuse it
            raise NotFound("no such quota request")
        return super().get_object()

    @extend_schema(
        request=QuotaRequestCreateSerializer,
        responses={201: QuotaRequestSerializer, **errors(400, 403, 404, 413, 415, e404=E404)},
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Ask platform staff for new limits, with a justification (admin)."""
        form = QuotaRequestCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            filed = request_quota(
                tenant=self.tenant,
                changes=dict(form.validated_data["changes"]),
                justification=form.validated_data["justification"],
                actor=request.user,
            )
        except GovernanceError as exc:
            raise refused(exc) from None
        return Response(QuotaRequestSerializer(filed).data, status=status.HTTP_201_CREATED)

    def _decide(self, request: Request, approve: bool) -> Response:
        form = DecisionSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            decided = decide(
                request=self.get_object(), approve=approve, note=form.validated_data.get("note", ""), actor=request.user
            )
        except GovernanceError as exc:
            raise refused(exc) from None
        return Response(QuotaRequestSerializer(decided).data)

    @extend_schema(
        parameters=[REQUEST_ID],
        request=DecisionSerializer,
        responses={
            200: QuotaRequestSerializer,
            **errors(
                400,
                403,
                404,
                409,
                413,
                415,
                e403="Not platform staff.",
                e404=E404,
                e409="The request was decided already.",
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Approve: the changes become the tenant's quota, in force within seconds (platform staff)."""
        return self._decide(request, approve=True)

    @extend_schema(
        parameters=[REQUEST_ID],
        request=DecisionSerializer,
        responses={
            200: QuotaRequestSerializer,
            **errors(
                400,
                403,
                404,
                409,
                413,
                415,
                e403="Not platform staff.",
                e404=E404,
                e409="The request was decided already.",
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def reject(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Reject, with a note for the tenant (platform staff)."""
        return self._decide(request, approve=False)


@extend_schema_view(
    list=extend_schema(
        responses={
            200: AuditEntrySerializer(many=True),
            **errors(400, 403, e403="Not logged in, or neither platform staff nor an admin of some tenant."),
        }
    )
)
class AuditViewSet(TenantScopedViewSet, mixins.ListModelMixin):
    """The audit log, newest first: platform staff read all of it, tenant admins their tenants' entries."""

    queryset = AuditEntry.objects.select_related("tenant")
    serializer_class = AuditEntrySerializer

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        if not admin_tenant_ids(request.user) and not request.user.is_staff:
            raise PermissionDenied("the audit log needs platform staff or the admin role in a tenant")

    def scope(self, queryset: QuerySet) -> QuerySet:
        if self.request.user.is_staff:
            return queryset
        return queryset.filter(tenant_id__in=admin_tenant_ids(self.request.user))


def admin_tenant_ids(user: object) -> list[int]:
    if not getattr(user, "is_authenticated", False):
        return []
    return [m.tenant_id for m in user.memberships.all() if m.role == Role.ADMIN]  # type: ignore[attr-defined]
