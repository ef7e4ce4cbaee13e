from django.contrib import admin

from serving.models import Artifact, Model, ModelVersion


class VersionInline(admin.TabularInline):
    model = ModelVersion
    extra = 0
    fields = ["version", "state", "loaded", "max_batch_size", "max_queue_delay_ms", "failure_reason"]
    readonly_fields = ["version", "state", "failure_reason"]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "task", "fallback", "updated_at"]
    inlines = [VersionInline]


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ["sha256", "size_bytes", "created_at"]
    readonly_fields = ["sha256", "size_bytes", "created_at"]
