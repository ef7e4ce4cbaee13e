"""Who is calling /v2: the API key in `Authorization: Bearer fy_...`, checked against the routing snapshot.

Plain Python, no database: one dict lookup by the key's prefix and one HMAC of its secret
(`tenants.keys`). Revoked keys are not in the snapshot; expiry is checked against `now` on every
request, so a key that expires between two snapshots is refused on time.

A client sends the same key on every request, so the Authorization values verified against the
current snapshot are remembered (successes only, at most MAX_REMEMBERED, forgotten whenever the
snapshot changes, so a revocation applies at once): a repeat costs one dict lookup instead of an
HMAC. The memo is keyed by the whole header value; a lookup that misses costs the same as before,
so it tells a prober nothing about other keys (the dict's hash is randomised per process).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.dataplane.errors import ServingError
from serving.dataplane.gateway.snapshot import KeyEntry, RoutingSnapshot
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


def bearer_token(value: bytes) -> str:
    """The token of an Authorization header value."""
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        raise Unauthenticated("malformed Authorization header: expected 'Bearer fy_...'")
    try:
        return token.decode("ascii")
    except UnicodeDecodeError:
        raise Unauthenticated("malformed API key") from None


MAX_REMEMBERED = 10_000

_memo_of: RoutingSnapshot | None = None  # the snapshot the memo's verdicts hold for
_memo: dict[bytes, tuple[KeyEntry, Caller]] = {}  # Authorization value -> its key and caller


def authenticate(value: bytes | None, snapshot: RoutingSnapshot, pepper: bytes, now: float) -> Caller:
    """The caller behind the request's Authorization header value (None: the request has none), or
    Unauthenticated (401). `now` is epoch seconds."""
    global _memo_of
    if value is None:
        raise Unauthenticated("an API key is required: send 'Authorization: Bearer fy_...'")
    if snapshot is not _memo_of:
        _memo.clear()
        _memo_of = snapshot
    known = _memo.get(value)
    if known is None:
        known = _verify(value, snapshot, pepper)
        if len(_memo) >= MAX_REMEMBERED:
            _memo.clear()
        _memo[value] = known
    entry, caller = known
    if entry.expires_at is not None and now >= entry.expires_at:
        raise Unauthenticated("API key expired")
    return caller


def _verify(value: bytes, snapshot: RoutingSnapshot, pepper: bytes) -> tuple[KeyEntry, Caller]:
    parts = keys.split(bearer_token(value))
    if parts is None:
        raise Unauthenticated("malformed API key: expected fy_<prefix>_<secret>")
    prefix, secret = parts
    entry = snapshot.keys.get(prefix)
    if entry is None or not keys.matches(pepper, secret, entry.digest):
        raise Unauthenticated("unknown or revoked API key")
    return entry, Caller(tenant_id=entry.tenant_id, prefix=prefix, scopes=entry.scopes)
