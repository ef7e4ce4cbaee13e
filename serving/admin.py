from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied

from serving.actions import sharing_state
from serving.model_names import not_available
from serving.models import Artifact, Model, ModelVersion, Pipeline, State, lock_name
from serving.validation import rename_refusal
from tenants import audit
from tenants.admin_audit import AuditedAdmin


class VersionInline(admin.TabularInline):
    """Every batching setting is editable here; ModelVersion.clean() (run by the admin's full_clean) refuses
    a combination the data plane could not serve, naming the field. Versions are neither added nor deleted
    here: one is registered by an upload (with its artifact) and leaves traffic by retiring, which takes it
    out of the model's routing and audits it (ModelVersion.retire); a deleted row would leave the routing
    naming it."""

    model = ModelVersion
    extra = 0
    can_delete = False
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

    def has_add_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


class ModelAdminForm(forms.ModelForm):
    """A new name is taken as the API takes one (serving.api.views.ModelViewSet): under the name lock, and
    refused when a pipeline holds it or when the tenant requires approval, the model has a stable version and
    a model of the tenant gave the name up (its callers would reach a version nobody approved for them)."""

    def clean(self) -> dict:
        cleaned = super().clean()
        name = cleaned.get("name")
        old = self.instance.name if self.instance.pk is not None else None
        if name and name != old:
            # Held to the end of the admin view's transaction, which saves the model: orders this against a
            # pipeline taking the name (serving.pipelines.register_pipeline).
            lock_name(name)
            if Pipeline.objects.filter(name=name).exists():
                self.add_error("name", not_available(name))
            elif self.instance.pk is not None and (refusal := rename_refusal(self.instance, name)) is not None:
                self.add_error("name", refusal)
        return cleaned


@admin.register(Model)
class ModelAdmin(AuditedAdmin, admin.ModelAdmin):
    """Audited as the API is: a rename is `model.rename` and a delete `model.delete` (the entries that make a
    model registered later under the name wait for an approval: serving.validation.name_released), a
    visibility change `model.visibility`; other fields `model.change`, a version's settings `version.change`.
    A model is deleted once every version is retired, as through the API; its owner is not changed (the
    API's rule too: its quota, approvals and audit history are its tenant's)."""

    form = ModelAdminForm
    list_display = ["name", "tenant", "visibility", "task", "fallback", "stable_version", "updated_at"]
    inlines = [VersionInline]
    # Routing changes go through serving.actions (promote, set_routing), which check the tenant's approval
    # policy and audit them.
    readonly_fields = [
        "stable_version",
        "rollout_weights",
        "experiment_arms",
        "tenant_versions",
        "shadow_version",
        "shadow_fraction",
    ]
    audit_name = "model"
    audit_elsewhere = ("name", "visibility", "shared_with")

    def audit_target(self, obj: Model) -> str:
        return f"model {obj.name}"

    def audit_tenant(self, obj: Model) -> object:
        return obj.tenant

    def audit_state(self, obj: Model) -> dict:
        """What the API's model.delete keeps."""
        return {
            "model": obj.pk,
            **obj.routing_state(),
            **sharing_state(obj),
            "versions": sorted(obj.versions.values_list("version", flat=True)),
        }

    def get_readonly_fields(self, request, obj=None) -> list[str]:  # noqa: ANN001
        return [*self.readonly_fields, "tenant"] if obj is not None else list(self.readonly_fields)

    def get_deleted_objects(self, objs, request):  # noqa: ANN001, ANN201
        """Live versions are listed as protected: the delete page and the bulk action then refuse, as the API
        does, until they are retired."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        live = ModelVersion.objects.filter(model__in=[m.pk for m in objs]).exclude(state=State.RETIRED)
        protected = [
            *protected,
            *(
                f"model {v.model.name} version {v.version} ({v.state}): retire it first"
                for v in live.select_related("model")
            ),
        ]
        return deleted, counts, perms_needed, protected

    def audit_delete(self, request, obj: Model) -> None:  # noqa: ANN001
        # Locked and checked again: a version may have been registered since the confirmation page.
        Model.objects.select_for_update().filter(pk=obj.pk).first()
        if obj.versions.exclude(state=State.RETIRED).exists():
            raise PermissionDenied(f"model {obj.name}: retire every version before deleting the model")
        super().audit_delete(request, obj)

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001
        # Read before the admin writes: shared_with is saved later, in save_related.
        obj._sharing_before = sharing_state(Model.objects.get(pk=obj.pk)) if change else None
        super().save_model(request, obj, form, change)
        old_name = form.initial.get("name")
        if change and obj.name != old_name:
            audit.record(
                request.user,
                "model.rename",
                f"model {old_name}",
                tenant=obj.tenant,
                before={"name": old_name, "model": obj.pk},
                after={"name": obj.name},
            )

    def save_related(self, request, form, formsets, change) -> None:  # noqa: ANN001
        """Visibility changed here goes into the audit log like the API's (the admin's view runs in one
        transaction, so the entry commits with the change)."""
        super().save_related(request, form, formsets, change)
        model = form.instance
        before, after = getattr(model, "_sharing_before", None), sharing_state(model)
        if after != before:
            audit.record(
                request.user, "model.visibility", f"model {model.name}", tenant=model.tenant, before=before, after=after
            )

    def save_formset(self, request, form, formset, change) -> None:  # noqa: ANN001
        super().save_formset(request, form, formset, change)
        if formset.model is ModelVersion:
            self.audit_formset(
                request,
                formset,
                "version",
                lambda v: f"model {v.model.name} version {v.version}",
                lambda v: v.model.tenant,
            )


@admin.register(Artifact)
class ArtifactAdmin(AuditedAdmin, admin.ModelAdmin):
    """Read and, once no version uses one (they protect it), deleted, audited. Artifacts are stored by an
    upload, which reads and hashes the file: a row added here would have neither."""

    list_display = ["sha256", "size_bytes", "created_at"]
    readonly_fields = ["sha256", "size_bytes", "created_at"]
    audit_name = "artifact"

    def audit_target(self, obj: Artifact) -> str:
        return f"artifact {obj.sha256}"

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False
