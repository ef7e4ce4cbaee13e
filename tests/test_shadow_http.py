"""Shadow traffic end to end: the digits model served by a real server, a second version mirrored at 100%
agrees with it, a version with permuted outputs does not; the comparison reaches PostgreSQL through the
flush and the Celery task (eager here), and the report API reads it per tenant. Setting the shadow
through the API and the command is validated and audited."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from django.contrib.auth.models import User
from django.core.management import call_command
from django.utils import timezone
from torch import nn

from rollout.models import ShadowDisagreement, ShadowMinute
from rollout.shadow_ingest import ingest
from rollout.shadow_report import agreement
from serving.actions import set_routing
from serving.demo import save_artifact
from serving.models import Model
from tenants.models import AuditEntry, Membership, Role
from tests.conftest import LiveServer, register, tenant
from tests.test_api import client_for
from tests.test_inference_http import digits_request, grew, infer, metrics


class Permuted(nn.Module):
    """The digits classifier with its scores rolled by one class: a version that is deliberately wrong."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(self.inner(x), 1, dims=1)


@pytest.fixture
def permuted_digits(model_files, tmp_path: Path) -> Path:  # noqa: ANN001
    path = tmp_path / "permuted.pt"
    save_artifact(Permuted(torch.jit.load(str(model_files.digits))), "torchscript", torch.zeros(2, 64), path)
    return path


@pytest.fixture
def shadow_server(transactional_db, model_files, permuted_digits, settings):  # noqa: ANN001, ANN201
    # A busy two-core machine must not shed this test's requests at the front door.
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    settings.FERRY_SHADOW_FLUSH_SECONDS = 3600  # the test flushes itself
    register(model_files.digits, "shadowed", max_batch_size=16, max_queue_delay_ms=2)
    register(model_files.digits, "shadowed", max_batch_size=16, max_queue_delay_ms=2)  # the same weights
    register(permuted_digits, "shadowed", max_batch_size=16, max_queue_delay_ms=2)
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def mirror_and_flush(server: LiveServer, images: np.ndarray) -> None:
    """Send each image (one request each) and wait until every mirror has been answered, then flush."""
    plane = server.plane()
    for image in images:
        resp = infer(server, "shadowed", digits_request(image[None, :]))
        assert resp.status == 200, resp.body
        assert resp.headers["x-ferry-model-version"] == "1"  # callers get the stable version's answer
    deadline = time.monotonic() + 60
    while len(plane.mirror.pairs) < len(images):
        assert time.monotonic() < deadline, f"{len(plane.mirror.pairs)} of {len(images)} mirrors answered"
        time.sleep(0.02)
    sent = asyncio.run_coroutine_threadsafe(plane.flush_shadow(), plane.loop).result(timeout=60)
    assert sent == len(images)


def test_same_weights_agree_and_permuted_outputs_do_not(shadow_server, digits_samples) -> None:  # noqa: ANN001
    images, _ = digits_samples
    since = timezone.now() - timedelta(seconds=1)
    # given version 2 (the same weights as 1) mirrored every request
    set_routing(model=Model.objects.get(name="shadowed"), shadow_version=2, shadow_fraction=1.0)
    shadow_server.refresh()
    # when 40 live requests are served
    mirror_and_flush(shadow_server, images[:40])
    # then the two agree on every row
    assert agreement("shadowed", 1, 2, since) == (1.0, 40)
    assert not ShadowDisagreement.objects.filter(candidate=2).exists()

    # given version 3 (permuted outputs) as the shadow instead (metrics are process-wide: count the growth)
    before = metrics(shadow_server)
    set_routing(model=Model.objects.get(name="shadowed"), shadow_version=3, shadow_fraction=1.0)
    shadow_server.refresh()
    mirror_and_flush(shadow_server, images[40:80])
    # then agreement is low, and the disagreements are kept with their inputs
    share, compared = agreement("shadowed", 1, 3, since)
    assert compared == 40 and share < 0.2
    kept = ShadowDisagreement.objects.filter(model_name="shadowed", candidate=3)
    assert kept.count() == 20  # the per-flush sample bound
    first = kept.first()
    assert first.summary.startswith("class ") and len(first.inputs["input"]) == 64
    # and /metrics counts what was mirrored, per shadow version
    after = metrics(shadow_server)
    assert grew(before, after, "ferry_shadow_mirrored_total", model="shadowed", version="3", outcome="ok") == 40


def test_a_stopped_shadow_mirrors_nothing(shadow_server, digits_samples) -> None:  # noqa: ANN001
    images, _ = digits_samples
    model = Model.objects.get(name="shadowed")
    set_routing(model=model, shadow_version=2, shadow_fraction=1.0)
    set_routing(model=model, shadow_version=None)  # clearing the version stops the mirroring
    model.refresh_from_db()
    assert (model.shadow_version, model.shadow_fraction) == (None, 0.0)
    shadow_server.refresh()
    for image in images[:5]:
        assert infer(shadow_server, "shadowed", digits_request(image[None, :])).status == 200
    plane = shadow_server.plane()
    assert not plane.mirror.queue and not plane.mirror.pairs


# -- setting the shadow, and reading the report, through the API ----------------------------------------


@pytest.fixture
def people(transactional_db, model_files) -> dict:  # noqa: ANN001
    acme, other = tenant("acme"), tenant("other")
    clients = {}
    for name, t, role in [
        ("eng", acme, Role.ENGINEER),
        ("viewer", acme, Role.VIEWER),
        ("outsider", other, Role.ENGINEER),
    ]:
        user = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=user, tenant=t, role=role)
        clients[name] = client_for(user)
    for _ in range(2):
        register(model_files.digits, "acme-digits", owner=acme, visibility="private", max_batch_size=4)
    return clients


def test_engineer_sets_the_shadow_by_patch_and_it_is_audited(people) -> None:  # noqa: ANN001
    response = people["eng"].patch(
        "/api/models/acme-digits/", {"shadow_version": 2, "shadow_fraction": 0.1}, format="json"
    )
    assert response.status_code == 200, response.content
    assert (response.json()["shadow_version"], response.json()["shadow_fraction"]) == (2, 0.1)
    entry = AuditEntry.objects.get(action="model.routing", actor__username="eng")
    assert entry.after["shadow_version"] == 2 and entry.before["shadow_version"] is None
    # a version that does not exist, a share out of range, a share without a version: 400 naming the field
    for body, field in [
        ({"shadow_version": 9}, "shadow_version"),
        ({"shadow_fraction": 2.0}, "shadow_fraction"),
        ({"shadow_version": None, "shadow_fraction": 0.5}, "shadow_fraction"),
    ]:
        response = people["eng"].patch("/api/models/acme-digits/", body, format="json")
        assert response.status_code == 400 and field in response.json()["fields"], (body, response.content)
    # a viewer may not; an outsider does not see the model
    for who, status in (("viewer", 403), ("outsider", 404)):
        response = people[who].patch("/api/models/acme-digits/", {"shadow_fraction": 0.5}, format="json")
        assert response.status_code == status, (who, response.content)
    assert Model.objects.get(name="acme-digits").shadow_fraction == 0.1


def test_route_model_command_sets_and_stops_the_shadow(people) -> None:  # noqa: ANN001
    call_command("route_model", "acme-digits", "--shadow", "2=0.25")
    model = Model.objects.get(name="acme-digits")
    assert (model.shadow_version, model.shadow_fraction) == (2, 0.25)
    call_command("route_model", "acme-digits", "--shadow", "")
    model.refresh_from_db()
    assert (model.shadow_version, model.shadow_fraction) == (None, 0.0)
    assert AuditEntry.objects.filter(action="model.routing").count() == 2


def stored_minute(candidate: int, agreed: int, compared: int, minute: int) -> dict:
    return {
        "model": "acme-digits",
        "baseline": 1,
        "candidate": candidate,
        "minute": minute,
        "task": "classification",
        "mirrored": compared,
        "shadow_errors": 0,
        "incomparable": 0,
        "compared": compared,
        "agreed": agreed,
        "abs_sum": 0.0,
        "abs_count": 0,
        "abs_max": 0.0,
        "similarity_sum": 0.0,
        "similarity_min": None,
        "difference": {"0": agreed, "60": compared - agreed},
        "confusion": {"3,3": agreed, "3,4": compared - agreed},
        "primary_latency": {"40": compared},
        "shadow_latency": {"50": compared},
        "statuses": {},
    }


def test_the_report_api_is_scoped_to_the_owners_engineers(people) -> None:  # noqa: ANN001
    now = int(time.time() // 60)
    sample_row = {
        "model": "acme-digits",
        "baseline": 1,
        "candidate": 2,
        "at": time.time(),
        "summary": "class 3 vs 4",
        "difference": 0.9,
        "inputs": {"input": [1.0] * 64},
        "output": "scores",
        "primary": [0.0] * 10,
        "shadow": [1.0] * 10,
    }
    assert ingest("b1", [stored_minute(2, 9, 10, now - 2), stored_minute(2, 5, 10, now - 1)], [sample_row]) == 2
    assert ingest("b1", [stored_minute(2, 9, 10, now - 2)], []) == 0  # a retried batch adds nothing
    response = people["eng"].get("/api/models/acme-digits/shadow/?candidate=2")
    assert response.status_code == 200, response.content
    report = response.json()
    assert report["totals"]["compared"] == 20 and report["totals"]["agreement"] == pytest.approx(0.7)
    assert [p["agreement"] for p in report["series"]] == [pytest.approx(0.9), pytest.approx(0.5)]
    assert report["confusion"] == {"labels": [3, 4], "matrix": [[14, 6], [0, 0]]}
    assert sum(b["count"] for b in report["differences"]["histogram"]) == 20
    assert report["latency"]["baseline"]["count"] == report["latency"]["candidate"]["count"] == 20
    assert report["latency"]["baseline"]["p99_ms"] < report["latency"]["candidate"]["p99_ms"]
    assert report["disagreements"][0]["summary"] == "class 3 vs 4"
    assert agreement("acme-digits", 1, 2, timezone.now() - timedelta(minutes=5)) == (pytest.approx(0.7), 20)
    # a candidate with nothing recorded is an empty report, not an error
    empty = people["eng"].get("/api/models/acme-digits/shadow/?candidate=9").json()
    assert empty["totals"]["agreement"] is None and empty["series"] == [] and empty["confusion"] is None
    # an outsider gets the 404 of a missing model; the owner's viewer sees the model, not its report (403, before
    # the query is read); a malformed query is a 400 naming the parameter
    assert people["outsider"].get("/api/models/acme-digits/shadow/?candidate=2").status_code == 404
    for query in ("?candidate=2", "?candidate=zero"):
        response = people["viewer"].get(f"/api/models/acme-digits/shadow/{query}")
        assert response.status_code == 403 and "engineer" in response.json()["error"], response.content
    response = people["eng"].get("/api/models/acme-digits/shadow/?candidate=zero")
    assert response.status_code == 400 and "candidate" in response.json()["fields"]
    assert people["eng"].get("/api/models/acme-digits/shadow/").status_code == 400
    assert ShadowMinute.objects.count() == 2


def test_old_comparisons_are_pruned(people, settings) -> None:  # noqa: ANN001
    from datetime import UTC, datetime

    from rollout.models import ShadowBatch
    from rollout.tasks import prune_shadow

    settings.FERRY_SHADOW_RETENTION_DAYS = 30
    now = int(time.time() // 60)
    old = now - 31 * 24 * 60
    ingest(
        "old",
        [stored_minute(2, 1, 1, old)],
        [
            {
                "model": "acme-digits",
                "baseline": 1,
                "candidate": 2,
                "at": old * 60.0,
                "summary": "old",
                "difference": None,
                "inputs": None,
                "output": "scores",
                "primary": [],
                "shadow": [],
            }
        ],
    )
    ingest("new", [stored_minute(2, 1, 1, now)], [])
    ShadowBatch.objects.filter(batch_id="old").update(recorded_at=datetime(2000, 1, 1, tzinfo=UTC))
    assert prune_shadow() == (1, 1, 1)
    assert list(ShadowMinute.objects.values_list("minute", flat=True)) == [datetime.fromtimestamp(now * 60, tz=UTC)]
    assert not ShadowDisagreement.objects.exists() and list(ShadowBatch.objects.values_list("batch_id", flat=True)) == [
        "new"
    ]
