"""`manage.py serve` with the API-key check replaced by a fixed caller (the demo tenant): the contrast
server of bench.auth_cost, and nothing else. It exists only under bench/, is started only by that tool on
127.0.0.1, and changes nothing in the product: Ferry itself has no anonymous mode.

    python -m bench.serve_without_auth --host 127.0.0.1 --port PORT   (with FERRY_QUOTAS=false)
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    sys.path.insert(0, os.getcwd())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    import django

    django.setup()
    from django.core.management import call_command

    from serving.dataplane.gateway.auth import Caller
    from serving.dataplane.http import consumers
    from tenants.models import Tenant

    demo = Tenant.objects.get(slug="demo")
    caller = Caller(tenant_id=demo.pk, prefix="", scopes=("infer", "manage"))
    consumers.authenticate = lambda headers, snapshot, pepper, now: caller  # type: ignore[assignment]
    call_command("serve", *sys.argv[1:])


if __name__ == "__main__":
    main()
