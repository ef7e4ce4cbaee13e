"""Per-tenant request quotas: a token bucket (rate + burst), requests in flight, a monthly budget.

Plain Python with an injected clock (epoch seconds): the in-process limiter of embedded mode, the
fallback of distributed mode while Redis is down, and the reference the Redis script
(`serving.dataplane.gateway.quota_redis`) mirrors. A decision is made in one step, in this order: the monthly budget,
then in-flight, then the bucket; a refused request takes nothing (no token, no in-flight slot, no
monthly count), so refusals cannot drain a budget.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

RATE, IN_FLIGHT, MONTHLY = "rate", "in_flight", "monthly"
CONTROL = "control"  # the tenant's repository loads and unloads (`ControlBuckets`)
# Retry-After for a tenant whose rate or burst is 0 (it may send nothing until its quota changes) and
# for in-flight (a slot frees when one of its own requests is answered: we cannot know when).
DISABLED_RETRY_S = 60.0
IN_FLIGHT_RETRY_S = 1.0


@dataclass(slots=True)  # not frozen: one per request, and a frozen dataclass's __init__ costs more
class Decision:
    """What the limiter decided, with the numbers of the RateLimit headers. On a refusal, `limit`,
    `remaining` and `reset` describe the limit that refused; on admission, the token bucket."""

    admitted: bool
    reason: str  # "" when admitted, else RATE | IN_FLIGHT | MONTHLY
    limit: int
    remaining: int
    reset: float  # seconds until `remaining` is back to `limit` (bucket full; month over)
    retry_after: float  # seconds; 0 when admitted

    def headers(self) -> list[tuple[bytes, bytes]]:
        """RateLimit-* (draft-ietf-httpapi-ratelimit-headers, the separate-fields form), and
        Retry-After on a refusal."""
        remaining = self.remaining
        out = [
            (b"ratelimit-limit", b"%d" % self.limit),
            (b"ratelimit-remaining", b"%d" % remaining if remaining > 0 else b"0"),
            (b"ratelimit-reset", b"%d" % math.ceil(self.reset)),
        ]
        if not self.admitted:
            out.append((b"retry-after", b"%d" % max(1, math.ceil(self.retry_after))))
        return out


@dataclass(slots=True)
class Bucket:
    tokens: float
    at: float

    def refill(self, now: float, rate: float, burst: float) -> None:
        elapsed = max(0.0, now - self.at)  # a clock stepped back refills nothing
        self.tokens = min(float(burst), self.tokens + elapsed * rate)
        self.at = now


def month_of(epoch: float) -> int:
    """The calendar month (UTC) of `epoch` as YYYYMM."""
    t = time.gmtime(epoch)
    return t.tm_year * 100 + t.tm_mon


def seconds_to_next_month(epoch: float) -> float:
    """Seconds from `epoch` to 00:00 UTC on the first day of the next month."""
    t = time.gmtime(epoch)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - epoch


class Limits(Protocol):
    """A tenant's request-path quota as this policy reads it: the routing snapshot's `TenantEntry` is one, and
    so is `ScaledLimits`. Declared here so that the policy imports nothing of the data plane's."""

    @property
    def requests_per_second(self) -> float: ...
    @property
    def burst(self) -> int: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def monthly_requests(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ScaledLimits:
    """A gateway's part of a tenant's limits (`scaled`)."""

    requests_per_second: float
    burst: int
    max_in_flight: int
    monthly_requests: int


def decide(limits: Limits, *, tokens: float, in_flight: int, used: int, now: float) -> Decision:
    """The decision for one request, given the refilled bucket, the tenant's requests in flight and its
    requests so far this month. Admitting takes one token, one in-flight slot and one monthly request."""
    rate, burst = limits.requests_per_second, limits.burst
    if used >= limits.monthly_requests:
        return Decision(
            False,
            MONTHLY,
            limits.monthly_requests,
            limits.monthly_requests - used,
            seconds_to_next_month(now),
            seconds_to_next_month(now),
        )
    if in_flight >= limits.max_in_flight:
        return Decision(False, IN_FLIGHT, limits.max_in_flight, 0, IN_FLIGHT_RETRY_S, IN_FLIGHT_RETRY_S)
    if rate <= 0 or burst < 1:
        return Decision(False, RATE, burst, 0, DISABLED_RETRY_S, DISABLED_RETRY_S)
    if tokens < 1.0:
        wait = (1.0 - tokens) / rate
        return Decision(False, RATE, burst, 0, (burst - tokens) / rate, wait)
    left = tokens - 1.0
    return Decision(True, "", burst, math.floor(left), (burst - left) / rate, 0.0)


def scaled(limits: Limits, share: int) -> Limits:
    """`limits` divided among `share` gateways (the fallback while Redis is down): each gateway allows
    its part, at least one request, so together they stay near the tenant's limit."""
    if share <= 1:
        return limits
    return ScaledLimits(
        requests_per_second=limits.requests_per_second / share,
        burst=max(1, limits.burst // share) if limits.burst else 0,
        max_in_flight=max(1, math.ceil(limits.max_in_flight / share)) if limits.max_in_flight else 0,
        monthly_requests=limits.monthly_requests,
    )


@dataclass
class ControlBuckets:
    """A token bucket per tenant for /v2 repository load and unload, at their own rate (tokens a second) and
    burst, far below inference's: each writes the database and republishes the routing snapshot to every
    gateway. On top of the tenant's request quota, which these calls take a request of too. One per
    process; the event loop's thread only (no lock)."""

    rate: float
    burst: int
    clock: Callable[[], float] = time.time
    _buckets: dict[int, Bucket] = field(default_factory=dict)

    def admit(self, tenant_id: int) -> Decision:
        """Take a token, or the refusal (reason CONTROL) with when one is back; a refusal takes nothing."""
        now = self.clock()
        bucket = self._buckets.get(tenant_id)
        if bucket is None:
            bucket = self._buckets[tenant_id] = Bucket(float(self.burst), now)
        bucket.refill(now, self.rate, self.burst)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return Decision(
                True, "", self.burst, math.floor(bucket.tokens), (self.burst - bucket.tokens) / self.rate, 0.0
            )
        return Decision(
            False, CONTROL, self.burst, 0, (self.burst - bucket.tokens) / self.rate, (1.0 - bucket.tokens) / self.rate
        )

    def refund(self, tenant_id: int) -> None:
        """Give back the token of a call refused after it was taken (by the request quota)."""
        bucket = self._buckets.get(tenant_id)
        if bucket is not None:
            bucket.tokens = min(float(self.burst), bucket.tokens + 1.0)


def debt_tokens(debt: int, *, age: float, born: float, now: float, rate: float, share: float) -> float:
    """Tokens to take from a shared bucket for `debt` requests a gateway admitted on its own, the first of
    them `age` seconds ago, its limits `share` (1/gateways) of the tenant's while it did.

    A bucket that was there all along (`born`, when the limiter began counting the tenant, before the debt)
    has refilled over that time by itself: the whole debt is charged. One the limiter began counting since
    (a Redis or node host that came back empty) never saw that time go by, and charging the whole debt to
    its fresh, full bucket refused the tenant for seconds after every restart; this gateway's share of the
    refill over the part of the debt's time the limiter missed is taken off first."""
    if debt <= 0:
        return 0.0
    missed = min(max(born - (now - age), 0.0), age)
    return max(0.0, debt - missed * rate * share)


@dataclass(slots=True)
class _TenantState:
    bucket: Bucket
    in_flight: int = 0
    month: int = 0
    used: int = 0
    born: float = 0.0  # when this limiter began counting the tenant (`debt_tokens`)


@dataclass
class InProcessQuota:
    """Every tenant's bucket, in-flight count and monthly count in this process.

    `admit` and `release` run on the event loop's thread only (no lock). In-flight cannot leak here:
    the caller releases in a `finally`, in the same process that counted it."""

    clock: Callable[[], float] = time.time
    _tenants: dict[int, _TenantState] = field(default_factory=dict)
    # The current month (YYYYMM) and when the next begins: the calendar is read once a month, not per request.
    _month: int = 0
    _month_since: float = math.inf
    _month_until: float = -math.inf

    def admit(self, tenant_id: int, limits: Limits) -> Decision:
        now = self.clock()
        state = self._tenants.get(tenant_id)
        if state is None:
            state = self._tenants[tenant_id] = _TenantState(Bucket(float(limits.burst), now), born=now)
        state.bucket.refill(now, limits.requests_per_second, limits.burst)
        month = self._month_at(now)
        if state.month != month:
            state.month, state.used = month, 0
        tokens, rate, burst = state.bucket.tokens, limits.requests_per_second, limits.burst
        if (
            tokens >= 1.0
            and state.in_flight < limits.max_in_flight
            and state.used < limits.monthly_requests
            and rate > 0
            and burst >= 1
        ):
            # What `decide` answers when every limit has room, without its call: the common case.
            left = tokens - 1.0
            state.bucket.tokens = left
            state.in_flight += 1
            state.used += 1
            return Decision(True, "", burst, math.floor(left), (burst - left) / rate, 0.0)
        decision = decide(limits, tokens=tokens, in_flight=state.in_flight, used=state.used, now=now)
        if decision.admitted:
            state.bucket.tokens -= 1.0
            state.in_flight += 1
            state.used += 1
        return decision

    def _month_at(self, now: float) -> int:
        if not self._month_since <= now < self._month_until:  # a new month (or a clock stepped back)
            t = time.gmtime(now)
            self._month = t.tm_year * 100 + t.tm_mon
            self._month_since = float(calendar.timegm((t.tm_year, t.tm_mon, 1, 0, 0, 0)))
            self._month_until = now + seconds_to_next_month(now)
        return self._month

    def seed(self, tenant_id: int, tokens: float) -> None:
        """Set the tenant's bucket to `tokens` now: the shared limiter's last word, so that deciding here
        (Redis away) starts from what the tenant had left instead of a full bucket."""
        now = self.clock()
        state = self._tenants.get(tenant_id)
        if state is None:
            self._tenants[tenant_id] = _TenantState(Bucket(tokens, now), born=now)
        else:
            state.bucket.tokens, state.bucket.at = tokens, now

    def charge(self, tenant_id: int, n: int, limits: Limits, *, age: float = 0.0, share: float = 1.0) -> None:
        """Count `n` requests admitted elsewhere (a gateway deciding alone while this limiter did not answer,
        the first `age` seconds ago, at `share` of the limits): the month's count, and tokens as
        `debt_tokens` says, down to one burst below empty at most (as the Redis script); never the in-flight
        count, which that gateway kept."""
        if n <= 0:
            return
        now = self.clock()
        state = self._tenants.get(tenant_id)
        if state is None:
            state = self._tenants[tenant_id] = _TenantState(Bucket(float(limits.burst), now), born=now)
        rate, burst = limits.requests_per_second, limits.burst
        state.bucket.refill(now, rate, burst)
        taken = debt_tokens(n, age=age, born=state.born, now=now, rate=rate, share=share)
        state.bucket.tokens = max(-float(burst), state.bucket.tokens - taken)
        month = self._month_at(now)
        if state.month != month:  # a tenant first seen here, or a new month: the debt opens its count
            state.month, state.used = month, 0
        state.used += n

    def release(self, tenant_id: int) -> None:
        state = self._tenants.get(tenant_id)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def in_flight(self, tenant_id: int) -> int:
        state = self._tenants.get(tenant_id)
        return state.in_flight if state is not None else 0
