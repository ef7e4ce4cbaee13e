"""Issue 8's rollout acceptance, end to end on the live server: real inference traffic, usage metered and
flushed by the data plane, and the gates evaluated by the embedded process's own periodic loop (the one that
stands in for Celery beat), with short bake times.

- a second `digits` version is shadowed (the report fills from live traffic), goes through the canary steps,
  is approved, and is promoted, with an audit trail;
- a version with wrong outputs is rolled back by the shadow agreement gate, without a human;
- a slower version is rolled back by the p99 gate, without a human.

The shadow phase mirrors the live traffic to the candidate and compares the answers (`serving.dataplane.gateway.shadow`,
`rollout.shadow_report`), flushed every second here.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from django.contrib.auth.models import User
from torch import nn

from rollout.models import Rollout, RolloutState
from serving.demo import save_artifact
from serving.models import Model
from tenants.models import AuditEntry, Membership, Role
from tests.conftest import LiveServer, register, tenant
from tests.test_api import client_for
from tests.test_inference_http import digits_request, infer, wait_until

DEADLINE_S = 120.0  # how long a rollout may take to reach its end here: stops a hang, asserts no timing


class Slow(nn.Module):
    """The digits network, then about a hundred milliseconds of matrix products whose result is discarded."""

    def __init__(self, inner: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.inner = inner
        self.weight = torch.randn(384, 384) / math.sqrt(384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ones(384, 384)
        for _ in range(40):
            y = torch.tanh(y @ self.weight)
        return self.inner(x) + 0.0 * y.sum()


class Wrong(nn.Module):
    """The digits network with its classes reversed: confident, fast, and wrong."""

    def __init__(self, inner: torch.jit.ScriptModule) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).flip(1)


@pytest.fixture
def server(transactional_db, model_files, settings) -> Iterator[LiveServer]:  # noqa: ANN001
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    settings.FERRY_USAGE_FLUSH_SECONDS = 1
    settings.FERRY_ROLLOUT_EVALUATE_SECONDS = 1
    register(model_files.digits, "digits", max_batch_size=8, max_queue_delay_ms=1)
    live = LiveServer().start()
    try:
        yield live
    finally:
        live.stop()


@pytest.fixture
def people(transactional_db) -> dict[str, User]:  # noqa: ANN001
    users = {}
    for name, role in [("eng", Role.ENGINEER), ("approver", Role.APPROVER)]:
        users[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=users[name], tenant=tenant(), role=role)
    return users


def add_version(server: LiveServer, path: Path, fmt: str = "torchscript") -> int:
    version = register(path, "digits", fmt, max_batch_size=8, max_queue_delay_ms=1)
    assert version.state == "ready", version.failure_reason
    server.refresh()
    wait_until(lambda: server.plane().node.is_ready(f"digits:{version.version}"), "the candidate loaded", 60)
    return version.version


def wrapped(model_files, cls: type[nn.Module], tmp_path: Path) -> Path:  # noqa: ANN001
    path = tmp_path / f"{cls.__name__.lower()}.pt"
    save_artifact(cls(torch.jit.load(str(model_files.digits))), "torchscript", torch.zeros(2, 64), path)
    return path


class Load:
    """Unpinned traffic from many routing keys, one request at a time, until stopped; counts statuses."""

    def __init__(self, server: LiveServer, rows: np.ndarray) -> None:
        self.server, self.rows = server, rows
        self.statuses: dict[int, int] = {}
        self.versions: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            row = self.rows[i % len(self.rows)][None, :]
            resp = infer(self.server, "digits", digits_request(row), {"X-Ferry-Routing-Key": f"caller-{i}"})
            self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1
            version = resp.headers.get("x-ferry-model-version", "")
            self.versions[version] = self.versions.get(version, 0) + 1
            i += 1

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def ended(rollout_id: int) -> Rollout:
    wait_until(lambda: not Rollout.objects.get(pk=rollout_id).active, "the rollout to end", DEADLINE_S)
    return Rollout.objects.get(pk=rollout_id)


def start(people: dict, **body: object) -> dict:
    response = client_for(people["eng"]).post("/api/rollouts/", {"model": "digits", **body}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_a_second_digits_version_is_shadowed_canaried_approved_and_promoted(
    server,
    people,
    model_files,  # noqa: ANN001
    digits_samples,
    settings,
) -> None:
    settings.FERRY_SHADOW_FLUSH_SECONDS = 1
    # given digits v1 serving and v2 (the same network, as a torch.export program) loaded but taking no traffic
    candidate = add_version(server, model_files.digits_export, "torch_export")
    rows, _ = digits_samples
    with Load(server, rows) as load:
        # when an engineer starts a rollout of v2: a short shadow, then two canary steps with short bakes, p99
        # given room for a busy machine
        doc = start(
            people,
            candidate=candidate,
            steps=[25, 100],
            shadow_seconds=2,
            bake_seconds=2,
            min_requests=30,
            min_compared=30,
            p99_slack_ms=100,
            step_timeout_seconds=300,
        )
        # and an approver approves while it runs
        approver = client_for(people["approver"])
        response = approver.post(f"/api/rollouts/{doc['id']}/approve/", {"note": "go"}, format="json")
        assert response.status_code == 200 and response.json()["approved"], response.content
        # then the periodic evaluation takes it through the shadow and both steps to promotion, with no human
        rollout = ended(doc["id"])
    assert rollout.state == RolloutState.PROMOTED, rollout.reason
    assert [(v["phase"], v["percent"]) for v in rollout.verdicts] == [
        ("shadow", 0.0),
        ("canary", 25.0),
        ("canary", 100.0),
    ]
    assert all(v["outcome"] == "pass" and v["action"] == "advance" for v in rollout.verdicts)
    model = Model.objects.get(name="digits")
    assert (model.stable_version, model.rollout_weights, model.shadow_version) == (candidate, {}, None)
    # the shadow report filled from the live traffic mirrored to v2, and the two agreed
    report = client_for(people["eng"]).get(f"/api/models/digits/shadow/?candidate={candidate}&baseline=1").json()
    assert report["totals"]["compared"] >= 30 and report["totals"]["agreement"] >= 0.95, report["totals"]
    # the traffic saw no errors, and both versions served it
    assert set(load.statuses) == {200}, load.statuses
    assert load.versions.get("1") and load.versions.get(str(candidate))
    # unpinned traffic goes to the promoted version now
    assert infer(server, "digits", digits_request(rows[:1])).headers["x-ferry-model-version"] == str(candidate)
    # and the audit trail shows each step, who did what
    trail = list(
        AuditEntry.objects.filter(target__startswith=f"rollout #{rollout.pk} ")
        .order_by("at", "pk")
        .values_list("action", "actor_name")
    )
    assert trail == [
        ("rollout.start", "eng"),
        ("rollout.approve", "approver"),
        ("rollout.step", "system"),
        ("rollout.step", "system"),
        ("rollout.promote", "system"),
    ]
    assert AuditEntry.objects.filter(action="model.promote", actor_name="system").count() == 1
    # the report reads the same over the API
    report = client_for(people["eng"]).get(f"/api/rollouts/{rollout.pk}/report/").json()
    assert report["rollout"]["state"] == "promoted" and len(report["rollout"]["verdicts"]) == 3


def test_wrong_outputs_are_rolled_back_by_the_agreement_gate(
    server,
    people,
    model_files,
    digits_samples,  # noqa: ANN001
    tmp_path,
    settings,
) -> None:
    settings.FERRY_SHADOW_FLUSH_SECONDS = 1
    # given a candidate that reverses the classes
    candidate = add_version(server, wrapped(model_files, Wrong, tmp_path))
    rows, _ = digits_samples
    with Load(server, rows) as load:
        # when its rollout starts with a shadow phase: live requests are mirrored to it and compared
        doc = start(
            people,
            candidate=candidate,
            steps=[10, 100],
            shadow_seconds=2,
            bake_seconds=2,
            min_compared=50,
            min_agreement=0.95,
            step_timeout_seconds=300,
        )
        rollout = ended(doc["id"])
    # then the agreement gate rolled it back before it answered anyone, and says why with the numbers
    assert rollout.state == RolloutState.ROLLED_BACK, rollout.reason
    assert "gate agreement failed" in rollout.reason
    gate = next(g for g in rollout.verdicts[-1]["gates"] if g["gate"] == "agreement")
    assert gate["status"] == "fail" and gate["numbers"]["compared"] >= 50 and gate["numbers"]["agreement"] < 0.5
    assert str(candidate) not in load.versions and set(load.statuses) == {200}
    model = Model.objects.get(name="digits")
    assert (model.stable_version, model.rollout_weights) == (1, {})
    # the shadow report holds the comparison, and the mirroring stopped with the rollout
    assert model.shadow_version is None
    report = client_for(people["eng"]).get(f"/api/models/digits/shadow/?candidate={candidate}").json()
    assert report["totals"]["compared"] >= 50 and report["confusion"] is not None
    entry = AuditEntry.objects.get(action="rollout.roll_back")
    assert entry.actor_name == "system" and "agreement" in entry.after["reason"]


def test_a_slower_version_is_rolled_back_by_the_p99_gate(
    server,
    people,
    model_files,
    digits_samples,  # noqa: ANN001
    tmp_path,
) -> None:
    # given a candidate that answers the same, a hundred-odd milliseconds later
    candidate = add_version(server, wrapped(model_files, Slow, tmp_path))
    rows, _ = digits_samples
    with Load(server, rows) as load:
        # when its canary starts at 50%
        doc = start(
            people,
            candidate=candidate,
            steps=[50, 100],
            shadow_seconds=0,
            bake_seconds=600,
            min_requests=20,
            max_p99_ratio=1.25,
            p99_slack_ms=30,
            step_timeout_seconds=300,
        )
        rollout = ended(doc["id"])
    # then the p99 gate rolled it back at the first step, with the numbers
    assert rollout.state == RolloutState.ROLLED_BACK, rollout.reason
    assert rollout.step == 0 and "gate p99 failed" in rollout.reason
    gate = next(g for g in rollout.verdicts[-1]["gates"] if g["gate"] == "p99")
    assert gate["numbers"]["candidate_p99_ms"] > gate["numbers"]["limit_ms"]
    assert set(load.statuses) == {200} and load.versions.get(str(candidate))
    model = Model.objects.get(name="digits")
    assert (model.stable_version, model.rollout_weights) == (1, {})
