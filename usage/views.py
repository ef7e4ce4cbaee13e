"""The console's usage page: one tenant's use over the last hour (by minute) or day (by hour)."""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.safestring import mark_safe

from tenants.scoping import visible_tenants
from usage.chart import Point, usage_svg
from usage.models import UsageMinute
from usage.report import DEFAULT_RANGE, GRANULARITY, Period, periods, truncate
from usage.sketch import merged, quantile

CHARTED = ("minute", "hour")
MAX_TABLE_ROWS = 500


def _points(found: list[Period], start, end, granularity: str) -> list[Point]:  # noqa: ANN001
    """One point per period of the range, empty periods included, summed over the tenant's models."""
    by_start: dict = {}
    for p in found:
        by_start.setdefault(p.start, []).append(p)
    step = GRANULARITY[granularity]
    points, at = [], truncate(start, granularity)
    while at < end:
        here = by_start.get(at, [])
        p99 = quantile(merged(p.latency for p in here), 0.99)
        points.append(
            Point(
                at,
                sum(p.requests for p in here),
                sum(p.errors_4xx + p.errors_5xx for p in here),
                None if p99 is None else round(p99 * 1000, 1),
            )
        )
        at += step
    return points


@login_required
def usage_page(request: HttpRequest) -> HttpResponse:
    tenants = list(visible_tenants(request.user).order_by("name"))
    slug = request.GET.get("tenant")
    if slug is not None:
        tenant = next((t for t in tenants if t.slug == slug), None)
        if tenant is None:
            raise Http404("no such tenant")  # another tenant's usage looks exactly like a missing tenant
    else:
        tenant = tenants[0] if tenants else None
    granularity = request.GET.get("granularity", "minute")
    if granularity not in CHARTED:
        granularity = "minute"
    context: dict = {"tenants": tenants, "tenant": tenant, "granularity": granularity, "choices": CHARTED}
    if tenant is not None:
        end = truncate(timezone.now(), granularity) + GRANULARITY[granularity]
        start = end - DEFAULT_RANGE[granularity]
        found = periods(UsageMinute.objects.filter(tenant=tenant), start=start, end=end, granularity=granularity)
        points = _points(found, start, end, granularity)
        context.update(
            chart=mark_safe(usage_svg(points, time_format="%H:%M")),  # noqa: S308 (numbers and times only)
            rows=[p.as_row() for p in reversed(found)][:MAX_TABLE_ROWS],
            totals={"requests": sum(p.requests for p in points), "errors": sum(p.errors for p in points)},
            csv_url=reverse("api-usage")
            + "?"
            + urlencode(
                {
                    "tenant": tenant.slug,
                    "granularity": granularity,
                    "format": "csv",
                    "from": start.isoformat(),
                    "to": end.isoformat(),
                }
            ),
            start=start,
            end=end,
        )
    return render(request, "console/usage.html", context)
