"""tritonclient.http, with its default settings (binary tensors), against a live Ferry."""

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException


@pytest.fixture
def client(digits_server):  # noqa: ANN001, ANN201
    c = httpclient.InferenceServerClient(url=digits_server.url.removeprefix("http://"))
    yield c
    c.close()


def test_health_and_metadata(client) -> None:  # noqa: ANN001
    # given a server with the digits model / when asked as Triton's client asks / then it answers as Triton
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits")
    assert client.is_model_ready("digits", "1")
    meta = client.get_model_metadata("digits")
    assert meta["name"] == "digits"
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 10]}]
    config = client.get_model_config("digits")
    assert config["max_batch_size"] == 16
    server = client.get_server_metadata()
    assert "binary_tensor_data" in server["extensions"]


def test_prediction_matches_label(client, digits_samples, model_files) -> None:  # noqa: ANN001
    # given held-out digits / when sent through tritonclient (binary by default) / then predictions are right
    x, y = digits_samples
    rows = x[-64:]
    correct = 0
    for i in range(len(rows)):
        inp = httpclient.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(rows[i : i + 1])
        result = client.infer("digits", [inp], outputs=[httpclient.InferRequestedOutput("scores")])
        scores = result.as_numpy("scores")
        assert scores.shape == (1, 10) and scores.dtype == np.float32
        correct += int(scores.argmax() == y[-64 + i])
        assert result.get_response()["model_version"] == "1"
    assert correct / len(rows) >= 0.85


def test_batch_of_rows_and_json_outputs(client, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    inp = httpclient.InferInput("input", [5, 64], "FP32")
    inp.set_data_from_numpy(x[:5], binary_data=False)
    result = client.infer("digits", [inp], outputs=[httpclient.InferRequestedOutput("scores", binary_data=False)])
    assert result.as_numpy("scores").shape == (5, 10)


def test_torch_export_model_and_pinned_version(client, digits_samples) -> None:  # noqa: ANN001
    x, y = digits_samples
    inp = httpclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(x[:1])
    result = client.infer("digits-export", [inp], model_version="1")
    assert result.as_numpy("scores").argmax() == y[0]


def test_errors_surface_as_exceptions(client) -> None:  # noqa: ANN001
    inp = httpclient.InferInput("input", [1, 64], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float64))
    with pytest.raises(InferenceServerException, match="expected datatype FP32"):
        client.infer("digits", [inp])
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")
