from django.contrib import admin

from tenants.models import ApiKey, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "created_at"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are created with `manage.py create_api_key` (the token is shown once); here they are read and
    revoked (set revoked_at)."""

    list_display = ["name", "tenant", "prefix", "scopes", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["tenant"]
    readonly_fields = ["tenant", "name", "prefix", "digest", "scopes", "created_by", "created_at", "updated_at",
                       "last_used_at"]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False
