from django.urls import include, path
from rest_framework.routers import SimpleRouter

from serving.api.views import ModelVersionViewSet, ModelViewSet

router = SimpleRouter()
router.register("models", ModelViewSet, basename="model")
versions = SimpleRouter()
versions.register("versions", ModelVersionViewSet, basename="model-version")

urlpatterns = [
    path("", include(router.urls)),
    path("models/<str:model_name>/", include(versions.urls)),
]
