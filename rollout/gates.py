"""A rollout's gates: is the candidate as good as the baseline on the evidence of one window?

Plain Python: no Django, no clock, no I/O. `rollout.evidence` gathers the numbers from usage and the shadow
comparison; `rollout.transitions` acts on the verdict. Each gate answers pass, fail or no data, with the
numbers it judged, so a rollback can say which gate failed and why.

A gate judges only on enough evidence: below its minimum sample (on either side) it says no data, neither
passing nor failing. A failing gate fails the rollout at once, whatever the bake time; advancing needs every
gate the phase requires to pass.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, NO_DATA = "pass", "fail", "no_data"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """What a candidate may be, against its baseline. Checked at construction."""

    max_error_rate_increase: float = 0.01  # candidate error rate may exceed the baseline's by this much (absolute)
    max_p99_ratio: float = 1.25  # candidate p99 may be this multiple of the baseline's ...
    p99_slack_ms: float = 5.0  # ... plus this, so sub-millisecond noise (and the sketch's ~4.5%) fails nothing
    min_agreement: float | None = 0.95  # shadow agreement at least this; None: no agreement gate
    min_requests: int = 100  # answers needed on each side before the error and p99 gates judge
    min_compared: int = 100  # shadow comparisons needed before the agreement gate judges

    def __post_init__(self) -> None:
        if not 0 <= self.max_error_rate_increase <= 1:
            raise ValueError("max_error_rate_increase must lie in 0..1")
        if not self.max_p99_ratio >= 1:
            raise ValueError("max_p99_ratio must be at least 1")
        if not self.p99_slack_ms >= 0:
            raise ValueError("p99_slack_ms must not be negative")
        if self.min_agreement is not None and not 0 <= self.min_agreement <= 1:
            raise ValueError("min_agreement must lie in 0..1")
        if self.min_requests < 1 or self.min_compared < 1:
            raise ValueError("min_requests and min_compared must be at least 1")


@dataclass(frozen=True, slots=True)
class Side:
    """One version's answers over the window."""

    requests: int = 0
    errors: int = 0  # 4xx + 5xx answers
    p99_ms: float | None = None

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None


@dataclass(frozen=True, slots=True)
class Evidence:
    baseline: Side
    candidate: Side
    agreement: float | None = None  # fraction of shadow comparisons where the outputs agreed
    compared: int = 0


@dataclass(frozen=True, slots=True)
class GateResult:
    gate: str
    status: str  # PASS, FAIL or NO_DATA
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def error_rate_gate(evidence: Evidence, limits: Thresholds) -> GateResult:
    base, cand = evidence.baseline, evidence.candidate
    numbers = {
        "candidate_requests": cand.requests,
        "candidate_errors": cand.errors,
        "baseline_requests": base.requests,
        "baseline_errors": base.errors,
        "candidate_error_rate": _round(cand.error_rate),
        "baseline_error_rate": _round(base.error_rate),
        "max_increase": limits.max_error_rate_increase,
    }
    short = _short_sample(base, cand, limits.min_requests)
    if short:
        return GateResult("error_rate", NO_DATA, short, numbers)
    assert cand.error_rate is not None and base.error_rate is not None
    limit = base.error_rate + limits.max_error_rate_increase
    if cand.error_rate > limit:
        return GateResult(
            "error_rate",
            FAIL,
            f"candidate error rate {cand.error_rate:.2%} exceeds the baseline's"
            f" {base.error_rate:.2%} + {limits.max_error_rate_increase:.2%} ({cand.errors} errors in"
            f" {cand.requests} answers)",
            numbers,
        )
    return GateResult(
        "error_rate", PASS, f"candidate error rate {cand.error_rate:.2%}, baseline {base.error_rate:.2%}", numbers
    )


def p99_gate(evidence: Evidence, limits: Thresholds) -> GateResult:
    base, cand = evidence.baseline, evidence.candidate
    numbers = {
        "candidate_requests": cand.requests,
        "baseline_requests": base.requests,
        "candidate_p99_ms": _round(cand.p99_ms),
        "baseline_p99_ms": _round(base.p99_ms),
        "max_ratio": limits.max_p99_ratio,
        "slack_ms": limits.p99_slack_ms,
    }
    short = _short_sample(base, cand, limits.min_requests)
    if short or cand.p99_ms is None or base.p99_ms is None:
        return GateResult("p99", NO_DATA, short or "no latency recorded", numbers)
    limit = base.p99_ms * limits.max_p99_ratio + limits.p99_slack_ms
    numbers["limit_ms"] = _round(limit)
    if cand.p99_ms > limit:
        return GateResult(
            "p99",
            FAIL,
            f"candidate p99 {cand.p99_ms:.1f} ms exceeds {limits.max_p99_ratio:g} x the"
            f" baseline's {base.p99_ms:.1f} ms + {limits.p99_slack_ms:g} ms = {limit:.1f} ms",
            numbers,
        )
    return GateResult(
        "p99",
        PASS,
        f"candidate p99 {cand.p99_ms:.1f} ms within {limit:.1f} ms (baseline {base.p99_ms:.1f} ms)",
        numbers,
    )


def agreement_gate(evidence: Evidence, limits: Thresholds) -> GateResult:
    numbers = {
        "agreement": _round(evidence.agreement),
        "compared": evidence.compared,
        "min_agreement": limits.min_agreement,
        "min_compared": limits.min_compared,
    }
    if limits.min_agreement is None:
        return GateResult("agreement", PASS, "no agreement threshold set", numbers)
    if evidence.agreement is None or evidence.compared < limits.min_compared:
        return GateResult(
            "agreement", NO_DATA, f"{evidence.compared} of {limits.min_compared} shadow comparisons", numbers
        )
    if evidence.agreement < limits.min_agreement:
        return GateResult(
            "agreement",
            FAIL,
            f"shadow agreement {evidence.agreement:.2%} is below"
            f" {limits.min_agreement:.2%} ({evidence.compared} compared)",
            numbers,
        )
    return GateResult(
        "agreement", PASS, f"shadow agreement {evidence.agreement:.2%} over {evidence.compared} compared", numbers
    )


@dataclass(frozen=True, slots=True)
class Verdict:
    """Every gate's result, and what they say together: FAIL when any gate failed, PASS when every gate the
    phase requires passed, NO_DATA otherwise (wait for more traffic)."""

    outcome: str
    results: tuple[GateResult, ...]

    @property
    def failed(self) -> tuple[GateResult, ...]:
        return tuple(r for r in self.results if r.status == FAIL)

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "gates": [r.to_dict() for r in self.results]}


# The gates each phase judges, and those it requires to pass. While shadowing the candidate serves no live
# traffic, so only the comparison speaks. On a canary step the agreement still fails the rollout when its
# sample is large enough, but does not hold a step back when the shadow has stopped (its traffic is live now).
SHADOW, CANARY = "shadow", "canary"
PHASES = {
    SHADOW: ((agreement_gate,), {"agreement"}),
    CANARY: ((error_rate_gate, p99_gate, agreement_gate), {"error_rate", "p99"}),
}


def judge(phase: str, evidence: Evidence, limits: Thresholds) -> Verdict:
    gates, required = PHASES[phase]
    results = tuple(gate(evidence, limits) for gate in gates)
    if any(r.status == FAIL for r in results):
        return Verdict(FAIL, results)
    if all(r.status == PASS for r in results if r.gate in required):
        return Verdict(PASS, results)
    return Verdict(NO_DATA, results)


def _short_sample(base: Side, cand: Side, needed: int) -> str:
    if cand.requests < needed or base.requests < needed:
        return f"candidate {cand.requests}, baseline {base.requests} answers; each needs {needed}"
    return ""


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
