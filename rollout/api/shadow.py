"""The shadow report's endpoint, `GET /api/models/{name}/shadow/` (mixed into the registry's model viewset),
its query and its JSON as the OpenAPI schema documents them (rollout.shadow_report builds the dict)."""

from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response

from rollout import shadow_report
from serving.api.serializers import ErrorSerializer, StrictIntegerField
from tenants.scoping import shadow_report_refusal

MAX_VERSION = 2**31 - 1
MAX_MINUTES = 7 * 24 * 60


class ShadowQuerySerializer(serializers.Serializer):
    candidate = serializers.IntegerField(
        min_value=1, max_value=MAX_VERSION, help_text="the shadow version to report on"
    )
    baseline = serializers.IntegerField(
        min_value=1,
        max_value=MAX_VERSION,
        required=False,
        help_text="compare against this version only (default: every version"
        " whose requests were mirrored to the candidate)",
    )
    minutes = serializers.IntegerField(
        min_value=1, max_value=MAX_MINUTES, required=False, default=60, help_text="the window, in minutes up to now"
    )


class ShadowConfigSerializer(serializers.Serializer):
    version = StrictIntegerField(allow_null=True, help_text="the model's current shadow version")
    fraction = serializers.FloatField(help_text="the share of live requests mirrored to it now")


class ShadowTotalsSerializer(serializers.Serializer):
    mirrored = serializers.IntegerField(help_text="mirrored requests the candidate answered or failed")
    shadow_errors = serializers.IntegerField(help_text="of those, failed on the candidate")
    incomparable = serializers.IntegerField(help_text="answered with outputs of another shape")
    compared = serializers.IntegerField(help_text="rows compared")
    agreed = serializers.IntegerField(help_text="rows that agreed (top-1 class, tolerance, or cosine >= 0.99)")
    agreement = serializers.FloatField(allow_null=True, help_text="agreed / compared; null when none compared")
    shadow_error_rate = serializers.FloatField(allow_null=True)
    shadow_errors_by_status = serializers.DictField(child=serializers.IntegerField())


class ShadowPointSerializer(serializers.Serializer):
    minute = serializers.DateTimeField()
    mirrored = serializers.IntegerField()
    compared = serializers.IntegerField()
    agreed = serializers.IntegerField()
    shadow_errors = serializers.IntegerField()
    agreement = serializers.FloatField(allow_null=True)


class BinSerializer(serializers.Serializer):
    low = serializers.FloatField()
    high = serializers.FloatField()
    count = serializers.IntegerField()


class DifferencesSerializer(serializers.Serializer):
    histogram = BinSerializer(
        many=True,
        help_text="per-row difference: largest absolute difference of the"
        " outputs (classification, regression) or 1 - cosine (embedding)",
    )
    mean_abs = serializers.FloatField(allow_null=True, help_text="regression: mean absolute difference")
    max_abs = serializers.FloatField(allow_null=True, help_text="regression: largest absolute difference")
    mean_cosine = serializers.FloatField(allow_null=True, help_text="embedding: mean cosine similarity")
    min_cosine = serializers.FloatField(allow_null=True, help_text="embedding: lowest cosine similarity")


class LatencyBinSerializer(serializers.Serializer):
    low_ms = serializers.FloatField()
    high_ms = serializers.FloatField()
    count = serializers.IntegerField()


class LatencySerializer(serializers.Serializer):
    count = serializers.IntegerField()
    p50_ms = serializers.FloatField(allow_null=True)
    p90_ms = serializers.FloatField(allow_null=True)
    p99_ms = serializers.FloatField(allow_null=True)
    histogram = LatencyBinSerializer(many=True)


class LatenciesSerializer(serializers.Serializer):
    measure = serializers.CharField(help_text="what the two distributions measure")
    baseline = LatencySerializer(help_text="the serving versions' device time on the mirrored requests")
    candidate = LatencySerializer(help_text="the candidate's device time on the same requests")


class ConfusionSerializer(serializers.Serializer):
    labels = serializers.ListField(child=serializers.IntegerField())
    matrix = serializers.ListField(
        child=serializers.ListField(child=serializers.IntegerField()),
        help_text="rows: the baseline's class; columns: the candidate's",
    )


class DisagreementSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    baseline = serializers.IntegerField()
    summary = serializers.CharField()
    difference = serializers.FloatField(allow_null=True)
    output = serializers.CharField()
    inputs = serializers.JSONField(allow_null=True, help_text="the row's inputs by name; null when too large")
    primary = serializers.JSONField(allow_null=True, help_text="the baseline's output row")
    shadow = serializers.JSONField(allow_null=True, help_text="the candidate's output row; null when it failed")


class ShadowReportSerializer(serializers.Serializer):
    model = serializers.CharField()
    task = serializers.CharField()
    candidate = serializers.IntegerField()
    baselines = serializers.ListField(child=serializers.IntegerField())
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    shadow = ShadowConfigSerializer()
    totals = ShadowTotalsSerializer()
    series = ShadowPointSerializer(many=True, help_text="agreement per minute")
    differences = DifferencesSerializer()
    latency = LatenciesSerializer()
    confusion = ConfusionSerializer(allow_null=True, help_text="classification only: top-1 class pairs")
    disagreements = DisagreementSerializer(many=True, help_text="the newest rows that disagreed, with inputs")


class ShadowReportMixin:
    @extend_schema(
        parameters=[ShadowQuerySerializer],
        responses={
            200: ShadowReportSerializer,
            400: OpenApiResponse(ErrorSerializer, description="A query parameter is malformed; `fields` names it."),
            403: OpenApiResponse(
                ErrorSerializer,
                description="Not logged in, or not an engineer (approver, admin) of the tenant that owns the model.",
            ),
            404: OpenApiResponse(ErrorSerializer, description="No such model, or one the caller may not see."),
        },
    )
    @action(detail=True, methods=["get"], url_path="shadow")
    def shadow(self, request: Request, *args: object, **kwargs: object) -> Response:
        """How a shadow version's answers compared with the versions serving the same live requests: agreement
        over time, the distribution of differences, both latency distributions, the confusion matrix
        (classifiers) and the newest disagreements with their inputs. The owning tenant's engineers (approvers,
        admins) and platform staff read it; anyone else who sees the model is refused (403)."""
        model = self.get_object()  # type: ignore[attr-defined]
        refusal = shadow_report_refusal(request.user, model)
        if refusal is not None:
            raise PermissionDenied(refusal)
        query = ShadowQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        report = shadow_report.build(
            model,
            query.validated_data["candidate"],
            baseline=query.validated_data.get("baseline"),
            until=timezone.now(),
            minutes=query.validated_data["minutes"],
        )
        return Response(ShadowReportSerializer(report).data)
