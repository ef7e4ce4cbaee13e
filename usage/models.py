"""Usage per tenant, model, version and minute, as the data plane metered it (usage.recorder)."""

from django.db import models

from tenants.models import Tenant


class UsageMinute(models.Model):
    """One minute of one version's use by one tenant, summed over every gateway that served it.

    The model is named, not referenced: usage outlives the model and its versions. Errors are counted
    by status class: 4xx (bad input, a model failing on this input, a client that left) and 5xx (shed,
    unavailable, past the deadline). `requests` counts every answer, so successes are requests - errors.
    A request this version refused and its fallback answered is the fallback's answer, and this version's
    `fell_back`: a rollout's gates count it against the version asked (rollout.evidence)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    model_name = models.CharField(max_length=100)
    version = models.PositiveIntegerField()
    minute = models.DateTimeField(help_text="the minute's start, UTC")
    requests = models.PositiveBigIntegerField(default=0, help_text="answers, errors included")
    errors_4xx = models.PositiveBigIntegerField(default=0)
    errors_5xx = models.PositiveBigIntegerField(default=0)
    items = models.PositiveBigIntegerField(default=0, help_text="rows served (successful answers only)")
    fell_back = models.PositiveBigIntegerField(
        default=0,
        help_text="requests this version refused that its model's fallback answered (not in requests: the"
        " fallback's row counts the answer)",
    )
    compute_seconds = models.FloatField(default=0.0, help_text="the requests' shares of their batches' device time")
    latency = models.JSONField(default=dict, help_text="usage.sketch bucket index -> answers")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "model_name", "version", "minute"], name="unique_usage_minute"),
        ]
        indexes = [models.Index(fields=["tenant", "minute"], name="usage_tenant_minute")]
        ordering = ["minute", "model_name", "version"]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.model_name}:{self.version} @ {self.minute:%Y-%m-%d %H:%M}"


class UsageBatch(models.Model):
    """A batch of drained usage already added in: a retried task finds its id here and adds nothing.
    Pruned after FERRY_USAGE_BATCH_DAYS (usage.tasks.prune_usage)."""

    batch_id = models.CharField(max_length=64, primary_key=True)
    recorded_at = models.DateTimeField(auto_now_add=True, db_index=True)
    rows = models.PositiveIntegerField(default=0)
