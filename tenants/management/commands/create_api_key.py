from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from tenants.actions import KeyRequestError, create_key
from tenants.keys import SCOPES
from tenants.models import Tenant


class Command(BaseCommand):
    help = "Create an API key for a tenant and print its token once (only a digest is stored)."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("tenant", help="the tenant's slug")
        parser.add_argument("name", help="what the key is for, e.g. checkout-service")
        parser.add_argument(
            "--scope",
            action="append",
            choices=SCOPES,
            required=True,
            help="infer (inference, metadata, index) or manage (repository load/unload); repeatable",
        )
        parser.add_argument("--expires-in-days", type=int, help="expire after this many days (default: never)")

    def handle(self, *args: object, **o: object) -> None:
        tenant = Tenant.objects.filter(slug=o["tenant"]).first()
        if tenant is None:
            raise CommandError(f"no tenant with slug {o['tenant']!r}")
        days = o["expires_in_days"]
        if days is not None and days <= 0:
            raise CommandError("--expires-in-days must be a positive number of days")
        expires_at = timezone.now() + timedelta(days=days) if days is not None else None
        try:
            key, token = create_key(tenant=tenant, name=str(o["name"]), scopes=list(o["scope"]), expires_at=expires_at)
        except KeyRequestError as exc:
            raise CommandError(str(exc)) from None
        expiry = f"expires {key.expires_at:%Y-%m-%d %H:%M} UTC" if key.expires_at else "never expires"
        self.stderr.write(
            f"key {key.prefix} for tenant {tenant.slug} (scopes {', '.join(key.scopes)}; {expiry}); "
            "the token below is shown only now:"
        )
        self.stdout.write(token)
