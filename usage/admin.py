from django.contrib import admin
from django.http import HttpRequest

from usage.models import UsageMinute


@admin.register(UsageMinute)
class UsageMinuteAdmin(admin.ModelAdmin):
    """Read only: usage is what the data plane metered; an edit here would silently change a bill."""

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

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
