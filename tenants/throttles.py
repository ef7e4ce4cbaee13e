"""The API's throttles per client address, against a caller who costs the server work without credentials.

- `FailedLogins`: wrong HTTP Basic credentials from one address, FERRY_API_FAILED_LOGIN_RATE of them; past it
  `tenants.lockout.LockoutAwareBasicAuthentication` answers 429 before it checks the next password. Each check
  hashes the password (PBKDF2, hundreds of milliseconds of CPU): an address spraying usernames (each under
  django-axes' limit, which counts per username and address) would otherwise spend the server's CPU at will.
- `AnonymousRate`: requests without credentials to the API's open views (the index, the schema, its pages),
  FERRY_API_ANON_RATE per address; building the schema costs the server far more than asking for it.

Both answer as every throttled API request does: 429 JSON with Retry-After (DRF's Throttled, through
serving.api.errors). The address is REMOTE_ADDR (the TCP peer, or the client a proxy of FERRY_TRUSTED_PROXIES
forwarded), never an X-Forwarded-For of the client's own (REST_FRAMEWORK's NUM_PROXIES is 0). The counts live in
Django's cache, the process's memory unless CACHES says otherwise: each web process counts its own.
"""

from __future__ import annotations

import math

from django.conf import settings
from rest_framework.exceptions import Throttled
from rest_framework.throttling import AnonRateThrottle, SimpleRateThrottle


class TooManyFailedLogins(Throttled):
    default_detail = "too many failed logins from this address"


class FailedLogins(SimpleRateThrottle):
    """Wrong HTTP Basic credentials per address: `refused` before a password is checked, `record` after a
    wrong one (so right ones never count)."""

    scope = "failed_login"

    def get_rate(self) -> str:
        return settings.FERRY_API_FAILED_LOGIN_RATE  # read per request: a test's settings override applies

    def get_cache_key(self, request: object, view: object) -> str:
        return self.cache_format % {"scope": self.scope, "ident": self.get_ident(request)}

    def _read(self, request: object) -> None:
        self.key = self.get_cache_key(request, None)
        self.now = self.timer()
        self.history = [at for at in self.cache.get(self.key, []) if at > self.now - self.duration]  # newest first

    def refused(self, request: object) -> TooManyFailedLogins | None:
        """The answer when the request's address has used up its failures, else None (nothing is counted)."""
        self._read(request)
        if len(self.history) < self.num_requests:
            return None
        return TooManyFailedLogins(wait=max(1, math.ceil(self.duration - (self.now - self.history[-1]))))

    def record(self, request: object) -> None:
        """Count a wrong password from the request's address."""
        self._read(request)
        self.throttle_success()


class AnonymousRate(AnonRateThrottle):
    """DRF's throttle of anonymous requests, at FERRY_API_ANON_RATE."""

    def get_rate(self) -> str:
        return settings.FERRY_API_ANON_RATE

    def wait(self) -> float:
        # DRF's is None when more requests are on record than the rate allows (it was lowered since): an answer
        # without Retry-After would invite an immediate retry, so the whole period is the wait then.
        waited = super().wait()
        return float(self.duration) if waited is None else waited
