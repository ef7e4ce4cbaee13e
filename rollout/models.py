"""Rollouts: a candidate version taken from shadow through canary steps to promotion, and its approvals;
and the shadow comparison stored per minute with a bounded sample of the disagreements
(rollout.shadow_compare computes both from the pairs a gateway kept; rollout.shadow_ingest adds them in).

State lives here, in PostgreSQL, so a rollout survives restarts; every change goes through
`rollout.transitions`, which locks the row, moves the model's routing through `serving.actions` and audits.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from rollout.gates import Thresholds

DEFAULT_STEPS = [1, 5, 25, 50, 100]


def default_steps() -> list[int]:
    return list(DEFAULT_STEPS)


class RolloutState(models.TextChoices):
    SHADOWING = "shadowing"  # the candidate is compared on mirrored traffic; it answers no one
    CANARY = "canary"  # the candidate takes steps[step] percent of unpinned traffic
    AWAITING_APPROVAL = "awaiting_approval"  # every step passed; an approver decides
    PROMOTED = "promoted"  # the candidate is the stable version
    ROLLED_BACK = "rolled_back"  # a gate failed, or someone rolled it back
    REJECTED = "rejected"  # an approver said no
    CANCELLED = "cancelled"  # abandoned, or the model changed under it

    @classmethod
    def active(cls) -> tuple[str, ...]:
        return (cls.SHADOWING, cls.CANARY, cls.AWAITING_APPROVAL)


class RolloutQuerySet(models.QuerySet["Rollout"]):
    def active(self) -> RolloutQuerySet:
        return self.filter(state__in=RolloutState.active())


class Rollout(models.Model):
    model = models.ForeignKey("serving.Model", on_delete=models.CASCADE, related_name="rollouts")
    candidate = models.PositiveIntegerField(help_text="the version being rolled out")
    baseline = models.PositiveIntegerField(help_text="the stable version when the rollout started")
    started_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    state = models.CharField(max_length=20, choices=RolloutState.choices, default=RolloutState.SHADOWING)
    step = models.PositiveSmallIntegerField(null=True, blank=True, help_text="index into steps while in canary")
    steps = models.JSONField(default=default_steps, help_text="canary shares in percent, increasing, e.g. [1, 5, 100]")
    shadow_seconds = models.PositiveIntegerField(default=600, help_text="how long to shadow; 0 skips shadowing")
    bake_seconds = models.PositiveIntegerField(default=600, help_text="how long each canary step bakes at least")
    step_timeout_seconds = models.PositiveIntegerField(
        default=3600,
        validators=[MinValueValidator(1)],
        help_text="a phase still without enough evidence after this long rolls back",
    )
    # Gate thresholds (rollout.gates.Thresholds).
    max_error_rate_increase = models.FloatField(default=0.01, validators=[MinValueValidator(0), MaxValueValidator(1)])
    max_p99_ratio = models.FloatField(default=1.25, validators=[MinValueValidator(1)])
    p99_slack_ms = models.FloatField(default=5.0, validators=[MinValueValidator(0)])
    min_agreement = models.FloatField(
        null=True, blank=True, default=0.95, validators=[MinValueValidator(0), MaxValueValidator(1)]
    )
    min_requests = models.PositiveIntegerField(default=100, validators=[MinValueValidator(1)])
    min_compared = models.PositiveIntegerField(default=100, validators=[MinValueValidator(1)])
    approved = models.BooleanField(default=False, help_text="the approval the tenant requires is given")
    reason = models.TextField(blank=True, help_text="why it ended as it did")
    # Decisive verdicts (each step passed, the gate that failed), oldest first; and the latest evaluation.
    verdicts = models.JSONField(default=list, blank=True)
    last_verdict = models.JSONField(null=True, blank=True)
    started_at = models.DateTimeField(default=timezone.now)
    phase_started_at = models.DateTimeField(help_text="when the shadow or the current step began")
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = RolloutQuerySet.as_manager()

    class Meta:
        ordering = ["-started_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"],
                condition=models.Q(state__in=RolloutState.active()),
                name="one_active_rollout_per_model",
            ),
        ]

    def __str__(self) -> str:
        return f"rollout #{self.pk} of {self.model.name} {self.baseline} -> {self.candidate} ({self.state})"

    @property
    def active(self) -> bool:
        return self.state in RolloutState.active()

    @property
    def percent(self) -> float:
        """The candidate's share of unpinned traffic now, in percent."""
        if self.step is not None and self.state in (RolloutState.CANARY, RolloutState.AWAITING_APPROVAL):
            return float(self.steps[self.step])
        return 0.0

    def thresholds(self) -> Thresholds:
        return Thresholds(
            max_error_rate_increase=self.max_error_rate_increase,
            max_p99_ratio=self.max_p99_ratio,
            p99_slack_ms=self.p99_slack_ms,
            min_agreement=self.min_agreement,
            min_requests=self.min_requests,
            min_compared=self.min_compared,
        )

    def summary(self) -> dict:
        """What the audit log keeps of a rollout's state."""
        return {"state": self.state, "step": self.step, "percent": self.percent, "approved": self.approved}


class Approval(models.Model):
    rollout = models.ForeignKey(Rollout, on_delete=models.CASCADE, related_name="approvals")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    username = models.CharField(max_length=150, help_text="kept if the user is deleted")
    note = models.TextField(blank=True, max_length=2000)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["at", "pk"]
        constraints = [models.UniqueConstraint(fields=["rollout", "user"], name="one_approval_per_person")]

    def __str__(self) -> str:
        return f"{self.username} approved rollout #{self.rollout_id}"


class PromotionState(models.TextChoices):
    PENDING = "pending"  # an approver of the model's tenant decides
    ACCEPTED = "accepted"  # an approver accepted it: the version became stable then
    REJECTED = "rejected"  # an approver said no


class PromotionRequest(models.Model):
    """A direct promotion under the tenant's "approval required" policy (rollout.promotion): the stable
    version changes only when an approver other than the requester (unless the tenant allows self-approval)
    accepts it, and only from the stable version the request was made against."""

    model = models.ForeignKey("serving.Model", on_delete=models.CASCADE, related_name="promotion_requests")
    version = models.PositiveIntegerField(help_text="the version to make stable")
    baseline = models.PositiveIntegerField(null=True, blank=True, help_text="the stable version when requested")
    state = models.CharField(max_length=10, choices=PromotionState.choices, default=PromotionState.PENDING)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL, related_name="+")
    requester_name = models.CharField(max_length=150, help_text="kept if the user is deleted")
    note = models.TextField(blank=True, max_length=2000, help_text="why, from the requester")
    requested_at = models.DateTimeField(default=timezone.now)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decider_name = models.CharField(max_length=150, blank=True)
    decision_note = models.TextField(blank=True, max_length=2000)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"], condition=models.Q(state="pending"), name="one_pending_promotion_per_model"
            ),
        ]

    def __str__(self) -> str:
        return f"promotion request #{self.pk} of {self.model.name} {self.baseline} -> {self.version} ({self.state})"

    def summary(self) -> dict:
        """What the audit log keeps of a request."""
        return {"state": self.state, "version": self.version, "baseline": self.baseline}


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
            models.UniqueConstraint(
                fields=["model_name", "baseline", "candidate", "minute"], name="unique_shadow_minute"
            ),
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
