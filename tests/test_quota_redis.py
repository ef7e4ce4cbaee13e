"""The shared limiter's script against the real Redis (FERRY_TEST_REDIS_URL), and the gate's fallback
when Redis does not answer. Time passing is simulated by moving the stored state back in Redis time."""

from __future__ import annotations

import asyncio
import calendar
import itertools
import os
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio as aioredis

from serving.dataplane.gateway.quota_gate import QuotaExceeded, QuotaGate
from serving.dataplane.gateway.quota_redis import MONTH_LUA, RedisQuota, keys_of
from serving.dataplane.gateway.snapshot import TenantEntry
from serving.dataplane.metrics import metrics
from serving.policies.quota import IN_FLIGHT, MONTHLY, RATE, month_of, seconds_to_next_month
from tests.conftest import free_port

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
_ids = itertools.count(900_000_000 + os.getpid() % 1000 * 1000)


def limits(**changes: object) -> TenantEntry:
    base = {
        "slug": "t",
        "requests_per_second": 0.001,
        "burst": 5,
        "max_in_flight": 100,
        "monthly_requests": 1_000_000,
        "priority": 1,
    }
    return TenantEntry(**{**base, **changes})  # type: ignore[arg-type]


@pytest.fixture
async def tenant_id() -> AsyncIterator[int]:
    tid = next(_ids)
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*keys_of(tid))
    yield tid
    client.delete(*keys_of(tid))
    client.close()


@pytest.fixture
async def limiter() -> AsyncIterator[RedisQuota]:
    quota = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    yield quota
    await quota.close()


def redis_now() -> float:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        seconds, micros = client.time()
        return seconds + micros / 1e6
    finally:
        client.close()


def month_used(tid: int) -> int:
    """The tenant's requests counted this month in Redis."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return int(client.hget(keys_of(tid)[0], "used"))
    finally:
        client.close()


def rewind(tid: int, seconds: float) -> None:
    """Pretend the bucket was last touched `seconds` earlier (Redis time)."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        at = float(client.hget(keys_of(tid)[0], "at"))
        client.hset(keys_of(tid)[0], "at", repr(at - seconds))
    finally:
        client.close()


async def test_burst_then_rate_refusal_with_the_wait_for_a_token(limiter, tenant_id) -> None:  # noqa: ANN001
    # given a bucket of 5 at 2/s
    tight = limits(requests_per_second=2, burst=5)
    decisions = [(await limiter.admit(tenant_id, tight))[0] for _ in range(5)]
    assert all(d.admitted for d in decisions)
    assert [d.remaining for d in decisions][-1] == 0
    # when a sixth comes before half a second passes
    rewind(tenant_id, -10)  # the bucket's clock moved ahead: no refill before the next call
    refused, _ = await limiter.admit(tenant_id, tight)
    # then it is refused for rate; the wait for one token is at most 1/rate
    assert (refused.admitted, refused.reason) == (False, RATE)
    assert 0 < refused.retry_after <= 0.5
    assert refused.headers()[-1] == (b"retry-after", b"1")


async def test_the_bucket_refills_with_redis_time_up_to_the_burst(limiter, tenant_id) -> None:  # noqa: ANN001
    tight = limits(requests_per_second=2, burst=3)
    for _ in range(3):
        assert (await limiter.admit(tenant_id, tight))[0].admitted
    rewind(tenant_id, -10)
    assert not (await limiter.admit(tenant_id, tight))[0].admitted
    # when a second passes (a bucket stamped in the future refilled nothing and was restamped now):
    # two tokens at 2/s
    rewind(tenant_id, 1)
    first, _ = await limiter.admit(tenant_id, tight)
    assert first.admitted and first.remaining == 1
    # an hour: the bucket holds the burst only
    rewind(tenant_id, 3600)
    assert sum([(await limiter.admit(tenant_id, tight))[0].admitted for _ in range(6)]) == 3


async def test_in_flight_release_and_leak_expiry(limiter, tenant_id) -> None:  # noqa: ANN001
    two = limits(max_in_flight=2, burst=100)
    (_, lease1), (_, lease2) = [await limiter.admit(tenant_id, two) for _ in range(2)]
    refused, _ = await limiter.admit(tenant_id, two)
    assert (refused.admitted, refused.reason, refused.limit) == (False, IN_FLIGHT, 2)
    # when one is released, a slot is free
    await limiter.release(tenant_id, lease1)
    assert (await limiter.admit(tenant_id, two))[0].admitted
    # when a gateway died holding lease2: its lease expires (moved to the past here) and frees the slot
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.zcard(keys_of(tenant_id)[1]) == 2
        client.zadd(keys_of(tenant_id)[1], {lease2: redis_now() - 1})
        assert 0 < client.ttl(keys_of(tenant_id)[1]) <= 60  # and the set itself expires when idle
    finally:
        client.close()
    assert (await limiter.admit(tenant_id, two))[0].admitted


async def test_monthly_counter_refuses_until_next_month_and_resets(limiter, tenant_id) -> None:  # noqa: ANN001
    budget = limits(monthly_requests=3, burst=100)
    for _ in range(3):
        assert (await limiter.admit(tenant_id, budget))[0].admitted
    refused, _ = await limiter.admit(tenant_id, budget)
    assert (refused.admitted, refused.reason, refused.limit, refused.remaining) == (False, MONTHLY, 3, 0)
    assert refused.retry_after == pytest.approx(seconds_to_next_month(redis_now()), abs=5)
    # when the stored count belongs to last month, this month starts from zero
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert int(client.hget(keys_of(tenant_id)[0], "month")) == month_of(redis_now())
        assert int(client.hget(keys_of(tenant_id)[0], "used")) == 3  # the refusal counted nothing
        client.hset(keys_of(tenant_id)[0], "month", 202001)
    finally:
        client.close()
    assert (await limiter.admit(tenant_id, budget))[0].admitted


async def test_two_limiters_share_one_tenant_budget(tenant_id) -> None:  # noqa: ANN001
    # given two gateways' limiters (two connections) and one tenant with a burst of 6
    one = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    two = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    try:
        shared = limits(burst=6)
        results = []
        for _ in range(6):
            results.append((await one.admit(tenant_id, shared))[0].admitted)
            results.append((await two.admit(tenant_id, shared))[0].admitted)
        # then six of twelve pass, whichever gateway asked
        assert sum(results) == 6
    finally:
        await one.close()
        await two.close()


async def test_a_flushed_script_cache_is_reloaded(limiter, tenant_id) -> None:  # noqa: ANN001
    assert (await limiter.admit(tenant_id, limits()))[0].admitted
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.script_flush()
    finally:
        client.close()
    # then the next EVALSHA meets NOSCRIPT, and the script is loaded again
    assert (await limiter.admit(tenant_id, limits()))[0].admitted


@pytest.mark.parametrize(
    "when",
    [
        (1970, 1, 1),
        (2000, 2, 29),
        (2024, 12, 31),
        (2025, 1, 1),
        (2026, 2, 28),
        (2028, 2, 29),
        (2100, 3, 1),
    ],
)
async def test_the_script_month_matches_python(when: tuple[int, int, int]) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        for offset in (0, 43_200, 86_399):
            epoch = calendar.timegm((*when, 0, 0, 0)) + offset
            got = await client.eval(MONTH_LUA + "return month_of(tonumber(ARGV[1]))", 0, repr(float(epoch)))
            assert got == month_of(epoch), (when, offset)
    finally:
        await client.aclose()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def live_gate(clock: FakeClock, *, gateways: int) -> QuotaGate:
    """A gate on the live Redis, one of `gateways`, deciding on `clock`; retrying Redis a second after it failed."""
    shared = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    return QuotaGate(shared=shared, gateways=gateways, timeout_s=2.0, retry_s=1.0, clock=clock)


def fallbacks() -> float:
    return metrics.QUOTA_FALLBACKS._value.get()


async def test_redis_down_falls_back_to_each_gateways_share(tenant_id) -> None:  # noqa: ANN001
    # given a gate whose Redis does not listen, for two gateways
    clock = FakeClock()
    dead = RedisQuota.from_url(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2, lease_s=60)
    gate = QuotaGate(shared=dead, gateways=2, timeout_s=0.2, retry_s=1.0, clock=clock)
    before = fallbacks()
    try:
        # when a tenant with a burst of 6 sends requests
        admitted = refused = 0
        for _ in range(6):
            try:
                ticket = await gate.admit(tenant_id, limits(burst=6))
            except QuotaExceeded as exc:
                assert exc.decision.reason == RATE
                refused += 1
            else:
                assert ticket.lease is None
                admitted += 1
        # then no error escapes: this gateway admits its half of the burst and refuses the rest
        assert (admitted, refused) == (3, 3)
        assert fallbacks() - before == 6
        # and a release of a ticket admitted in-process is counted in-process
        gate.release(ticket)
    finally:
        await gate.close()


async def test_redis_failure_is_not_retried_until_retry_s_passes(tenant_id) -> None:  # noqa: ANN001
    clock = FakeClock()
    live = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    gate = QuotaGate(shared=live, gateways=1, timeout_s=2.0, retry_s=1.0, clock=clock)
    try:
        # given Redis answered once (a lease in Redis)
        assert (await gate.admit(tenant_id, limits())).lease is not None
        # when it is marked down (as after a timeout): decisions are local, and Redis is not asked
        gate._redis_down_until = clock.now + 1.0
        assert (await gate.admit(tenant_id, limits())).lease is None
        # when retry_s passes: Redis again
        clock.now += 1.0
        ticket = await gate.admit(tenant_id, limits())
        assert ticket.lease is not None
        gate.release(ticket)
    finally:
        await gate.close()  # waits for the release task
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.zcard(keys_of(tenant_id)[1]) == 1  # the first lease, never released
    finally:
        client.close()


async def test_a_month_redis_refused_stays_refused_while_redis_is_down(tenant_id) -> None:  # noqa: ANN001
    live = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    gate = QuotaGate(shared=live, gateways=1, timeout_s=2.0, retry_s=60.0)
    try:
        spent = limits(monthly_requests=1)
        await gate.admit(tenant_id, spent)
        with pytest.raises(QuotaExceeded):
            await gate.admit(tenant_id, spent)
        # when Redis goes away, the tenant does not get a fresh month from the fallback
        gate._redis_down_until = float("inf")
        with pytest.raises(QuotaExceeded) as refused:
            await gate.admit(tenant_id, spent)
        assert refused.value.decision.reason == MONTHLY
    finally:
        await gate.close()


async def test_a_debt_is_charged_to_the_bucket_and_the_month(limiter, tenant_id) -> None:  # noqa: ANN001
    # given a fresh bucket of 5 / when a request arrives with 3 admitted elsewhere to charge
    decision, _ = await limiter.admit(tenant_id, limits(burst=5), debt=3)
    # then the bucket lost 4 tokens and the month counts 4
    assert decision.admitted and decision.remaining == 1
    assert month_used(tenant_id) == 4
    # a debt larger than the bucket leaves it at most one burst below empty: refused, not forever
    refused, _ = await limiter.admit(tenant_id, limits(burst=5, requests_per_second=1), debt=100)
    assert refused.reason == RATE and refused.retry_after == pytest.approx(6.0, abs=0.1)


async def test_a_redis_that_came_back_empty_is_charged_only_past_the_refill_it_missed(limiter, tenant_id) -> None:  # noqa: ANN001
    # given no state for the tenant (Redis restarted empty), and a gateway of two that admitted 30 requests on
    # its own over the last 10 s, at half of a tenant's 2/s with a burst of 5
    tight = limits(requests_per_second=2, burst=5)
    decision, _ = await limiter.admit(tenant_id, tight, debt=30, debt_age=10.0, share=0.5)
    # then the month counts them, and the bucket the 20 past the 10 s x 1/s of refill Redis did not see: one
    # burst below empty at most, so the tenant waits for tokens, not for 30 of them
    assert not decision.admitted and decision.reason == RATE
    assert decision.retry_after == pytest.approx(3.0, abs=0.1)  # from -5 to 1 at 2/s
    assert month_used(tenant_id) == 30
    # and within what it missed, a debt takes nothing from the bucket: admitted, 4 left
    other = tenant_id + 500_000
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*keys_of(other))
    try:
        decision, _ = await limiter.admit(other, tight, debt=8, debt_age=10.0, share=0.5)
        assert decision.admitted and decision.remaining == 4
        # while once Redis has counted the tenant since before a debt began, the debt is charged whole
        client.hset(keys_of(other)[0], "born", repr(redis_now() - 20.0))
        decision, _ = await limiter.admit(other, tight, debt=3, debt_age=10.0, share=0.5)
        assert decision.admitted and decision.remaining == 0  # 4 left, 3 charged, 1 taken
    finally:
        client.delete(*keys_of(other))
        client.close()


async def test_what_the_fallback_admitted_is_charged_when_redis_answers_again(tenant_id) -> None:  # noqa: ANN001
    clock = FakeClock()
    gate = live_gate(clock, gateways=1)
    try:
        # given Redis said 4 of a bucket of 5 are left
        first = await gate.admit(tenant_id, limits(burst=5))
        assert first.decision.remaining == 4
        # when Redis is away, the gateway's own bucket starts from those 4, not from 5
        gate._redis_down_until = clock.now + 1.0
        local = [await gate.admit(tenant_id, limits(burst=5)) for _ in range(4)]
        assert [t.lease for t in local] == [None] * 4
        with pytest.raises(QuotaExceeded):
            await gate.admit(tenant_id, limits(burst=5))
        # when Redis answers again, the 4 admitted here are charged before the next decision
        clock.now += 1.0
        with pytest.raises(QuotaExceeded):
            await gate.admit(tenant_id, limits(burst=5))
    finally:
        await gate.close()
    assert month_used(tenant_id) == 5


async def test_after_redis_comes_back_empty_the_fallback_s_debt_does_not_refuse_the_tenant(tenant_id) -> None:  # noqa: ANN001
    clock = FakeClock()
    gate = live_gate(clock, gateways=2)
    tight = limits(requests_per_second=2, burst=5)
    try:
        # given a gateway of two that admitted on its own for 11 s while Redis was away: 12 requests at its half
        # of the tenant's 2/s, from the 2 of the last 4 Redis said were left
        assert (await gate.admit(tenant_id, tight)).decision.remaining == 4
        gate._redis_down_until = clock.now + 11.0
        local = []
        for _ in range(10):
            local += [await gate.admit(tenant_id, tight)]
            clock.now += 1.0
        local += [await gate.admit(tenant_id, tight)]
        local += [await gate.admit(tenant_id, tight)]
        assert len(local) == 12 and all(t.lease is None for t in local)
        # when Redis comes back empty (restarted without its data), a second later
        client = redis.Redis.from_url(REDIS_URL)
        try:
            client.delete(*keys_of(tenant_id))
        finally:
            client.close()
        clock.now += 1.0
        # then the next request is admitted: the 12 are counted for the month, but only the 1 past this
        # gateway's share of the 11 s of refill Redis did not see (11 x 2/s x 1/2) is taken from its fresh bucket
        back = await gate.admit(tenant_id, tight)
        assert back.lease is not None and back.decision.remaining == 3
    finally:
        await gate.close()
    assert month_used(tenant_id) == 13


async def test_answered_leases_leave_redis_in_batches(tenant_id) -> None:  # noqa: ANN001
    live = RedisQuota.from_url(REDIS_URL, timeout_s=2.0, lease_s=60)
    gate = QuotaGate(shared=live, gateways=1, timeout_s=2.0)
    calls = []
    release_many = live.release_many

    async def counted(leases):  # noqa: ANN001, ANN202
        calls.append(len(leases))
        await release_many(leases)

    live.release_many = counted  # type: ignore[method-assign]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        # given five requests admitted through Redis: five leases held
        tickets = [await gate.admit(tenant_id, limits()) for _ in range(5)]
        assert client.zcard(keys_of(tenant_id)[1]) == 5
        # when all five are answered in one turn of the event loop
        for ticket in tickets:
            gate.release(ticket)
        await gate.close()
        # then one round trip removed them all
        assert calls == [5]
        assert client.zcard(keys_of(tenant_id)[1]) == 0
    finally:
        client.close()


async def test_the_admits_of_one_turn_leave_as_one_pipeline_and_each_gets_its_own_answer(limiter, tenant_id) -> None:  # noqa: ANN001
    batches = []
    execute = limiter._pipe._execute

    async def counted(batch):  # noqa: ANN001, ANN202
        batches.append(len(batch))
        return await execute(batch)

    limiter._pipe._execute = counted  # type: ignore[method-assign]
    # given a burst of 5: when eight requests ask in one turn of the event loop
    answers = await asyncio.gather(*(limiter.admit(tenant_id, limits()) for _ in range(8)))
    # then one round trip asked for all eight, and each has its own answer: five admitted (a lease each,
    # the tokens counting down), three refused for the rate
    assert batches == [8]
    decisions = [decision for decision, _ in answers]
    assert [d.admitted for d in decisions] == [True] * 5 + [False] * 3
    assert [d.remaining for d in decisions[:5]] == [4, 3, 2, 1, 0]
    assert {d.reason for d in decisions[5:]} == {RATE}
    assert len({lease for _, lease in answers}) == 8
