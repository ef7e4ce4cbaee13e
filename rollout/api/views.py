"""The rollout API: start a rollout, move it (advance, approve, reject, promote, roll back, cancel), read it
and its report. Rollouts are readable by the members of the tenant that owns the model (platform staff: every
one); another tenant's rollout does not exist (404), its model public or not. Changes need the role in the
tenant that owns the model: engineer to start, advance, roll back and cancel; approver to approve, reject and
promote (403). A transition the rollout's state does not allow is a 409.
"""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, PermissionDenied
from rest_framework.permissions import SAFE_METHODS
from rest_framework.request import Request
from rest_framework.response import Response

from rollout import transitions
from rollout.api.serializers import (
    ListFilterSerializer,
    NoteSerializer,
    RolloutCreateSerializer,
    RolloutReportSerializer,
    RolloutSerializer,
)
from rollout.gates import Thresholds
from rollout.models import Rollout, RolloutState
from serving.api.serializers import NAME_SCHEMA
from serving.api.views import errors
from tenants.models import Role, has_role
from tenants.scoping import TenantScopedViewSet, member_tenant_ids, require, visible_models

ID = OpenApiParameter(
    "id", {"type": "integer", "minimum": 1, "maximum": 2**63 - 1}, OpenApiParameter.PATH, description="the rollout's id"
)
E403 = (
    "Not logged in, or lacking the role in the tenant that owns the model: engineer to start, advance, roll"
    " back or cancel; approver to approve, reject or promote. The person who started a rollout cannot"
    " approve it unless the tenant allows self-approval."
)
E404 = "No such rollout, or one of a tenant the caller is not in."
E409 = (
    "The rollout's state does not allow this transition (it has ended, awaits approval, or is not approved; or an"
    " advance would promote it without its gates' evidence)."
)


class Refused(APIException):
    def __init__(self, error: transitions.RolloutError) -> None:
        super().__init__(error.message)
        self.status_code = error.status


def _move(body: type[NoteSerializer] | None = None) -> dict:
    return {
        "parameters": [ID],
        "request": body,
        "responses": {
            200: RolloutSerializer,
            **errors(
                403,
                404,
                409,
                *((400, 413, 415) if body else ()),
                e403=E403,
                e404=E404,
                e409=E409,
                e400="The note is malformed.",
            ),
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
                enum=RolloutState.values,
                description="only rollouts in this state",
            ),
        ],
        responses={200: RolloutSerializer(many=True), **errors(400, 403)},
    ),
    retrieve=extend_schema(parameters=[ID], responses={200: RolloutSerializer, **errors(403, 404, e404=E404)}),
)
class RolloutViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """Rollouts, newest first, of the models the caller's tenants own."""

    queryset = Rollout.objects.select_related("model", "model__tenant", "started_by").prefetch_related("approvals")
    serializer_class = RolloutSerializer
    lookup_value_regex = "[1-9][0-9]{0,18}"

    def initial(self, request: Request, *args: object, **kwargs: object) -> None:
        super().initial(request, *args, **kwargs)
        # Refused before the body is read: someone who is an engineer nowhere learns nothing from validation.
        if request.method not in SAFE_METHODS and not has_role(request.user, Role.ENGINEER):
            raise PermissionDenied("changing a rollout needs the engineer role (approver to approve)")

    def scope(self, queryset: QuerySet) -> QuerySet:
        user = self.request.user
        # A tenant's own workflow (who started it, approvals and their notes, the gates' verdicts): members of
        # the owning tenant see it, as they see its promotion requests, whoever else may see the model.
        if not user.is_staff:
            queryset = queryset.filter(model__tenant_id__in=member_tenant_ids(user))
        if self.action == "list":
            # A plain dict, not the QueryDict: DRF reads an empty form value of an optional field as absent,
            # and `?model=` is not a name.
            form = ListFilterSerializer(data=dict(self.request.query_params.items()))
            form.is_valid(raise_exception=True)
            if "model" in form.validated_data:
                queryset = queryset.filter(model__name=form.validated_data["model"])
            if "state" in form.validated_data:
                queryset = queryset.filter(state=form.validated_data["state"])
        return queryset

    def _object(self, role: str, doing: str) -> Rollout:
        rollout = self.get_object()
        require(self.request.user, role, rollout.model.tenant_id, doing)
        return rollout

    def _note(self) -> str:
        form = NoteSerializer(data=self.request.data)
        form.is_valid(raise_exception=True)
        return form.validated_data.get("note", "")

    def _answer(self, rollout: Rollout) -> Response:
        fresh = self.get_queryset().get(pk=rollout.pk)
        return Response(RolloutSerializer(fresh).data)

    @extend_schema(
        request=RolloutCreateSerializer,
        responses={
            201: RolloutSerializer,
            **errors(
                400,
                403,
                404,
                409,
                413,
                415,
                e403=E403,
                e400="Malformed, or the steps do not increase to 100.",
                e404="No such model (or one the caller may not see), or no such version of it.",
                e409="The model has no stable version or an active rollout already, or the candidate is not ready or"
                " is the stable version.",
            ),
        },
    )
    def create(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Start a rollout: shadowing first (unless `shadow_seconds` is 0), then the canary steps, each judged
        by the gates, then an approval and promotion."""
        form = RolloutCreateSerializer(data=request.data)
        form.is_valid(raise_exception=True)
        data = dict(form.validated_data)
        model = visible_models(request.user).filter(name=data.pop("model")).first()
        if model is None:
            raise NotFound("unknown model")
        require(request.user, Role.ENGINEER, model.tenant_id, "starting a rollout")
        limits = {k: data.pop(k) for k in list(data) if k in Thresholds.__dataclass_fields__}
        try:
            rollout = transitions.start(model=model, actor=request.user, thresholds=Thresholds(**limits), **data)
        except transitions.RolloutError as exc:
            raise Refused(exc) from None
        fresh = self.get_queryset().get(pk=rollout.pk)
        return Response(RolloutSerializer(fresh).data, status=status.HTTP_201_CREATED)

    @extend_schema(**_move())
    @action(detail=True, methods=["post"])
    def advance(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Move to the next phase now, without waiting out the bake time; a gate failing on the evidence so far
        rolls it back instead."""
        return self._do(transitions.advance, Role.ENGINEER, "advancing a rollout")

    @extend_schema(**_move(NoteSerializer))
    @action(detail=True, methods=["post"])
    def approve(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Approve the promotion: at once if every step has passed, else when the last one does."""
        return self._do(transitions.approve, Role.APPROVER, "approving a rollout", note=True)

    @extend_schema(**_move(NoteSerializer))
    @action(detail=True, methods=["post"])
    def reject(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Reject the candidate: all unpinned traffic goes back to the baseline."""
        return self._do(transitions.reject, Role.APPROVER, "rejecting a rollout", note=True)

    @extend_schema(**_move())
    @action(detail=True, methods=["post"])
    def promote(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Promote an approved rollout's candidate now, skipping the steps left."""
        return self._do(transitions.promote, Role.APPROVER, "promoting a rollout")

    @extend_schema(**_move(NoteSerializer))
    @action(detail=True, methods=["post"], url_path="roll-back")
    def roll_back(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Roll back: all unpinned traffic goes back to the baseline."""
        return self._do(transitions.roll_back, Role.ENGINEER, "rolling back a rollout", note=True)

    @extend_schema(**_move())
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, *args: object, **kwargs: object) -> Response:
        """Abandon the rollout: all unpinned traffic goes back to the baseline."""
        return self._do(transitions.cancel, Role.ENGINEER, "cancelling a rollout")

    def _do(self, move, role: str, doing: str, note: bool = False) -> Response:  # noqa: ANN001
        rollout = self._object(role, doing)
        extra = {"note": self._note()} if note else {}
        try:
            rollout = move(rollout=rollout, actor=self.request.user, **extra)
        except transitions.RolloutError as exc:
            raise Refused(exc) from None
        return self._answer(rollout)

    @extend_schema(parameters=[ID], responses={200: RolloutReportSerializer, **errors(403, 404, e404=E404)})
    @action(detail=True, methods=["get"])
    def report(self, request: Request, *args: object, **kwargs: object) -> Response:
        """The rollout with its verdicts, and the gates judged on the evidence now."""
        rollout = self.get_object()
        current = None
        if rollout.active:
            _, current = transitions.judge(rollout, timezone.now())
        return Response(RolloutReportSerializer({"rollout": rollout, "current": current}).data)
