"""Tests for serving.dataplane.node.runtime: assemble/split, loading TorchScript and torch.export artifacts,
output checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from serving.dataplane.http.protocol import TensorSpec
from serving.dataplane.node.runtime import ModelRuntime, RuntimeFailure, assemble, load_module, pick_device, split

X = TensorSpec("input", "FP32", (64,))
SCORES = TensorSpec("scores", "FP32", (10,))
TOKENS = TensorSpec("tokens", "INT64", (-1,))
SCORES2 = TensorSpec("scores", "FP32", (2,))
CPU = torch.device("cpu")


def runtime(path, fmt: str = "torchscript", inputs=(X,), outputs=(SCORES,)) -> ModelRuntime:
    rt = ModelRuntime(path, fmt, list(inputs), list(outputs), CPU)
    rt.load()
    return rt


# --- assemble ----------------------------------------------------------------------------------------


def test_assemble_stacks_requests_along_the_batch_dimension() -> None:
    # given two requests of 1 and 2 rows with two fixed-shape inputs
    specs = [TensorSpec("a", "FP32", (3,)), TensorSpec("b", "INT64", ())]
    r1 = {"a": np.full((1, 3), 1.0, np.float32), "b": np.array([7], np.int64)}
    r2 = {"a": np.full((2, 3), 2.0, np.float32), "b": np.array([8, 9], np.int64)}
    # when assembled
    a, b = assemble([r1, r2], specs)
    # then each input is stacked in request order
    assert a.shape == (3, 3) and a.dtype == np.float32
    np.testing.assert_array_equal(a[:, 0], [1.0, 2.0, 2.0])
    np.testing.assert_array_equal(b, [7, 8, 9])


def test_assemble_zero_pads_variable_dims_to_the_batch_maximum() -> None:
    # given token rows of lengths 2, 4 and 3 (the middle request has 2 rows)
    r1 = {"tokens": np.array([[5, 6]], np.int64)}
    r2 = {"tokens": np.array([[1, 2, 3, 4], [9, 9, 0, 0]], np.int64)}
    r3 = {"tokens": np.array([[7, 7, 7]], np.int64)}
    # when assembled
    (tokens,) = assemble([r1, r2, r3], [TOKENS])
    # then every row is padded with zeros to length 4
    np.testing.assert_array_equal(tokens, [[5, 6, 0, 0], [1, 2, 3, 4], [9, 9, 0, 0], [7, 7, 7, 0]])
    assert tokens.dtype == np.int64
    # and the requests are untouched
    assert r1["tokens"].shape == (1, 2)


def test_assemble_pads_several_variable_dims_independently() -> None:
    # given an input with two variable dims
    spec = TensorSpec("m", "FP32", (-1, -1))
    r1 = {"m": np.ones((1, 2, 3), np.float32)}
    r2 = {"m": np.ones((1, 3, 1), np.float32)}
    # when assembled
    (m,) = assemble([r1, r2], [spec])
    # then each variable dim is padded to its own maximum
    assert m.shape == (2, 3, 3)
    assert m[0].sum() == 6 and m[1].sum() == 3
    assert m[0, 2].sum() == 0 and m[1, :, 1:].sum() == 0


@pytest.mark.parametrize("spec", [X, TOKENS])
def test_assemble_single_request_is_not_copied(spec: TensorSpec) -> None:
    # given one request
    array = np.ones((3, 64), np.float32) if spec is X else np.ones((3, 5), np.int64)
    # when assembled alone
    (out,) = assemble([{spec.name: array}], [spec])
    # then the request's own array is passed through
    assert out is array


# --- split -------------------------------------------------------------------------------------------


def test_split_hands_each_request_its_rows() -> None:
    # given outputs for a batch of 1 + 3 + 2 rows
    scores = np.arange(12, dtype=np.float32).reshape(6, 2)
    labels = np.arange(6, dtype=np.int64)
    # when split
    parts = split([scores, labels], [1, 3, 2], ["scores", "label"])
    # then each request gets its contiguous slice of every output
    assert [p["scores"].shape[0] for p in parts] == [1, 3, 2]
    np.testing.assert_array_equal(parts[1]["scores"], scores[1:4])
    np.testing.assert_array_equal(parts[2]["label"], [4, 5])
    assert set(parts[0]) == {"scores", "label"}


def test_split_raises_when_an_output_has_the_wrong_number_of_rows() -> None:
    # given an output of 5 rows for a batch of 6
    outputs = [np.zeros((6, 2), np.float32), np.zeros(5, np.int64)]
    # when split / then a RuntimeFailure names the output and both counts
    with pytest.raises(RuntimeFailure, match=r"output 'label' has 5 rows for a batch of 6"):
        split(outputs, [2, 4], ["scores", "label"])


# --- devices and loading -------------------------------------------------------------------------------


def test_pick_device() -> None:
    # when nothing is preferred, cuda is chosen only where present (this machine: cpu unless CUDA)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == expected
    # and an explicit preference is honoured
    assert pick_device("cpu") == CPU


@pytest.mark.parametrize(("attr", "fmt"), [("digits", "torchscript"), ("digits_export", "torch_export")])
def test_runtime_loads_and_predicts(model_files, digits_samples, attr: str, fmt: str) -> None:
    # given a trained digits classifier in either artifact format
    rt = runtime(getattr(model_files, attr), fmt)
    # then loading measured its parameters
    assert rt.memory_bytes > 0
    assert rt.load_seconds >= 0.0
    # when a batch of real digits is predicted
    x, y = digits_samples
    (scores,) = rt.predict([x[:200]])
    # then it answers FP32 scores of the declared shape, mostly right
    assert scores.shape == (200, 10) and scores.dtype == np.float32
    assert float((scores.argmax(axis=1) == y[:200]).mean()) > 0.8


def test_torchscript_and_export_artifacts_agree(model_files, digits_samples) -> None:
    # given the same network saved both ways
    ts = runtime(model_files.digits, "torchscript")
    ex = runtime(model_files.digits_export, "torch_export")
    x = digits_samples[0][:16]
    # then both give the same scores
    np.testing.assert_allclose(ts.predict([x])[0], ex.predict([x])[0], rtol=1e-5, atol=1e-5)


def test_run_assembles_predicts_and_splits_per_request(model_files, digits_samples) -> None:
    # given three requests of 1, 4 and 2 rows
    rt = runtime(model_files.digits)
    x = digits_samples[0]
    requests = [{"input": x[0:1]}, {"input": x[1:5]}, {"input": x[5:7]}]
    # when run together
    results = rt.run(requests)
    # then each request gets its own rows, equal to running it alone
    assert [r["scores"].shape for r in results] == [(1, 10), (4, 10), (2, 10)]
    for request, result in zip(requests, results, strict=True):
        np.testing.assert_allclose(result["scores"], rt.predict([request["input"]])[0], rtol=1e-4, atol=1e-5)


def test_padded_token_batch_scores_each_row_as_if_alone(model_files) -> None:
    # given the variable-length tokens model (padding id 0 is masked)
    rt = runtime(model_files.tokens, inputs=(TOKENS,), outputs=(SCORES2,))
    rows = [
        np.array([[3, 9, 12]]),
        np.array([[1, 2, 3, 4, 5, 6, 7]]),
        np.array([[40]]),
        np.array([[8, 8, 0, 0]]),
    ]  # the last is already padded by its client
    requests = [{"tokens": r.astype(np.int64)} for r in rows]
    # when run as one padded batch (longest row: 7)
    together = rt.run(requests)
    # then each row scores as it does alone, unpadded
    for request, result in zip(requests, together, strict=True):
        (alone,) = rt.predict([request["tokens"]])
        np.testing.assert_allclose(result["scores"], alone, rtol=1e-5, atol=1e-6)
    # and the rows are not all the same (the check would be vacuous otherwise)
    assert not np.allclose(together[0]["scores"], together[1]["scores"])


def test_predict_before_load_fails() -> None:
    rt = ModelRuntime(None, "torchscript", [X], [SCORES], CPU)  # type: ignore[arg-type]
    with pytest.raises(RuntimeFailure, match="not loaded"):
        rt.predict([np.zeros((1, 64), np.float32)])


def test_wrong_output_dtype_raises_a_clear_runtime_failure(model_files) -> None:
    # given a model that declares FP32 scores but returns int64
    rt = runtime(model_files.wrong_dtype)
    # when it predicts / then the failure names the output, the dtype it gave and the one declared
    with pytest.raises(RuntimeFailure, match=r"output 'scores' is int64, signature says FP32"):
        rt.predict([np.ones((2, 64), np.float32)])


def test_wrong_output_shape_raises(model_files) -> None:
    # given digits declared with 5 scores instead of 10
    rt = runtime(model_files.digits, outputs=(TensorSpec("scores", "FP32", (5,)),))
    with pytest.raises(RuntimeFailure, match=r"has shape \[2, 10\], signature says \[-1, 5\]"):
        rt.predict([np.zeros((2, 64), np.float32)])


def test_wrong_number_of_outputs_raises(model_files) -> None:
    # given digits declared with two outputs
    rt = runtime(model_files.digits, outputs=(SCORES, TensorSpec("label", "INT64", ())))
    with pytest.raises(RuntimeFailure, match="returned 1 outputs, signature declares 2"):
        rt.predict([np.zeros((2, 64), np.float32)])


def test_model_exception_becomes_runtime_failure(model_files) -> None:
    # given a model that raises on negative pixels
    rt = runtime(model_files.fails_on_negative)
    # then good input works and bad input raises RuntimeFailure naming the model's error
    assert rt.predict([np.ones((2, 64), np.float32)])[0].shape == (2, 10)
    with pytest.raises(RuntimeFailure, match="model raised"):
        rt.predict([-np.ones((2, 64), np.float32)])


def test_input_shape_mismatch_becomes_runtime_failure(model_files) -> None:
    # given digits fed 32 features instead of 64
    rt = runtime(model_files.digits)
    with pytest.raises(RuntimeFailure, match="model raised"):
        rt.predict([np.zeros((2, 32), np.float32)])


@pytest.mark.parametrize(
    ("attr", "fmt"),
    [
        ("not_a_zip", "torchscript"),
        ("corrupt_zip", "torchscript"),
        ("corrupt_zip", "torch_export"),
        ("digits_export", "torchscript"),  # mislabelled
        ("digits", "torch_export"),  # mislabelled
    ],
)
def test_unloadable_artifacts_raise_runtime_failure(model_files, attr: str, fmt: str) -> None:
    with pytest.raises(RuntimeFailure, match=f"cannot load {fmt} artifact"):
        load_module(getattr(model_files, attr), fmt, CPU)


def test_unknown_format_raises(model_files) -> None:
    with pytest.raises(RuntimeFailure, match="unknown artifact format 'onnx'"):
        load_module(model_files.digits, "onnx", CPU)


def test_example_batch_follows_the_signature(model_files) -> None:
    # given the tokens signature (variable length, INT64)
    rt = ModelRuntime(model_files.tokens, "torchscript", [TOKENS], [SCORES2], CPU)
    # when an example batch of 3 rows is made
    (tokens,) = rt.example_batch(3)
    # then variable dims are 8 long and the dtype is the declared one
    assert tokens.shape == (3, 8) and tokens.dtype == np.int64


def test_profile_measures_each_size(model_files) -> None:
    rt = runtime(model_files.digits)
    profile = rt.profile([1, 4], repeats=2)
    assert set(profile) == {1, 4}
    assert all(v > 0 for v in profile.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runtime_matches_cpu(model_files, digits_samples) -> None:
    # given the digits model on the GPU and on the CPU
    gpu = ModelRuntime(model_files.digits, "torchscript", [X], [SCORES], torch.device("cuda"))
    gpu.load()
    cpu = runtime(model_files.digits)
    x = digits_samples[0][:32]
    # then the GPU footprint is counted and outputs come back as matching host arrays
    assert gpu.memory_bytes > 0
    (on_gpu,) = gpu.predict([x])
    assert isinstance(on_gpu, np.ndarray) and on_gpu.dtype == np.float32
    np.testing.assert_allclose(on_gpu, cpu.predict([x])[0], rtol=1e-3, atol=1e-3)


class Doubler(torch.nn.Module):
    """tokens INT64 [-1] -> values FP32 [-1]: a variable-length output, one value per token."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens.to(torch.float32) * 2.0


def test_variable_outputs_come_back_at_each_requests_own_length(tmp_path) -> None:  # noqa: ANN001
    # given a model whose output is as long as its input
    path = tmp_path / "doubler.pt"
    torch.jit.save(torch.jit.script(Doubler()), str(path))
    rt = runtime(path, inputs=(TOKENS,), outputs=(TensorSpec("values", "FP32", (-1,)),))
    # when requests of 3 and 6 tokens run in one padded batch
    short, long = np.array([[1, 2, 3]], np.int64), np.array([[1, 2, 3, 4, 5, 6]], np.int64)
    results = rt.run([{"tokens": short}, {"tokens": long}])
    # then each gets its own length back, not its neighbour's padding
    np.testing.assert_array_equal(results[0]["values"], [[2.0, 4.0, 6.0]])
    np.testing.assert_array_equal(results[1]["values"], [[2.0, 4.0, 6.0, 8.0, 10.0, 12.0]])


def test_length_buckets_split_only_when_padding_would_dominate() -> None:
    from serving.dataplane.node.runtime import length_buckets

    # given similar lengths / then one group
    assert length_buckets([(5,), (6,), (7,)], [1, 1, 1]) == [[0, 1, 2]]
    # given one long request among short ones / then the long one runs apart
    assert length_buckets([(2,), (100,), (3,), (2,)], [1, 1, 1, 1]) == [[0, 3, 2], [1]]
    # rows weigh in: a long request of many rows is not split off from one short row
    assert length_buckets([(2,), (4,)], [1, 8]) == [[0, 1]]


def test_a_long_request_does_not_pad_a_batch_of_short_ones(model_files) -> None:
    # given the tokens model and a spy on its forward calls
    rt = runtime(model_files.tokens, inputs=(TOKENS,), outputs=(SCORES2,))
    shapes: list[tuple[int, ...]] = []
    predict = rt.predict
    rt.predict = lambda batch: (shapes.append(batch[0].shape), predict(batch))[1]  # type: ignore[method-assign]
    # when three short requests and one 200 tokens long run together
    requests = [{"tokens": np.ones((1, n), np.int64)} for n in (3, 200, 4, 3)]
    results = rt.run(requests)
    # then the short ones ran padded to 4, the long one alone, and every request got its answer in order
    assert sorted(shapes) == [(1, 200), (3, 4)]
    for request, result in zip(requests, results, strict=True):
        (alone,) = predict([request["tokens"]])
        np.testing.assert_allclose(result["scores"], alone, rtol=1e-5, atol=1e-6)


class BF16Scores(torch.nn.Module):
    """x BF16 [4] -> log-probabilities BF16 [4], computed in bfloat16 (a -inf input gives a -inf score)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x * 2.0, dim=-1)


class BF16ForFP32(torch.nn.Module):
    """Answers bfloat16 where its signature says FP32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)


BF16_IN = TensorSpec("x", "BF16", (4,))
BF16_OUT = TensorSpec("scores", "BF16", (4,))


def test_a_bf16_model_gets_bfloat16_and_its_answer_leaves_as_its_bits(tmp_path) -> None:  # noqa: ANN001
    # given a model computing in bfloat16, and a request's BF16 input as the protocol carries it: its bits
    path = tmp_path / "bf16.pt"
    torch.jit.save(torch.jit.script(BF16Scores()), str(path))
    rt = runtime(path, inputs=(BF16_IN,), outputs=(BF16_OUT,))
    values = torch.tensor([[1.5, -float("inf"), 0.1, 3.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16)
    bits = values.view(torch.uint16).numpy().copy()
    # when it predicts
    (scores,) = rt.predict([bits])
    # then the model saw the bfloat16 values, and its bfloat16 answer comes back as its bits
    assert scores.dtype == np.uint16 and scores.shape == (2, 4)
    expected = torch.log_softmax(values * 2.0, dim=-1)
    np.testing.assert_array_equal(scores, expected.view(torch.uint16).numpy())
    assert torch.from_numpy(scores).view(torch.bfloat16)[0, 1] == -float("inf")
    # and its example batches are bfloat16 values in [0, 1), as the other float types'
    (example,) = rt.example_batch(3)
    as_floats = torch.from_numpy(example).view(torch.bfloat16).float()
    assert example.dtype == np.uint16 and example.shape == (3, 4)
    assert bool(((as_floats >= 0) & (as_floats < 1)).all()) and bool(as_floats.any())
    assert rt.profile([1, 2], repeats=1).keys() == {1, 2}


@pytest.mark.parametrize(
    ("model", "inputs", "outputs", "message"),
    [
        (
            BF16ForFP32(),
            (X,),
            (TensorSpec("scores", "FP32", (64,)),),
            "output 'scores' is bfloat16, signature says FP32",
        ),
        (
            Doubler(),
            (TOKENS,),
            (TensorSpec("values", "BF16", (-1,)),),
            "output 'values' is float32, signature says BF16",
        ),
    ],
)
def test_bfloat16_where_the_signature_says_otherwise_is_a_runtime_failure(tmp_path, model, inputs, outputs, message):  # noqa: ANN001
    path = tmp_path / "m.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    rt = runtime(path, inputs=inputs, outputs=outputs)
    with pytest.raises(RuntimeFailure, match=message):
        rt.predict(rt.example_batch(2))
