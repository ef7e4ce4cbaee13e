"""Request and response shapes of the rollout API (strict, as the registry API's are)."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from rollout.models import Approval, PromotionRequest, PromotionState, Rollout, RolloutState
from serving.api.serializers import ModelNameField, StrictFloatField, StrictIntegerField, TextField

MAX_SECONDS = 30 * 86400  # a phase longer than a month is a mistake, not a plan
MAX_VERSION = 2**31 - 1


class ApprovalSerializer(serializers.ModelSerializer):
    class Meta:
        model = Approval
        fields = ["username", "note", "at"]
        read_only_fields = fields


@extend_schema_field(
    {
        "type": "object",
        "nullable": True,
        "additionalProperties": True,
        "description": "a gate verdict: outcome (pass, fail, no_data), gates with their status,"
        " reason and numbers, the windows read, and the action taken",
    }
)
class VerdictField(serializers.JSONField):
    pass


class RolloutSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    started_by = serializers.CharField(source="started_by.username", read_only=True, allow_null=True, default=None)
    percent = serializers.FloatField(read_only=True, help_text="the candidate's share of unpinned traffic now")
    approvals = ApprovalSerializer(many=True, read_only=True)
    verdicts = serializers.ListField(
        child=VerdictField(), read_only=True, help_text="the decisive verdicts, oldest first"
    )
    last_verdict = VerdictField(read_only=True, help_text="the latest evaluation")

    class Meta:
        model = Rollout
        fields = [
            "id",
            "model",
            "candidate",
            "baseline",
            "state",
            "step",
            "percent",
            "steps",
            "shadow_seconds",
            "bake_seconds",
            "step_timeout_seconds",
            "max_error_rate_increase",
            "max_p99_ratio",
            "p99_slack_ms",
            "min_agreement",
            "min_requests",
            "min_compared",
            "approved",
            "approvals",
            "started_by",
            "reason",
            "verdicts",
            "last_verdict",
            "started_at",
            "phase_started_at",
            "finished_at",
        ]
        read_only_fields = fields


class RolloutCreateSerializer(serializers.Serializer):
    """Start a rollout of `candidate` against the model's stable version. Every setting but the two names
    has a default."""

    model = ModelNameField(help_text="the model's name")
    candidate = StrictIntegerField(min_value=1, max_value=MAX_VERSION, help_text="the version to roll out")
    steps = serializers.ListField(
        child=StrictIntegerField(min_value=1, max_value=100),
        min_length=1,
        max_length=20,
        required=False,
        help_text="canary shares in percent, increasing, ending at 100 (default [1, 5, 25, 50, 100])",
    )
    shadow_seconds = StrictIntegerField(
        min_value=0,
        max_value=MAX_SECONDS,
        required=False,
        help_text="how long to shadow first; 0 starts the canary at once",
    )
    bake_seconds = StrictIntegerField(
        min_value=0, max_value=MAX_SECONDS, required=False, help_text="the least time each canary step runs"
    )
    step_timeout_seconds = StrictIntegerField(
        min_value=1,
        max_value=MAX_SECONDS,
        required=False,
        help_text="a phase still without enough evidence this long rolls back",
    )
    max_error_rate_increase = StrictFloatField(min_value=0, max_value=1, required=False)
    max_p99_ratio = StrictFloatField(min_value=1, max_value=1000, required=False)
    p99_slack_ms = StrictFloatField(min_value=0, max_value=60_000, required=False)
    min_agreement = StrictFloatField(
        min_value=0, max_value=1, required=False, allow_null=True, help_text="null: no shadow agreement gate"
    )
    min_requests = StrictIntegerField(min_value=1, max_value=10**9, required=False)
    min_compared = StrictIntegerField(min_value=1, max_value=10**9, required=False)


class NoteSerializer(serializers.Serializer):
    note = TextField(max_length=2000, required=False, help_text="why, for the audit log")


class RolloutReportSerializer(serializers.Serializer):
    rollout = RolloutSerializer()
    current = VerdictField(help_text="the gates on the evidence now (null once the rollout has ended)")


class ListFilterSerializer(serializers.Serializer):
    """The list's query parameters (limit and offset are the paginator's)."""

    model = ModelNameField(required=False)
    state = serializers.ChoiceField(choices=RolloutState.values, required=False)


class PromotionRequestSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    requested_by = serializers.CharField(
        source="requester_name", read_only=True, help_text="who filed it (kept if the user is deleted)"
    )
    decided_by = serializers.CharField(source="decider_name", read_only=True, help_text="empty while pending")

    class Meta:
        model = PromotionRequest
        fields = [
            "id",
            "model",
            "version",
            "baseline",
            "state",
            "requested_by",
            "note",
            "requested_at",
            "decided_by",
            "decision_note",
            "decided_at",
        ]
        read_only_fields = fields


class PromotionFilterSerializer(serializers.Serializer):
    """The promotion request list's query parameters (limit and offset are the paginator's)."""

    model = ModelNameField(required=False)
    state = serializers.ChoiceField(choices=PromotionState.values, required=False)
