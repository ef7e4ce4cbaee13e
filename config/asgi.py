"""ASGI entry point: /v2 and /metrics go to the lean inference consumer, /ws/v2 to the inference socket, the
rest to Django.

Every request passes the front door (serving.dataplane.http.frontdoor) first: its body is counted against the
process's budget of body bytes held, and a body for Django is bounded before Django reads it.
"""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.core.asgi import get_asgi_application  # noqa: E402
from django.urls import path  # noqa: E402

django_app = get_asgi_application()

from django.conf import settings  # noqa: E402
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

if settings.SECRET_KEY_MISSING:  # a web process of a shared deployment on a key of its own (config.settings)
    raise ImproperlyConfigured(settings.SECRET_KEY_MISSING)

from serving.dataplane.http.consumers import InferenceConsumer, InferenceRequest  # noqa: E402
from serving.dataplane.http.websocket import InferenceSocket  # noqa: E402
from serving.django_door import bounded  # noqa: E402
from serving.fleet_consumer import FleetConsumer  # noqa: E402
from serving.lifespan import Lifespan  # noqa: E402

inference_app = InferenceConsumer.as_asgi()


async def http_app(scope, receive, send):  # noqa: ANN001, ANN201
    path = scope["path"]
    if path == "/v2" or path.startswith("/v2/") or path == "/metrics":
        # The consumer bounds its own body (413 past FERRY_MAX_INFER_BODY_BYTES) and charges it to the
        # process's budget itself: no wrapper on the hot path.
        return await inference_app(scope, receive, send)
    return await bounded(django_app, scope, receive, send)


# The console's live pages: session-authenticated, and only from a page of an allowed host (a page elsewhere
# could otherwise open a socket with the user's cookie).
console_websocket_app = AllowedHostsOriginValidator(
    AuthMiddlewareStack(
        URLRouter(
            [
                path("ws/fleet/", FleetConsumer.as_asgi()),
            ]
        )
    )
)

# Inference over a WebSocket (/ws/v2/models/{name}[/versions/{v}]/infer): an API key in every connection, no
# session or cookie, so no Origin check (docs/websocket.md); a path of its own, never through the console's stack.
websocket_infer_app = InferenceSocket.as_asgi()


async def websocket_app(scope, receive, send):  # noqa: ANN001, ANN201
    if scope["path"].startswith("/ws/v2/"):
        return await websocket_infer_app(scope, receive, send)
    return await console_websocket_app(scope, receive, send)


application = ProtocolTypeRouter({"http": http_app, "websocket": websocket_app, "lifespan": Lifespan()})
# The front door's protocol answers inference POSTs with this handler directly, without ASGI
# (serving.dataplane.http.frontdoor.Lane); the consumer above runs the same handler for every other /v2 request.
application.ferry_infer = InferenceRequest
