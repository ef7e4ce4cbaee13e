"""The demo models as `make run` builds them: trained, registered, served, and shown in the console."""

from __future__ import annotations

import hashlib
import http.client

import orjson
import pytest

from serving.demo import build_all
from serving.models import Model, ModelVersion, State
from tests.conftest import LiveServer
from tests.test_console_browser import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, log_in

pytestmark = pytest.mark.browser
DEMO = ["digits-small", "digits", "digits-wide", "token-sentiment"]
EPOCH_SCALE = 0.02


def post(server: LiveServer, model: str, payload: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request(
            "POST",
            f"/v2/models/{model}/infer",
            body=orjson.dumps(payload),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"},
        )
        resp = conn.getresponse()
        return resp.status, orjson.loads(resp.read())
    finally:
        conn.close()


def test_demo_models_build_serve_and_show(transactional_db, django_user_model, digits_samples, settings) -> None:  # noqa: ANN001
    # This test is about the demo models, not shedding: on a loaded shared machine the event loop's lag would
    # shed its requests (503 "server saturated"), as tests/test_auth.py's server would.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    # given an empty registry / when the demo models are built (briefly trained: the code path, not the accuracy)
    lines: list[str] = []
    # (0.02: one epoch of each MLP and of the sentiment model, 3 of the wide convnet's 135 steps: the wide model is
    # most of this test's training, and at 0.1 it took 14 steps)
    assert build_all(say=lines.append, epoch_scale=EPOCH_SCALE) == DEMO
    # then each is ready, with its held-out accuracy recorded and printed, in the declared format
    versions = {v.model.name: v for v in ModelVersion.objects.select_related("model")}
    assert sorted(versions) == sorted(DEMO)
    for name, version in versions.items():
        assert version.state == State.READY, version.failure_reason
        assert 0.0 <= version.metrics["accuracy"] <= 1.0
        assert any(line.startswith(f"{name}: held-out accuracy") for line in lines)
    assert versions["digits-small"].format == "torch_export"
    assert versions["digits"].format == versions["digits-wide"].format == versions["token-sentiment"].format
    assert versions["digits"].format == "torchscript"
    assert Model.objects.get(name="digits").fallback.name == "digits-small"
    assert Model.objects.get(name="digits-wide").fallback.name == "digits-small"
    # the wide model trained for a fraction of an epoch here: its steps were printed, the last one of 3
    assert any(line.strip().startswith("step 3/3 ") for line in lines)
    # and building again reuses what is there
    assert build_all(say=lines.append, epoch_scale=EPOCH_SCALE) == []
    django_user_model.objects.create_user("demo-op", password="demo-op-password", is_staff=True)

    server = LiveServer().start()
    try:
        # when each demo model is asked / then it answers with its declared output
        x, _ = digits_samples
        digits_input = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": x[0].tolist()}]}
        for model in ("digits", "digits-small", "digits-wide"):
            status, body = post(server, model, digits_input)
            assert status == 200, body
            assert body["model_name"] == model and body["outputs"][0]["shape"] == [1, 10]
        # a batch of labelled samples through the wide model: its answers are its argmax per row
        batch = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [8, 64], "data": x[:8].ravel().tolist()}]}
        status, body = post(server, "digits-wide", batch)
        assert status == 200 and body["outputs"][0]["shape"] == [8, 10], body
        status, body = post(
            server,
            "token-sentiment",
            {
                "inputs": [
                    {"name": "tokens", "datatype": "INT64", "shape": [2, 5], "data": [1, 2, 3, 0, 0, 9, 10, 11, 12, 40]}
                ]
            },
        )
        assert status == 200 and body["outputs"][0]["shape"] == [2, 2], body

        # and the console, in a real browser, lists every demo model as ready and loaded
        assert CHROMIUM.exists(), f"Chromium is missing at {CHROMIUM}: scripts/setup.sh test installs it"
        from playwright.sync_api import expect, sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(base_url=server.url)
                page.set_default_timeout(WAIT_MS)
                page.goto("/")
                log_in(page, "demo-op", "demo-op-password")
                for name in DEMO:
                    row = page.locator(f'tr[data-key="{name}:1"]')
                    expect(row.locator("td.model strong")).to_have_text(name)
                    expect(row.locator(".state")).to_have_text("ready")
                    expect(row.locator(".loaded")).to_have_text("loaded")
                for name in ("digits", "digits-wide"):
                    expect(page.locator(f'tr[data-key="{name}:1"] td.model')).to_contain_text("fallback digits-small")
            finally:
                browser.close()
    finally:
        server.stop()


def test_a_cached_demo_model_is_registered_again_without_training_and_a_corrupt_one_is_retrained(
    db,  # noqa: ANN001
    tmp_path,  # noqa: ANN001
) -> None:
    import dataclasses

    from serving.demo import DEMO_MODELS, build_digits, cache_key, train_and_register

    small = next(d for d in DEMO_MODELS if d.name == "digits-small")
    tiny = dataclasses.replace(small, name="tiny", fmt="torchscript", build=build_digits(8, 1, 2))
    cache = tmp_path / "cache"
    # given a first build: trained, registered, and kept in the cache under its key
    lines: list[str] = []
    first = train_and_register(tiny, tiny.build, lines.append, cache=cache)
    assert first.state == State.READY and f"{tiny.name}: training" in lines
    key = cache_key(tiny, tiny.build, 1.0)
    assert [p.name for p in cache.iterdir()] == [key]
    # when it is built again / then the kept artifact is registered, nothing trained, the same bytes
    lines.clear()
    second = train_and_register(tiny, tiny.build, lines.append, cache=cache)
    assert second.version == 2 and second.state == State.READY
    assert f"{tiny.name}: training" not in lines and any("trained earlier" in line for line in lines)
    assert second.artifact.sha256 == first.artifact.sha256
    assert second.metrics["accuracy"] == first.metrics["accuracy"]
    # another recipe, scale or format is another key
    assert cache_key(tiny, build_digits(8, 1, 2, seed=1), 1.0) != key
    assert cache_key(tiny, tiny.build, 0.5) != key
    assert cache_key(small, tiny.build, 1.0) != key
    # when the kept artifact is changed on disk / then the registry's sha256 check refuses it, the entry is removed,
    # and the model is trained again: seeded, to the very same artifact
    kept = cache / key / "model.pt"
    kept.write_bytes(kept.read_bytes() + b"\0")
    lines.clear()
    third = train_and_register(tiny, tiny.build, lines.append, cache=cache)
    assert any("refused" in line for line in lines) and f"{tiny.name}: training" in lines
    assert third.state == State.READY and third.artifact.sha256 == first.artifact.sha256
    assert hashlib.sha256((cache / key / "model.pt").read_bytes()).hexdigest() == first.artifact.sha256
