"""Request and response shapes of the tenant API: tenants, members, API keys, quotas and the audit log."""

from __future__ import annotations

from datetime import datetime

from django.utils import timezone
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from serving.api.serializers import StrictBooleanField, StrictIntegerField, TextField
from tenants import keys
from tenants.governance import LIMIT_BOUNDS
from tenants.models import ApiKey, AuditEntry, Membership, Quota, QuotaRequest, Role, Tenant, role_in

USERNAME_PATTERN = r"[A-Za-z0-9_.@+-]{1,150}"


@extend_schema_field(
    {
        "type": "string",
        "enum": [*Role.values, None],
        "nullable": True,
        "description": "the caller's role in the tenant; null for platform staff outside it",
    }
)
class CallerRoleField(serializers.Field):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(source="*", read_only=True, **kwargs)

    def to_representation(self, tenant: Tenant) -> str | None:
        return role_in(self.context["request"].user, tenant)


class TenantSerializer(serializers.ModelSerializer):
    role = CallerRoleField()

    class Meta:
        model = Tenant
        fields = [
            "slug",
            "name",
            "role",
            "allow_self_approval",
            "promotion_policy",
            "share_shadow_samples",
            "created_at",
        ]
        read_only_fields = fields


class TenantUpdateSerializer(serializers.Serializer):
    """The tenant's settings its admin changes (PATCH /api/tenants/{slug}/); any subset."""

    share_shadow_samples = StrictBooleanField(
        required=False,
        help_text="whether other tenants' shadow reports may keep samples (inputs and outputs) of"
        " this tenant's requests; off, they count in those reports' aggregates only",
    )

    def validate(self, attrs: dict) -> dict:
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["not a tenant setting that can be changed"] for name in unknown})
        return attrs


class MemberSerializer(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", read_only=True)

    class Meta:
        model = Membership
        fields = ["username", "role"]
        read_only_fields = fields


@extend_schema_field({"type": "string", "pattern": f"^{USERNAME_PATTERN}$", "maxLength": 150})
class UsernameField(TextField):
    pass


class MemberCreateSerializer(serializers.Serializer):
    username = UsernameField(help_text="an existing user")
    role = serializers.ChoiceField(choices=Role.choices)


class RoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Role.choices)


class ApiKeySerializer(serializers.ModelSerializer):
    created_by = serializers.CharField(source="created_by.username", read_only=True, allow_null=True)
    active = serializers.BooleanField(read_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "name",
            "prefix",
            "scopes",
            "created_by",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "active",
        ]
        read_only_fields = fields


class ApiKeyCreatedSerializer(ApiKeySerializer):
    token = serializers.CharField(read_only=True, help_text="shown in this response only; never stored")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "token"]
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.Serializer):
    name = TextField(max_length=100, trim_whitespace=False)
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=keys.SCOPES), min_length=1, max_length=len(keys.SCOPES)
    )
    expires_at = serializers.DateTimeField(required=False, allow_null=True, help_text="in the future; null: never")

    def validate_expires_at(self, value: datetime | None) -> datetime | None:
        if value is not None and value <= timezone.now():
            raise serializers.ValidationError("must lie in the future")
        return value


class QuotaSerializer(serializers.ModelSerializer):
    class Meta:
        model = Quota
        fields = [*Quota.LIMITS, "updated_at"]
        read_only_fields = fields


class QuotaChangesSerializer(serializers.Serializer):
    """The limits to change, any non-empty subset, by Quota field name."""

    def get_fields(self) -> dict:
        # A nullable limit (the plan's latency budget) takes null: cleared, back to the platform's default.
        return {
            name: StrictIntegerField(min_value=low, max_value=high, required=False, allow_null=name in Quota.NULLABLE)
            for name, (low, high) in LIMIT_BOUNDS.items()
        }

    def to_internal_value(self, data: object) -> dict:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(self.fields))
            if unknown:
                raise serializers.ValidationError({name: ["not a quota limit"] for name in unknown})
        attrs = super().to_internal_value(data)
        if not attrs:
            raise serializers.ValidationError("name at least one limit to change")
        return attrs


class ClosedQuotaChangesExtension(OpenApiSerializerExtension):
    target_class = QuotaChangesSerializer

    def map_serializer(self, auto_schema, direction):  # noqa: ANN001, ANN201
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        schema["additionalProperties"] = False
        schema["minProperties"] = 1
        return schema


class QuotaRequestCreateSerializer(serializers.Serializer):
    changes = QuotaChangesSerializer()
    justification = TextField(max_length=2000, help_text="why the tenant needs it")


class QuotaRequestSerializer(serializers.ModelSerializer):
    changes = QuotaChangesSerializer(read_only=True)
    requested_by = serializers.CharField(source="requested_by.username", read_only=True, allow_null=True)
    decided_by = serializers.CharField(source="decided_by.username", read_only=True, allow_null=True)

    class Meta:
        model = QuotaRequest
        fields = [
            "id",
            "changes",
            "justification",
            "state",
            "requested_by",
            "requested_at",
            "decided_by",
            "decided_at",
            "decision_note",
        ]
        read_only_fields = fields


class DecisionSerializer(serializers.Serializer):
    note = TextField(max_length=2000, required=False, allow_blank=True, help_text="shown to the tenant")


class AuditEntrySerializer(serializers.ModelSerializer):
    actor = serializers.CharField(source="actor_name", read_only=True)
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True, allow_null=True)

    class Meta:
        model = AuditEntry
        fields = ["id", "at", "actor", "tenant", "action", "target", "before", "after"]
        read_only_fields = fields
