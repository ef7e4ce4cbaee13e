from django.apps import AppConfig


class RolloutConfig(AppConfig):
    name = "rollout"
    verbose_name = "Rollout"
