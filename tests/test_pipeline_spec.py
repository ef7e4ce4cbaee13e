"""The pipeline spec's check and row arithmetic (serving.policies.pipeline): plain Python, no server."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from serving.policies.pipeline import (
    MAX_DEPTH,
    MAX_NODES,
    CombineError,
    Condition,
    ModelSignature,
    PipelineError,
    Tensor,
    check,
    choose_branch,
    combine,
    combine_answers,
    parse,
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
    # Each case with the words it is refused for: a case refused for another reason would pass unnoticed.
    bad = [
        ({}, "pipeline: a node must have exactly one of model, sequence"),
        ({"model": "digits", "sequence": []}, "pipeline: a node must have exactly one of"),
        ({"sequence": []}, "step 'sequence': 'sequence' must be a non-empty list of nodes"),
        ({"ensemble": [{"model": "digits"}]}, "step 'ensemble': 'ensemble' must list at least two nodes"),
        (
            {"ensemble": [{"model": "digits"}, {"model": "digits"}]},
            "step 'digits': two nodes have this name: name them apart with 'name'",
        ),
        (
            {
                "splitter": [
                    {"weight": 0.5, "node": {"model": "digits"}},
                    {"weight": 0.2, "node": {"model": "digits-small"}},
                ]
            },
            "step 'splitter': splitter weights sum to 0.7, not 1",
        ),
        (
            {"switch": {"tensor": "input", "op": "<", "value": 1}, "then": {"model": "digits"}},
            "step 'switch', tensor 'input': the condition's tensor is not there",  # nothing has read it yet
        ),
        (
            # The request's "input" is read by the first member: the switch tests it, then has nothing to pass.
            {
                "ensemble": [
                    {"model": "digits"},
                    {"switch": {"tensor": "input", "op": "<", "value": 1}, "then": {"model": "digits-small"}},
                ]
            },
            "step 'switch': a switch without 'else' passes its input through: put a step before it",
        ),
        ({"model": "digits", "version": 0}, "step 'digits': 'version' must be an integer from 1 to 2147483647"),
        ({"model": "digits", "inputs": {"nope": "input"}}, "step 'digits', tensor 'nope': the model has no input"),
    ]
    for spec, message in bad:
        with pytest.raises(PipelineError) as caught:
            check(spec, signatures)
        assert caught.value.message.startswith(message), (spec, caught.value.message)


def test_huge_numbers_are_refused_as_spec_errors() -> None:
    # JSON's integers have no bound: 10**400 has no float (np.isfinite raised TypeError, a 500), a version
    # past the database's integer would fail its query.
    step = {"model": "digits-small", "name": "small"}
    for value in (10**400, -(10**400), float("inf"), True, "1"):
        spec = {
            "sequence": [step, {"switch": {"tensor": "scores", "op": "<", "value": value}, "then": {"model": "digits"}}]
        }
        with pytest.raises(PipelineError, match="the switch's 'value' must be a finite number"):
            check(spec, signatures)
    for version in (2**31, 10**400):
        with pytest.raises(PipelineError, match="'version' must be an integer from 1 to 2147483647"):
            check({"model": "digits", "version": version}, signatures)
    assert check({"model": "digits", "version": 2**31 - 1}, signatures).models == ("digits",)
    branches = [{"weight": 10**400, "node": {"model": "digits"}}, {"weight": 0.5, "node": {"model": "digits-small"}}]
    with pytest.raises(PipelineError, match=r"a splitter weight is a number in \(0, 1\]"):
        check({"splitter": branches}, signatures)


def test_node_and_depth_limits() -> None:
    # 64 nodes are a pipeline; the 65th is refused before anything deeper is looked at.
    steps = [{"model": "digits", "name": f"s{i}", "inputs": {"input": "request.input"}} for i in range(63)]
    assert len(parse({"sequence": steps}).walk()) == MAX_NODES
    with pytest.raises(PipelineError, match=f"^pipeline: more than {MAX_NODES} nodes$"):
        parse({"sequence": [*steps, {"model": "digits", "name": "one-more"}]})
    deep: dict = {"model": "digits"}
    for _ in range(MAX_DEPTH):
        deep = {"sequence": [deep]}
    assert parse(deep).steps()[0].model == "digits"
    with pytest.raises(PipelineError, match=f"^pipeline: nested deeper than {MAX_DEPTH}$"):
        parse({"sequence": [deep]})


def test_a_reference_to_a_step_that_has_not_run_is_refused() -> None:
    # Read as a bare name, "smal.scores" became a request tensor of that name, which no client sends.
    misspelled = {"sequence": [{"model": "digits-small", "name": "small"}, {"model": "digits"}]}
    misspelled["sequence"][1]["inputs"] = {"input": "smal.scores"}
    with pytest.raises(PipelineError) as caught:
        check({"model": "digits", "inputs": {"input": "smal.scores"}}, signatures)
    assert caught.value.message == (
        "step 'digits', tensor 'input': reads 'smal.scores', but no step 'smal' has run before this step"
        " (a request tensor of that name is written 'request.smal.scores')"
    )
    # A step of the graph that runs later, or in another member of the same ensemble.
    later = {
        "sequence": [
            {"model": "embed", "inputs": {"input": "big.scores"}},
            {"model": "digits", "name": "big", "inputs": {"input": "request.input"}},
        ]
    }
    with pytest.raises(
        PipelineError, match="^step 'embed', tensor 'input': reads 'big.scores', but step 'big' has not"
    ):
        check(later, signatures)
    sibling = {
        "ensemble": [
            {"model": "embed", "name": "a", "inputs": {"input": "request.input"}},
            {"model": "embed", "name": "b", "inputs": {"input": "a.embedding"}},
        ]
    }
    with pytest.raises(PipelineError, match="^step 'b', tensor 'input': reads 'a.embedding', but step 'a' has not"):
        check(sibling, signatures)
    condition = {
        "sequence": [
            {"model": "digits-small"},
            {"switch": {"tensor": "later.scores", "op": "<", "value": 1}, "then": {"model": "digits", "name": "later"}},
        ]
    }
    with pytest.raises(PipelineError, match="tensor 'later.scores': reads 'later.scores', but step 'later' has not"):
        check(condition, signatures)
    # Still read: a request tensor with a dot in its name, written as one, and a step that has run.
    dotted = check({"model": "digits", "inputs": {"input": "request.smal.scores"}}, signatures)
    assert dotted.inputs == {"smal.scores": Tensor("FP32", (64,))}
    ran = {
        "sequence": [
            {"model": "digits-small", "name": "small"},
            {"model": "embed", "inputs": {"input": "request.input"}},
            {"model": "digits", "inputs": {"input": "request.input"}},
            {"switch": {"tensor": "small.scores", "op": "<", "value": 1}, "then": {"model": "embed", "name": "e2"}},
        ]
    }
    with pytest.raises(PipelineError, match="'then' and 'else' must answer the same tensors"):
        check(ran, signatures)  # past the references: refused for what the branches answer


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


def test_answers_that_do_not_combine_raise_combine_error() -> None:
    # The check saw one version of each member; a canary or a pin may answer otherwise at call time: a
    # CombineError naming the tensor, for the executor to answer, not numpy's ValueError or a KeyError.
    four, five = np.zeros((2, 4), dtype=np.float32), np.zeros((2, 5), dtype=np.float32)
    for how in ("mean", "vote"):
        with pytest.raises(
            CombineError, match=f"^tensor 'scores': members answer float32 \\[4\\] and float32 \\[5\\]: {how}"
        ):
            combine(how, [four, five], "scores")
    with pytest.raises(CombineError, match="float32 \\[4\\] and float64 \\[4\\]: mean cannot join them"):
        combine("mean", [four, four.astype(np.float64)], "scores")
    with pytest.raises(CombineError, match="concat cannot join them"):
        combine("concat", [four, np.zeros((3, 4), dtype=np.float32)], "scores")
    with pytest.raises(CombineError, match="^tensor 'scores': vote needs a last dimension"):
        combine("vote", [np.zeros(2), np.zeros(2)], "scores")
    with pytest.raises(CombineError, match="^tensor 'extra': the members do not all answer this tensor$"):
        combine_answers("mean", [{"scores": four}, {"scores": four, "extra": four}])
    assert combine_answers("concat", [{"scores": four}, {"scores": five}])["scores"].shape == (2, 9)
    # A variable dimension answered empty: no value to reduce (numpy's max raised ValueError).
    with pytest.raises(CombineError, match="^tensor 'scores': the switch's condition has no values to reduce$"):
        Condition("scores", "max", "<", 1).rows(np.zeros((2, 0), dtype=np.float32))
    assert Condition("scores", "max", "<", 1).rows(np.zeros((0, 4), dtype=np.float32)).tolist() == []


def test_vote_takes_memory_of_one_answer_not_of_its_classes_squared() -> None:
    # 4000 classes: an identity of the classes is 64 MB per member per call; the votes are 16 KB.
    rng = np.random.default_rng(0)
    members = [rng.random((1, 4000), dtype=np.float32) for _ in range(3)]
    tracemalloc.start()
    try:
        votes = combine("vote", members)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024, peak
    tops = [int(np.argmax(m)) for m in members]
    expected = np.zeros(4000, dtype=np.float32)
    for top in tops:
        expected[top] += 1 / 3
    np.testing.assert_allclose(votes[0], expected, rtol=1e-6)


def test_bf16_scores_are_joined_but_not_computed_on() -> None:
    # BF16 travels as its bits (uint16): a mean, a vote or a condition here would compute on the bits.
    half = ModelSignature({"input": Tensor("FP32", (64,))}, {"scores": Tensor("BF16", (10,))})
    models = {**MODELS, "half": half, "half2": half}

    def typed(name: str, version: int | None) -> ModelSignature | None:
        return models.get(name)

    members = [{"model": "half"}, {"model": "half2"}]
    for how in ("mean", "vote"):
        with pytest.raises(PipelineError, match=f"{how} needs .*other than BF16"):
            check({"ensemble": members, "combine": how}, typed)
    switch = {"switch": {"tensor": "scores", "op": "<", "value": 0.5}, "then": {"model": "half2"}}
    with pytest.raises(PipelineError, match="condition needs a numeric tensor other than BF16, not BF16"):
        check({"sequence": [{"model": "half"}, switch]}, typed)
    assert check({"ensemble": members, "combine": "concat"}, typed).outputs == {"scores": Tensor("BF16", (20,))}
