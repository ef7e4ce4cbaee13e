from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving"

    def ready(self) -> None:
        from serving import signals  # noqa: F401  (connects snapshot refresh on registry changes)
