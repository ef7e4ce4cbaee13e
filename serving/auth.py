"""Who is calling /v2: the API key in `Authorization: Bearer fy_...`, checked against the routing snapshot.

Plain Python, no database: one dict lookup by the key's prefix and one HMAC of its secret per
request (`tenants.keys`). Revoked keys are not in the snapshot; expiry is checked against `now`, so
a key that expires between two snapshots is refused on time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from serving.errors import ServingError
from serving.snapshot import RoutingSnapshot
from tenants import keys

CHALLENGE = (b"www-authenticate", b'Bearer realm="ferry"')


class Unauthenticated(ServingError):
    """No usable API key: 401 with a Bearer challenge."""

    status = 401
    headers = (CHALLENGE,)


class Forbidden(ServingError):
    """A valid key without the scope this endpoint needs: 403."""

    status = 403
    headers = ()


@dataclass(frozen=True, slots=True)
class Caller:
    tenant_id: int
    prefix: str
    scopes: tuple[str, ...]

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise Forbidden(f"this API key lacks the '{scope}' scope this endpoint needs")


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The token of the request's Authorization header (ASGI headers: lower-case names)."""
    value = None
    for name, raw in headers:
        if name == b"authorization":
            value = raw
            break
    if value is None:
        raise Unauthenticated("an API key is required: send 'Authorization: Bearer fy_...'")
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        raise Unauthenticated("malformed Authorization header: expected 'Bearer fy_...'")
    try:
        return token.decode("ascii")
    except UnicodeDecodeError:
        raise Unauthenticated("malformed API key") from None


def authenticate(
    headers: Iterable[tuple[bytes, bytes]], snapshot: RoutingSnapshot, pepper: bytes, now: float
) -> Caller:
    """The caller behind the request's API key, or Unauthenticated (401). `now` is epoch seconds."""
    parts = keys.split(bearer_token(headers))
    if parts is None:
        raise Unauthenticated("malformed API key: expected fy_<prefix>_<secret>")
    prefix, secret = parts
    entry = snapshot.keys.get(prefix)
    if entry is None or not keys.matches(pepper, secret, entry.digest):
        raise Unauthenticated("unknown or revoked API key")
    if entry.expires_at is not None and now >= entry.expires_at:
        raise Unauthenticated("API key expired")
    return Caller(tenant_id=entry.tenant_id, prefix=prefix, scopes=entry.scopes)
