from django.core.management.base import BaseCommand, CommandError

from tenants.governance import GovernanceError, set_quota
from tenants.models import Quota, Tenant


class Command(BaseCommand):
    help = (
        "Set a tenant's quota limits, e.g. `set_quota demo requests_per_second=5000 burst=10000`"
        " (`latency_budget_ms=none` clears the plan's budget); "
        "validated like a quota request, written to the audit log, in force within seconds."
    )

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("tenant", help="the tenant's slug")
        parser.add_argument("limits", nargs="+", metavar="LIMIT=VALUE", help=f"limits: {', '.join(Quota.LIMITS)}")

    def handle(self, *args: object, **o: object) -> None:
        tenant = Tenant.objects.filter(slug=o["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant {o['tenant']!r}")
        changes: dict[str, int | None] = {}
        for item in o["limits"]:  # type: ignore[union-attr]
            name, sep, value = str(item).partition("=")
            if not sep:
                raise CommandError(f"expected LIMIT=VALUE, got {item!r}")
            if value.lower() == "none" and name in Quota.NULLABLE:  # cleared: the platform's default applies
                changes[name] = None
                continue
            try:
                changes[name] = int(value)
            except ValueError:
                raise CommandError(f"{name}: {value!r} is not an integer") from None
        try:
            quota = set_quota(tenant=tenant, changes=changes, actor=None)
        except GovernanceError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"quota of {tenant.slug}: " + ", ".join(f"{k}={v}" for k, v in quota.limits().items()))
