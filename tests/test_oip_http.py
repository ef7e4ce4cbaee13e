"""The Open Inference Protocol's corners over REST, as KServe's and Triton's clients read them: the health bodies,
liveness without a data plane, the statistics extension, one `platform` name, load options Ferry cannot honour,
and compressed request bodies."""

from __future__ import annotations

import gzip

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import mint_key, register, tenant
from tests.test_inference_http import assert_error, call, digits_request, infer


@pytest.fixture
def client(digits_server):  # noqa: ANN001, ANN201
    c = httpclient.InferenceServerClient(url=digits_server.url.removeprefix("http://"))
    yield c
    c.close()


@pytest.fixture
def auth(digits_server) -> dict[str, str]:  # noqa: ANN001
    return {"Authorization": f"Bearer {digits_server.key}"}


def digits_input(rows: np.ndarray) -> httpclient.InferInput:
    inp = httpclient.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    return inp


def test_health_answers_the_protocols_bodies(digits_server) -> None:  # noqa: ANN001
    # when the probes and a model's readiness are asked / then each body is the OIP's JSON object, as KServe's
    # InferenceRESTClient reads it (response.json()["live"], ["ready"])
    for path, body in (
        ("/v2/health/live", {"live": True}),
        ("/v2/health/ready", {"ready": True}),
        ("/v2/models/digits/ready", {"name": "digits", "ready": True}),
        ("/v2/models/digits/versions/1/ready", {"name": "digits", "ready": True}),
    ):
        resp = call(digits_server, "GET", path)
        assert resp.status == 200, (path, resp.body)
        assert resp.headers["content-type"] == "application/json"
        assert resp.json() == body, path


def test_liveness_and_metadata_answer_without_a_data_plane(transactional_db, settings, request) -> None:  # noqa: ANN001
    # given a web process with no data plane (no embedded node and no Redis to reach nodes: none is started)
    settings.FERRY_EMBEDDED_NODE = False
    settings.REDIS_URL = ""
    server = request.getfixturevalue("live_server")
    assert server.plane() is None
    # when the probes ask / then liveness and server metadata answer 200 while the process runs (a 503 here would
    # have Kubernetes restart a pod that is only starting)
    live = call(server, "GET", "/v2/health/live", auth=None)
    assert live.status == 200 and live.json() == {"live": True}
    assert call(server, "GET", "/v2", auth=None).json()["name"] == "ferry"
    # while readiness says it is not ready
    assert_error(call(server, "GET", "/v2/health/ready", auth=None), 503, "starting")


def test_statistics_over_rest(digits_server, client, auth, digits_samples, model_files) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # given three rows served, and another tenant's private model
    assert infer(digits_server, "digits", digits_request(x[:3])).status == 200
    register(model_files.digits, "theirs", owner=tenant("other"), visibility="private")
    digits_server.refresh()
    # when tritonclient.http asks for one model's statistics / then Triton's statistics JSON counts them
    stats = client.get_inference_statistics("digits", headers=auth)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("digits", "1")]
    assert stats[0]["inference_count"] >= 3 and stats[0]["inference_stats"]["success"]["count"] >= 1
    assert stats[0]["inference_stats"]["compute_infer"]["ns"] > 0
    assert set(stats[0]["inference_stats"]) >= {"success", "fail", "queue", "compute_infer"}
    assert client.get_inference_statistics("digits", "1", headers=auth)["model_stats"] == stats
    # and every model's lists the ones this tenant sees, not the other tenant's
    everything = {s["name"] for s in client.get_inference_statistics(headers=auth)["model_stats"]}
    assert everything == {"digits", "digits-export", "tokens"}
    other = {"Authorization": f"Bearer {mint_key('other')}"}
    assert "theirs" in {s["name"] for s in client.get_inference_statistics(headers=other)["model_stats"]}
    # and the other tenant's model is unknown, in the words of a missing one; a missing version is 404 too
    hidden = assert_error(call(digits_server, "GET", "/v2/models/theirs/stats"), 404, "unknown model")
    missing = assert_error(call(digits_server, "GET", "/v2/models/nope/stats"), 404, "unknown model")
    assert hidden.replace("theirs", "NAME") == missing.replace("nope", "NAME")
    assert_error(call(digits_server, "GET", "/v2/models/digits/versions/9/stats"), 404, "'9'")
    assert_error(call(digits_server, "GET", "/v2/models/stats", auth=None), 401, "API key")
    assert_error(call(digits_server, "POST", "/v2/models/digits/stats", b""), 405, "GET")
    assert "statistics" in client.get_server_metadata()["extensions"]


def test_metadata_and_config_name_one_platform(digits_server) -> None:  # noqa: ANN001
    for model, platform in (("digits", "pytorch_libtorch"), ("digits-export", "pytorch_export")):
        assert call(digits_server, "GET", f"/v2/models/{model}").json()["platform"] == platform
        assert call(digits_server, "GET", f"/v2/models/{model}/config").json()["platform"] == platform


def test_a_load_with_a_config_or_files_is_refused_naming_it(digits_server, client, auth) -> None:  # noqa: ANN001
    # when a load sends Triton's config override or a model file / then 400 naming the parameter
    for parameter in ("config", "file:1/model.pt"):
        body = {"parameters": {parameter: "e30="}}
        resp = call(digits_server, "POST", "/v2/repository/models/digits/load", body)
        assert_error(resp, 400, f"'{parameter}'", "not supported")
    with pytest.raises(InferenceServerException, match="'config'") as refused:
        client.load_model("digits", headers=auth, config="{}")
    assert refused.value.status() == "400"
    # while a plain load, and an unload with tritonclient's unload_dependents, are served
    client.unload_model("digits", headers=auth)
    client.load_model("digits", headers=auth)
    assert client.is_model_ready("digits", headers=auth)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_a_compressed_request_body_is_415_naming_identity(client, auth, digits_samples, algorithm) -> None:  # noqa: ANN001
    x, _ = digits_samples
    # when tritonclient.http compresses its request / then 415 saying what is supported, not a misleading 400
    # (a copy of the headers each call: tritonclient adds its encoding headers to the dict it is given)
    with pytest.raises(InferenceServerException, match="identity") as refused:
        client.infer("digits", [digits_input(x[:1])], headers=dict(auth), request_compression_algorithm=algorithm)
    assert refused.value.status() == "415"
    assert algorithm in refused.value.message()
    # while a compressed answer asked for comes back plain (Accept-Encoding needs nothing)
    answer = client.infer("digits", [digits_input(x[:1])], headers=dict(auth), response_compression_algorithm=algorithm)
    assert answer.as_numpy("scores").shape == (1, 10)


def test_every_path_that_reads_a_body_refuses_a_compressed_one(digits_server, digits_samples) -> None:  # noqa: ANN001
    x, _ = digits_samples
    body = gzip.compress(orjson.dumps(digits_request(x[:1])))
    for path in ("/v2/models/digits/infer", "/v2/models/digits/versions/1/infer", "/v2/repository/index"):
        resp = call(digits_server, "POST", path, body, headers={"Content-Encoding": "gzip"})
        assert_error(resp, 415, "gzip", "identity")
    plain = infer(digits_server, "digits", digits_request(x[:1]), headers={"Content-Encoding": "identity"})
    assert plain.status == 200, plain.body
