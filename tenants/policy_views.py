"""The tenant page's promotion policy form (console): platform staff set it; every member reads it on the
page (templates/console/tenant.html). A tenant's admin is refused (403) like any other member."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from tenants.promotion_policy import PolicyError, set_promotion_policy
from tenants.scoping import tenant_or_404


@login_required
@require_POST
def promotion_policy(request: HttpRequest, slug: str) -> HttpResponse:
    tenant = tenant_or_404(request.user, slug)  # 404 for a tenant the user is not in
    try:
        set_promotion_policy(tenant=tenant, policy=request.POST.get("promotion_policy", ""), actor=request.user)
    except PolicyError as exc:
        if exc.status == 403:
            raise PermissionDenied(exc.message) from None
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
    return redirect("console-tenant", slug=tenant.slug)
