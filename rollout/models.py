"""Shadow comparison stored per minute, and a bounded sample of the disagreements (rollout.shadow_compare
computes both from the pairs a gateway kept; rollout.shadow_ingest adds them in)."""

from django.db import models


class ShadowMinute(models.Model):
    """One minute of a shadow: requests served by `baseline` and mirrored to `candidate`, summed over every
    gateway. Models are named, not referenced, as usage does: the record outlives the versions."""

    model_name = models.CharField(max_length=100)
    baseline = models.PositiveIntegerField(help_text="the version that answered the callers")
    candidate = models.PositiveIntegerField(help_text="the shadow version the requests were mirrored to")
    minute = models.DateTimeField(help_text="the minute's start, UTC")
    task = models.CharField(max_length=20)
    mirrored = models.PositiveBigIntegerField(default=0, help_text="mirrored requests the shadow answered")
    shadow_errors = models.PositiveBigIntegerField(default=0, help_text="of those, failed on the shadow")
    incomparable = models.PositiveBigIntegerField(default=0, help_text="answers of different shapes")
    compared = models.PositiveBigIntegerField(default=0, help_text="rows compared")
    agreed = models.PositiveBigIntegerField(default=0, help_text="rows that agree (rollout.shadow_compare)")
    abs_sum = models.FloatField(default=0.0, help_text="regression: sum of absolute element differences")
    abs_count = models.PositiveBigIntegerField(default=0, help_text="regression: elements compared")
    abs_max = models.FloatField(default=0.0, help_text="regression: largest absolute element difference")
    similarity_sum = models.FloatField(default=0.0, help_text="embedding: sum of cosine similarities")
    similarity_min = models.FloatField(null=True, blank=True, help_text="embedding: lowest cosine similarity")
    difference = models.JSONField(default=dict, help_text="per-row difference: usage.sketch bucket -> rows")
    confusion = models.JSONField(default=dict, help_text='classification: {"baseline class,candidate class": rows}')
    primary_latency = models.JSONField(default=dict, help_text="the baseline's latency: usage.sketch bucket -> count")
    shadow_latency = models.JSONField(default=dict, help_text="the candidate's latency: usage.sketch bucket -> count")
    statuses = models.JSONField(default=dict, help_text="the candidate's failures: status -> count")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["model_name", "baseline", "candidate", "minute"],
                                    name="unique_shadow_minute"),
        ]
        indexes = [models.Index(fields=["model_name", "candidate", "minute"], name="shadow_candidate_minute")]
        ordering = ["minute"]

    def __str__(self) -> str:
        return f"{self.model_name} {self.baseline}->{self.candidate} @ {self.minute:%Y-%m-%d %H:%M}"


class ShadowDisagreement(models.Model):
    """A row the two versions answered differently (or the candidate failed on), with its inputs."""

    model_name = models.CharField(max_length=100)
    baseline = models.PositiveIntegerField()
    candidate = models.PositiveIntegerField()
    at = models.DateTimeField()
    summary = models.CharField(max_length=500)
    difference = models.FloatField(null=True, blank=True)
    output = models.CharField(max_length=100, help_text="the output tensor compared")
    inputs = models.JSONField(null=True, blank=True, help_text="the row's inputs; null when too large to keep")
    primary = models.JSONField(null=True, blank=True)
    shadow = models.JSONField(null=True, blank=True)

    class Meta:
        indexes = [models.Index(fields=["model_name", "candidate", "at"], name="shadow_disagreement_at")]
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.model_name} {self.baseline}->{self.candidate}: {self.summary}"


class ShadowBatch(models.Model):
    """A flushed batch already added in: a retried task adds nothing twice."""

    batch_id = models.CharField(max_length=64, primary_key=True)
    recorded_at = models.DateTimeField(auto_now_add=True, db_index=True)
