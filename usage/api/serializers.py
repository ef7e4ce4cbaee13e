from rest_framework import serializers

from serving.models import MODEL_NAME_PATTERN
from usage.report import GRANULARITY

MAX_VERSION = 2**31 - 1


class _Query(serializers.Serializer):
    tenant = serializers.SlugField(
        required=False,
        max_length=50,
        help_text="a tenant's slug; default: every tenant the caller belongs to (staff: every tenant)",
    )
    model = serializers.RegexField(
        f"^{MODEL_NAME_PATTERN}$", required=False, max_length=100, help_text="a model's name"
    )
    version = serializers.IntegerField(required=False, min_value=1, max_value=MAX_VERSION)
    granularity = serializers.ChoiceField(
        choices=list(GRANULARITY),
        default="minute",
        help_text="period of each row; the range may span at most 1 day of minutes, 14 days of hours, 92 days of days",
    )

    def validate(self, attrs: dict) -> dict:
        start, end = attrs.get("from"), attrs.get("to")
        if start is not None and end is not None and start >= end:
            raise serializers.ValidationError({"from": ["must be before 'to'"]})
        return attrs


# `from` is a Python keyword: the fields are declared on a class built by name.
UsageQuerySerializer = type(
    "UsageQuerySerializer",
    (_Query,),
    {
        "from": serializers.DateTimeField(
            required=False,
            help_text="ISO 8601 start of the range, inclusive (default: the range's length before `to`)",
        ),
        "to": serializers.DateTimeField(
            required=False, help_text="ISO 8601 end of the range, exclusive (default: now)"
        ),
        "__doc__": "Query parameters of GET /api/usage/.",
    },
)


class UsageRowSerializer(serializers.Serializer):
    """A tenant's use of one model version over one period."""

    tenant = serializers.SlugField(help_text="the tenant's slug")
    model = serializers.CharField(help_text="the model's name")
    version = serializers.IntegerField()
    start = serializers.DateTimeField(help_text="the period's start, UTC")
    requests = serializers.IntegerField(help_text="answers, errors included")
    errors_4xx = serializers.IntegerField()
    errors_5xx = serializers.IntegerField()
    items = serializers.IntegerField(help_text="rows served")
    compute_seconds = serializers.FloatField(help_text="device seconds: each request's share of its batch")
    p50_ms = serializers.FloatField(allow_null=True, help_text="median latency, from arrival to answer")
    p95_ms = serializers.FloatField(allow_null=True)
    p99_ms = serializers.FloatField(allow_null=True)
