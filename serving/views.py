"""Console pages for the registry (server-rendered; live figures come from this process's data plane)."""

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from rollout.views import panel
from serving.actions import set_visibility
from serving.dataplane import plane as dataplane
from serving.dataplane.metrics import metrics
from serving.fallbacks import hidden_fallbacks
from serving.models import Model, Visibility
from serving.version_charts import version_hour
from tenants.models import Role, Tenant
from tenants.scoping import can_write, shadow_report_refusal, visible_models


def saturation(shares: dict[str, float]) -> dict:
    """The models page's indicator over the last 30 s: share of answers the version served itself, passed to
    its fallback, shed (503), or failed otherwise (a timeout, a 500, a 4xx), with a level: errors (over 1%
    failed), shedding (over 1% shed), fallback (over 1% passed on) or ok. With no answers in the window, no
    level and no shares (None: the page shows "—"), not an "ok" that nothing measured."""
    if not shares:
        return {"level": None, "fallback_pct": None, "shed_pct": None, "error_pct": None}
    fallback, shed, error = shares.get("fallback", 0.0), shares.get("shed", 0.0), shares.get("error", 0.0)
    level = "errors" if error > 0.01 else "shedding" if shed > 0.01 else "fallback" if fallback > 0.01 else "ok"
    return {
        "level": level,
        "fallback_pct": round(fallback * 100, 1),
        "shed_pct": round(shed * 100, 1),
        "error_pct": round(error * 100, 1),
    }


def _live(model: str, version: int) -> dict:
    """A version's live figures; None for each this process has no measure of (it never counted for the
    version), which the page shows as "—"."""
    stats = metrics.live_stats(model, version)
    plane = dataplane.current()
    key = f"{model}:{version}"
    return {
        "saturation": saturation(metrics.saturation_shares(model, version)),
        "rate": round(stats.rate, 1) if stats else None,
        "p50_ms": round(stats.p50_ms, 1) if stats and stats.p50_ms is not None else None,
        "p99_ms": round(stats.p99_ms, 1) if stats and stats.p99_ms is not None else None,
        "mean_batch": round(stats.mean_batch, 1) if stats and stats.mean_batch is not None else None,
        "errors": stats.errors if stats else None,
        "loaded": bool(plane and plane.node.is_ready(key)),
    }


def _profile(version) -> str:  # noqa: ANN001
    """'b1 2.1 ms · b32 9.4 ms · 19 MB': the ends of the measured latency profile and the footprint."""
    points = sorted((int(k), v) for k, v in (version.latency_profile or {}).items())
    parts = [f"b{size} {seconds * 1000:.1f} ms" for size, seconds in (points[:1] + points[-1:] if points else [])]
    if len(points) == 1:
        parts = parts[:1]
    if version.memory_bytes:
        parts.append(f"{version.memory_bytes / 2**20:.0f} MB")
    return " · ".join(parts)


@login_required
def models_page(request: HttpRequest) -> HttpResponse:
    models = visible_models(request.user).prefetch_related("versions").select_related("fallback", "tenant")
    hidden = hidden_fallbacks(request.user, models)
    rows = [
        {
            "model": m,
            "fallback_hidden": m.pk in hidden,
            "versions": [{"v": v, "live": _live(m.name, v.version), "profile": _profile(v)} for v in m.versions.all()],
        }
        for m in models
    ]
    return render(request, "console/models.html", {"rows": rows})


@login_required
def models_live(request: HttpRequest) -> JsonResponse:
    rows = {
        f"{name}:{version}": _live(name, version)
        for name, version in visible_models(request.user).values_list("name", "versions__version")
        if version is not None
    }
    return JsonResponse({"versions": rows})


@login_required
@require_http_methods(["GET", "POST"])
def model_page(request: HttpRequest, name: str) -> HttpResponse:
    """One model: its versions, owner and visibility. A model the user may not see is a 404 exactly like
    a missing one; changing who sees it needs the admin role in the tenant that owns it."""
    model = visible_models(request.user).select_related("tenant", "fallback").filter(name=name).first()
    if model is None:
        raise Http404("no such model")
    may_share = can_write(request.user, Role.ADMIN, model.tenant_id)
    if request.method == "POST":
        if not may_share:
            raise PermissionDenied("changing who sees a model needs the admin role in the tenant that owns it")
        visibility = request.POST.get("visibility", "")
        slugs = [s for s in request.POST.get("shared_with", "").replace(",", " ").split() if s]
        shared = list(Tenant.objects.filter(slug__in=slugs))
        missing = sorted(set(slugs) - {t.slug for t in shared})
        if visibility not in Visibility.values or missing:
            error = f"no tenant {missing[0]!r}" if missing else "choose private, shared or public"
            context = _model_context(model, may_share, request.user) | _fallback(request.user, model) | {"error": error}
            return render(request, "console/model.html", context, status=400)
        set_visibility(model=model, visibility=visibility, shared_with=shared, actor=request.user)
        return redirect("console-model", name=model.name)
    return render(
        request, "console/model.html", _model_context(model, may_share, request.user) | _fallback(request.user, model)
    )


def _fallback(user: object, model: Model) -> dict:
    """Whether the page names the model's fallback or says it is hidden (serving.fallbacks)."""
    return {"fallback_hidden": bool(hidden_fallbacks(user, [model]))}


def _model_context(model: Model, may_share: bool, user: object) -> dict:
    versions = [
        {"v": v, "profile": _profile(v), "hour": version_hour(model.name, v.version)} for v in model.versions.all()
    ]
    shared = sorted(model.shared_with.values_list("slug", flat=True)) if may_share else []
    return {
        "model": model,
        "versions": versions,
        "hours": [item for item in versions if item["hour"] is not None],
        "may_share": may_share,
        "shared_with": " ".join(shared),
        "visibilities": Visibility.values,
        "may_read_shadow": shadow_report_refusal(user, model) is None,
        **panel(user, model),
    }
