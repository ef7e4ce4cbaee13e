"""Tenant workflows: API keys (the token is returned once, never stored), members' roles, and quota
requests decided by platform staff. Each change writes its audit entry in the same transaction.

Key changes save an `ApiKey`, whose post_save signal (`serving.signals`) republishes the routing snapshot
when the transaction commits, so this process's data plane sees the change at once; other processes
see it through Redis, or in embedded mode through the refresh loop's fingerprint (within 2 s).
"""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from tenants import audit, keys
from tenants.models import ApiKey, Tenant


class KeyRequestError(ValueError):
    """A key request that cannot be met (unknown scope, no scope, expiry in the past)."""


def clean_scopes(scopes: object) -> list[str]:
    if isinstance(scopes, str) or not isinstance(scopes, list | tuple | set | frozenset):
        raise KeyRequestError(f"scopes must be a list drawn from {', '.join(keys.SCOPES)}")
    unknown = [s for s in scopes if s not in keys.SCOPES]
    if unknown:
        raise KeyRequestError(f"unknown scope {unknown[0]!r}; scopes are {', '.join(keys.SCOPES)}")
    if not scopes:
        raise KeyRequestError(f"a key needs at least one scope of {', '.join(keys.SCOPES)}")
    return [s for s in keys.SCOPES if s in scopes]


def create_key(
    *,
    tenant: Tenant,
    name: str,
    scopes: list[str] | tuple[str, ...],
    expires_at: datetime | None = None,
    created_by: object | None = None,
) -> tuple[ApiKey, str]:
    """A new key for `tenant`; returns (the stored row, the token). Show the token once: it is not kept."""
    cleaned = clean_scopes(scopes)
    if not name or len(name) > 100:
        raise KeyRequestError("a key needs a name of 1 to 100 characters")
    if expires_at is not None and expires_at <= timezone.now():
        raise KeyRequestError("expires_at is in the past")
    minted = keys.mint(keys.pepper_from(settings.SECRET_KEY))
    with transaction.atomic():
        key = ApiKey.objects.create(
            tenant=tenant,
            name=name,
            prefix=minted.prefix,
            digest=minted.digest,
            scopes=cleaned,
            expires_at=expires_at,
            created_by=created_by,
        )
        audit.record(created_by, "key.create", f"key fy_{key.prefix}", tenant=tenant, after=key_state(key))
    return key, minted.token


def revoke_key(*, key: ApiKey, actor: object | None = None) -> ApiKey:
    """Revoke at once (idempotent): the key leaves the routing snapshot."""
    with transaction.atomic():
        locked = ApiKey.objects.select_for_update().get(pk=key.pk)
        if locked.revoked_at is None:
            before = key_state(locked)
            locked.revoked_at = timezone.now()
            locked.save(update_fields=["revoked_at", "updated_at"])
            audit.record(
                actor,
                "key.revoke",
                f"key fy_{locked.prefix}",
                tenant=locked.tenant,
                before=before,
                after=key_state(locked),
            )
    key.revoked_at, key.updated_at = locked.revoked_at, locked.updated_at
    return key


def key_state(key: ApiKey) -> dict:
    """What the audit log keeps of a key: never its digest."""
    return {
        "name": key.name,
        "prefix": key.prefix,
        "scopes": list(key.scopes),
        "expires_at": key.expires_at.isoformat() if key.expires_at else None,
        "revoked_at": key.revoked_at.isoformat() if key.revoked_at else None,
    }
