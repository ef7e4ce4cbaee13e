"""The shadow report's endpoint, mixed into the registry's model viewset: `GET /api/models/{name}/shadow/`."""

from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from rollout import shadow_report
from rollout.api.serializers import ShadowQuerySerializer, ShadowReportSerializer
from serving.api.serializers import ErrorSerializer


class ShadowReportMixin:
    @extend_schema(
        parameters=[ShadowQuerySerializer],
        responses={
            200: ShadowReportSerializer,
            400: OpenApiResponse(ErrorSerializer, description="A query parameter is malformed; `fields` names it."),
            403: OpenApiResponse(ErrorSerializer, description="Not logged in."),
            404: OpenApiResponse(ErrorSerializer, description="No such model, or one the caller may not see."),
        },
    )
    @action(detail=True, methods=["get"], url_path="shadow")
    def shadow(self, request: Request, *args: object, **kwargs: object) -> Response:
        """How a shadow version's answers compared with the versions serving the same live requests: agreement
        over time, the distribution of differences, both latency distributions, the confusion matrix
        (classifiers) and the newest disagreements with their inputs. Anyone who sees the model may read it."""
        model = self.get_object()  # type: ignore[attr-defined]
        query = ShadowQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        report = shadow_report.build(model, query.validated_data["candidate"],
                                     baseline=query.validated_data.get("baseline"), until=timezone.now(),
                                     minutes=query.validated_data["minutes"])
        return Response(ShadowReportSerializer(report).data)
