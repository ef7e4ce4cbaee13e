from django.apps import AppConfig

from tenants import checks  # noqa: F401  (registers the system checks of login-related settings)


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants"
