from django.urls import include, path, re_path
from rest_framework.routers import SimpleRouter

from serving.api.serializers import TENANT_SLUG_PATTERN
from tenants.api.views import (
    ApiKeyViewSet,
    AuditViewSet,
    MemberViewSet,
    QuotaRequestViewSet,
    QuotaViewSet,
    TenantViewSet,
)

router = SimpleRouter()
router.register("tenants", TenantViewSet, basename="tenant")
router.register("audit", AuditViewSet, basename="audit")
nested = SimpleRouter()
nested.register("members", MemberViewSet, basename="tenant-member")
nested.register("keys", ApiKeyViewSet, basename="tenant-key")
nested.register("quota-requests", QuotaRequestViewSet, basename="tenant-quota-request")

urlpatterns = [
    re_path("", include(router.urls)),
    re_path(
        rf"^tenants/(?P<slug>{TENANT_SLUG_PATTERN})/",
        include(
            [
                path("quota/", QuotaViewSet.as_view({"get": "retrieve"}), name="tenant-quota"),
                *nested.urls,
            ]
        ),
    ),
]
