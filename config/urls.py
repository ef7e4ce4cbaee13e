from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView

from rollout import promotion_views as promotion_console
from rollout import shadow_views as shadow_console
from rollout import views as rollout_console
from serving import artifact_views, fleet_views, pipeline_views, planner_views
from serving import views as console
from serving.api import docs as api_docs
from tenants import policy_views as policy_console
from tenants import views as tenant_console
from usage import views as usage_console

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="console-models", permanent=False)),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("console/models/", console.models_page, name="console-models"),
    path("console/live/", console.models_live, name="console-models-live"),
    path("console/models/<str:name>/", console.model_page, name="console-model"),
    path("console/models/<str:name>/shadow/", shadow_console.shadow_page, name="console-shadow"),
    path("console/models/<str:name>/rollouts/", rollout_console.rollout_start, name="console-rollout-start"),
    path("console/rollouts/<int:pk>/<str:move>/", rollout_console.rollout_action, name="console-rollout-action"),
    path("console/models/<str:name>/promote/", promotion_console.promote, name="console-promote"),
    path(
        "console/promotion-requests/<int:pk>/<str:move>/",
        promotion_console.promotion_action,
        name="console-promotion-action",
    ),
    path(
        "console/tenants/<slug:slug>/promotion-policy/",
        policy_console.promotion_policy,
        name="console-promotion-policy",
    ),
    path("console/tenants/", tenant_console.tenants_page, name="console-tenants"),
    path("console/tenants/<slug:slug>/", tenant_console.tenant_page, name="console-tenant"),
    path("console/tenants/<slug:slug>/keys/", tenant_console.keys_page, name="console-keys"),
    path("console/tenants/<slug:slug>/quota/", tenant_console.quota_page, name="console-quota"),
    path("console/quota-requests/", tenant_console.quota_review_page, name="console-quota-review"),
    path("console/audit/", tenant_console.audit_page, name="console-audit"),
    path("console/usage/", usage_console.usage_page, name="console-usage"),
    path("console/planner/", planner_views.planner_page, name="console-planner"),
    path("console/planner/fleet/", planner_views.planner_fleet, name="console-planner-fleet"),
    path("console/fleet/", fleet_views.fleet_page, name="console-fleet"),
    path("console/pipelines/", pipeline_views.pipelines_page, name="console-pipelines"),
    path("console/pipelines/<str:name>/", pipeline_views.pipeline_page, name="console-pipeline"),
    path("console/pipelines/<str:name>/live/", pipeline_views.pipeline_live, name="console-pipeline-live"),
    # Before the API's include: its last pattern answers every other /api/ path with a JSON 404.
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", api_docs.SwaggerView.as_view(url_name="schema"), name="api-docs"),
    path("api/redoc/", api_docs.RedocView.as_view(url_name="schema"), name="api-redoc"),
    path("api/", api_docs.ApiIndexView.as_view(), name="api-index"),
    path("api/", include("usage.api.urls")),
    path("api/", include("rollout.api.urls")),
    path("api/", include("serving.api.urls")),
    path("internal/artifacts/<str:sha256>", artifact_views.artifact, name="internal-artifact"),
    path("admin/", admin.site.urls),
]

handler500 = "serving.api.errors.server_error"
