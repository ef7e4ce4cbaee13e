"""`PUT /api/tenants/{slug}/promotion-policy/` (mixed into the tenant viewset): platform staff set whether the
tenant's stable versions change only with an approval or engineers may promote. Members read the policy
on the tenant itself; a tenant admin is refused (403) like every other member."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from serving.api.views import errors
from tenants.models import PromotionPolicy
from tenants.promotion_policy import PolicyError, set_promotion_policy


class PromotionPolicySerializer(serializers.Serializer):
    promotion_policy = serializers.ChoiceField(
        choices=PromotionPolicy.choices,
        help_text="approval: every change of a model's stable version needs an approver (a rollout's approval or"
        " an accepted promotion request); engineers: engineers promote directly",
    )


class Refused(APIException):
    def __init__(self, error: PolicyError) -> None:
        super().__init__(error.message)
        self.status_code = error.status


class PromotionPolicyMixin:
    @extend_schema(
        request=PromotionPolicySerializer,
        responses={
            200: PromotionPolicySerializer,
            **errors(
                400,
                403,
                404,
                413,
                415,
                e403="Not logged in, or not platform staff (a tenant's admin included).",
                e404="No such tenant, or one the caller is not in.",
                e400="Not a promotion policy.",
            ),
        },
    )
    @action(detail=True, methods=["put"], url_path="promotion-policy")
    def promotion_policy(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Set the tenant's promotion policy (platform staff only). Audited as `tenant.promotion_policy`."""
        tenant = self.get_object()  # type: ignore[attr-defined]  # 404 for a tenant the caller is not in
        if not request.user.is_staff:  # before the body is read
            raise PermissionDenied("changing a tenant's promotion policy needs platform staff")
        form = PromotionPolicySerializer(data=request.data)
        form.is_valid(raise_exception=True)
        try:
            tenant = set_promotion_policy(
                tenant=tenant, policy=form.validated_data["promotion_policy"], actor=request.user
            )
        except PolicyError as exc:
            raise Refused(exc) from None
        return Response({"promotion_policy": tenant.promotion_policy})
