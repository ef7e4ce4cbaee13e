from django.contrib import admin

from serving.actions import sharing_state
from serving.models import Artifact, Model, ModelVersion


class VersionInline(admin.TabularInline):
    """Every batching setting is editable here; ModelVersion.clean() (run by the admin's full_clean) refuses
    a combination the data plane could not serve, naming the field."""

    model = ModelVersion
    extra = 0
    fields = [
        "version",
        "state",
        "loaded",
        "max_batch_size",
        "max_queue_delay_ms",
        "preferred_batch_sizes",
        "max_queue_size",
        "default_timeout_ms",
        "failure_reason",
    ]
    readonly_fields = ["version", "state", "failure_reason"]


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "visibility", "task", "fallback", "stable_version", "updated_at"]
    inlines = [VersionInline]
    # Routing changes go through serving.actions (promote, set_routing), which audit them.
    readonly_fields = ["stable_version", "rollout_weights", "experiment_arms", "tenant_versions"]

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001
        # Read before the admin writes: shared_with is saved later, in save_related.
        obj._sharing_before = sharing_state(Model.objects.get(pk=obj.pk)) if change else None
        super().save_model(request, obj, form, change)

    def save_related(self, request, form, formsets, change) -> None:  # noqa: ANN001
        """Visibility changed here goes into the audit log like the API's (the admin's view runs in one
        transaction, so the entry commits with the change)."""
        from tenants import audit

        super().save_related(request, form, formsets, change)
        model = form.instance
        before, after = getattr(model, "_sharing_before", None), sharing_state(model)
        if after != before:
            audit.record(
                request.user, "model.visibility", f"model {model.name}", tenant=model.tenant, before=before, after=after
            )


@admin.register(Artifact)
class ArtifactAdmin(admin.ModelAdmin):
    list_display = ["sha256", "size_bytes", "created_at"]
    readonly_fields = ["sha256", "size_bytes", "created_at"]
