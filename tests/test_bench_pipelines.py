"""bench.pipelines' verdict against issue 23's acceptance, and the setup script its overload models pick."""

from __future__ import annotations

from bench import pipelines


def step(multiplier: float, p99: float, shed: float = 0.0, fallback: float = 0.0, retry: int | None = None) -> dict:
    seconds = 5.0
    shed_n = round(shed * seconds)
    return {
        "multiplier": multiplier, "p99_ms": p99, "shed_rps": shed, "fallback_rps": fallback, "seconds": seconds,
        "shed_with_retry_after": shed_n if retry is None else retry,
    }  # fmt: skip


def ramp(*steps: dict) -> dict:
    return {"result": {"steps": list(steps)}}


def test_a_ramp_under_budget_that_sheds_past_1x_passes() -> None:
    worst, under, retry, relieved = pipelines.verdict(ramp(step(0.5, 40), step(2, 250, shed=100), step(1, 60)))
    assert (worst, under, retry, relieved) == (250, True, True, True)


def test_falling_back_counts_as_relief() -> None:
    assert pipelines.verdict(ramp(step(1, 50), step(3, 120, fallback=30)))[3] is True


def test_a_step_over_budget_fails() -> None:
    worst, under, *_ = pipelines.verdict(ramp(step(0.5, 40), step(3, 300, shed=50)))
    assert worst == 300 and under is False


def test_a_step_without_any_200_fails() -> None:
    worst, under, *_ = pipelines.verdict(ramp(step(0.5, 40), step(3, float("nan"), shed=50)))
    assert worst != worst and under is False


def test_an_overloaded_step_neither_shedding_nor_falling_back_fails() -> None:
    assert pipelines.verdict(ramp(step(1.5, 100, shed=10), step(2, 100)))[3] is False


def test_a_503_without_retry_after_fails() -> None:
    assert pipelines.verdict(ramp(step(2, 100, shed=10, retry=49)))[2] is False


def test_the_setup_registers_a_cascade_per_big_model_and_only_the_models_asked() -> None:
    script = pipelines.setup(["digits-wide"])
    assert "'digits-wide-cascade'" in script and "'digits-cascade'" in script and "demo_cache_dir()" in script
    assert "token-sentiment" not in script
    assert "'digits-wide'" not in pipelines.setup(["digits"])
