from django.contrib import admin

from autoscaling.models import ScalingPolicy


@admin.register(ScalingPolicy)
class ScalingPolicyAdmin(admin.ModelAdmin):
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
