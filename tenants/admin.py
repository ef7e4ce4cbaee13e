from django.contrib import admin

from tenants import audit
from tenants.actions import key_state
from tenants.admin_audit import AuditedAdmin
from tenants.models import ApiKey, AuditEntry, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin, admin.ModelAdmin):
    """Audited: the approval and sharing settings under their own actions (below), roles as role.*, any other
    field as tenant.change; creating and deleting a tenant as tenant.create and tenant.delete."""

    list_display = ["name", "slug", "allow_self_approval", "created_at"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline]
    audit_name = "tenant"
    audit_elsewhere = ("allow_self_approval", "promotion_policy", "share_shadow_samples")

    def audit_target(self, obj: Tenant) -> str:
        return f"tenant {obj.slug}"

    def audit_tenant(self, obj: Tenant) -> Tenant:
        return obj

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001
        """Loosening (or restoring) the four-eyes rule on rollouts is a change the audit log keeps."""
        super().save_model(request, obj, form, change)
        if change and "allow_self_approval" in form.changed_data:
            audit.record(
                request.user,
                "tenant.self_approval",
                f"tenant {obj.slug}",
                tenant=obj,
                before={"allow_self_approval": not obj.allow_self_approval},
                after={"allow_self_approval": obj.allow_self_approval},
            )
        if change and "promotion_policy" in form.changed_data:  # staff only (the admin site), audited as the API's is
            audit.record(
                request.user,
                "tenant.promotion_policy",
                f"tenant {obj.slug}",
                tenant=obj,
                before={"promotion_policy": form.initial.get("promotion_policy")},
                after={"promotion_policy": obj.promotion_policy},
            )
        if change and "share_shadow_samples" in form.changed_data:  # as the console's and the API's change is
            audit.record(
                request.user,
                "tenant.shadow_samples",
                f"tenant {obj.slug}",
                tenant=obj,
                before={"share_shadow_samples": not obj.share_shadow_samples},
                after={"share_shadow_samples": obj.share_shadow_samples},
            )

    def save_formset(self, request, form, formset, change) -> None:  # noqa: ANN001
        """Role changes made here go into the audit log like the console's (the admin's view runs in one
        transaction, so the entries commit with the change)."""
        roles_before = {id(f.instance): f.initial.get("role") for f in formset.initial_forms}
        super().save_formset(request, form, formset, change)
        if formset.model is not Membership:
            return
        for m in formset.new_objects:
            audit.record(
                request.user, "role.add", f"member {m.user.get_username()}", tenant=m.tenant, after={"role": m.role}
            )
        for m, fields in formset.changed_objects:
            if "role" in fields or "user" in fields:
                audit.record(
                    request.user,
                    "role.change",
                    f"member {m.user.get_username()}",
                    tenant=m.tenant,
                    before={"role": roles_before.get(id(m))},
                    after={"role": m.role},
                )
        for m in formset.deleted_objects:
            audit.record(
                request.user,
                "role.remove",
                f"member {m.user.get_username()}",
                tenant=m.tenant,
                before={"role": roles_before.get(id(m))},
            )


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin, admin.ModelAdmin):
    """Keys are created with `manage.py create_api_key` or the console (the token is shown once); here they
    are read and revoked (set revoked_at) or given an expiry, which the audit log records, as it does a
    key deleted here (key.delete, never its digest)."""

    list_display = ["name", "tenant", "prefix", "scopes", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    readonly_fields = [
        "tenant",
        "name",
        "prefix",
        "digest",
        "scopes",
        "created_by",
        "created_at",
        "updated_at",
        "last_used_at",
    ]

    audit_name = "key"
    audit_elsewhere = ("expires_at", "revoked_at")  # key.revoke and key.change, in save_model

    def audit_target(self, obj: ApiKey) -> str:
        return f"key fy_{obj.prefix}"

    def audit_tenant(self, obj: ApiKey) -> Tenant:
        return obj.tenant

    def audit_state(self, obj: ApiKey) -> dict:
        return key_state(obj)

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001
        before = key_state(ApiKey.objects.get(pk=obj.pk)) if change else None
        super().save_model(request, obj, form, change)
        after = key_state(obj)
        if after != before:
            action = "key.revoke" if before and before["revoked_at"] is None and obj.revoked_at else "key.change"
            audit.record(request.user, action, f"key fy_{obj.prefix}", tenant=obj.tenant, before=before, after=after)


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    """Read-only: the log is appended to by the workflows, never edited."""

    list_display = ["at", "actor_name", "tenant", "action", "target"]
    list_filter = ["action", "tenant"]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
