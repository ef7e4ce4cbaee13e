"""The data plane's quota check: Redis when configured, in-process otherwise, and what happens between.

While Redis does not answer (an error, or no reply within its timeout) the gateway decides in-process
with the tenant's limits divided by the number of gateways (`serving.policies.quota.scaled`), counts it in
`ferry_quota_fallback_total`, and does not try Redis again for `retry_s`, so an outage costs one timeout
per `retry_s`, not one per request. A request is never answered 500 and never admitted unlimited
because Redis is away. The in-process bucket starts from what Redis last said the tenant had left
(scaled), not full, and what this gateway admitted on its own is a debt charged to the tenant's
bucket and month at its next Redis call, so a timeout (a slow moment, not an outage) does not hand
the tenant extra requests. The debt travels with its age and this gateway's share of the limits: a
limiter that came back empty charges its bucket only what exceeds the refill it did not see
(`serving.policies.quota.debt_tokens`), so a restart does not refuse the tenant afterwards. The
monthly budget cannot be enforced across gateways during an outage: only a tenant Redis last refused
for its month stays refused; otherwise its rate bounds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from serving.dataplane.gateway.quota_redis import RedisQuota
from serving.dataplane.gateway.snapshot import TenantEntry
from serving.dataplane.metrics import metrics
from serving.policies.quota import (
    MONTHLY,
    ControlBuckets,
    Decision,
    InProcessQuota,
    Limits,
    month_of,
    scaled,
    seconds_to_next_month,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)  # not frozen: one per request
class Ticket:
    """An admitted request's hold on its tenant's in-flight count; hand it back to `release`."""

    tenant_id: int
    decision: Decision
    lease: str | None  # the Redis lease; None when this process counted it


class QuotaExceeded(Exception):
    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


class QuotaGate:
    def __init__(
        self,
        *,
        shared: RedisQuota | None,
        gateways: int = 1,
        timeout_s: float = 0.05,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        control: ControlBuckets | None = None,
    ) -> None:
        self.shared = shared
        self.local = InProcessQuota(clock=clock)
        # /v2 repository load and unload: a bucket of their own per tenant, in this process (not shared
        # through Redis: each gateway allows the rate), besides the request taken from the quota above.
        self.control = control
        self.gateways = gateways
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._redis_down_until = 0.0
        self._month_spent: dict[int, int] = {}  # tenant -> the month (YYYYMM) Redis refused it for
        # tenant -> requests admitted here, not yet charged in Redis, and when the first of them was
        self._debt: dict[int, tuple[int, float]] = {}
        # Redis leases answered and not yet removed, sent as one pipeline per event-loop turn (not a task
        # and a round trip per request).
        self._to_release: list[tuple[int, str]] = []
        self._releasing: asyncio.Task[None] | None = None

    async def admit(self, tenant_id: int, limits: TenantEntry) -> Ticket:
        """A ticket for an admitted request, or QuotaExceeded with the refusal."""
        now = self._clock()
        if self.shared is not None and now >= self._redis_down_until:
            debt, since = self._debt.pop(tenant_id, (0, now))
            try:
                async with asyncio.timeout(self.timeout_s):
                    decision, lease = await self.shared.admit(
                        tenant_id, limits, debt, debt_age=now - since, share=1.0 / self.gateways
                    )
            except (redis.RedisError, OSError, TimeoutError) as exc:
                if debt:  # perhaps charged, perhaps not: keep it (charging twice errs on the strict side)
                    more, later = self._debt.get(tenant_id, (0, since))
                    self._debt[tenant_id] = (debt + more, min(since, later))
                self._redis_down_until = self._clock() + self.retry_s
                log.warning(
                    "quota check through Redis failed (%s); deciding in-process for %.0f s",
                    str(exc) or f"{type(exc).__name__} after {self.timeout_s * 1000:.0f} ms",
                    self.retry_s,
                )
            else:
                self.local.seed(tenant_id, max(0, decision.remaining) / self.gateways)
                if decision.reason == MONTHLY:
                    self._month_spent[tenant_id] = month_of(self._clock())
                if not decision.admitted:
                    raise QuotaExceeded(decision)
                return Ticket(tenant_id, decision, lease)
            return self._admit_here(tenant_id, scaled(limits, self.gateways), fallback=True)
        if self.shared is not None:
            return self._admit_here(tenant_id, scaled(limits, self.gateways), fallback=True)
        return self._admit_here(tenant_id, limits, fallback=False)

    def admit_here(self, tenant_id: int, limits: TenantEntry) -> Ticket:
        """The decision without a shared limiter (embedded mode): synchronous, so the request path spends
        no coroutine on it. QuotaExceeded on a refusal."""
        return self._admit_here(tenant_id, limits, fallback=False)

    def _admit_here(self, tenant_id: int, limits: Limits, *, fallback: bool) -> Ticket:
        now = 0.0
        if fallback:
            metrics.QUOTA_FALLBACKS.inc()
            now = self._clock()
            if self._month_spent.get(tenant_id) == month_of(now):
                wait = seconds_to_next_month(now)
                raise QuotaExceeded(Decision(False, MONTHLY, limits.monthly_requests, 0, wait, wait))
        decision = self.local.admit(tenant_id, limits)
        if not decision.admitted:
            raise QuotaExceeded(decision)
        if fallback:
            debt, since = self._debt.get(tenant_id, (0, now))
            self._debt[tenant_id] = (debt + 1, since)
        return Ticket(tenant_id, decision, None)

    def release(self, ticket: Ticket) -> None:
        """Give the ticket's in-flight slot back, without waiting: Redis leases are removed in batches by
        a task (if that fails, the lease expires on its own)."""
        if ticket.lease is None:
            self.local.release(ticket.tenant_id)
            return
        self._to_release.append((ticket.tenant_id, ticket.lease))
        if self._releasing is None or self._releasing.done():
            self._releasing = asyncio.get_running_loop().create_task(self._release_batches())

    async def _release_batches(self) -> None:
        assert self.shared is not None
        await asyncio.sleep(0)  # let the answers of this loop turn join the batch
        while self._to_release:
            batch, self._to_release = self._to_release, []
            try:
                async with asyncio.timeout(self.timeout_s * 4):
                    await self.shared.release_many(batch)
            except (redis.RedisError, OSError, TimeoutError) as exc:
                log.warning("releasing %d in-flight leases failed (%s); they expire on their own", len(batch), exc)

    async def close(self) -> None:
        if self._releasing is not None:
            await asyncio.gather(self._releasing, return_exceptions=True)
        if self.shared is not None:
            await self.shared.close()


def from_settings() -> QuotaGate | None:
    """The gate this process's settings ask for; None with quotas off (FERRY_QUOTAS=false)."""
    from django.conf import settings

    if not settings.FERRY_QUOTAS:
        return None
    timeout_s = settings.FERRY_QUOTA_REDIS_TIMEOUT_MS / 1000
    shared = None
    if settings.FERRY_QUOTA_REDIS_URL:
        shared = RedisQuota.from_url(
            settings.FERRY_QUOTA_REDIS_URL, timeout_s=timeout_s, lease_s=settings.FERRY_QUOTA_LEASE_S
        )
    control = ControlBuckets(rate=settings.FERRY_CONTROL_LOADS_PER_MINUTE / 60, burst=settings.FERRY_CONTROL_LOAD_BURST)
    return QuotaGate(shared=shared, gateways=settings.FERRY_QUOTA_GATEWAYS, timeout_s=timeout_s, control=control)
