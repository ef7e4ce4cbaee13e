from django.apps import AppConfig


class AutoscalingConfig(AppConfig):
    name = "autoscaling"
    verbose_name = "Autoscaling"

    def ready(self) -> None:
        from autoscaling import signals  # noqa: F401  (a policy turned off or deleted clears desired_replicas)
