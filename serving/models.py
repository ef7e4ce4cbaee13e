"""Model registry: models, their versions and the content-addressed artifacts they run."""

from __future__ import annotations

from django.core.exceptions import NON_FIELD_ERRORS, ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import connection, models, transaction

from rollout.routing import RouteTable
from tenants import audit

# A model name, unanchored: the API's URLs and OpenAPI schema use this same expression.
MODEL_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
MODEL_NAME = RegexValidator(
    rf"^{MODEL_NAME_PATTERN}$",
    "Model names use letters, digits, '_', '.' and '-', starting with a letter or digit.",
)
# Names the Open Inference Protocol's paths use under /v2/models/ for something else: GET /v2/models/stats is
# the statistics of every model (Triton's statistics extension), so a model of that name could not be read there.
RESERVED_NAMES = frozenset({"stats"})


def not_reserved(name: str) -> None:
    if name in RESERVED_NAMES:
        raise ValidationError(f"{name!r} is reserved: the inference protocol's paths use it", code="reserved")


# The batching fields, and the field each of BatchingConfig's messages is about (by the name it starts with).
BATCHING_FIELDS = (
    "max_batch_size",
    "max_queue_delay_ms",
    "preferred_batch_sizes",
    "max_queue_size",
    "default_timeout_ms",
)
PLACEMENT_FIELDS = ("min_memory_bytes", "accelerators", "pinned", "min_replicas")
_CONFIG_MESSAGE_FIELD = {
    "max_batch_size": "max_batch_size",
    "max_queue_delay": "max_queue_delay_ms",
    "max_queue_size": "max_queue_size",
    "preferred batch size": "preferred_batch_sizes",
}
# The field each of RouteTable's messages is about, by the word it starts with.
_ROUTING_MESSAGE_FIELD = {
    "stable": "stable_version",
    "weights": "rollout_weights",
    "rollout_weights": "rollout_weights",
    "experiment": "experiment_arms",
    "experiment_arms": "experiment_arms",
    "tenants": "tenant_versions",
    "tenant_versions": "tenant_versions",
    "shadow": "shadow_version",
    "shadow_version": "shadow_version",
    "shadow_fraction": "shadow_fraction",
}
ROUTING_FIELDS = ("rollout_weights", "experiment_arms", "tenant_versions", "shadow_version", "shadow_fraction")


class Task(models.TextChoices):
    CLASSIFICATION = "classification"
    REGRESSION = "regression"
    EMBEDDING = "embedding"


class ArtifactFormat(models.TextChoices):
    TORCHSCRIPT = "torchscript", "TorchScript"
    TORCH_EXPORT = "torch_export", "torch.export program"


class State(models.TextChoices):
    REGISTERED = "registered"
    VALIDATING = "validating"
    READY = "ready"
    FAILED = "failed"
    RETIRED = "retired"


class Visibility(models.TextChoices):
    PRIVATE = "private"  # its tenant only
    SHARED = "shared"  # its tenant and the tenants in shared_with
    PUBLIC = "public"  # every tenant


class Model(models.Model):
    name = models.CharField(max_length=100, unique=True, validators=[MODEL_NAME, not_reserved])
    # No tenant: a platform model, visible to every tenant whatever its visibility.
    tenant = models.ForeignKey("tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="models")
    visibility = models.CharField(max_length=10, choices=Visibility.choices, default=Visibility.PRIVATE)
    shared_with = models.ManyToManyField("tenants.Tenant", blank=True, related_name="shared_models")
    description = models.TextField(blank=True)
    task = models.CharField(max_length=20, choices=Task.choices, default=Task.CLASSIFICATION)
    fallback = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="fallback_for",
        help_text="A smaller model that answers when this one is saturated.",
    )
    # Routing (rollout.routing): the version unpinned traffic goes to, and the rules that send some of it
    # elsewhere. Changed through serving.actions (promote, set_routing), which validate and audit.
    stable_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The version unpinned traffic goes to; set when the first version is ready, then by promotion.",
    )
    rollout_weights = models.JSONField(
        default=dict,
        blank=True,
        help_text='{version: share} summing to 1, e.g. {"3": 0.95, "4": 0.05}',
    )
    experiment_arms = models.JSONField(
        default=dict,
        blank=True,
        help_text="A/B arms, {version: share} summing to 1, sticky per routing key",
    )
    tenant_versions = models.JSONField(
        default=dict,
        blank=True,
        help_text="{tenant id: version}: the version each named tenant is served",
    )
    # A shadow (rollout.shadow_report): this share of the live requests served by other versions is mirrored
    # to `shadow_version` at the lowest priority and the answers compared; callers never see its answers.
    shadow_version = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="the version live requests are mirrored to for comparison",
    )
    shadow_fraction = models.FloatField(
        default=0.0,
        blank=True,
        help_text="the share of live requests mirrored to the shadow version, 0 to 1",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def route_table(self) -> RouteTable:
        """The stored routing rules as the policy takes them; ValueError when they are malformed."""

        def numbered(raw: object, what: str) -> dict[int, object]:
            if not isinstance(raw, dict):
                raise ValueError(f"{what} must be an object of version numbers")
            try:
                return {int(k): v for k, v in raw.items()}
            except ValueError:
                raise ValueError(f"{what}: keys must be integers") from None

        return RouteTable(
            stable=self.stable_version,
            weights=numbered(self.rollout_weights, "rollout_weights"),  # type: ignore[arg-type]
            experiment=numbered(self.experiment_arms, "experiment_arms"),  # type: ignore[arg-type]
            tenants=numbered(self.tenant_versions, "tenant_versions"),  # type: ignore[arg-type]
            shadow=self.shadow_version,
            shadow_fraction=self.shadow_fraction,
        )

    def clean(self) -> None:
        """Routing rules the policy can use, naming only this model's live versions and existing tenants."""
        from tenants.models import Tenant

        super().clean()
        try:
            table = self.route_table()
        except ValueError as exc:
            raise ValidationError(
                {_ROUTING_MESSAGE_FIELD.get(str(exc).split(":")[0].split(" ")[0], NON_FIELD_ERRORS): str(exc)}
            ) from None
        if self.pk is None:
            if table.versions():
                raise ValidationError({NON_FIELD_ERRORS: "a new model has no versions to route to"})
            return
        live = set(self.versions.exclude(state=State.RETIRED).values_list("version", flat=True))
        if table.shadow is not None and table.shadow not in live:
            raise ValidationError({"shadow_version": f"version {table.shadow} is not live"})
        missing = sorted(table.versions() - live)
        if missing:
            raise ValidationError({NON_FIELD_ERRORS: f"routing names versions that are not live: {missing}"})
        if table.stable is not None and not self.versions.filter(version=table.stable, state=State.READY).exists():
            raise ValidationError({"stable_version": f"version {table.stable} is not ready"})
        unknown = sorted(
            set(table.tenants) - set(Tenant.objects.filter(pk__in=table.tenants).values_list("pk", flat=True))
        )
        if unknown:
            raise ValidationError({"tenant_versions": f"no such tenants: {unknown}"})

    def routing_state(self) -> dict:
        """What the audit log keeps of a model's routing."""
        return {
            "stable_version": self.stable_version,
            "rollout_weights": self.rollout_weights,
            "experiment_arms": self.experiment_arms,
            "tenant_versions": self.tenant_versions,
            "shadow_version": self.shadow_version,
            "shadow_fraction": self.shadow_fraction,
        }

    def next_version_number(self) -> int:
        last = self.versions.order_by("-version").values_list("version", flat=True).first()
        return (last or 0) + 1


# The advisory lock space of `lock_name` (PostgreSQL's two-key form: this, and the name's hash).
NAME_LOCK_SPACE = 0x46657279  # "Fery"


def lock_name(name: str) -> None:
    """Hold, until the surrounding transaction ends, the lock that orders every taking of `name`. Models and
    pipelines share one namespace that no unique constraint spans (each table has its own), so whatever
    creates or renames either one takes this lock before it checks the other table, and two of them at once
    cannot both find the name free. PostgreSQL: a transaction-level advisory lock on the name's hash (two
    names that hash alike merely wait on each other). SQLite: its IMMEDIATE transactions already run one at
    a time (config.settings)."""
    if not connection.in_atomic_block:
        raise RuntimeError("lock_name() holds its lock for a transaction: call it inside transaction.atomic()")
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [NAME_LOCK_SPACE, name])


class Artifact(models.Model):
    sha256 = models.CharField(max_length=64, primary_key=True)
    size_bytes = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.sha256[:12]


class ModelVersionQuerySet(models.QuerySet["ModelVersion"]):
    def servable(self) -> ModelVersionQuerySet:
        return self.filter(state=State.READY).select_related("model", "artifact", "model__fallback")


class ModelVersion(models.Model):
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    artifact = models.ForeignKey(Artifact, on_delete=models.PROTECT, related_name="versions")
    format = models.CharField(max_length=20, choices=ArtifactFormat.choices)
    inputs = models.JSONField(help_text="[{name, datatype, shape}] per item, -1 for a variable dim")
    outputs = models.JSONField()
    max_batch_size = models.PositiveIntegerField(default=32, validators=[MinValueValidator(1)])
    max_queue_delay_ms = models.FloatField(default=5.0, validators=[MinValueValidator(0.0)])
    preferred_batch_sizes = models.JSONField(default=list, blank=True)
    max_queue_size = models.PositiveIntegerField(default=1024, validators=[MinValueValidator(1)])
    default_timeout_ms = models.PositiveIntegerField(default=1000, validators=[MinValueValidator(1)])
    state = models.CharField(max_length=20, choices=State.choices, default=State.REGISTERED)
    failure_reason = models.TextField(blank=True)
    # Desired serving state, set by the repository extension's load/unload.
    loaded = models.BooleanField(default=True)
    # The gateway answers a repeat of an identical request from its cache (serving.dataplane.gateway.cache).
    response_cache = models.BooleanField(
        default=False,
        help_text="answer repeated identical requests from the gateway's response cache (Triton's"
        " response_cache); only for a deterministic model",
    )
    latency_profile = models.JSONField(default=dict, blank=True, help_text="{batch size: ms}")
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    load_seconds = models.FloatField(null=True, blank=True)
    metrics = models.JSONField(default=dict, blank=True, help_text="e.g. held-out accuracy")
    # Placement (serving.policies.placement): constraints a node must meet, and what keeps the version loaded.
    min_memory_bytes = models.BigIntegerField(
        default=0, validators=[MinValueValidator(0)], help_text="a node's device memory must be at least this"
    )
    accelerators = models.JSONField(
        default=list, blank=True, help_text="accelerator types allowed to host it, e.g. a10g, h100; empty: any"
    )
    pinned = models.BooleanField(default=False, help_text="never evicted to make room for another version")
    min_replicas = models.PositiveIntegerField(
        default=0, help_text="replicas kept loaded; the stable version with a minimum is never evicted"
    )
    # Replicas the autoscaler (Celery beat) last asked for; null when the autoscaler has not decided. The placement
    # reconciler keeps max(min_replicas, desired_replicas) loaded across the fleet.
    desired_replicas = models.PositiveIntegerField(
        null=True, blank=True, help_text="replicas the autoscaler wants loaded; null: not decided"
    )
    # What nodes measured when they loaded it, per accelerator type: {type: {memory_bytes, cold_start_seconds}}.
    placement_measurements = models.JSONField(default=dict, blank=True)
    # Why no node can hold it (too big for the budget, constraints no node meets); empty when placeable.
    unschedulable_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    objects = ModelVersionQuerySet.as_manager()

    class Meta:
        ordering = ["model__name", "version"]
        constraints = [
            models.UniqueConstraint(fields=["model", "version"], name="unique_model_version"),
        ]

    def __str__(self) -> str:
        return f"{self.model.name}:{self.version}"

    @property
    def key(self) -> str:
        return f"{self.model.name}:{self.version}"

    def clean(self) -> None:
        """Batching settings the data plane can serve: what `serving.policies.batching.BatchingConfig` accepts.

        Runs in `full_clean()` (the admin, the API's batching PATCH, registration). A number field that
        holds something other than a number has failed its own validation, which reported it; the
        combination is then not checked.
        """
        from serving.policies.batching import BatchingConfig

        super().clean()
        if self.preferred_batch_sizes is None:  # an emptied form field: no preferred sizes
            self.preferred_batch_sizes = []
        preferred = self.preferred_batch_sizes
        if not isinstance(preferred, list) or any(type(p) is not int for p in preferred):
            raise ValidationError({"preferred_batch_sizes": "must be a list of integers, e.g. [4, 8]"})
        numbers = (self.max_batch_size, self.max_queue_delay_ms, self.max_queue_size)
        if any(type(n) not in (int, float) for n in numbers):
            return
        try:
            BatchingConfig(
                max_batch_size=self.max_batch_size,
                max_queue_delay=self.max_queue_delay_ms / 1000.0,
                max_queue_size=self.max_queue_size,
                preferred_batch_sizes=tuple(preferred),
            )
        except ValueError as exc:
            message = str(exc)
            field = next(
                (f for prefix, f in _CONFIG_MESSAGE_FIELD.items() if message.startswith(prefix)), NON_FIELD_ERRORS
            )
            raise ValidationError({field: message}) from None

    def mark(self, state: str, reason: str = "") -> None:
        self.state = state
        self.failure_reason = reason
        self.save(update_fields=["state", "failure_reason", "updated_at"])

    @transaction.atomic
    def retire(self, actor: object = None) -> None:
        """Stop serving this version; the routing rules that named it no longer do. Audited
        (`version.retire`, with the model's routing before and after), in the same transaction."""
        was = self.state
        self.mark(State.RETIRED)
        model = Model.objects.select_for_update().get(pk=self.model_id)
        before = model.routing_state()
        if drop_version_from_routes(model, self.version):
            model.save(update_fields=["stable_version", *ROUTING_FIELDS, "updated_at"])
        audit.record(
            actor,
            "version.retire",
            f"model {model.name} version {self.version}",
            tenant=model.tenant,
            before={"state": was, **before},
            after={"state": State.RETIRED.value, **model.routing_state()},
        )


def drop_version_from_routes(model: Model, version: int) -> bool:
    """Remove `version` from `model`'s routing rules (unsaved); True when any named it. A split it was in
    loses it whole (the split's remaining shares would not sum to 1): its traffic goes to the stable version."""
    changed = False
    if model.stable_version == version:
        model.stable_version = None
        changed = True
    for field in ("rollout_weights", "experiment_arms"):
        shares = getattr(model, field) or {}
        if str(version) in shares or version in shares:
            setattr(model, field, {})
            changed = True
    if model.shadow_version == version:
        model.shadow_version, model.shadow_fraction = None, 0.0
        changed = True
    pins = model.tenant_versions or {}
    kept = {t: v for t, v in pins.items() if v != version}
    if kept != pins:
        model.tenant_versions = kept
        changed = True
    return changed


class Tier(models.TextChoices):
    HOT = "hot", "on the device"
    WARM = "warm", "in host memory"
    COLD = "cold", "its artifact on the node's local disk, not in memory: a load reads no network"


class Replica(models.Model):
    """What one node holds of one version, as the placement reconciler last read the node's heartbeat
    (serving.replicas). A node that is lost loses its rows at the next reconciler step."""

    node = models.CharField(max_length=200)
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="replicas")
    tier = models.CharField(max_length=10, choices=Tier.choices)
    assigned = models.BooleanField(default=False, help_text="placed there by the placement reconciler")
    accelerator = models.CharField(max_length=100)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["version_id", "node"]
        constraints = [models.UniqueConstraint(fields=["node", "version"], name="unique_node_version")]

    def __str__(self) -> str:
        return f"{self.version_id}@{self.node}: {self.tier}"


# A pipeline is its tenant's or everyone's: it has no list of tenants to share with, as a model has.
PIPELINE_VISIBILITIES = [(Visibility.PRIVATE.value, "Private"), (Visibility.PUBLIC.value, "Public")]
# The versions of a pipeline served (the latest ones): each counts toward its tenant's max_versions and is checked
# again in every snapshot; older ones stay in the registry, as history.
PIPELINE_VERSIONS_SERVED = 10


class Pipeline(models.Model):
    """A named DAG of model steps served at /v2/models/{name}/infer like a model (serving.policies.pipeline).
    Its name shares the models' namespace; each change of its graph is a new `PipelineVersion`, and the
    latest one serves unpinned requests."""

    name = models.CharField(max_length=100, unique=True, validators=[MODEL_NAME, not_reserved])
    tenant = models.ForeignKey(
        "tenants.Tenant", null=True, blank=True, on_delete=models.PROTECT, related_name="pipelines"
    )
    visibility = models.CharField(max_length=10, choices=PIPELINE_VISIBILITIES, default=Visibility.PRIVATE)
    description = models.TextField(blank=True)
    fallback = models.ForeignKey(
        Model,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="fallback_for_pipelines",
        help_text="A model with the pipeline's signature that answers when a step is refused.",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class PipelineVersion(models.Model):
    """One graph of a pipeline, immutable once registered, with the signature its check derived."""

    pipeline = models.ForeignKey(Pipeline, on_delete=models.CASCADE, related_name="versions")
    version = models.PositiveIntegerField()
    spec = models.JSONField(help_text="the graph: serving.policies.pipeline's spec")
    inputs = models.JSONField(help_text="[{name, datatype, shape}] derived from the steps")
    outputs = models.JSONField()
    # Steps name models, and a name changes hands (deleted, renamed, then taken by another tenant's model):
    # each snapshot serves the version only while each name is still the model its check saw.
    step_models = models.JSONField(
        default=dict, blank=True, help_text="{model name: model id} of its steps' models when it was registered"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["pipeline__name", "version"]
        constraints = [models.UniqueConstraint(fields=["pipeline", "version"], name="unique_pipeline_version")]

    def __str__(self) -> str:
        return f"{self.pipeline.name}:{self.version}"
