from django.urls import include, re_path
from rest_framework.routers import SimpleRouter

from rollout.api.promotion import PromotionRequestViewSet
from rollout.api.views import RolloutViewSet

router = SimpleRouter()
router.register("rollouts", RolloutViewSet, basename="rollout")
router.register("promotion-requests", PromotionRequestViewSet, basename="promotion-request")

urlpatterns = [re_path("", include(router.urls))]
