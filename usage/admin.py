from django.contrib import admin
from django.http import HttpRequest

from tenants.admin_audit import AuditedAdmin
from usage.models import UsageMinute


@admin.register(UsageMinute)
class UsageMinuteAdmin(AuditedAdmin, admin.ModelAdmin):
    """Read only: usage is what the data plane metered; an edit here would silently change a bill. A row
    deleted here (which changes a bill, and the evidence a rollout's gates read) is audited, usage.delete
    with what it counted."""

    list_display = [
        "minute",
        "tenant",
        "model_name",
        "version",
        "requests",
        "errors_4xx",
        "errors_5xx",
        "fell_back",
        "items",
        "compute_seconds",
    ]
    list_filter = ["tenant"]
    date_hierarchy = "minute"
    search_fields = ["model_name"]
    audit_name = "usage"

    def audit_target(self, obj: UsageMinute) -> str:
        return f"usage of model {obj.model_name} version {obj.version} at {obj.minute:%Y-%m-%d %H:%M}"

    def audit_tenant(self, obj: UsageMinute) -> object:
        return obj.tenant

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
