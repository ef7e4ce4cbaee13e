from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from serving.actions import RegistrationError, promote, set_routing
from serving.models import Model
from tenants.models import Tenant


def shares(text: str, what: str) -> dict[int, float]:
    """`3=0.95,4=0.05` -> {3: 0.95, 4: 0.05}; "" clears."""
    result: dict[int, float] = {}
    for item in filter(None, text.split(",")):
        version, sep, share = item.partition("=")
        try:
            result[int(version)] = float(share) if sep else float("nan")
        except ValueError:
            raise CommandError(f"{what}: expected VERSION=SHARE, got {item!r}") from None
    return result


class Command(BaseCommand):
    help = (
        "Route a model's traffic: promote a version to stable, set rollout weights or experiment arms"
        " (VERSION=SHARE,... summing to 1; '' clears), mirror a share of requests to a shadow version,"
        " pin a tenant to a version (SLUG=VERSION; SLUG= unpins)."
        " Validated, written to the audit log, in force within seconds. Where the model's tenant requires"
        " approval, promoting and sending an unapproved version traffic are refused: roll it out, or"
        " have a promotion request accepted."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("model", help="the model's name")
        parser.add_argument("--promote", type=int, metavar="VERSION", help="make VERSION the stable version")
        parser.add_argument("--weights", metavar="V=SHARE,...", help="rollout weights, e.g. 3=0.95,4=0.05")
        parser.add_argument("--experiment", metavar="V=SHARE,...", help="A/B arms, e.g. 3=0.5,5=0.5")
        parser.add_argument(
            "--shadow",
            metavar="VERSION=FRACTION",
            help="mirror this share of live requests to VERSION for comparison, e.g. 4=0.1; '' stops",
        )
        parser.add_argument(
            "--tenant",
            action="append",
            default=[],
            metavar="SLUG=VERSION",
            help="serve tenant SLUG this version (SLUG= removes its pin); repeatable",
        )

    def handle(self, *args: object, **o: object) -> None:
        model = Model.objects.filter(name=o["model"]).first()
        if model is None:
            raise CommandError(f"no model {o['model']!r}")
        rules: dict[str, object] = {}
        if o["weights"] is not None:
            rules["rollout_weights"] = shares(str(o["weights"]), "--weights")
        if o["experiment"] is not None:
            rules["experiment_arms"] = shares(str(o["experiment"]), "--experiment")
        if o["shadow"] is not None:
            shadow = shares(str(o["shadow"]), "--shadow")
            if len(shadow) > 1:
                raise CommandError("--shadow: one VERSION=FRACTION")
            rules["shadow_version"], rules["shadow_fraction"] = next(iter(shadow.items()), (None, 0.0))
        if o["tenant"]:
            pins = dict(model.tenant_versions or {})
            for item in o["tenant"]:  # type: ignore[union-attr]
                slug, sep, version = str(item).partition("=")
                tenant = Tenant.objects.filter(slug=slug).first()
                if not sep or tenant is None:
                    raise CommandError(f"--tenant: expected an existing SLUG=VERSION, got {item!r}")
                if version:
                    if not version.isdigit():
                        raise CommandError(f"--tenant: {version!r} is not a version")
                    pins[str(tenant.pk)] = int(version)
                else:
                    pins.pop(str(tenant.pk), None)
            rules["tenant_versions"] = pins
        try:
            if o["promote"] is not None:
                model = promote(model=model, version=int(o["promote"]))  # type: ignore[arg-type]
            if rules:
                model = set_routing(model=model, **rules)
        except RegistrationError as exc:
            raise CommandError(exc.message) from None
        except ValidationError as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())) from None
        table = model.route_table()
        self.stdout.write(
            f"{model.name}: stable {table.stable}, weights {dict(table.weights)}, experiment"
            f" {dict(table.experiment)}, tenants {dict(table.tenants)}, shadow {table.shadow}"
            f" ({table.shadow_fraction:g})"
        )
