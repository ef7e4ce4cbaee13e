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


@pytest.fixture
def auth(digits_server) -> dict[str, str]:  # noqa: ANN001
    """What an application passes to every tritonclient call: its API key."""
    return {"Authorization": f"Bearer {digits_server.key}"}


def test_without_the_key_the_client_raises_401(client) -> None:  # noqa: ANN001
    # given no headers / when inferring or reading metadata / then the server's 401 surfaces; health stays open
    inp = httpclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="API key"):
        client.infer("digits", [inp])
    with pytest.raises(InferenceServerException, match="API key"):
        client.get_model_metadata("digits")
    assert client.is_server_live() and client.is_server_ready()
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


def test_health_and_metadata(client, auth) -> None:  # noqa: ANN001
    # given a server with the digits model / when asked as Triton's client asks / then it answers as Triton
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("digits", headers=auth)
    assert client.is_model_ready("digits", "1", headers=auth)
    meta = client.get_model_metadata("digits", headers=auth)
    assert meta["name"] == "digits"
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 10]}]
    config = client.get_model_config("digits", headers=auth)
    assert config["max_batch_size"] == 16
    server = client.get_server_metadata()
    assert "binary_tensor_data" in server["extensions"]


def test_prediction_matches_label(client, auth, digits_samples, model_files) -> None:  # noqa: ANN001
    # given held-out digits / when sent through tritonclient (binary by default) / then predictions are right
    x, y = digits_samples
    rows = x[-64:]
    correct = 0
    for i in range(len(rows)):
        inp = httpclient.InferInput("input", [1, 64], "FP32")
        inp.set_data_from_numpy(rows[i : i + 1])
        result = client.infer("digits", [inp], outputs=[httpclient.InferRequestedOutput("scores")], headers=auth)
        scores = result.as_numpy("scores")
        assert scores.shape == (1, 10) and scores.dtype == np.float32
        correct += int(scores.argmax() == y[-64 + i])
        assert result.get_response()["model_version"] == "1"
    assert correct / len(rows) >= 0.85


def test_batch_of_rows_and_json_outputs(client, auth, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    inp = httpclient.InferInput("input", [5, 64], "FP32")
    inp.set_data_from_numpy(x[:5], binary_data=False)
    result = client.infer(
        "digits", [inp], outputs=[httpclient.InferRequestedOutput("scores", binary_data=False)], headers=auth
    )
    assert result.as_numpy("scores").shape == (5, 10)


def test_torch_export_model_and_pinned_version(client, auth, digits_samples) -> None:  # noqa: ANN001
    x, y = digits_samples
    inp = httpclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(x[:1])
    result = client.infer("digits-export", [inp], model_version="1", headers=auth)
    assert result.as_numpy("scores").argmax() == y[0]


def test_errors_surface_as_exceptions(client, auth) -> None:  # noqa: ANN001
    inp = httpclient.InferInput("input", [1, 64], "FP64")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float64))
    with pytest.raises(InferenceServerException, match="expected datatype FP32"):
        client.infer("digits", [inp], headers=auth)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope", headers=auth)


def test_an_extension_ferry_lacks_is_a_400_naming_it(client, auth, digits_samples) -> None:  # noqa: ANN001
    # given tritonclient.http asking for classification (class_count), or for a sequence (sequence_id)
    inp = httpclient.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(digits_samples[0][:1])
    classified = [httpclient.InferRequestedOutput("scores", class_count=3)]
    for attempt, parameter in (
        (lambda: client.infer("digits", [inp], outputs=classified, headers=auth), "classification"),
        (lambda: client.infer("digits", [inp], sequence_id=12, sequence_start=True, headers=auth), "sequence_id"),
    ):
        # then the server's 400 names the parameter, rather than serving it as if it had not asked
        with pytest.raises(InferenceServerException, match=f"parameter '{parameter}' is not supported") as refused:
            attempt()
        assert refused.value.status() == "400"
