"""GET /api/usage/: usage per tenant, model, version and period, as JSON (paginated) or CSV (whole)."""

from __future__ import annotations

import csv
import io
from datetime import datetime

from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import generics
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.request import Request
from rest_framework.response import Response

from serving.api.pagination import BoundedLimitOffsetPagination
from serving.api.serializers import ErrorSerializer
from tenants.scoping import visible_tenants
from usage.api.serializers import UsageQuerySerializer, UsageRowSerializer
from usage.models import UsageMinute
from usage.report import DEFAULT_RANGE, MAX_RANGE, TooMuchUsage, periods

COLUMNS = list(UsageRowSerializer().fields)


class CSVRenderer(BaseRenderer):
    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(
        self, data: object, accepted_media_type: str | None = None, renderer_context: dict | None = None
    ) -> bytes:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in data:  # type: ignore[attr-defined]
            writer.writerow({k: _inert(v) for k, v in row.items()})
        return out.getvalue().encode()


def _inert(value: object) -> object:
    """A spreadsheet runs a cell that starts with = + - or @ as a formula (a slug may start with -)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@"):
        return "'" + value
    return value


def usage_range(granularity: str, start: datetime | None, end: datetime | None) -> tuple[datetime, datetime]:
    """[start, end) with the defaults filled in; a range longer than the granularity allows is a 400."""
    if end is None:
        end = (start + DEFAULT_RANGE[granularity]) if start is not None else timezone.now()
    if start is None:
        start = end - DEFAULT_RANGE[granularity]
    if end - start > MAX_RANGE[granularity]:
        days = MAX_RANGE[granularity].total_seconds() / 86400
        raise ValidationError({"to": [f"a range of {granularity}s spans at most {days:g} days"]})
    return start, end


def _error(description: str) -> OpenApiResponse:
    return OpenApiResponse(ErrorSerializer, description=description)


class UsageView(generics.ListAPIView):
    serializer_class = UsageRowSerializer
    pagination_class = BoundedLimitOffsetPagination
    renderer_classes = [JSONRenderer, CSVRenderer]
    queryset = UsageMinute.objects.none()  # for the schema; get() builds the real one for the caller

    @extend_schema(
        summary="Usage per tenant, model, version and period",
        description=(
            "Requests, errors, items, compute seconds and latency percentiles, summed from minute cells"
            " (they land a flush interval, 10 s by default, after the answers). JSON is paginated with"
            " limit/offset; `format=csv` or `Accept: text/csv` gives every row as CSV."
        ),
        parameters=[
            UsageQuerySerializer,
            OpenApiParameter("format", str, enum=["json", "csv"], description="csv: the whole result as CSV"),
        ],
        responses={
            (200, "application/json"): UsageRowSerializer(many=True),
            (200, "text/csv"): OpenApiTypes.STR,
            (400, "application/json"): _error("A query parameter is malformed, or the range is too long."),
            (403, "application/json"): _error("Not logged in."),
            (404, "application/json"): _error("No such tenant, or one the caller does not belong to."),
        },
    )
    def get(self, request: Request, *args: object, **kwargs: object) -> Response:
        # A plain dict: from a QueryDict DRF reads an empty `from=` or `to=` as absent, not as malformed.
        query = UsageQuerySerializer(data=dict(request.query_params.items()))
        query.is_valid(raise_exception=True)
        params = query.validated_data
        granularity = params["granularity"]
        start, end = usage_range(granularity, params.get("from"), params.get("to"))
        tenants = visible_tenants(request.user)
        if "tenant" in params:
            tenant = tenants.filter(slug=params["tenant"]).first()
            if tenant is None:
                raise NotFound(f"unknown tenant '{params['tenant']}'")
            cells = UsageMinute.objects.filter(tenant=tenant)
        else:
            cells = UsageMinute.objects.filter(tenant__in=tenants)
        if "model" in params:
            cells = cells.filter(model_name=params["model"])
        if "version" in params:
            cells = cells.filter(version=params["version"])
        try:
            found = periods(cells, start=start, end=end, granularity=granularity)
        except TooMuchUsage as exc:
            raise ValidationError({"from": [str(exc)]}) from None
        rows = [p.as_row() for p in found]
        if isinstance(request.accepted_renderer, CSVRenderer):
            data = UsageRowSerializer(rows, many=True).data
            name = f"usage-{start:%Y%m%dT%H%M}-{end:%Y%m%dT%H%M}.csv"
            return Response(data, headers={"Content-Disposition": f'attachment; filename="{name}"'})
        page = self.paginate_queryset(rows)
        return self.get_paginated_response(UsageRowSerializer(page, many=True).data)

    def perform_content_negotiation(self, request: Request, force: bool = False) -> tuple:
        if request.method != "GET":  # OPTIONS' metadata, a 405: JSON, whatever the caller asked for
            return JSONRenderer(), JSONRenderer.media_type
        return super().perform_content_negotiation(request, force)

    def handle_exception(self, exc: Exception) -> Response:
        # Errors are JSON whatever the caller asked for.
        self.request.accepted_renderer = JSONRenderer()
        self.request.accepted_media_type = JSONRenderer.media_type
        return super().handle_exception(exc)
