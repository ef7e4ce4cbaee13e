"""The console's rollout panel on a model's page, and the POST forms behind its buttons.

A button is shown only to someone allowed to press it, and every POST is checked again here (through
`rollout.transitions`, which checks the role in the model's tenant): the page is a convenience, not the guard.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from rollout import transitions
from rollout.models import Rollout
from rollout.promotion_views import promotion_panel
from serving.models import Model, State
from tenants.models import Role
from tenants.scoping import can_write, member_tenant_ids, visible_models

RECENT = 5  # ended rollouts the panel lists under the active one


def panel(user: Any, model: Model) -> dict:
    """The panel's context: the model's rollouts (active first) if `user` may see them (members of the owning
    tenant and staff, as the API), each with the buttons `user` may press, and whether (and with which
    candidates) `user` may start one."""
    engineer = can_write(user, Role.ENGINEER, model.tenant_id)
    approver = can_write(user, Role.APPROVER, model.tenant_id)
    self_ok = model.tenant is not None and model.tenant.allow_self_approval
    rollouts: list[Rollout] = []
    visible = may_see_rollouts(user, model)
    if visible:
        rollouts = list(model.rollouts.select_related("started_by").prefetch_related("approvals")[: RECENT + 1])
    rows = []
    for r in rollouts:
        approvers = {a.user_id for a in r.approvals.all()}
        own = getattr(user, "pk", None) == r.started_by_id
        rows.append(
            {
                "rollout": r,
                "steps": [
                    {"percent": p, "current": r.step == i and r.active, "done": r.step is not None and i < r.step}
                    for i, p in enumerate(r.steps)
                ],
                "failed": [g for v in r.verdicts[-1:] for g in v.get("gates", []) if g.get("status") == "fail"],
                "buttons": [
                    name
                    for name, shown in (
                        ("approve", approver and r.active and (self_ok or not own) and user.pk not in approvers),
                        ("reject", approver and r.active),
                        ("promote", approver and r.active and r.approved),
                        ("roll-back", engineer and r.active),
                    )
                    if shown
                ],
            }
        )
    active = any(r.active for r in rollouts)
    candidates = []
    if engineer and not active and model.stable_version is not None:
        candidates = list(
            model.versions.filter(state=State.READY)
            .exclude(version=model.stable_version)
            .values_list("version", flat=True)
        )
    return {
        "rollouts": rows,
        "rollouts_visible": visible,
        "rollout_candidates": candidates,
        **promotion_panel(user, model, active),
    }


def may_see_rollouts(user: Any, model: Model) -> bool:
    """Rollouts are the owning tenant's workflow (who started them, approvals and notes, verdicts): its
    members and platform staff see them, not every tenant that sees a public model."""
    return bool(getattr(user, "is_staff", False)) or (
        model.tenant_id is not None and model.tenant_id in member_tenant_ids(user)
    )


_MOVES = {
    "approve": transitions.approve,
    "reject": transitions.reject,
    "promote": transitions.promote,
    "roll-back": transitions.roll_back,
}


@login_required
@require_POST
def rollout_action(request: HttpRequest, pk: int, move: str) -> HttpResponse:
    """Press a panel button. A rollout of a tenant the user is not in is a 404; a missing role a 403; a move
    its state no longer allows (someone else was faster) goes back to the page, which shows the state."""
    if move not in _MOVES:
        raise Http404("no such action")
    scoped = Rollout.objects.filter(pk=pk, model__in=visible_models(request.user))
    if not request.user.is_staff:
        scoped = scoped.filter(model__tenant_id__in=member_tenant_ids(request.user))
    rollout = scoped.select_related("model").first()
    if rollout is None:
        raise Http404("no such rollout")
    kwargs = {"note": request.POST.get("note", "")[:2000]} if move != "promote" else {}
    try:
        _MOVES[move](rollout=rollout, actor=request.user, **kwargs)
    except transitions.RolloutError as exc:
        if exc.status == 403:
            raise PermissionDenied(exc.message) from None
        if exc.status != 409:
            raise
    back = request.POST.get("next", "")  # the page the button was on (the model's, or its shadow report)
    if back.startswith("/console/") and url_has_allowed_host_and_scheme(back, allowed_hosts={request.get_host()}):
        return redirect(back)
    return redirect("console-model", name=rollout.model.name)


@login_required
@require_POST
def rollout_start(request: HttpRequest, name: str) -> HttpResponse:
    """Start a rollout from the panel's form, with the default gates and the steps and times given."""
    model = visible_models(request.user).filter(name=name).first()
    if model is None:
        raise Http404("no such model")
    try:
        candidate = int(request.POST.get("candidate", ""))
        steps = [int(s) for s in request.POST.get("steps", "1 5 25 50 100").replace(",", " ").split()]
        shadow = int(request.POST.get("shadow_seconds", "600"))
        bake = int(request.POST.get("bake_seconds", "600"))
        if shadow < 0 or bake < 0:
            raise ValueError
    except ValueError:
        return HttpResponse(
            "candidate, steps and seconds must be whole non-negative numbers", status=400, content_type="text/plain"
        )
    try:
        transitions.start(
            model=model, candidate=candidate, actor=request.user, steps=steps, shadow_seconds=shadow, bake_seconds=bake
        )
    except transitions.RolloutError as exc:
        if exc.status == 403:
            raise PermissionDenied(exc.message) from None
        return HttpResponse(exc.message, status=exc.status, content_type="text/plain")
    return redirect("console-model", name=model.name)
