from django.apps import AppConfig


class AutoscalingConfig(AppConfig):
    name = "autoscaling"
    verbose_name = "Autoscaling"

    def ready(self) -> None:
        # Here, not at the top: the receivers' module imports models, which Django allows only once the app
        # registry is ready, and ready() is the hook it calls then. (A policy turned off or deleted clears
        # desired_replicas.)
        from autoscaling import signals  # noqa: F401
