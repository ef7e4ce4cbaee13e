from django.core.management.base import BaseCommand, CommandError

from tenants.actions import revoke_key
from tenants.models import ApiKey


class Command(BaseCommand):
    help = "Revoke an API key by its prefix (the 10 characters after fy_); serving refuses it within 2 s."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument("prefix", help="the key's prefix, or the whole token")

    def handle(self, *args: object, **o: object) -> None:
        prefix = str(o["prefix"])
        if prefix.startswith("fy_"):
            prefix = prefix[3:].partition("_")[0]
        key = ApiKey.objects.filter(prefix=prefix).select_related("tenant").first()
        if key is None:
            raise CommandError(f"no API key with prefix {prefix!r}")
        was_revoked = key.revoked_at is not None
        revoke_key(key=key)
        state = "was already revoked" if was_revoked else "revoked"
        self.stdout.write(f"key {key.prefix} ({key.name}, tenant {key.tenant.slug}) {state}")
