"""The quota policy (`serving.policies.quota`) on a fake clock: every branch of the decision, the bucket, the month."""

from __future__ import annotations

import calendar

import pytest

from serving.dataplane.gateway.gateway import _priority
from serving.dataplane.gateway.snapshot import TenantEntry
from serving.dataplane.http.protocol import ProtocolError
from serving.policies.quota import (
    DISABLED_RETRY_S,
    IN_FLIGHT,
    IN_FLIGHT_RETRY_S,
    MONTHLY,
    RATE,
    Bucket,
    Decision,
    InProcessQuota,
    debt_tokens,
    decide,
    month_of,
    scaled,
    seconds_to_next_month,
)

JAN_31_LATE = calendar.timegm((2026, 1, 31, 23, 59, 0))


def limits(**changes: object) -> TenantEntry:
    base = {
        "slug": "t",
        "requests_per_second": 10,
        "burst": 5,
        "max_in_flight": 100,
        "monthly_requests": 1000,
        "priority": 1,
    }
    return TenantEntry(**{**base, **changes})  # type: ignore[arg-type]


class FakeClock:
    def __init__(self, now: float = JAN_31_LATE) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_admits_up_to_the_burst_then_refuses_with_the_wait_for_one_token() -> None:
    # given a full bucket of 5 at 10/s
    quota = InProcessQuota(clock=FakeClock())
    admitted = [quota.admit(1, limits()) for _ in range(5)]
    # then five pass, counting the tokens down in RateLimit-Remaining
    assert [d.admitted for d in admitted] == [True] * 5
    assert [d.remaining for d in admitted] == [4, 3, 2, 1, 0]
    assert admitted[0].limit == 5 and admitted[0].reset == pytest.approx(0.1)
    # when a sixth comes at the same instant
    refused = quota.admit(1, limits())
    # then it is refused for rate, told to retry when one token is back (0.1 s), the bucket full in 0.5 s
    assert (refused.admitted, refused.reason, refused.remaining) == (False, RATE, 0)
    assert refused.retry_after == pytest.approx(0.1)
    assert refused.reset == pytest.approx(0.5)


def test_the_bucket_refills_at_the_rate_and_never_past_the_burst() -> None:
    clock = FakeClock()
    quota = InProcessQuota(clock=clock)
    for _ in range(5):
        quota.admit(1, limits())
    assert not quota.admit(1, limits()).admitted
    # when 0.25 s pass at 10/s: two tokens
    clock.now += 0.25
    assert [quota.admit(1, limits()).admitted for _ in range(3)] == [True, True, False]
    # when an hour passes: the bucket holds the burst, not 36,000
    clock.now += 3600
    assert sum(quota.admit(1, limits()).admitted for _ in range(10)) == 5


def test_a_clock_stepped_back_refills_nothing() -> None:
    bucket = Bucket(tokens=0.0, at=100.0)
    bucket.refill(50.0, rate=10, burst=5)
    assert bucket.tokens == 0.0 and bucket.at == 50.0


def test_in_flight_refuses_past_the_limit_and_a_release_frees_a_slot() -> None:
    quota = InProcessQuota(clock=FakeClock())
    wide = limits(burst=100, max_in_flight=2)
    assert quota.admit(1, wide).admitted and quota.admit(1, wide).admitted
    refused = quota.admit(1, wide)
    assert (refused.admitted, refused.reason, refused.limit, refused.retry_after) == (
        False,
        IN_FLIGHT,
        2,
        IN_FLIGHT_RETRY_S,
    )
    # a refusal took nothing: still two in flight
    assert quota.in_flight(1) == 2
    quota.release(1)
    assert quota.admit(1, wide).admitted
    # a release with nothing in flight (or for an unknown tenant) does not go negative
    for _ in range(5):
        quota.release(1)
    quota.release(99)
    assert quota.in_flight(1) == 0 and quota.in_flight(99) == 0


def test_monthly_budget_refuses_until_the_next_calendar_month_utc() -> None:
    clock = FakeClock()
    quota = InProcessQuota(clock=clock)
    budget = limits(monthly_requests=2, burst=100, max_in_flight=100)
    assert quota.admit(1, budget).admitted and quota.admit(1, budget).admitted
    refused = quota.admit(1, budget)
    # then refused for the month, retry at 1 February 00:00 UTC: 60 s away
    assert (refused.admitted, refused.reason, refused.limit, refused.remaining) == (False, MONTHLY, 2, 0)
    assert refused.retry_after == pytest.approx(60.0) and refused.reset == pytest.approx(60.0)
    # when the month turns, the count starts again
    clock.now += 61
    assert quota.admit(1, budget).admitted


def test_monthly_is_checked_before_in_flight_and_in_flight_before_the_bucket() -> None:
    empty = limits(monthly_requests=1, max_in_flight=1)
    assert decide(empty, tokens=0.0, in_flight=1, used=1, now=JAN_31_LATE).reason == MONTHLY
    assert decide(empty, tokens=0.0, in_flight=1, used=0, now=JAN_31_LATE).reason == IN_FLIGHT
    assert decide(empty, tokens=0.0, in_flight=0, used=0, now=JAN_31_LATE).reason == RATE
    assert decide(empty, tokens=1.0, in_flight=0, used=0, now=JAN_31_LATE).admitted


@pytest.mark.parametrize("changes", [{"requests_per_second": 0}, {"burst": 0}])
def test_a_zero_rate_or_burst_refuses_everything(changes: dict) -> None:
    decision = decide(limits(**changes), tokens=5.0, in_flight=0, used=0, now=JAN_31_LATE)
    assert (decision.admitted, decision.reason, decision.retry_after) == (False, RATE, DISABLED_RETRY_S)


def test_tenants_have_separate_budgets() -> None:
    quota = InProcessQuota(clock=FakeClock())
    one = limits(burst=1)
    assert quota.admit(1, one).admitted
    assert not quota.admit(1, one).admitted
    assert quota.admit(2, one).admitted


def test_month_arithmetic() -> None:
    assert month_of(JAN_31_LATE) == 202601
    assert month_of(JAN_31_LATE + 60) == 202602
    dec = calendar.timegm((2025, 12, 31, 23, 0, 0))
    assert seconds_to_next_month(dec) == 3600 and month_of(dec + 3600) == 202601
    leap = calendar.timegm((2028, 2, 29, 0, 0, 0))
    assert seconds_to_next_month(leap) == 86400


def test_scaled_divides_the_rate_burst_and_in_flight_among_gateways() -> None:
    assert scaled(limits(), 1) == limits()
    part = scaled(limits(requests_per_second=10, burst=5, max_in_flight=3), 4)
    assert (part.requests_per_second, part.burst, part.max_in_flight) == (2.5, 1, 1)
    assert part.monthly_requests == 1000  # the monthly budget is not divided
    # a limit of 0 stays 0 (refuse everything), it does not become 1
    off = scaled(limits(burst=0, max_in_flight=0), 4)
    assert (off.burst, off.max_in_flight) == (0, 0)


def test_headers_follow_the_ratelimit_draft_and_refusals_carry_retry_after() -> None:
    admitted = Decision(True, "", 5, 3, 0.21, 0.0)
    assert admitted.headers() == [
        (b"ratelimit-limit", b"5"),
        (b"ratelimit-remaining", b"3"),
        (b"ratelimit-reset", b"1"),
    ]
    refused = Decision(False, RATE, 5, -1, 0.5, 0.05)
    assert refused.headers()[-1] == (b"retry-after", b"1")  # never 0: a client would retry at once
    assert (b"ratelimit-remaining", b"0") in refused.headers()


@pytest.mark.parametrize(("asked", "tier", "runs_at"), [(0, 1, 1), (0, 3, 3), (1, 2, 2), (3, 1, 3), (2, 3, 3)])
def test_the_tenant_tier_is_a_floor_on_the_requested_priority(asked: int, tier: int, runs_at: int) -> None:
    assert _priority({"priority": asked}, tier) == runs_at


def test_a_bad_priority_is_still_a_400() -> None:
    with pytest.raises(ProtocolError):
        _priority({"priority": -1}, 2)


def test_seed_sets_the_bucket_to_what_the_shared_limiter_left() -> None:
    clock = FakeClock()
    quota = InProcessQuota(clock=clock)
    quota.seed(1, 1.0)  # a tenant this process has not seen
    assert quota.admit(1, limits()).admitted and not quota.admit(1, limits()).admitted
    quota.seed(1, 2.0)  # and one it has
    assert quota.admit(1, limits()).remaining == 1


def test_a_debt_is_charged_whole_to_a_bucket_that_saw_its_time_go_by() -> None:
    # given 30 requests a gateway admitted alone over the last 10 s, at half the limits (two gateways), to a
    # limiter counting the tenant since before then / then all 30 are taken (the bucket refilled by itself)
    assert debt_tokens(30, age=10.0, born=0.0, now=100.0, rate=2.0, share=0.5) == 30.0
    assert debt_tokens(0, age=10.0, born=100.0, now=100.0, rate=2.0, share=0.5) == 0.0


def test_a_limiter_that_came_back_empty_is_charged_only_past_the_refill_it_missed() -> None:
    # given a limiter that began counting the tenant 4 s ago, and a debt begun 10 s ago: it missed 6 s, of which
    # this gateway's share of the refill is 6 s x 2/s x 0.5 = 6 tokens
    assert debt_tokens(30, age=10.0, born=96.0, now=100.0, rate=2.0, share=0.5) == pytest.approx(24.0)
    # and one that began just now missed it all: 10 tokens off, never below nothing
    assert debt_tokens(30, age=10.0, born=100.0, now=100.0, rate=2.0, share=0.5) == pytest.approx(20.0)
    assert debt_tokens(5, age=10.0, born=100.0, now=100.0, rate=2.0, share=0.5) == 0.0


def test_a_fresh_limiter_charges_a_restarts_debt_without_refusing_the_tenant_after_it() -> None:
    # given a node host just started (a fresh limiter), and a web process of two that admitted 1,000 requests
    # on its own over the 10 s the host was away, at 100/s of a tenant's 200/s with a burst of 400
    clock = FakeClock()
    quota = InProcessQuota(clock=clock)
    rate = limits(requests_per_second=200, burst=400, monthly_requests=1_000_000)
    quota.charge(1, 1_000, rate, age=10.0, share=0.5)
    # then the month counts them all, but the bucket only what exceeded that process's share of the refill the
    # host missed: the tenant is admitted at once
    assert quota.admit(1, rate).admitted
    assert quota._tenants[1].used == 1_001
    # while a limiter that was counting all along charges the whole debt, to one burst below empty at most
    clock.now += 1.0
    quota.charge(1, 100_000, rate, age=0.5, share=0.5)
    assert quota._tenants[1].bucket.tokens == -400.0
    refused = quota.admit(1, rate)
    assert not refused.admitted and refused.reason == RATE
