"""The registry's share of a tenant's quota: how many models and versions it registers, and how much
accelerator memory its loaded private models take. Checked when they are registered or loaded, never
per request. A pipeline is served like a model, so it counts as one (max_models), and each of its served
versions (the latest PIPELINE_VERSIONS_SERVED) as a version (max_versions).

A refusal is a RegistrationError with status 429 naming the quota, and no Retry-After: waiting does
not help; deleting or retiring something, or a raised quota, does. Each check locks the tenant's
Quota row (select_for_update), so two registrations at once cannot both take the last slot; call
them inside the transaction that creates the row.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from django.db.models import Count, Sum
from django.utils import timezone

from serving.errors import RegistrationError
from serving.models import PIPELINE_VERSIONS_SERVED, Model, ModelVersion, Pipeline, State, Visibility
from tenants.models import Quota


class QuotaFull(RegistrationError):
    def __init__(self, quota: str, message: str) -> None:
        super().__init__(f"{message} (quota {quota}); retire or delete something, or request an increase", 429)
        self.quota = quota


def _locked_quota(tenant_id: int) -> Quota:
    quota, _ = Quota.objects.select_for_update().get_or_create(tenant_id=tenant_id)
    return quota


def model_count(tenant_id: int) -> int:
    """The tenant's models and pipelines: both are served by name."""
    return Model.objects.filter(tenant_id=tenant_id).count() + Pipeline.objects.filter(tenant_id=tenant_id).count()


def version_count(tenant_id: int) -> int:
    """The tenant's live (not retired) model versions and served pipeline versions."""
    live = ModelVersion.objects.filter(model__tenant_id=tenant_id).exclude(state=State.RETIRED).count()
    per_pipeline = (
        Pipeline.objects.filter(tenant_id=tenant_id).annotate(n=Count("versions")).values_list("n", flat=True)
    )
    return live + sum(min(n, PIPELINE_VERSIONS_SERVED) for n in per_pipeline)


def _check_new_name(tenant_id: int | None) -> None:
    """Whether a model or pipeline just created in this transaction fits its tenant's max_models (platform
    ones, tenant None, have no quota). Raises QuotaFull, for the caller to roll the creation back."""
    if tenant_id is None:
        return
    quota = _locked_quota(tenant_id)
    count = model_count(tenant_id) - 1  # the one just created
    if count + 1 > quota.max_models:
        raise QuotaFull("max_models", f"the tenant has {count} of its {quota.max_models} models and pipelines")


def check_new_model(model: Model) -> None:
    """Whether `model`, just created in this transaction, fits its tenant's count of models and pipelines."""
    _check_new_name(model.tenant_id)


def check_new_pipeline(pipeline: Pipeline) -> None:
    """Whether `pipeline`, just created in this transaction, fits its tenant's count of models and pipelines."""
    _check_new_name(pipeline.tenant_id)


def check_new_version(tenant_id: int | None) -> None:
    """Room for one more live (not retired) model version or served pipeline version among the tenant's."""
    if tenant_id is None:
        return
    quota = _locked_quota(tenant_id)
    count = version_count(tenant_id)
    if count + 1 > quota.max_versions:
        raise QuotaFull("max_versions", f"the tenant has {count} of its {quota.max_versions} live versions")


def loaded_private_bytes(tenant_id: int, *, excluding_model: int | None = None) -> int:
    """Accelerator memory of the tenant's private models' versions that are ready and loaded."""
    rows = ModelVersion.objects.filter(
        model__tenant_id=tenant_id,
        model__visibility=Visibility.PRIVATE,
        state=State.READY,
        loaded=True,
    )
    if excluding_model is not None:
        rows = rows.exclude(model_id=excluding_model)
    return int(rows.aggregate(total=Sum("memory_bytes"))["total"] or 0)


def check_accelerator_bytes(model: Model, adding: int, *, excluding_model: bool = False) -> None:
    """Room for `adding` more bytes of `model` (a private model of a tenant) on the accelerator; with
    `excluding_model`, `adding` replaces what the model's loaded versions hold now."""
    if model.tenant_id is None or model.visibility != Visibility.PRIVATE:
        return
    quota = _locked_quota(model.tenant_id)
    used = loaded_private_bytes(model.tenant_id, excluding_model=model.pk if excluding_model else None)
    if used + adding > quota.max_accelerator_bytes:
        raise QuotaFull(
            "max_accelerator_bytes",
            f"loading {model.name} needs {adding} bytes of accelerator memory; the tenant's private models"
            f" hold {used} of its {quota.max_accelerator_bytes}",
        )


def usage_against_quota(tenant_id: int, now: datetime | None = None) -> dict[str, int]:
    """What the tenant uses of each limit that can be read from the registry and its metered usage: requests
    this month (metered, so up to one usage flush behind), the busiest minute's rate in the last hour,
    its models and pipelines, live model versions and served pipeline versions, and the accelerator memory
    of its loaded private models."""
    from usage.models import UsageMinute

    now = now or timezone.now()
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    usage = UsageMinute.objects.filter(tenant_id=tenant_id)
    this_month = usage.filter(minute__gte=month_start).aggregate(total=Sum("requests"))["total"] or 0
    busiest = (
        usage.filter(minute__gte=now - timedelta(hours=1))
        .values("minute")
        .annotate(n=Sum("requests"))
        .order_by("-n")
        .values_list("n", flat=True)
        .first()
    ) or 0
    return {
        "monthly_requests": int(this_month),
        "requests_per_second": math.ceil(busiest / 60),
        "max_models": model_count(tenant_id),
        "max_versions": version_count(tenant_id),
        "max_accelerator_bytes": loaded_private_bytes(tenant_id),
    }
