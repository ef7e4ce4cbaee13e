"""Pipelines served end to end (a live server, the embedded node): a cheap model that hands the rows it is
unsure of to a bigger one, an ensemble of two versions, and what a refused step does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from serving.demo import build_digits, save_artifact
from serving.models import Model, ModelVersion
from serving.pipelines import register_pipeline
from serving.publish import publish_snapshot
from tests.conftest import LiveServer, register, tenant
from tests.test_inference_http import assert_error, call, digits_request, infer, scores

UNSURE = 0.9
SWITCH = {
    "sequence": [
        {"model": "p-small", "name": "small"},
        {
            "switch": {"tensor": "scores", "reduce": "max_softmax", "op": "<", "value": UNSURE},
            "then": {"model": "p-big", "name": "big"},
            "name": "unsure",
        },
    ]
}


@pytest.fixture(scope="module")
def weak_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits classifier trained briefly: unsure (top softmax under 0.9) of about half the images."""
    torch.manual_seed(1)
    module, _ = build_digits(32, 1, 20, seed=1)(lambda line: None)
    path = tmp_path_factory.mktemp("pipeline") / "weak.pt"
    save_artifact(module, "torchscript", torch.zeros(2, 64), path)
    return path


@pytest.fixture
def pipeline_server(transactional_db, model_files, weak_digits, settings):  # noqa: ANN001, ANN201
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    register(weak_digits, "p-small", max_batch_size=64, max_queue_delay_ms=1)
    register(model_files.digits, "p-big", max_batch_size=64, max_queue_delay_ms=1)
    register(weak_digits, "p-big", max_batch_size=64, max_queue_delay_ms=1)  # version 2: other weights
    register_pipeline(name="cheap-then-big", spec=SWITCH, tenant=tenant(), visibility="public")
    ensemble = {
        "ensemble": [{"model": "p-big", "version": 1, "name": "v1"}, {"model": "p-big", "version": 2, "name": "v2"}]
    }
    register_pipeline(name="two-versions", spec=ensemble, tenant=tenant(), visibility="public")
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def softmax_max(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return (e / e.sum(axis=1, keepdims=True)).max(axis=1)


def test_switch_sends_only_the_unsure_rows_to_the_big_model(pipeline_server, digits_samples) -> None:  # noqa: ANN001
    images = digits_samples[0][:48]
    small = scores(infer(pipeline_server, "p-small", digits_request(images)))
    big = scores(call(pipeline_server, "POST", "/v2/models/p-big/versions/1/infer", digits_request(images)))
    unsure = softmax_max(small) < UNSURE
    assert 0 < unsure.sum() < len(images), "the weak model should be unsure of some images, not all"

    resp = infer(pipeline_server, "cheap-then-big", digits_request(images))
    got = scores(resp)
    expected = np.where(unsure[:, None], big, small)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert resp.json()["model_name"] == "cheap-then-big"
    steps = dict(part.split("=") for part in resp.headers["x-ferry-pipeline-steps"].split(","))
    assert steps == {"small": str(len(images)), "big": str(int(unsure.sum()))}  # the share that reached big

    # One row at a time: each answered by the model its confidence calls for.
    for i in range(4):
        one = scores(infer(pipeline_server, "cheap-then-big", digits_request(images[i : i + 1])))
        np.testing.assert_allclose(one[0], expected[i], rtol=1e-5, atol=1e-5)


def test_ensemble_of_two_versions_answers_the_mean(pipeline_server, digits_samples) -> None:  # noqa: ANN001
    images = digits_samples[0][100:110]
    v1 = scores(call(pipeline_server, "POST", "/v2/models/p-big/versions/1/infer", digits_request(images)))
    v2 = scores(call(pipeline_server, "POST", "/v2/models/p-big/versions/2/infer", digits_request(images)))
    got = scores(infer(pipeline_server, "two-versions", digits_request(images)))
    np.testing.assert_allclose(got, (v1 + v2) / 2, rtol=1e-6, atol=1e-6)


def test_a_refused_step_is_a_503_or_the_pipelines_fallback(pipeline_server, digits_samples) -> None:  # noqa: ANN001
    images = digits_samples[0][:2]
    # A deadline no step can meet: shed, as a model's request would be, with Retry-After.
    resp = infer(pipeline_server, "cheap-then-big", digits_request(images, parameters={"timeout": 1}))
    assert_error(resp, 503)
    assert "retry-after" in resp.headers
    # With a fallback, a step that cannot be served (its model unloaded) hands the call to it.
    register_pipeline(name="cheap-then-big", spec=SWITCH, tenant=tenant(), visibility="public", fallback="p-big")
    ModelVersion.objects.filter(model__name="p-small").update(loaded=False)
    publish_snapshot()
    pipeline_server.refresh()
    resp = infer(pipeline_server, "cheap-then-big", digits_request(images))
    assert resp.status == 200, resp.body
    assert resp.headers["x-ferry-fallback-from"] == "cheap-then-big:2"
    assert resp.json()["model_name"] == "p-big"
    direct = scores(call(pipeline_server, "POST", "/v2/models/p-big/versions/1/infer", digits_request(images)))
    np.testing.assert_allclose(scores(resp), direct, rtol=1e-6, atol=1e-6)


def test_unknown_or_invisible_pipeline_is_404(pipeline_server, digits_samples) -> None:  # noqa: ANN001
    register_pipeline(name="hidden-pipe", spec={"model": "p-small"}, tenant=tenant("other"), visibility="private")
    pipeline_server.refresh()
    hidden = infer(pipeline_server, "hidden-pipe", digits_request(digits_samples[0][:1]))
    missing = infer(pipeline_server, "no-such-pipe", digits_request(digits_samples[0][:1]))
    assert_error(hidden, 404)
    assert_error(missing, 404)
    assert hidden.error.replace("hidden-pipe", "X") == missing.error.replace("no-such-pipe", "X")


def test_pipeline_metadata_and_ready_are_a_models(pipeline_server) -> None:  # noqa: ANN001
    # given the cascade / when its metadata is read / then it is a model's, with the derived signature
    meta = call(pipeline_server, "GET", "/v2/models/cheap-then-big")
    assert meta.status == 200, meta.body
    assert meta.json() == {
        "name": "cheap-then-big",
        "versions": ["1"],
        "platform": "ferry_pipeline",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 10]}],
    }
    assert call(pipeline_server, "GET", "/v2/models/cheap-then-big/versions/1").json()["versions"] == ["1"]
    assert_error(call(pipeline_server, "GET", "/v2/models/cheap-then-big/versions/7"), 404, "no version '7'")
    assert_error(call(pipeline_server, "GET", "/v2/models/cheap-then-big/config"), 404, "pipeline")
    # and it is ready while every step's model has a version ready
    assert call(pipeline_server, "GET", "/v2/models/cheap-then-big/ready").status == 200
    assert call(pipeline_server, "GET", "/v2/models/cheap-then-big/versions/1/ready").status == 200
    # when the big step's model has no version loaded / then the pipeline is not ready: 503, Retry-After
    ModelVersion.objects.filter(model__name="p-big").update(loaded=False)
    publish_snapshot()
    pipeline_server.refresh()
    resp = call(pipeline_server, "GET", "/v2/models/cheap-then-big/ready")
    assert_error(resp, 503, "cheap-then-big")
    assert "retry-after" in resp.headers


def test_a_foreign_private_pipeline_is_a_404_like_none(pipeline_server) -> None:  # noqa: ANN001
    register_pipeline(name="hidden-pipe", spec={"model": "p-small"}, tenant=tenant("other"), visibility="private")
    pipeline_server.refresh()
    for suffix in ("", "/ready", "/versions/1", "/versions/1/ready"):
        hidden = call(pipeline_server, "GET", f"/v2/models/hidden-pipe{suffix}")
        missing = call(pipeline_server, "GET", f"/v2/models/no-such-pipe{suffix}")
        said = assert_error(hidden, 404)
        assert said.replace("hidden-pipe", "NAME") == assert_error(missing, 404).replace("no-such-pipe", "NAME")


def test_ready_names_no_step_model_the_caller_cannot_see(pipeline_server, weak_digits) -> None:  # noqa: ANN001
    # given a public pipeline of another tenant whose step's model that tenant has made private since
    other = tenant("other")
    register(weak_digits, "their-secret", owner=other, visibility="public")
    register_pipeline(name="their-pipe", spec={"model": "their-secret", "name": "s"}, tenant=other, visibility="public")
    Model.objects.filter(name="their-secret").update(visibility="private")
    publish_snapshot()
    pipeline_server.refresh()
    # when this tenant asks / then the pipeline is described, but not ready, and the model's name is unsaid
    assert call(pipeline_server, "GET", "/v2/models/their-pipe").json()["platform"] == "ferry_pipeline"
    said = assert_error(call(pipeline_server, "GET", "/v2/models/their-pipe/ready"), 503, "step 's'")
    assert "their-secret" not in said


def test_a_step_named_after_a_model_gone_private_is_unsaid(pipeline_server, weak_digits, digits_samples) -> None:  # noqa: ANN001
    # given public pipelines of another tenant, each with a step named after its model (no `name`): one on
    # that tenant's own model, one on a third tenant's; both models made private since
    other, third = tenant("other"), tenant("third")
    register(weak_digits, "their-secret", owner=other, visibility="public")
    register(weak_digits, "third-secret", owner=third, visibility="public")
    register_pipeline(name="their-pipe", spec={"model": "their-secret"}, tenant=other, visibility="public")
    register_pipeline(name="third-pipe", spec={"model": "third-secret"}, tenant=other, visibility="public")
    Model.objects.filter(name__in=["their-secret", "third-secret"]).update(visibility="private")
    publish_snapshot()
    pipeline_server.refresh()
    images = digits_samples[0][:1]
    # when this tenant calls them, asks whether they are ready, or leaves their steps no time
    # then each is a 503 that says a step is not available, and never the model's name
    for pipe, secret in (("their-pipe", "their-secret"), ("third-pipe", "third-secret")):
        answers = [
            infer(pipeline_server, pipe, digits_request(images)),
            call(pipeline_server, "GET", f"/v2/models/{pipe}/ready"),
            infer(pipeline_server, pipe, digits_request(images, parameters={"timeout": 1})),
        ]
        for resp in answers:
            said = assert_error(resp, 503, pipe)
            assert secret not in said, said
        assert "a step of this pipeline is not available" in answers[0].error
