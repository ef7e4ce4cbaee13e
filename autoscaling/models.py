"""Which versions the autoscaler sizes, and how: a version without an enabled policy keeps its `desired_replicas`
as whoever set it left it (null: the placement reconciler keeps `min_replicas`). Turning a policy off, or deleting
an enabled one, by any path (admin, command, ORM) clears what the autoscaler asked for: `autoscaling.signals`."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from serving.models import ModelVersion


class ScalingPolicy(models.Model):
    version = models.OneToOneField("serving.ModelVersion", on_delete=models.CASCADE, related_name="scaling")
    enabled = models.BooleanField(default=True)
    max_replicas = models.PositiveIntegerField(default=4, validators=[MinValueValidator(1)])
    target_utilisation = models.FloatField(
        default=0.7,
        validators=[MinValueValidator(0.05), MaxValueValidator(1.0)],
        help_text="the share of one replica's capacity (within the latency budget) each replica is sized for",
    )
    warm_pool = models.PositiveIntegerField(default=0, help_text="replicas kept beyond what the forecast needs")
    cool_down_seconds = models.FloatField(
        default=300.0,
        validators=[MinValueValidator(0.0)],
        help_text="a lower replica count must hold this long before replicas are removed",
    )
    idle_to_zero_seconds = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(0.0)],
        help_text="with min_replicas 0: no request for this long unloads the last replica; empty: never",
    )
    accelerator = models.CharField(
        max_length=50,
        blank=True,
        help_text="the node pool it scales on; empty: the version's first allowed accelerator, else the first pool",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "scaling policies"

    def __str__(self) -> str:
        return f"scaling of {self.version_id}"

    def release(self) -> bool:
        """Hand the version back to its min_replicas: clear the desired replicas the autoscaler set. True when they
        were set. Call it inside the transaction that turns the policy off."""
        # The version's row is locked whether or not desired is set: a tick's write locks it too and then re-checks
        # the policy, so it runs wholly before this transaction (and is cleared here) or sees the policy off.
        version = ModelVersion.objects.select_for_update().filter(pk=self.version_id).first()
        if version is None or version.desired_replicas is None:
            return False
        # update(): updated_at stays, so no routing snapshot is rebuilt, as for the autoscaler's own writes.
        ModelVersion.objects.filter(pk=self.version_id).update(desired_replicas=None)
        return True
