"""Request and response shapes of the registry API, strict where DRF alone would coerce.

DRF turns a JSON number into text for a CharField, "8" into 8 for an IntegerField and trims names; the
OpenAPI schema says "string" and "integer", so these fields refuse what the schema forbids instead.
"""

import json
import math
import re

from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from serving.dataplane.http.protocol import DATATYPES
from serving.fallbacks import hidden_fallbacks
from serving.models import (
    MODEL_NAME_PATTERN,
    RESERVED_NAMES,
    ArtifactFormat,
    Model,
    ModelVersion,
    Replica,
    Task,
    Visibility,
)
from tenants.models import Tenant
from tenants.scoping import member_tenant_ids, visible_models, visible_tenants

# A tenant's slug, as SlugField stores it.
TENANT_SLUG_PATTERN = r"[-a-zA-Z0-9_]{1,50}"
TENANT_SLUG_SCHEMA = {"type": "string", "pattern": f"^{TENANT_SLUG_PATTERN}$", "maxLength": 50}

NAME_RE = re.compile(MODEL_NAME_PATTERN)
NAME_SCHEMA = {"type": "string", "pattern": f"^{MODEL_NAME_PATTERN}$", "maxLength": 100}
SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")
# Free text: PostgreSQL cannot store NUL characters, so the schema rules them out. (One or more: with
# allow_blank the schema becomes oneOf this or an empty string, and the two must not overlap.)
TEXT_PATTERN = "^[^\\u0000]+$"

# Bounds of the batching settings the API accepts (uploads and the batching PATCH).
MAX_BATCH_SIZE = 4096
MAX_QUEUE_DELAY_MS = 10_000
MAX_QUEUE_SIZE = 1_000_000
MAX_DEFAULT_TIMEOUT_MS = 600_000


class ErrorSerializer(serializers.Serializer):
    """Every error the API answers."""

    error = serializers.CharField(help_text="what went wrong, in one line")
    fields = serializers.DictField(
        required=False,
        help_text="per field or query parameter, its messages (present when the request itself was invalid)",
    )


class StrictCharField(serializers.CharField):
    """A JSON string only, and one PostgreSQL can store."""

    default_error_messages = {"unicode": "must be valid Unicode without NUL characters"}

    def to_internal_value(self, data: object) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        try:
            data.encode("utf-8")  # a lone surrogate ("\ud800" in JSON) cannot be stored
        except UnicodeEncodeError:
            self.fail("unicode")
        if "\x00" in data:
            self.fail("unicode")
        return super().to_internal_value(data)


@extend_schema_field({"type": "string", "pattern": TEXT_PATTERN})
class TextField(StrictCharField):
    pass


@extend_schema_field(NAME_SCHEMA)
class ModelNameField(StrictCharField):
    default_error_messages = {
        "name": "model names are 1-100 of letters, digits, '_', '.' and '-', starting with a letter or digit",
    }

    def __init__(self, **kwargs: object) -> None:
        super().__init__(max_length=100, trim_whitespace=False, **kwargs)

    def to_internal_value(self, data: object) -> str:
        value = super().to_internal_value(data)
        if not NAME_RE.fullmatch(value):
            self.fail("name")
        return value


@extend_schema_field(
    {
        **NAME_SCHEMA,
        "nullable": True,
        "description": "name of an existing model, or null; null too when the fallback is a model"
        " the caller may not see (then `fallback_hidden` is true)",
    }
)
class FallbackField(serializers.SlugRelatedField):
    """Another model the caller may see, by name; anything that cannot be a name is refused before the
    database is asked, and a model the caller may not see does not exist."""

    def get_queryset(self):  # noqa: ANN201
        return visible_models(_caller(self), super().get_queryset())

    def run_validation(self, data: object = serializers.empty) -> Model | None:
        if data == "":  # DRF's related fields read "" as null; the schema says a name or null
            self.fail("invalid")
        return super().run_validation(data)

    def to_internal_value(self, data: object) -> Model:
        if not isinstance(data, str) or not NAME_RE.fullmatch(data):
            self.fail("invalid")
        return super().to_internal_value(data)


def _caller(field: serializers.Field) -> object:
    request = field.context.get("request")
    return getattr(request, "user", None)


class TenantField(serializers.SlugRelatedField):
    """A tenant by slug. As input, only tenants the caller belongs to (any, for staff) exist: naming
    another answers exactly as naming none."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(slug_field="slug", queryset=Tenant.objects.all(), **kwargs)

    def get_queryset(self):  # noqa: ANN201
        return visible_tenants(_caller(self))

    def to_internal_value(self, data: object) -> Tenant:
        if not isinstance(data, str) or not re.fullmatch(TENANT_SLUG_PATTERN, data):
            self.fail("invalid")
        return super().to_internal_value(data)


@extend_schema_field(
    {
        **TENANT_SLUG_SCHEMA,
        "nullable": True,
        "description": "the owning tenant's slug; null for a platform model (staff only)."
        " Omitted on create: the caller's only tenant",
    }
)
class OwnerField(TenantField):
    pass


@extend_schema_field(
    {
        "type": "array",
        "items": TENANT_SLUG_SCHEMA,
        "description": "tenants that see the model when its visibility is `shared`",
    }
)
class SharedWithField(serializers.ManyRelatedField):
    """Tenants by slug; any tenant on the platform may be named. Validated as slugs: looked up once the
    caller's role allows the change."""


class StrictIntegerField(serializers.IntegerField):
    """A JSON integer only: no strings, booleans or numbers with a fraction part (8.0 included)."""

    def to_internal_value(self, data: object) -> int:
        if type(data) is not int:
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    """A finite JSON number only: no strings or booleans."""

    def to_internal_value(self, data: object) -> float:
        if type(data) not in (int, float) or not math.isfinite(data):
            self.fail("invalid")
        return super().to_internal_value(data)


class ReplicaSerializer(serializers.ModelSerializer):
    """What one node holds of the version, as the placement reconciler last read the fleet."""

    class Meta:
        model = Replica
        fields = ["node", "tier", "assigned", "accelerator", "updated_at"]
        read_only_fields = fields


class ModelVersionSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    artifact_sha256 = serializers.CharField(source="artifact_id", read_only=True)
    replicas = ReplicaSerializer(
        many=True,
        read_only=True,
        help_text=(
            "per node: hot (on the device), warm (in host memory) or cold (served there, not in memory), and whether"
            " the placement reconciler put it there; the measured load time per accelerator type is in"
            " placement_measurements"
        ),
    )

    class Meta:
        model = ModelVersion
        fields = [
            "model",
            "version",
            "state",
            "failure_reason",
            "loaded",
            "format",
            "artifact_sha256",
            "inputs",
            "outputs",
            "max_batch_size",
            "max_queue_delay_ms",
            "preferred_batch_sizes",
            "max_queue_size",
            "default_timeout_ms",
            "response_cache",
            "latency_profile",
            "memory_bytes",
            "load_seconds",
            "metrics",
            "min_memory_bytes",
            "accelerators",
            "pinned",
            "min_replicas",
            "placement_measurements",
            "desired_replicas",
            "unschedulable_reason",
            "replicas",
            "created_at",
            "updated_at",
        ]
        # Changed through the batching and placement PATCHes, uploads and the repository extension.
        read_only_fields = fields


class _AnyTenantSlug(serializers.SlugRelatedField):
    """A tenant's slug, as written: its form is checked here, and whether it names a tenant only after the
    caller's role to share the model is (serving.api.views), so a validation error says nothing of which
    tenants exist."""

    def to_internal_value(self, data: object) -> str:  # type: ignore[override]
        if not isinstance(data, str) or not re.fullmatch(TENANT_SLUG_PATTERN, data):
            self.fail("invalid")
        return data


class ModelSerializer(serializers.ModelSerializer):
    """A model. Changing `visibility` or `shared_with` needs the admin role in the owning tenant."""

    name = ModelNameField()
    tenant = OwnerField(allow_null=True, required=False)
    visibility = serializers.ChoiceField(choices=Visibility.choices, required=False)
    shared_with = SharedWithField(
        child_relation=_AnyTenantSlug(slug_field="slug", queryset=Tenant.objects.all()),
        required=False,
    )
    description = TextField(required=False, allow_blank=True)
    fallback = FallbackField(slug_field="name", queryset=Model.objects.all(), allow_null=True, required=False)
    fallback_hidden = serializers.SerializerMethodField(
        help_text="true when the model has a fallback the caller may not see (another tenant's private model):"
        " `fallback` is null then",
    )
    versions = ModelVersionSerializer(many=True, read_only=True)
    stable_version = serializers.IntegerField(
        read_only=True,
        allow_null=True,
        help_text="the version unpinned traffic goes to (null until a version is ready); changed by promote",
    )
    shadow_version = StrictIntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=2**31 - 1,
        help_text="the version a share of live requests is mirrored to, its answers compared and never returned"
        " (null: none; setting it to null stops the mirroring)",
    )
    shadow_fraction = StrictFloatField(
        required=False,
        min_value=0.0,
        max_value=1.0,
        help_text="the share of live requests mirrored to the shadow version (0 to 1)",
    )

    class Meta:
        model = Model
        fields = [
            "name",
            "tenant",
            "visibility",
            "shared_with",
            "description",
            "task",
            "fallback",
            "fallback_hidden",
            "versions",
            "stable_version",
            "shadow_version",
            "shadow_fraction",
            "created_at",
            "updated_at",
        ]
        read_only_fields = ["created_at", "updated_at"]

    @extend_schema_field(OpenApiTypes.BOOL)
    def get_fallback_hidden(self, instance: Model) -> bool:
        """Whether the caller may not see the model's fallback (serving.fallbacks): one query per fallback a
        response names, shared by a list's rows."""
        if instance.fallback_id is None:
            return False
        seen = self.context.setdefault("fallback_seen", {})
        if instance.fallback_id not in seen:
            seen[instance.fallback_id] = not hidden_fallbacks(_caller(self), [instance])
        return not seen[instance.fallback_id]

    def validate_name(self, value: str) -> str:
        if value in RESERVED_NAMES and (self.instance is None or self.instance.name != value):
            raise serializers.ValidationError(f"{value!r} is reserved: the inference protocol's paths use it")
        return value

    def validate_fallback(self, value: Model | None) -> Model | None:
        if value is not None and self.instance is not None and value.pk == self.instance.pk:
            raise serializers.ValidationError("a model cannot be its own fallback")
        return value

    def validate_tenant(self, value: Tenant | None) -> Tenant | None:
        if self.instance is not None and value != self.instance.tenant:
            raise serializers.ValidationError("a model's tenant cannot be changed")
        return value

    def to_representation(self, instance: Model) -> dict:
        data = super().to_representation(instance)
        if data.get("fallback_hidden"):  # its name is its own tenant's business
            data["fallback"] = None
        # Which other tenants a model is shared with is the owner's business.
        user = _caller(self)
        if not getattr(user, "is_staff", False):
            if "member_of" not in self.context:  # once per response: a list shares its child's context
                self.context["member_of"] = set(member_tenant_ids(user))
            if instance.tenant_id not in self.context["member_of"]:
                data["shared_with"] = []
        return data


class StrictBooleanField(serializers.BooleanField):
    """A JSON boolean only: no "true" strings or 0/1."""

    def to_internal_value(self, data: object) -> bool:
        if type(data) is not bool:
            self.fail("invalid")
        return data


class BatchingUpdateSerializer(serializers.Serializer):
    """The batching settings of one version; any subset. Validated again as a whole by ModelVersion.clean()."""

    max_batch_size = StrictIntegerField(min_value=1, max_value=MAX_BATCH_SIZE, required=False)
    max_queue_delay_ms = StrictFloatField(min_value=0, max_value=MAX_QUEUE_DELAY_MS, required=False)
    preferred_batch_sizes = serializers.ListField(
        child=StrictIntegerField(min_value=1, max_value=MAX_BATCH_SIZE),
        required=False,
        help_text="each within 1..max_batch_size",
    )
    max_queue_size = StrictIntegerField(min_value=1, max_value=MAX_QUEUE_SIZE, required=False)
    default_timeout_ms = StrictIntegerField(min_value=1, max_value=MAX_DEFAULT_TIMEOUT_MS, required=False)
    # Triton keeps the response cache in the same model config as dynamic batching.
    response_cache = StrictBooleanField(
        required=False, help_text="answer repeats of identical requests from the gateway's cache (deterministic models)"
    )

    def validate(self, attrs: dict) -> dict:
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["not a batching setting"] for name in unknown})
        return attrs


class PlacementUpdateSerializer(serializers.Serializer):
    """A version's placement constraints and what keeps it loaded; any subset."""

    min_memory_bytes = StrictIntegerField(
        min_value=0, max_value=2**62, required=False, help_text="a node's device memory must be at least this"
    )
    accelerators = serializers.ListField(
        child=serializers.RegexField(r"^[a-z0-9][a-z0-9._-]{0,63}$"),
        max_length=32,
        required=False,
        help_text="accelerator types allowed to host it (lower case, e.g. a10g); empty: any",
    )
    pinned = StrictBooleanField(required=False, help_text="never evicted to make room for another version")
    min_replicas = StrictIntegerField(
        min_value=0,
        max_value=1000,
        required=False,
        help_text="replicas kept; the stable version with a minimum is never evicted",
    )

    def validate(self, attrs: dict) -> dict:
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError({name: ["not a placement setting"] for name in unknown})
        if "accelerators" in attrs:
            attrs["accelerators"] = sorted(set(attrs["accelerators"]))
        return attrs


class ClosedObjectExtension(OpenApiSerializerExtension):
    """The batching PATCH refuses properties it does not know, so its schema says so."""

    target_class = BatchingUpdateSerializer

    def map_serializer(self, auto_schema, direction):  # noqa: ANN001, ANN201
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        schema["additionalProperties"] = False
        return schema


class ClosedPlacementExtension(ClosedObjectExtension):
    target_class = PlacementUpdateSerializer


TENSOR_SPEC_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "datatype": {"type": "string", "enum": sorted(DATATYPES)},
        "shape": {
            "type": "array",
            "items": {"type": "integer", "minimum": -1},
            "description": "without the batch dimension; -1 marks a variable dimension",
        },
    },
    "required": ["name", "datatype", "shape"],
}


class JSONListField(serializers.Field):
    """A JSON list sent as a part of a multipart form (documented with contentType application/json)."""

    def __init__(self, child: serializers.Field | None = None, **kwargs: object) -> None:
        self.child = child
        super().__init__(**kwargs)

    def to_internal_value(self, data: object) -> list:
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise serializers.ValidationError(f"not valid JSON: {exc.msg}") from None
        if not isinstance(data, list):
            raise serializers.ValidationError("must be a JSON list")
        if self.child is not None:
            return serializers.ListField(child=self.child).run_validation(data)
        return data

    def to_representation(self, value: list) -> list:
        return value


@extend_schema_field(
    {
        "type": "array",
        "items": TENSOR_SPEC_SCHEMA,
        "minItems": 1,
        "description": 'JSON, e.g. [{"name": "input", "datatype": "FP32", "shape": [64]}]',
    }
)
class SignatureField(JSONListField):
    pass


@extend_schema_field(
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH_SIZE},
        "description": "JSON, e.g. [4, 8]; each within 1..max_batch_size",
    }
)
class BatchSizesField(JSONListField):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(child=StrictIntegerField(min_value=1, max_value=MAX_BATCH_SIZE), **kwargs)


@extend_schema_field({"type": "string", "pattern": "^[0-9a-fA-F]{64}$"})
class Sha256Field(StrictCharField):
    default_error_messages = {"sha256": "must be 64 hexadecimal digits"}

    def __init__(self, **kwargs: object) -> None:
        super().__init__(trim_whitespace=False, **kwargs)

    def to_internal_value(self, data: object) -> str:
        value = super().to_internal_value(data)
        if not SHA256_RE.fullmatch(value):
            self.fail("sha256")
        return value


@extend_schema_field({"type": "string", "format": "binary"})
class ArtifactField(serializers.FileField):
    """A file part of the multipart upload."""


@extend_schema_field(
    {
        **TENANT_SLUG_SCHEMA,
        "description": "for a new model, the tenant that owns it (default:"
        " the caller's only tenant); ignored otherwise",
    }
)
class UploadTenantField(TenantField):
    pass


class VersionUploadSerializer(serializers.Serializer):
    artifact = ArtifactField(help_text="TorchScript archive or torch.export program (.pt2)")
    tenant = UploadTenantField(required=False)
    format = serializers.ChoiceField(choices=ArtifactFormat.choices)
    sha256 = Sha256Field(required=False, help_text="checked against the upload")
    inputs = SignatureField()
    outputs = SignatureField()
    task = serializers.ChoiceField(choices=Task.choices, required=False)
    description = TextField(required=False, allow_blank=True)
    max_batch_size = serializers.IntegerField(min_value=1, max_value=MAX_BATCH_SIZE, required=False)
    max_queue_delay_ms = serializers.FloatField(min_value=0, max_value=MAX_QUEUE_DELAY_MS, required=False)
    preferred_batch_sizes = BatchSizesField(required=False)
    max_queue_size = serializers.IntegerField(min_value=1, max_value=MAX_QUEUE_SIZE, required=False)
    default_timeout_ms = serializers.IntegerField(min_value=1, max_value=MAX_DEFAULT_TIMEOUT_MS, required=False)


# Parts of the upload that carry JSON, for the schema's multipart encoding.
UPLOAD_JSON_PARTS = ("inputs", "outputs", "preferred_batch_sizes")
