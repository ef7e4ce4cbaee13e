from django.contrib import admin
from django.http import HttpRequest

from rollout.models import Approval, Rollout
from tenants.admin_audit import AuditedAdmin


class ApprovalInline(admin.TabularInline):
    model = Approval
    extra = 0
    fields = ["username", "note", "at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Rollout)
class RolloutAdmin(AuditedAdmin, admin.ModelAdmin):
    """Read only: a rollout changes through rollout.transitions (the API, the console, the evaluator), which
    lock it, move the model's routing and audit; an edit here would do none of that. A finished rollout may
    be deleted (rollout.delete, audited); a running one may not: its candidate would keep the share of
    traffic its step gave it, with no gate left to roll it back and no approval (rollout.approval) for it."""

    list_display = ["pk", "model", "baseline", "candidate", "state", "step", "approved", "started_by", "started_at"]
    list_filter = ["state"]
    search_fields = ["model__name"]
    inlines = [ApprovalInline]
    audit_name = "rollout"

    def audit_target(self, obj: Rollout) -> str:
        # rollout.transitions' words for a rollout
        return f"rollout #{obj.pk} of model {obj.model.name} version {obj.candidate}"

    def audit_tenant(self, obj: Rollout) -> object:
        return obj.model.tenant

    def audit_state(self, obj: Rollout) -> dict:
        return {**obj.summary(), "baseline": obj.baseline, "candidate": obj.candidate}

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Rollout | None = None) -> bool:
        # Asked per object by the delete page and by "delete selected" (and for a model's rollouts when the
        # model is deleted here): a running one makes each refuse.
        if obj is not None and obj.active:
            return False
        return super().has_delete_permission(request, obj)
