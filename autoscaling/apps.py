from django.apps import AppConfig


class AutoscalingConfig(AppConfig):
    name = "autoscaling"
    verbose_name = "Autoscaling"
