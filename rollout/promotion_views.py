"""The model page's promotion requests (console): approvers of the owning tenant accept or reject pending
ones, the requester sees theirs awaiting approval, and engineers promote a version directly, which files a
request where the tenant requires approval (rollout.promotion). Every POST is checked again there."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from rollout import approval, promotion
from rollout.models import PromotionRequest, PromotionState
from serving.models import Model, State
from tenants.models import Role
from tenants.scoping import can_write, member_tenant_ids, visible_models

RECENT = 3  # decided requests listed under the pending one


def promotion_panel(user: Any, model: Model, rollout_active: bool) -> dict:
    """The requests of `model` `user` may see (its tenant's members and staff), each with the buttons
    `user` may press, and the versions `user` may promote (or request) now."""
    member = bool(getattr(user, "is_staff", False)) or model.tenant_id in member_tenant_ids(user)
    if model.tenant_id is None or not member:
        requests: list[PromotionRequest] = []
    else:
        requests = list(model.promotion_requests.select_related("model__tenant")[: RECENT + 1])
    approver = can_write(user, Role.APPROVER, model.tenant_id)
    rows = [
        {
            "request": r,
            "mine": getattr(user, "pk", None) == r.requested_by_id,
            "buttons": [
                name
                for name, shown in (
                    ("approve", approver and r.state == PromotionState.PENDING and promotion.may_accept(r, user)),
                    ("reject", approver and r.state == PromotionState.PENDING),
                )
                if shown
            ],
        }
        for r in requests
    ]
    pending = any(r.state == PromotionState.PENDING for r in requests)
    candidates: list[int] = []
    if can_write(user, Role.ENGINEER, model.tenant_id) and not rollout_active and not pending:
        candidates = list(
            model.versions.filter(state=State.READY)
            .exclude(version=model.stable_version)
            .values_list("version", flat=True)
        )
    return {
        "promotion_requests": rows,
        "promote_candidates": candidates,
        "promotion_needs_approval": approval.needs_approval(model),
    }


def _refused(exc: promotion.PromotionError) -> HttpResponse:
    if exc.status == 403:
        raise PermissionDenied(exc.message)
    if exc.status == 404:
        raise Http404(exc.message)
    return HttpResponse(exc.message, status=exc.status, content_type="text/plain")


@login_required
@require_POST
def promote(request: HttpRequest, name: str) -> HttpResponse:
    """Promote the version the form names: at once where engineers may promote, else a promotion request."""
    model = visible_models(request.user).filter(name=name).first()
    if model is None:
        raise Http404("no such model")
    try:
        version = int(request.POST.get("version", ""))
    except ValueError:
        return HttpResponse("version must be a whole number", status=400, content_type="text/plain")
    try:
        promotion.promote_or_request(
            model=model, version=version, actor=request.user, note=request.POST.get("note", "")[:2000]
        )
    except promotion.PromotionError as exc:
        return _refused(exc)
    return redirect("console-model", name=model.name)


_MOVES = {"approve": promotion.accept, "reject": promotion.reject}


@login_required
@require_POST
def promotion_action(request: HttpRequest, pk: int, move: str) -> HttpResponse:
    """Press Approve or Reject. A request of a tenant the user is not in is a 404; a missing role, or the
    requester's own request, a 403; one decided already, or whose model's stable version has changed since,
    a 409 that says so."""
    if move not in _MOVES:
        raise Http404("no such action")
    scoped = PromotionRequest.objects.filter(pk=pk, model__in=visible_models(request.user))
    if not request.user.is_staff:
        scoped = scoped.filter(model__tenant_id__in=member_tenant_ids(request.user))
    found = scoped.select_related("model", "model__tenant").first()
    if found is None:
        raise Http404("no such promotion request")
    try:
        _MOVES[move](request=found, actor=request.user, note=request.POST.get("note", "")[:2000])
    except promotion.PromotionError as exc:  # a 409 says why (decided already, the stable version moved)
        return _refused(exc)
    return redirect("console-model", name=found.model.name)
