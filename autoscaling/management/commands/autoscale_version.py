from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from autoscaling.models import ScalingPolicy
from serving.models import ModelVersion
from serving.tasks import request_reconcile
from tenants import audit

FIELDS = (
    "enabled",
    "max_replicas",
    "target_utilisation",
    "warm_pool",
    "cool_down_seconds",
    "idle_to_zero_seconds",
    "accelerator",
)


class Command(BaseCommand):
    help = (
        "Let the autoscaler size a version (or stop it: --off). Its min_replicas stays the floor; with"
        " min_replicas 0 and --idle-to-zero it is unloaded after that long without a request. Audited."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("model")
        parser.add_argument("version", type=int)
        parser.add_argument("--off", action="store_true", help="stop sizing it; its desired replicas are cleared")
        parser.add_argument("--max", type=int, dest="max_replicas")
        parser.add_argument("--target-utilisation", type=float)
        parser.add_argument("--warm-pool", type=int)
        parser.add_argument("--cool-down", type=float, dest="cool_down_seconds", help="seconds")
        parser.add_argument(
            "--idle-to-zero",
            type=float,
            dest="idle_to_zero_seconds",
            help="seconds without a request before the last replica goes (min_replicas 0); -1: never",
        )
        parser.add_argument("--accelerator", help="the node pool it scales on")

    def handle(self, *args: object, **o: object) -> None:
        version = (
            ModelVersion.objects.select_related("model__tenant")
            .filter(model__name=o["model"], version=o["version"])
            .first()
        )
        if version is None:
            raise CommandError(f"no version {o['version']} of model {o['model']!r}")
        with transaction.atomic():
            policy = ScalingPolicy.objects.select_for_update().filter(version=version).first()
            before = {f: getattr(policy, f) for f in FIELDS} if policy else None
            policy = policy or ScalingPolicy(version=version)
            policy.enabled = not o["off"]
            for name in FIELDS[1:]:
                if o.get(name) is not None:
                    setattr(policy, name, o[name])
            if policy.idle_to_zero_seconds is not None and policy.idle_to_zero_seconds < 0:
                policy.idle_to_zero_seconds = None
            try:
                policy.full_clean()
            except ValidationError as exc:
                raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from None
            policy.save()  # turning it on -> off clears desired_replicas (autoscaling.signals)
            if o["off"] and policy.release():  # it was off already, with a desired count left from before
                transaction.on_commit(request_reconcile)
            after = {f: getattr(policy, f) for f in FIELDS}
            audit.record(
                None,
                "version.scaling",
                f"model {version.model.name} version {version.version}",
                tenant=version.model.tenant,
                before=before,
                after=after,
            )
        self.stdout.write(f"{version.model.name}:{version.version} scaling: {after}")
