import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.management.base import BaseCommand, CommandError

from serving.demo import give_to_tenant
from tenants import keys
from tenants.actions import create_key
from tenants.models import ApiKey, Membership, Role, Tenant

KEY_FILE = "demo-api-key"
PASSWORD_FILE = "demo-admin-password"
FORMER_PASSWORD = "ferry-admin"  # the demo account's password before it was generated, published in old READMEs


def key_still_valid(token: str) -> bool:
    """Whether `token` is an active key in the registry under the current pepper."""
    parts = keys.split(token)
    if parts is None:
        return False
    key = ApiKey.objects.filter(prefix=parts[0]).first()
    return key is not None and key.active and keys.matches(keys.pepper_from(settings.SECRET_KEY), parts[1], key.digest)


def write_secret(path: Path, text: str) -> None:
    """Write `text` readable by this user only (0600), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class Command(BaseCommand):
    help = (
        "Create the embedded-mode operator account (FERRY_ADMIN_USER; FERRY_ADMIN_PASSWORD, else a random password"
        " written to $FERRY_DATA_DIR/demo-admin-password), the demo tenant that owns the demo models, and a demo"
        " API key in $FERRY_DATA_DIR/demo-api-key, if missing. Neither secret is printed."
    )

    def handle(self, *args: object, **options: object) -> None:
        if settings.SECRET_KEY_MISSING:  # the demo key's pepper would be this process's alone (config.settings)
            raise CommandError(settings.SECRET_KEY_MISSING)
        username = os.environ.get("FERRY_ADMIN_USER", "admin")
        given = os.environ.get("FERRY_ADMIN_PASSWORD", "")
        User = get_user_model()
        user, created = User.objects.get_or_create(username=username, defaults={"is_staff": True, "is_superuser": True})
        path = Path(settings.DATA_DIR) / PASSWORD_FILE
        # An account made before the password was generated still has the demo's published one: replaced, as a
        # new account's would be set, unless the environment asks for it.
        if created or (not given and user.check_password(FORMER_PASSWORD)):
            self._set_password(user, given, path)
        elif path.exists():
            self.stdout.write(f"console login: {username} (existing account; its generated password in {path})")
        else:
            self.stdout.write(f"console login: {username} (existing account)")
        tenant, _ = Tenant.objects.get_or_create(slug="default", defaults={"name": "Default"})
        Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": Role.ADMIN})
        self._demo_tenant(user)

    def _set_password(self, user: AbstractBaseUser, given: str, path: Path) -> None:
        """The account's password: FERRY_ADMIN_PASSWORD's, else a random one written to `path` (mode 600);
        never printed, since the output of `make run` and of compose's setup job is kept in logs."""
        password = given or secrets.token_urlsafe(18)
        user.set_password(password)
        user.save()
        if given:
            self.stdout.write(f"console login: {user} with the password of FERRY_ADMIN_PASSWORD")
            return
        write_secret(path, password + "\n")
        self.stdout.write(f"console login: {user}, its password in {path} (mode 600; change it in /admin/)")

    def _demo_tenant(self, user: object) -> None:
        demo, _ = Tenant.objects.get_or_create(slug="demo", defaults={"name": "Demo"})
        Membership.objects.update_or_create(user=user, tenant=demo, defaults={"role": Role.ADMIN})
        given = give_to_tenant(demo)
        if given:
            self.stdout.write(f"demo models now public models of tenant demo: {', '.join(given)}")
        path = Path(settings.DATA_DIR) / KEY_FILE
        try:
            existing = path.read_text().strip()
        except OSError:
            existing = ""
        if existing and key_still_valid(existing):
            self.stdout.write(f"demo API key: in {path} (existing)")
            return
        key, token = create_key(tenant=demo, name="demo", scopes=list(keys.SCOPES), created_by=user)
        write_secret(path, token + "\n")
        # The token itself is not printed: this output is kept in logs (docker compose logs, CI's).
        self.stdout.write(
            f"demo API key (scopes {', '.join(key.scopes)}) in {path} (mode 600); try it:\n"
            f'  curl -s -H "Authorization: Bearer $(cat {path})" http://127.0.0.1:8000/v2/models/digits\n'
            "  # tritonclient:\n"
            f'  client.infer("digits", [x], headers={{"Authorization": "Bearer " + open("{path}").read().strip()}})'
        )
