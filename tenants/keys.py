"""API key material: minting, the stored digest, and verification. Plain Python, no Django.

A key reads `fy_<prefix>_<secret>`. The prefix (10 characters) is stored in the clear and indexed,
so a presented key is found without a scan; the secret (43 characters, 256 bits from `secrets`)
is stored only as HMAC-SHA256 under a server-side pepper. A keyed hash, not a slow password
hash: the secret is high-entropy, so guessing is hopeless either way, and verification sits on
every inference request, where a slow hash would cost milliseconds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import string
from dataclasses import dataclass

PREFIX_LENGTH = 10
_ALPHABET = string.ascii_letters + string.digits
SCOPES = ("infer", "manage")


@dataclass(frozen=True, slots=True)
class Minted:
    """A new key: `token` is shown once; `prefix` and `digest` are what is stored."""

    token: str
    prefix: str
    digest: str


def mint(pepper: bytes) -> Minted:
    prefix = "".join(secrets.choice(_ALPHABET) for _ in range(PREFIX_LENGTH))
    secret = secrets.token_urlsafe(32)
    return Minted(f"fy_{prefix}_{secret}", prefix, digest(pepper, secret))


def digest(pepper: bytes, secret: str) -> str:
    return hmac.digest(pepper, secret.encode(), "sha256").hex()  # one C call; hmac.new builds objects


def split(token: str) -> tuple[str, str] | None:
    """(prefix, secret) of a well-formed key, else None."""
    if not token.startswith("fy_") or len(token) < 3 + PREFIX_LENGTH + 2:
        return None
    prefix, sep, secret = token[3:].partition("_")
    if sep != "_" or len(prefix) != PREFIX_LENGTH or not secret:
        return None
    return prefix, secret


def matches(pepper: bytes, secret: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(pepper, secret), stored_digest)


def pepper_from(secret_key: str) -> bytes:
    """The pepper, derived from Django's SECRET_KEY so no second secret has to be managed; rotating
    SECRET_KEY invalidates every API key (docs/operating.md says so)."""
    return hashlib.sha256(b"ferry-api-key-pepper:" + secret_key.encode()).digest()
