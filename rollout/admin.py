from django.contrib import admin
from django.http import HttpRequest

from rollout.models import Approval, Rollout


class ApprovalInline(admin.TabularInline):
    model = Approval
    extra = 0
    fields = ["username", "note", "at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False


@admin.register(Rollout)
class RolloutAdmin(admin.ModelAdmin):
    """Read only: a rollout changes through rollout.transitions (the API, the console, the evaluator), which
    lock it, move the model's routing and audit; an edit here would do none of that."""

    list_display = ["pk", "model", "baseline", "candidate", "state", "step", "approved", "started_by", "started_at"]
    list_filter = ["state"]
    search_fields = ["model__name"]
    inlines = [ApprovalInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
