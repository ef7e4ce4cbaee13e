import json

from rest_framework import serializers

from serving.models import ArtifactFormat, Model, ModelVersion, Task


class ModelVersionSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    artifact_sha256 = serializers.CharField(source="artifact_id", read_only=True)

    class Meta:
        model = ModelVersion
        fields = [
            "model", "version", "state", "failure_reason", "loaded", "format", "artifact_sha256",
            "inputs", "outputs", "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes",
            "max_queue_size", "default_timeout_ms", "latency_profile", "memory_bytes", "load_seconds",
            "metrics", "created_at", "updated_at",
        ]
        read_only_fields = [
            "model", "version", "state", "failure_reason", "format", "artifact_sha256", "inputs", "outputs",
            "latency_profile", "memory_bytes", "load_seconds", "metrics", "created_at", "updated_at",
        ]


class ModelSerializer(serializers.ModelSerializer):
    fallback = serializers.SlugRelatedField(
        slug_field="name", queryset=Model.objects.all(), allow_null=True, required=False
    )
    versions = ModelVersionSerializer(many=True, read_only=True)

    class Meta:
        model = Model
        fields = ["name", "description", "task", "fallback", "versions", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def validate_fallback(self, value: Model | None) -> Model | None:
        if value is not None and self.instance is not None and value.pk == self.instance.pk:
            raise serializers.ValidationError("a model cannot be its own fallback")
        return value


class JSONListField(serializers.Field):
    """A JSON list sent as a string field of a multipart form."""

    def to_internal_value(self, data: object) -> list:
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise serializers.ValidationError(f"not valid JSON: {exc.msg}") from None
        if not isinstance(data, list):
            raise serializers.ValidationError("must be a JSON list")
        return data

    def to_representation(self, value: list) -> list:
        return value


class VersionUploadSerializer(serializers.Serializer):
    artifact = serializers.FileField(help_text="TorchScript archive or torch.export program (.pt2)")
    format = serializers.ChoiceField(choices=ArtifactFormat.choices)
    sha256 = serializers.RegexField(r"^[0-9a-fA-F]{64}$", required=False, help_text="checked against the upload")
    inputs = JSONListField(help_text='[{"name": "input", "datatype": "FP32", "shape": [64]}]')
    outputs = JSONListField()
    task = serializers.ChoiceField(choices=Task.choices, required=False)
    description = serializers.CharField(required=False, allow_blank=True)
    max_batch_size = serializers.IntegerField(min_value=1, max_value=4096, required=False)
    max_queue_delay_ms = serializers.FloatField(min_value=0, max_value=10_000, required=False)
    preferred_batch_sizes = JSONListField(required=False)
    max_queue_size = serializers.IntegerField(min_value=1, max_value=1_000_000, required=False)
    default_timeout_ms = serializers.IntegerField(min_value=1, max_value=600_000, required=False)
