"""Which versions the autoscaler sizes, and how: a version without an enabled policy keeps its `desired_replicas`
as whoever set it left it (null: the placement reconciler keeps `min_replicas`)."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


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
