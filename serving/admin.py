from django.contrib import admin

from serving.models import Artifact, Model, ModelVersion


class VersionInline(admin.TabularInline):
    """Every batching setting is editable here; ModelVersion.clean() (run by the admin's full_clean) refuses
    a combination the data plane could not serve, naming the field."""

    model = ModelVersion
    extra = 0
    fields = ["version", "state", "loaded", "max_batch_size", "max_queue_delay_ms", "preferred_batch_sizes",
              "max_queue_size", "default_timeout_ms", "failure_reason"]
    readonly_fields = ["version", "state", "failure_reason"]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "visibility", "task", "fallback", "updated_at"]
    inlines = [VersionInline]


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ["sha256", "size_bytes", "created_at"]
    readonly_fields = ["sha256", "size_bytes", "created_at"]
