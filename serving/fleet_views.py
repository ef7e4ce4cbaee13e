"""The console's fleet page (`/console/fleet/`) and its JSON twin (`/api/fleet/`): nodes, their packing, their
busy share beside their work utilisation (now and over the last ten minutes), and the events of the last hour.
The page is kept live by `serving.fleet_consumer` over a WebSocket.

Viewers and up (a role in some tenant, or platform staff) see the whole fleet's nodes; versions of models they
may not see show as unnamed segments, and their events and failures are left out (`serving.fleet_state.scoped`).
"""

from __future__ import annotations

import time
from typing import Any

from asgiref.sync import async_to_sync
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils.safestring import mark_safe
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import PermissionDenied as ApiPermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from serving.api.serializers import ErrorSerializer
from serving.fleet_chart import packing_svg, size, utilisation_svg
from serving.fleet_state import read_now, scoped
from tenants.models import Role, has_role
from tenants.scoping import visible_models

NEEDS = "the fleet is shown to viewers and up (a role in some tenant) and platform staff"


def may_view(user: Any) -> bool:
    return has_role(user, Role.VIEWER)


def visible_names(user: Any) -> set[str] | None:
    """The model names `user` may see (None: every model, for platform staff)."""
    if user.is_staff:
        return None
    return set(visible_models(user).values_list("name", flat=True))


def _ago(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _pct(share: float | None) -> str:
    """A share as the page shows it: "—" where there is none (a lost node, a node that does not measure it)."""
    return "—" if share is None else f"{round(share * 100)}%"


def parts(state: dict[str, Any]) -> dict[str, str]:
    """The page's live sections rendered from a (scoped) state: what the page draws first and the socket sends."""
    nodes = [
        n
        | {
            "bar": mark_safe(packing_svg(n)),  # noqa: S308 (packing_svg escapes every name it draws)
            "used_text": size(n["memory_used"]),
            "budget_text": size(n["memory_budget"]),
            "busy_pct": _pct(n.get("busy")),
            "work_pct": _pct(n.get("work")),
            "chart": mark_safe(utilisation_svg(n)),  # noqa: S308 (utilisation_svg escapes the node's name)
            "seen": _ago(n["heartbeat_age"]),
            "heartbeat_text": time.strftime("%H:%M:%S", time.gmtime(n["heartbeat_at"])),
        }
        for n in state["nodes"]
    ]
    events = [e | {"time": time.strftime("%H:%M:%S", time.gmtime(e["at"]))} for e in state["events"]]
    return {
        "nodes": render_to_string("console/fleet_nodes.html", {"nodes": nodes}),
        "events": render_to_string("console/fleet_events.html", {"events": events}),
        "versions": render_to_string("console/fleet_versions.html", {"versions": state.get("versions", [])}),
    }


def state_for(user: Any) -> dict[str, Any]:
    return scoped(async_to_sync(read_now)(), visible_names(user))


@login_required
def fleet_page(request: HttpRequest) -> HttpResponse:
    if not may_view(request.user):
        raise PermissionDenied(NEEDS)
    state = state_for(request.user)
    return render(request, "console/fleet.html", {"parts": parts(state), "count": len(state["nodes"])})


class ResidentSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="model:version; empty for a version of a model the caller may not see")
    tier = serializers.ChoiceField(["hot", "warm"], help_text="hot: on the device; warm: in host memory")
    bytes = serializers.IntegerField(min_value=0)
    hidden = serializers.BooleanField(required=False)


class FleetNodeSerializer(serializers.Serializer):
    name = serializers.CharField()
    state = serializers.ChoiceField(["live", "lost"], help_text="lost: its heartbeat expired (within the hour)")
    embedded = serializers.BooleanField(
        help_text="a node without a heartbeat: inside the web process that answered, or its node host"
    )
    node_host = serializers.BooleanField(
        required=False, help_text="the node host that this web process and the others on its port share"
    )
    host = serializers.CharField()
    pid = serializers.IntegerField()
    device = serializers.CharField()
    accelerator = serializers.CharField()
    accelerator_count = serializers.IntegerField(min_value=0)
    labels = serializers.DictField(child=serializers.CharField())
    heartbeat_at = serializers.FloatField(help_text="epoch seconds")
    heartbeat_age = serializers.FloatField(help_text="seconds since the last heartbeat")
    memory_total = serializers.IntegerField(min_value=0)
    memory_budget = serializers.IntegerField(min_value=0)
    memory_used = serializers.IntegerField(min_value=0, help_text="bytes of hot versions")
    busy = serializers.FloatField(
        min_value=0, max_value=1, allow_null=True, help_text="device busy share of the last 10 s; null for a lost node"
    )
    work = serializers.FloatField(
        min_value=0,
        allow_null=True,
        help_text="work utilisation of the last 10 s: rows served at their version's best-batch device seconds over the"
        " 10 s, not capped (above `busy` means the reference under-prices a row); null for a lost node or one that"
        " does not measure it",
    )
    utilisation = serializers.ListField(
        child=serializers.ListField(child=serializers.FloatField(), min_length=3, max_length=3),
        help_text="[epoch seconds, busy, work] per 10 s over the last ten minutes, oldest first",
    )
    resident = ResidentSerializer(many=True)
    failures = serializers.DictField(child=serializers.CharField(), help_text="version key -> why it failed here")


class FleetEventSerializer(serializers.Serializer):
    node = serializers.CharField()
    at = serializers.FloatField(help_text="epoch seconds")
    kind = serializers.CharField(help_text="load, evict, load_failed, unschedulable, no_room, lost")
    group = serializers.ChoiceField(["load", "eviction", "failure", "other"])
    key = serializers.CharField(allow_blank=True, help_text="model:version; empty for a node's own event")
    detail = serializers.CharField(allow_blank=True)


class FleetVersionSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="model:version")
    state = serializers.CharField(help_text="as /v2/repository/index gives it: READY, LOADING, UNAVAILABLE, ...")
    reason = serializers.CharField(allow_blank=True, help_text="why it is not ready (cold, unschedulable, failed)")
    hot = serializers.ListField(child=serializers.CharField(), help_text="live nodes holding it on the device")
    warm = serializers.ListField(child=serializers.CharField(), help_text="live nodes holding it in host memory")


class FleetSerializer(serializers.Serializer):
    at = serializers.FloatField(help_text="when it was read, epoch seconds")
    nodes = FleetNodeSerializer(many=True)
    versions = FleetVersionSerializer(many=True, help_text="every version the caller may see, with its state")
    events = FleetEventSerializer(many=True, help_text="the last hour's, newest first (at most 200)")


class FleetView(APIView):
    """GET /api/fleet/: what the console's fleet page shows, for automation."""

    @extend_schema(
        operation_id="fleet_retrieve",
        responses={
            200: FleetSerializer,
            403: OpenApiResponse(ErrorSerializer, description=f"Not logged in, or no role: {NEEDS}."),
        },
    )
    def get(self, request: Request) -> Response:
        if not may_view(request.user):
            raise ApiPermissionDenied(NEEDS)
        return Response(FleetSerializer(state_for(request.user)).data)
