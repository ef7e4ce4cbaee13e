"""Console pages for tenants: members and roles, API keys, quota and quota requests, the audit log.

Every page needs a login; a tenant the user is not in is a 404 (as if it did not exist), a role too low for
the page or the action a 403. Actions are POSTs (CSRF-checked) that redirect back to the page.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_http_methods

from serving.quota_counts import usage_against_quota
from tenants import keys
from tenants.actions import KeyRequestError, create_key, revoke_key
from tenants.governance import GovernanceError, decide, remove_member, request_quota, set_role, set_shadow_sharing
from tenants.models import (
    ApiKey,
    AuditEntry,
    Membership,
    PromotionPolicy,
    Quota,
    QuotaRequest,
    Role,
    Tenant,
    has_role,
    role_in,
)
from tenants.scoping import tenant_or_404, visible_tenants

# The token just created travels to the page that shows it in a cookie of its own: signed, for that page only,
# for a minute, deleted the first time it is shown. Not in the session, whose store is the database: a token
# whose page was never loaded would sit there in clear until the session expired.
NEW_TOKEN = "ferry-new-api-key"
NEW_TOKEN_SECONDS = 60
AUDIT_PAGE = 200


def tenant_with_role(request: HttpRequest, slug: str, role: str) -> Tenant:
    """The tenant, 404 unless the user is in it (or staff), 403 unless they hold `role` there."""
    tenant = tenant_or_404(request.user, slug)
    if not has_role(request.user, role, tenant):
        raise PermissionDenied(f"this needs the {role} role in tenant {tenant.slug}")
    return tenant


def _bad(request: HttpRequest, template: str, context: dict, error: str) -> HttpResponse:
    return render(request, template, {**context, "error": error}, status=400)


@login_required
def tenants_page(request: HttpRequest) -> HttpResponse:
    rows = [{"tenant": t, "role": role_in(request.user, t)} for t in visible_tenants(request.user).order_by("name")]
    return render(request, "console/tenants.html", {"rows": rows})


@login_required
@require_http_methods(["GET", "POST"])
def tenant_page(request: HttpRequest, slug: str) -> HttpResponse:
    """Members and their roles; an admin adds, re-roles and removes them, and sets whether other tenants'
    shadow reports may keep samples of this tenant's requests."""
    tenant = tenant_with_role(request, slug, Role.VIEWER)
    members = Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")

    def context() -> dict:
        return {
            "tenant": tenant,
            "members": members,
            "roles": Role.values,
            "is_admin": has_role(request.user, Role.ADMIN, tenant),
            "my_role": role_in(request.user, tenant),
            "promotion_policies": PromotionPolicy.choices,
        }

    if request.method == "GET":
        return render(request, "console/tenant.html", context())
    tenant_with_role(request, slug, Role.ADMIN)
    username, role = request.POST.get("username", ""), request.POST.get("role", "")
    try:
        if request.POST.get("action") == "shadow_samples":
            set_shadow_sharing(
                tenant=tenant, share=request.POST.get("share_shadow_samples") == "on", actor=request.user
            )
        elif request.POST.get("action") == "remove":
            membership = members.filter(user__username=username).first()
            if membership is None:
                raise GovernanceError(f"{username} is not a member")
            remove_member(membership=membership, actor=request.user)
        else:
            user = get_user_model().objects.filter(username=username).first()
            if user is None:
                raise GovernanceError(f"no user named {username!r}")
            set_role(tenant=tenant, user=user, role=role, actor=request.user)
    except GovernanceError as exc:
        return _bad(request, "console/tenant.html", context(), exc.message)
    return redirect("console-tenant", slug=tenant.slug)


@login_required
@require_http_methods(["GET", "POST"])
def keys_page(request: HttpRequest, slug: str) -> HttpResponse:
    """The tenant's API keys (admin). A new key's token is shown on the next page view only."""
    tenant = tenant_with_role(request, slug, Role.ADMIN)

    def context() -> dict:
        return {
            "tenant": tenant,
            "keys": ApiKey.objects.filter(tenant=tenant).select_related("created_by"),
            "scopes": keys.SCOPES,
        }

    if request.method == "GET":
        # Deleted as it is shown: a reload, or any later view, no longer has it.
        new = request.get_signed_cookie(NEW_TOKEN, default=None, salt=NEW_TOKEN, max_age=NEW_TOKEN_SECONDS)
        response = render(request, "console/keys.html", {**context(), "new_token": new})
        response["Cache-Control"] = "no-store"
        if NEW_TOKEN in request.COOKIES:
            response.delete_cookie(NEW_TOKEN, path=request.path, samesite="Strict")
        return response
    if request.POST.get("action") == "revoke":
        key = ApiKey.objects.filter(tenant=tenant, prefix=request.POST.get("prefix", "")).first()
        if key is None:
            raise Http404("no such key")
        revoke_key(key=key, actor=request.user)
        return redirect("console-keys", slug=tenant.slug)
    try:
        days = request.POST.get("expires_in_days", "").strip()
        expires_at = None
        if days:
            if not days.isdigit() or not 1 <= int(days) <= 3650:
                raise KeyRequestError("expiry must be a whole number of days from 1 to 3650, or empty")
            expires_at = timezone.now() + timedelta(days=int(days))
        _, token = create_key(
            tenant=tenant,
            name=request.POST.get("name", "").strip(),
            scopes=request.POST.getlist("scopes"),
            expires_at=expires_at,
            created_by=request.user,
        )
    except KeyRequestError as exc:
        return _bad(request, "console/keys.html", context(), str(exc))
    response = redirect("console-keys", slug=tenant.slug)
    response.set_signed_cookie(
        NEW_TOKEN,
        token,
        salt=NEW_TOKEN,
        max_age=NEW_TOKEN_SECONDS,
        path=request.path,
        secure=settings.SESSION_COOKIE_SECURE,
        httponly=True,
        samesite="Strict",
    )
    return response


@login_required
@require_http_methods(["GET", "POST"])
def quota_page(request: HttpRequest, slug: str) -> HttpResponse:
    """The tenant's limits and its quota requests; an admin asks for new limits with a justification."""
    tenant = tenant_with_role(request, slug, Role.VIEWER)
    quota, _ = Quota.objects.get_or_create(tenant=tenant)

    def context() -> dict:
        used = usage_against_quota(tenant.pk)
        return {
            "tenant": tenant,
            "limits": [(name, value, used.get(name)) for name, value in quota.limits().items()],
            "is_admin": has_role(request.user, Role.ADMIN, tenant),
            "requests": QuotaRequest.objects.filter(tenant=tenant).select_related("requested_by", "decided_by"),
        }

    if request.method == "GET":
        return render(request, "console/quota.html", context())
    tenant_with_role(request, slug, Role.ADMIN)
    try:
        changes = {}
        for name in Quota.LIMITS:
            raw = request.POST.get(name, "").strip()
            if raw:
                if not raw.isdigit():
                    raise GovernanceError(f"{name} must be a whole number")
                changes[name] = int(raw)
        request_quota(
            tenant=tenant, changes=changes, justification=request.POST.get("justification", ""), actor=request.user
        )
    except GovernanceError as exc:
        return _bad(request, "console/quota.html", context(), exc.message)
    return redirect("console-quota", slug=tenant.slug)


@login_required
@require_http_methods(["GET", "POST"])
def quota_review_page(request: HttpRequest) -> HttpResponse:
    """Pending quota requests of every tenant, for platform staff to approve or reject with a note."""
    if not request.user.is_staff:
        raise PermissionDenied("deciding quota requests needs platform staff")
    pending = QuotaRequest.objects.filter(state=QuotaRequest.State.PENDING).select_related("tenant", "requested_by")

    def context() -> dict:
        rows = [
            {"request": r, "changes": [(n, getattr(r.tenant.quota, n, None), v) for n, v in r.changes.items()]}
            for r in pending
        ]
        return {"rows": rows}

    if request.method == "GET":
        return render(request, "console/quota_review.html", context())
    raw = request.POST.get("id", "")
    filed = QuotaRequest.objects.filter(pk=int(raw)).first() if raw.isdigit() and int(raw) < 2**31 else None
    if filed is None:
        raise Http404("no such quota request")
    decision = request.POST.get("decision")
    if decision not in ("approve", "reject"):
        return _bad(request, "console/quota_review.html", context(), "the decision must be approve or reject")
    try:
        decide(request=filed, approve=decision == "approve", note=request.POST.get("note", ""), actor=request.user)
    except GovernanceError as exc:
        return _bad(request, "console/quota_review.html", context(), exc.message)
    return redirect("console-quota-review")


@login_required
def audit_page(request: HttpRequest) -> HttpResponse:
    """The newest audit entries: all for platform staff, a tenant admin's tenants' otherwise."""
    entries = AuditEntry.objects.select_related("tenant")
    if not request.user.is_staff:
        mine = [m.tenant_id for m in request.user.memberships.all() if m.role == Role.ADMIN]
        if not mine:
            raise PermissionDenied("the audit log needs platform staff or the admin role in a tenant")
        entries = entries.filter(tenant_id__in=mine)
    return render(request, "console/audit.html", {"entries": entries[:AUDIT_PAGE], "limit": AUDIT_PAGE})
