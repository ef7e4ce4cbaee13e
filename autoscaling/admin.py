from django.contrib import admin

from autoscaling.models import ScalingPolicy
from tenants.admin_audit import AuditedAdmin


@admin.register(ScalingPolicy)
class ScalingPolicyAdmin(AuditedAdmin, admin.ModelAdmin):
    """Audited as scaling.create, scaling.change (the fields changed) and scaling.delete, naming the version
    as `manage.py autoscale_version`'s version.scaling entries do."""

    list_display = (
        "version",
        "enabled",
        "max_replicas",
        "target_utilisation",
        "cool_down_seconds",
        "idle_to_zero_seconds",
        "accelerator",
    )
    list_select_related = ("version__model",)
    raw_id_fields = ("version",)
    audit_name = "scaling"

    def audit_target(self, obj: ScalingPolicy) -> str:
        return f"model {obj.version.model.name} version {obj.version.version}"

    def audit_tenant(self, obj: ScalingPolicy) -> object:
        return obj.version.model.tenant
