"""The audit log: every change to keys, quotas, roles and visibility, with who, when, before and after.

Call `record` inside the transaction that makes the change, so the entry and the change commit together.
"""

from __future__ import annotations

from typing import Any

from tenants.models import AuditEntry, Tenant


def record(
    actor: Any,
    action: str,
    target: str,
    *,
    tenant: Tenant | None = None,
    before: dict | None = None,
    after: dict | None = None,
) -> AuditEntry:
    """Append one entry. `actor` is a user, or None for the system (a command run without a user)."""
    user = actor if getattr(actor, "is_authenticated", False) else None
    name = user.get_username() if user is not None else "system"
    return AuditEntry.objects.create(
        actor=user,
        actor_name=name,
        tenant=tenant,
        action=action,
        target=target[:200],
        before=before,
        after=after,
    )
