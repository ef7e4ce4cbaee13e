from django.urls import path

from usage.api.views import UsageView

urlpatterns = [path("usage/", UsageView.as_view(), name="api-usage")]
