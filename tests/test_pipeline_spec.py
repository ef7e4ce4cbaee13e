"""The pipeline spec's check and row arithmetic (serving.policies.pipeline): plain Python, no server."""

from __future__ import annotations

import numpy as np
import pytest

from serving.policies.pipeline import (
    Condition,
    ModelSignature,
    PipelineError,
    Tensor,
    check,
    choose_branch,
    combine,
)

DIGITS = ModelSignature({"input": Tensor("FP32", (64,))}, {"scores": Tensor("FP32", (10,))}, max_batch_size=32)
SMALL = ModelSignature({"input": Tensor("FP32", (64,))}, {"scores": Tensor("FP32", (10,))}, max_batch_size=64)
TOKENS = ModelSignature({"tokens": Tensor("INT64", (-1,), (1024,))}, {"scores": Tensor("FP32", (2,))})
EMBED = ModelSignature({"input": Tensor("FP32", (64,))}, {"embedding": Tensor("FP32", (16,))})
MODELS = {"digits": DIGITS, "digits-small": SMALL, "tokens": TOKENS, "embed": EMBED}

SWITCH = {
    "sequence": [
        {"model": "digits-small", "name": "small"},
        {"switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": 0.9}, "then": {"model": "digits"}},
    ]
}


def signatures(name: str, version: int | None) -> ModelSignature | None:
    return MODELS.get(name)


def test_switch_pipeline_derives_its_signature() -> None:
    checked = check(SWITCH, signatures)
    assert checked.inputs == {"input": Tensor("FP32", (64,))}
    assert checked.outputs == {"scores": Tensor("FP32", (10,))}
    assert checked.max_rows == 32  # the smaller of the steps' batch limits
    assert checked.models == ("digits-small", "digits")


def test_steps_that_do_not_connect_are_refused_naming_step_and_tensor() -> None:
    # digits answers "scores" FP32 [10]; tokens reads "tokens" INT64: mapped to scores, it does not connect.
    spec = {"sequence": [{"model": "digits"}, {"model": "tokens", "inputs": {"tokens": "scores"}}]}
    with pytest.raises(PipelineError) as caught:
        check(spec, signatures)
    assert caught.value.step == "tokens" and caught.value.tensor == "tokens"
    assert "INT64 [-1]" in caught.value.message and "FP32 [10]" in caught.value.message
    # A tensor the step before does not answer.
    spec = {"sequence": [{"model": "embed"}, {"model": "digits", "inputs": {"input": "features"}}]}
    with pytest.raises(PipelineError, match="step 'digits', tensor 'input'.*has no tensor 'features'"):
        check(spec, signatures)
    # Mapped to the embedding, the type does not connect.
    spec = {"sequence": [{"model": "embed"}, {"model": "digits", "inputs": {"input": "embedding"}}]}
    with pytest.raises(PipelineError, match=r"step 'digits', tensor 'input': needs FP32 \[64\], gets FP32 \[16\]"):
        check(spec, signatures)
    # A bare name the step before does not answer is the request's.
    spec = {"sequence": [{"model": "embed"}, {"model": "digits"}]}
    assert check(spec, signatures).outputs == {"scores": Tensor("FP32", (10,))}


def test_an_invisible_model_reads_as_an_unknown_one() -> None:
    hidden = {"secret-model": DIGITS}

    def visible(name: str, version: int | None) -> ModelSignature | None:
        return MODELS.get(name) if name not in hidden else None

    messages = []
    for name in ("secret-model", "no-such-model"):
        with pytest.raises(PipelineError) as caught:
            check({"model": name, "name": "step"}, visible)
        messages.append(caught.value.message)
    assert messages[0] == messages[1]
    assert "secret-model" not in messages[0]


def test_switch_branches_must_answer_the_same_tensors() -> None:
    spec = {
        "sequence": [
            {"model": "digits"},
            {
                "switch": {"tensor": "scores", "op": "<", "value": 1},
                "then": {"model": "embed", "inputs": {"input": "request.input"}},
            },
        ]
    }
    with pytest.raises(PipelineError, match="'then' and 'else' must answer the same tensors"):
        check(spec, signatures)


def test_ensemble_combines_and_checks_types() -> None:
    mean = {"ensemble": [{"model": "digits"}, {"model": "digits-small"}], "combine": "mean"}
    assert check(mean, signatures).outputs == {"scores": Tensor("FP32", (10,))}
    concat = {"ensemble": [{"model": "digits"}, {"model": "digits-small"}], "combine": "concat"}
    assert check(concat, signatures).outputs == {"scores": Tensor("FP32", (20,))}
    mixed = {"ensemble": [{"model": "digits"}, {"model": "embed"}], "combine": "mean"}
    with pytest.raises(PipelineError, match="members do not all answer"):
        check(mixed, signatures)


def test_malformed_specs_are_refused() -> None:
    bad = [
        {},
        {"model": "digits", "sequence": []},
        {"sequence": []},
        {"ensemble": [{"model": "digits"}]},
        {"ensemble": [{"model": "digits"}, {"model": "digits"}]},  # two steps named "digits"
        {
            "splitter": [
                {"weight": 0.5, "node": {"model": "digits"}},
                {"weight": 0.2, "node": {"model": "digits-small"}},
            ]
        },
        {"switch": {"tensor": "input", "op": "<", "value": 1}, "then": {"model": "digits"}},  # nothing to pass through
        {"model": "digits", "version": 0},
        {"model": "digits", "inputs": {"nope": "input"}},
    ]
    for spec in bad:
        with pytest.raises(PipelineError):
            check(spec, signatures)


def test_condition_rows_and_combinations() -> None:
    scores = np.array([[10.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=np.float32)
    unsure = Condition("scores", "max_softmax", "<", 0.9)
    assert unsure.rows(scores).tolist() == [False, True]
    assert Condition("scores", "max", ">=", 10).rows(scores).tolist() == [True, False]
    a = np.array([[1.0, 3.0]], dtype=np.float32)
    b = np.array([[3.0, 1.0]], dtype=np.float32)
    assert combine("mean", [a, b]).tolist() == [[2.0, 2.0]]
    assert combine("concat", [a, b]).tolist() == [[1.0, 3.0, 3.0, 1.0]]
    assert combine("vote", [a, b, b])[0].tolist() == pytest.approx([2 / 3, 1 / 3])
    assert [choose_branch((0.9, 0.1), u) for u in (0.0, 0.89, 0.9, 0.99)] == [0, 0, 1, 1]
