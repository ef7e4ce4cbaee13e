"""The rollout gates (rollout.gates): plain Python, judged on hand-made evidence."""

from __future__ import annotations

import pytest

from rollout.gates import (
    CANARY,
    FAIL,
    NO_DATA,
    PASS,
    SHADOW,
    Evidence,
    Side,
    Thresholds,
    agreement_gate,
    error_rate_gate,
    judge,
    p99_gate,
)

LIMITS = Thresholds(
    max_error_rate_increase=0.01,
    max_p99_ratio=1.25,
    p99_slack_ms=5,
    min_agreement=0.95,
    min_requests=100,
    min_compared=50,
)
BASE = Side(requests=1000, errors=10, p99_ms=20.0)


def canary(cand: Side, agreement: float | None = None, compared: int = 0) -> Evidence:
    return Evidence(baseline=BASE, candidate=cand, agreement=agreement, compared=compared)


def test_error_rate_gate_compares_against_the_baseline_with_its_allowance() -> None:
    # 1% baseline: 2% is within 1% + 1%, 2.1% is not
    assert error_rate_gate(canary(Side(1000, 20, 20.0)), LIMITS).status == PASS
    failed = error_rate_gate(canary(Side(1000, 21, 20.0)), LIMITS)
    assert failed.status == FAIL
    assert failed.numbers["candidate_error_rate"] == 0.021 and failed.numbers["baseline_error_rate"] == 0.01
    assert "2.10%" in failed.reason and "1.00%" in failed.reason


def test_p99_gate_allows_ratio_plus_slack() -> None:
    # limit 20 * 1.25 + 5 = 30 ms
    assert p99_gate(canary(Side(500, 0, 30.0)), LIMITS).status == PASS
    failed = p99_gate(canary(Side(500, 0, 30.5)), LIMITS)
    assert failed.status == FAIL and failed.numbers["limit_ms"] == 30.0
    assert "30.5 ms" in failed.reason and "20.0 ms" in failed.reason


@pytest.mark.parametrize(
    "cand, base",
    [
        (Side(99, 99, 900.0), BASE),  # a terrible candidate, but too few answers to judge
        (Side(1000, 0, 10.0), Side(99, 0, 10.0)),  # too few baseline answers
    ],
)
def test_no_verdict_below_the_minimum_sample(cand: Side, base: Side) -> None:
    evidence = Evidence(baseline=base, candidate=cand)
    assert error_rate_gate(evidence, LIMITS).status == NO_DATA
    assert p99_gate(evidence, LIMITS).status == NO_DATA
    assert judge(CANARY, evidence, LIMITS).outcome == NO_DATA


def test_agreement_gate() -> None:
    assert agreement_gate(canary(BASE, 0.96, 50), LIMITS).status == PASS
    failed = agreement_gate(canary(BASE, 0.9, 50), LIMITS)
    assert failed.status == FAIL and "90.00%" in failed.reason
    assert agreement_gate(canary(BASE, 0.1, 49), LIMITS).status == NO_DATA  # too few compared
    assert agreement_gate(canary(BASE, None, 0), LIMITS).status == NO_DATA  # no shadow comparison at all
    no_threshold = Thresholds(min_agreement=None)
    assert agreement_gate(canary(BASE, None, 0), no_threshold).status == PASS


def test_shadowing_needs_agreement_and_canary_needs_errors_and_latency() -> None:
    good = Side(1000, 10, 21.0)
    # shadowing: only the comparison speaks
    assert judge(SHADOW, canary(Side(), 0.99, 60), LIMITS).outcome == PASS
    assert judge(SHADOW, canary(Side(), None, 0), LIMITS).outcome == NO_DATA
    assert judge(SHADOW, canary(Side(), 0.5, 60), LIMITS).outcome == FAIL
    # canary: error rate and p99 must pass; agreement without data does not hold it back ...
    assert judge(CANARY, canary(good), LIMITS).outcome == PASS
    # ... but a large enough sample that disagrees fails it
    verdict = judge(CANARY, canary(good, 0.5, 60), LIMITS)
    assert verdict.outcome == FAIL and [r.gate for r in verdict.failed] == ["agreement"]


def test_a_failing_gate_fails_even_while_another_lacks_data() -> None:
    # p99 fails on enough answers; agreement has none
    verdict = judge(CANARY, canary(Side(1000, 0, 500.0)), LIMITS)
    assert verdict.outcome == FAIL and [r.gate for r in verdict.failed] == ["p99"]
    doc = verdict.to_dict()
    assert doc["outcome"] == FAIL and {g["gate"]: g["status"] for g in doc["gates"]} == {
        "error_rate": PASS,
        "p99": FAIL,
        "agreement": NO_DATA,
    }


@pytest.mark.parametrize(
    "bad",
    [
        {"max_error_rate_increase": -0.1},
        {"max_p99_ratio": 0.9},
        {"p99_slack_ms": -1},
        {"min_agreement": 1.5},
        {"min_requests": 0},
        {"min_compared": 0},
    ],
)
def test_thresholds_are_checked(bad: dict) -> None:
    with pytest.raises(ValueError):
        Thresholds(**bad)
