"""Per-tenant quotas shared by every gateway: one Redis script call per request, the calls of one turn of
the event loop sent together as one pipeline (`serving.dataplane.transport.redis_pipe.Pipe`).

The script (`ADMIT`) refills the tenant's token bucket, drops expired in-flight leases, counts the
month, decides as `serving.policies.quota.decide` does and, when it admits, takes a token, adds an in-flight
lease and counts the request, atomically. Time is Redis' own (TIME), so gateways with skewed clocks
share one bucket and agree on the month. Keys are hash-tagged by tenant, so a Redis Cluster keeps a
tenant's keys in one slot:

    ferry:quota:{<tenant id>}           hash: tokens, at, month (YYYYMM), used
    ferry:quota:{<tenant id>}:inflight  sorted set: lease id -> expiry (Redis time, seconds)

In-flight is a set of leases rather than a counter so that a gateway that dies with requests in
flight cannot leak them: a lease the gateway never releases expires after `lease_s`.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from serving.dataplane.gateway.snapshot import TenantEntry
from serving.dataplane.transport.redis_pipe import Pipe
from serving.policies.quota import DISABLED_RETRY_S, IN_FLIGHT_RETRY_S, Decision, seconds_to_next_month

PREFIX = "ferry:quota"

# YYYYMM of `now` (epoch seconds, UTC): Howard Hinnant's civil_from_days, in Lua.
MONTH_LUA = """
local function month_of(now)
  local z = math.floor(now / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y * 100 + m
end
"""

# KEYS: state hash, in-flight set. ARGV: rate, burst, max_in_flight, monthly, lease id, lease seconds,
# debt (requests this gateway admitted on its own while Redis did not answer: charged to the month, and to
# the bucket down to at most one burst's worth below empty, less this gateway's share of the refill over
# the part of the debt's time the hash did not exist: `serving.policies.quota.debt_tokens`), the debt's
# age in seconds, that share (1/gateways). The hash's `born` is when it began counting the tenant.
# Returns {reason ('' when admitted), tokens left, in flight, used this month, Redis time}; numbers
# that may be fractional travel as strings (a Lua number would be truncated to an integer reply).
ADMIT = (
    MONTH_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local max_in_flight, monthly = tonumber(ARGV[3]), tonumber(ARGV[4])
local lease_s = tonumber(ARGV[6])
local st = redis.call('HMGET', KEYS[1], 'tokens', 'at', 'month', 'used', 'born')
local tokens, at = tonumber(st[1]), tonumber(st[2])
local born = tonumber(st[5]) or 0
if tokens == nil or at == nil then tokens, at, born = burst, now, now end
local elapsed = now - at
if elapsed < 0 then elapsed = 0 end
local debt = tonumber(ARGV[7])
local charged = 0
if debt > 0 then
  local age, share = tonumber(ARGV[8]), tonumber(ARGV[9])
  local missed = math.min(math.max(born - (now - age), 0), age)
  charged = math.max(0, debt - missed * rate * share)
end
tokens = math.max(-burst, math.min(burst, tokens + elapsed * rate - charged))
local month = month_of(now)
local used = tonumber(st[4]) or 0
if tonumber(st[3]) ~= month then used = 0 end
used = used + debt
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local in_flight = redis.call('ZCARD', KEYS[2])
local reason = ''
if used >= monthly then reason = 'monthly'
elseif in_flight >= max_in_flight then reason = 'in_flight'
elseif rate <= 0 or burst < 1 or tokens < 1 then reason = 'rate'
end
if reason == '' then
  tokens = tokens - 1
  used = used + 1
  in_flight = in_flight + 1
  redis.call('ZADD', KEYS[2], now + lease_s, ARGV[5])
  redis.call('EXPIRE', KEYS[2], math.ceil(lease_s))
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'at', string.format('%.6f', now),
           'month', month, 'used', used, 'born', string.format('%.6f', born))
redis.call('EXPIRE', KEYS[1], 40 * 86400)
return {reason, string.format('%.6f', tokens), in_flight, used, string.format('%.6f', now)}
"""
)


def keys_of(tenant_id: int) -> tuple[str, str]:
    base = f"{PREFIX}:{{{tenant_id}}}"
    return base, f"{base}:inflight"


def decision_from(limits: TenantEntry, reply: list) -> Decision:
    """The script's reply as the pure policy's Decision (same numbers, Redis' clock)."""
    reason = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
    tokens, used, now = float(reply[1]), int(reply[3]), float(reply[4])
    rate, burst = limits.requests_per_second, limits.burst
    if reason == "monthly":
        wait = seconds_to_next_month(now)
        return Decision(False, reason, limits.monthly_requests, limits.monthly_requests - used, wait, wait)
    if reason == "in_flight":
        return Decision(False, reason, limits.max_in_flight, 0, IN_FLIGHT_RETRY_S, IN_FLIGHT_RETRY_S)
    if reason == "rate":
        if rate <= 0 or burst < 1:
            return Decision(False, reason, burst, 0, DISABLED_RETRY_S, DISABLED_RETRY_S)
        return Decision(False, reason, burst, 0, (burst - tokens) / rate, (1.0 - tokens) / rate)
    return Decision(True, "", burst, int(tokens), (burst - tokens) / rate, 0.0)


class RedisQuota:
    """The shared limiter: `admit` is the one script call (EVALSHA, the script loaded again on NOSCRIPT),
    `release` removes the lease. Raises redis' errors (and TimeoutError) for the caller to fall back on.
    A request's call waits for the end of its event-loop turn and goes with the others of that turn in
    one pipeline: one write and one read for all of them, where a call per request cost a round trip
    each (a web process under load admits several requests a turn)."""

    def __init__(self, client: aioredis.Redis, *, lease_s: float) -> None:
        self.client = client
        self.lease_s = lease_s
        self._sha = client.register_script(ADMIT).sha
        self._pipe = Pipe(client)
        # Lease ids unique across gateways and restarts (a container's pid is often 1 every time): host,
        # process, a random start-up token, a counter.
        self._origin = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}:"
        self._ids = itertools.count()

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float, lease_s: float) -> RedisQuota:
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, lease_s=lease_s)

    async def admit(
        self, tenant_id: int, limits: TenantEntry, debt: int = 0, *, debt_age: float = 0.0, share: float = 1.0
    ) -> tuple[Decision, str]:
        """The decision for one request, and its lease id; `debt` requests admitted elsewhere, the first
        `debt_age` seconds ago at `share` of the limits, are charged first (see `QuotaGate`)."""
        lease = f"{self._origin}{next(self._ids)}"
        command = (
            "EVALSHA",
            self._sha,
            2,
            *keys_of(tenant_id),
            repr(float(limits.requests_per_second)),
            limits.burst,
            limits.max_in_flight,
            limits.monthly_requests,
            lease,
            repr(float(self.lease_s)),
            debt,
            repr(float(debt_age)),
            repr(float(share)),
        )
        if not self._pipe.started:  # its task runs on the loop of the first call, as the client's connections do
            self._pipe.start()
        try:
            reply = await self._send(command)
        except NoScriptError:  # Redis restarted or flushed its scripts: nothing ran; load it, then run it
            await self.client.script_load(ADMIT)
            reply = await self._send(command)
        return decision_from(limits, reply), lease

    async def _send(self, command: tuple) -> list:
        future = self._pipe.send(*command)
        assert future is not None
        return await future

    async def release(self, tenant_id: int, lease: str) -> None:
        await self.client.zrem(keys_of(tenant_id)[1], lease)

    async def release_many(self, leases: list[tuple[int, str]]) -> None:
        """Remove many leases in one round trip: one ZREM per tenant, pipelined."""
        by_tenant: dict[int, list[str]] = {}
        for tenant_id, lease in leases:
            by_tenant.setdefault(tenant_id, []).append(lease)
        async with self.client.pipeline(transaction=False) as pipe:
            for tenant_id, ids in by_tenant.items():
                pipe.zrem(keys_of(tenant_id)[1], *ids)
            await pipe.execute()

    async def close(self) -> None:
        await self._pipe.close()
        await self.client.aclose()
