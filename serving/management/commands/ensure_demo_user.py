import os

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

from tenants.models import Membership, Role, Tenant


class Command(BaseCommand):
    help = "Create the embedded-mode operator account (FERRY_ADMIN_USER / FERRY_ADMIN_PASSWORD) if missing."

    def handle(self, *args: object, **options: object) -> None:
        username = os.environ.get("FERRY_ADMIN_USER", "admin")
        password = os.environ.get("FERRY_ADMIN_PASSWORD", "ferry-admin")
        User = get_user_model()
        user, created = User.objects.get_or_create(username=username, defaults={"is_staff": True,
                                                                                 "is_superuser": True})
        if created:
            user.set_password(password)
            user.save()
        tenant, _ = Tenant.objects.get_or_create(slug="default", defaults={"name": "Default"})
        Membership.objects.get_or_create(user=user, tenant=tenant, defaults={"role": Role.OPERATOR})
        if created:
            self.stdout.write(f"console login: {username} / {password} (change it in /admin/)")
        else:
            self.stdout.write(f"console login: {username} (existing account)")
