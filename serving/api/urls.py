from django.urls import include, re_path
from rest_framework.routers import SimpleRouter

from serving.api.errors import not_found
from serving.api.pipelines import PipelineViewSet
from serving.api.views import ModelVersionViewSet, ModelViewSet
from serving.fleet_views import FleetView
from serving.models import MODEL_NAME_PATTERN

router = SimpleRouter()
router.register("models", ModelViewSet, basename="model")
router.register("pipelines", PipelineViewSet, basename="pipeline")
versions = SimpleRouter()
versions.register("versions", ModelVersionViewSet, basename="model-version")

urlpatterns = [
    re_path(r"^fleet/$", FleetView.as_view(), name="api-fleet"),
    re_path("", include(router.urls)),
    re_path("", include("tenants.api.urls")),
    # The same pattern as the schema's `model_name` (and ModelViewSet's `name`).
    re_path(rf"^models/(?P<model_name>{MODEL_NAME_PATTERN})/", include(versions.urls)),
    # Whatever else ends in a slash (control characters included) is no endpoint: a JSON 404. A path
    # without the slash is redirected to it first by APPEND_SLASH, so it ends here too.
    re_path(r"^(?:[\s\S]*/)?$", not_found),
]
