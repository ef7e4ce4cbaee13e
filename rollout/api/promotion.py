"""The promotion request API: `/api/promotion-requests/` lists and reads the requests of the models the
caller's tenants own (platform staff: every one); another tenant's request does not exist (404). `approve`
and `reject` need the approver role in the tenant that owns the model (403); the person who filed a request
cannot approve it unless the tenant allows self-approval (403); a request decided already, or one whose
model's stable version has changed since it was filed, is a 409. Requests are filed by promoting a version
(`POST /api/models/{name}/versions/{v}/promote/`) where the tenant requires approval.
"""

from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, PermissionDenied
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from rollout import promotion
from rollout.api.serializers import NoteSerializer, PromotionFilterSerializer, PromotionRequestSerializer
from rollout.models import PromotionRequest, PromotionState
from serving.api.serializers import NAME_SCHEMA
from serving.api.views import errors
from tenants.models import Role, has_role
from tenants.scoping import TenantScopedViewSet, member_tenant_ids, require

ID = OpenApiParameter(
    "id",
    {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
    OpenApiParameter.PATH,
    description="the promotion request's id",
)
E403 = (
    "Not logged in, or lacking the approver role in the tenant that owns the model; or the caller filed the"
    " request and the tenant does not allow self-approval."
)
E404 = "No such promotion request, or one of a tenant the caller is not in."
E409 = (
    "The request was decided already, the model's stable version has changed since it was filed, or the"
    " promotion is refused now (a rollout of the model is active, the version is no longer ready)."
)


class Refused(APIException):
    def __init__(self, error: promotion.PromotionError) -> None:
        super().__init__(error.message)
        self.status_code = error.status


def _decision() -> dict:
    return {
        "parameters": [ID],
        "request": NoteSerializer,
        "responses": {
            200: PromotionRequestSerializer,
            **errors(400, 403, 404, 409, 413, 415, e403=E403, e404=E404, e409=E409, e400="The note is malformed."),
        },
    }


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter("model", NAME_SCHEMA, OpenApiParameter.QUERY, description="only this model's"),
            OpenApiParameter(
                "state",
                str,
                OpenApiParameter.QUERY,
                enum=PromotionState.values,
                description="only requests in this state",
            ),
        ],
        responses={200: PromotionRequestSerializer(many=True), **errors(400, 403)},
    ),
    retrieve=extend_schema(parameters=[ID], responses={200: PromotionRequestSerializer, **errors(403, 404, e404=E404)}),
)
class PromotionRequestViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Promotion requests, newest first, of the models the caller's tenants own."""

    queryset = PromotionRequest.objects.select_related("model", "model__tenant")
    serializer_class = PromotionRequestSerializer
    lookup_value_regex = "[1-9][0-9]{0,18}"

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        # Refused before the body is read: someone who is an approver nowhere learns nothing from validation.
        if request.method not in SAFE_METHODS and not has_role(request.user, Role.APPROVER):
            raise PermissionDenied("deciding a promotion request needs the approver role")

    def scope(self, queryset: QuerySet) -> QuerySet:
        user = self.request.user
        # A tenant's own workflow: members of the owning tenant see it, whoever else may see the model.
        if not user.is_staff:
            queryset = queryset.filter(model__tenant_id__in=member_tenant_ids(user))
        if self.action == "list":
            form = PromotionFilterSerializer(data=dict(self.request.query_params.items()))
            form.is_valid(raise_exception=True)
            if "model" in form.validated_data:
                queryset = queryset.filter(model__name=form.validated_data["model"])
            if "state" in form.validated_data:
                queryset = queryset.filter(state=form.validated_data["state"])
        return queryset

    @extend_schema(**_decision())
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Accept the request: the version becomes the model's stable version now."""
        return self._decide(promotion.accept, "approving a promotion request")

    @extend_schema(**_decision())
    @action(detail=True, methods=["post"])
    def reject(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Reject the request: the stable version stays."""
        return self._decide(promotion.reject, "rejecting a promotion request")

    def _decide(self, decide, doing: str) -> Response:  # noqa: ANN001
        found = self.get_object()
        require(self.request.user, Role.APPROVER, found.model.tenant_id, doing)
        form = NoteSerializer(data=self.request.data)
        form.is_valid(raise_exception=True)
        try:
            decided = decide(request=found, actor=self.request.user, note=form.validated_data.get("note", ""))
        except promotion.PromotionError as exc:
            raise Refused(exc) from None
        return Response(PromotionRequestSerializer(self.get_queryset().get(pk=decided.pk)).data)
