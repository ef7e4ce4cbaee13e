"""The API's pages for people: /api/ lists the resources and where the schema and its two readers are;
/api/docs/ is Swagger UI and /api/redoc/ Redoc, their scripts from drf-spectacular-sidecar in our static files.

Neither page may load anything from elsewhere: Redoc's page comes without drf-spectacular's web-font links
(templates/api/redoc.html), Swagger UI's script is a file of its own (the split view) rather than inline, and
both answer with a Content-Security-Policy that allows this origin only (besides data: images, blob: workers and
inline styles), which also stops the Redocly logo that Redoc's bundle fetches from its CDN (the image is
dropped; the "API docs by Redocly" link stays).

All three are open to anonymous visitors, like /api/schema/ itself: they name only paths the public schema
names already, and every resource behind them keeps its own authentication and permissions."""

from drf_spectacular.utils import extend_schema, inline_serializer
from drf_spectacular.views import SpectacularRedocView, SpectacularSwaggerSplitView
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

# (name, URL name): the top-level collections; nested ones (a model's versions, a tenant's keys) are under them.
RESOURCES = (
    ("models", "model-list"),
    ("tenants", "tenant-list"),
    ("rollouts", "rollout-list"),
    ("promotion-requests", "promotion-request-list"),
    ("audit", "audit-list"),
    ("usage", "api-usage"),
    ("fleet", "api-fleet"),
)

ApiIndex = inline_serializer(
    "ApiIndex",
    {
        "resources": inline_serializer(
            "ApiResource",
            {
                "name": serializers.CharField(),
                "url": serializers.URLField(),
            },
            many=True,
        ),
        "schema": serializers.URLField(help_text="the OpenAPI document"),
        "docs": serializers.URLField(help_text="Swagger UI over the schema"),
        "redoc": serializers.URLField(help_text="Redoc over the schema"),
    },
)


class ApiIndexView(APIView):
    permission_classes = [AllowAny]
    authentication_classes = []  # nothing here depends on who asks

    @extend_schema(
        operation_id="api_index",
        responses={200: ApiIndex},
        auth=[],
        summary="The resources of this API, the schema and the documentation pages",
    )
    def get(self, request: Request) -> Response:
        def url(name: str) -> str:
            return reverse(name, request=request)

        return Response(
            {
                "resources": [{"name": name, "url": url(url_name)} for name, url_name in RESOURCES],
                "schema": url("schema"),
                "docs": url("api-docs"),
                "redoc": url("api-redoc"),
            }
        )


class _ThisOriginOnly:
    """Answers with a Content-Security-Policy that lets the page load from this server only."""

    # Inline styles: both UIs set them from their scripts; data: images: Swagger UI's icons; blob: workers:
    # Redoc's search index.
    content_security_policy = (
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
        "worker-src 'self' blob:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    )

    def finalize_response(self, request: Request, response: Response, *args: object, **kwargs: object) -> Response:
        response = super().finalize_response(request, response, *args, **kwargs)
        response["Content-Security-Policy"] = self.content_security_policy
        return response


class SwaggerView(_ThisOriginOnly, SpectacularSwaggerSplitView):
    pass


class RedocView(_ThisOriginOnly, SpectacularRedocView):
    template_name = "api/redoc.html"
