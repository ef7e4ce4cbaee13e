"""Rollouts on PostgreSQL: the state machine (rollout.transitions) driven by metered usage, its locking, the
approval rule, the REST API with its roles, and the periodic evaluation in a real Celery worker.

Usage goes in through the real path (usage.recorder -> usage.ingest) with a clock of the test's choosing, and
evaluations are given `now`, so bake times pass without sleeping.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import datetime, timedelta

import pytest
from celery import Celery
from django.conf import settings as django_settings
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from rollout import evidence, transitions
from rollout.gates import Thresholds
from rollout.models import Rollout, RolloutState
from rollout.transitions import RolloutError
from serving.actions import RegistrationError
from serving.actions import promote as promote_version
from serving.models import Model
from tenants.models import AuditEntry, Membership, Role
from tests.conftest import celery_worker, engineers_may_promote, register, tenant
from tests.test_api import client_for
from usage.ingest import ingest
from usage.recorder import UsageRecorder

LIMITS = Thresholds(min_requests=50, min_compared=20, min_agreement=None, max_p99_ratio=1.25, p99_slack_ms=5)


def feed(
    model: str,
    version: int,
    answers: int,
    *,
    at: datetime,
    errors: int = 0,
    latency: float = 0.010,
    tenant_id: int | None = None,
) -> None:
    """Meter `answers` answers of `model:version` (the first `errors` of them 503) in the minute of `at`."""
    recorder = UsageRecorder(clock=at.timestamp)
    tid = tenant_id if tenant_id is not None else tenant("acme").pk
    for i in range(answers):
        status = 503 if i < errors else 200
        recorder.record(tid, model, version, status, 0 if status >= 400 else 1, 0.001, latency)
    ingest(uuid.uuid4().hex, recorder.drain().rows())


@pytest.fixture
def people(db):  # noqa: ANN001, ANN201
    acme, other = tenant("acme"), tenant("other")
    users = {}
    for name, t, role in [
        ("eng", acme, Role.ENGINEER),
        ("approver", acme, Role.APPROVER),
        ("viewer", acme, Role.VIEWER),
        ("outsider", other, Role.ADMIN),
    ]:
        users[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=users[name], tenant=t, role=role)
    return users


@pytest.fixture
def canaried(people, model_files) -> Model:  # noqa: ANN001
    """`canaried` of tenant acme, private: version 1 stable, version 2 ready."""
    acme = tenant("acme")
    register(model_files.digits, "canaried", owner=acme, visibility="private", max_batch_size=2)
    register(model_files.digits, "canaried", owner=acme, visibility="private", max_batch_size=2)
    model = Model.objects.get(name="canaried")
    assert model.stable_version == 1
    return model


def start(model: Model, actor: User, **kwargs: object) -> Rollout:
    options = {"steps": [10, 50, 100], "shadow_seconds": 0, "bake_seconds": 60, "thresholds": LIMITS} | kwargs
    return transitions.start(model=model, candidate=2, actor=actor, **options)


def weights(model: Model) -> dict:
    model.refresh_from_db()
    return model.rollout_weights


def actions(rollout: Rollout) -> list[str]:
    target = f"rollout #{rollout.pk} of "
    return [e.action for e in AuditEntry.objects.filter(target__startswith=target).order_by("at", "pk")]


# -- starting -------------------------------------------------------------------------------------------


def test_start_takes_the_first_step_and_audits_it(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"])
    assert (rollout.state, rollout.step, rollout.baseline, rollout.percent) == (RolloutState.CANARY, 0, 1, 10.0)
    assert weights(canaried) == {"2": 0.1, "1": 0.9}
    assert actions(rollout) == ["rollout.start", "rollout.step"]
    assert AuditEntry.objects.filter(action="model.routing", actor__username="eng").count() == 1


def test_start_with_shadowing_moves_no_traffic(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"], shadow_seconds=300)
    assert rollout.state == RolloutState.SHADOWING and rollout.step is None and rollout.percent == 0
    assert weights(canaried) == {}


@pytest.mark.parametrize(
    "kwargs, status, fragment",
    [
        ({"candidate": 1}, 409, "already the stable version"),
        ({"candidate": 7}, 404, "no version 7"),
        ({"candidate": 2, "steps": [5, 1, 100]}, 400, "increase"),
        ({"candidate": 2, "steps": [5, 50]}, 400, "last step must be 100"),
    ],
)
def test_start_refusals(people, canaried, kwargs: dict, status: int, fragment: str) -> None:  # noqa: ANN001
    with pytest.raises(RolloutError) as caught:
        transitions.start(model=canaried, actor=people["eng"], **kwargs)
    assert caught.value.status == status and fragment in caught.value.message
    assert not Rollout.objects.exists()


def test_one_active_rollout_per_model_and_roles(people, canaried) -> None:  # noqa: ANN001
    with pytest.raises(RolloutError) as caught:
        start(canaried, people["viewer"])
    assert caught.value.status == 403
    start(canaried, people["eng"])
    with pytest.raises(RolloutError) as caught:
        start(canaried, people["eng"])
    assert caught.value.status == 409 and "active rollout" in caught.value.message


# -- the gates at work ----------------------------------------------------------------------------------


def test_steps_advance_after_bake_on_passing_gates_then_await_approval(people, canaried) -> None:  # noqa: ANN001
    # steps start 5 s into a minute, so each 61-s step reads minutes of its own
    t0 = (timezone.now() + timedelta(minutes=1)).replace(second=5, microsecond=0)
    rollout = start(canaried, people["eng"], now=t0)
    # no traffic yet: nothing moves, and the verdict says why
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=61))
    assert rollout.step == 0 and rollout.last_verdict["outcome"] == "no_data"
    # enough good answers on both sides, but the bake time has not passed: no move
    feed("canaried", 1, 500, at=t0)
    feed("canaried", 2, 60, at=t0)
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=30))
    assert rollout.step == 0 and rollout.last_verdict["outcome"] == "pass"
    # after the bake time: the next step
    t1 = t0 + timedelta(seconds=61)
    rollout = transitions.evaluate(rollout.pk, now=t1)
    assert (rollout.state, rollout.step) == (RolloutState.CANARY, 1)
    assert weights(canaried) == {"2": 0.5, "1": 0.5}
    assert rollout.verdicts[-1]["action"] == "advance" and rollout.verdicts[-1]["percent"] == 10.0
    feed("canaried", 1, 300, at=t1)
    feed("canaried", 2, 300, at=t1)
    # the last step (100%): the baseline serves nothing in its window, so it is judged on the rollout's whole run
    rollout = transitions.evaluate(rollout.pk, now=t1 + timedelta(seconds=61))
    assert rollout.step == 2 and weights(canaried) == {"2": 1.0, "1": 0.0}
    t3 = t1 + timedelta(seconds=180)
    feed("canaried", 2, 100, at=t3)
    rollout = transitions.evaluate(rollout.pk, now=t3)
    assert rollout.state == RolloutState.AWAITING_APPROVAL
    assert rollout.verdicts[-1]["windows"]["baseline_since"] == rollout.started_at.isoformat()
    assert actions(rollout) == [
        "rollout.start",
        "rollout.step",
        "rollout.step",
        "rollout.step",
        "rollout.await_approval",
    ]
    # the starter cannot approve alone; an approver can, and that promotes
    with pytest.raises(RolloutError) as caught:
        transitions.approve(rollout=rollout, actor=people["eng"])
    assert caught.value.status == 403
    rollout = transitions.approve(rollout=rollout, actor=people["approver"], note="numbers look fine")
    assert rollout.state == RolloutState.PROMOTED and rollout.finished_at is not None
    canaried.refresh_from_db()
    assert (canaried.stable_version, canaried.rollout_weights) == (2, {})
    assert actions(rollout)[-2:] == ["rollout.approve", "rollout.promote"]


def test_a_slow_candidate_is_rolled_back_by_the_p99_gate_with_the_numbers(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"])
    t0 = rollout.phase_started_at
    feed("canaried", 1, 500, at=t0, latency=0.010)
    feed("canaried", 2, 60, at=t0, latency=0.080)
    # a failing gate acts at once, before the bake time is out
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=5))
    assert rollout.state == RolloutState.ROLLED_BACK
    assert "gate p99 failed" in rollout.reason and "ms" in rollout.reason
    failed = [g for g in rollout.verdicts[-1]["gates"] if g["status"] == "fail"]
    assert [g["gate"] for g in failed] == ["p99"]
    assert failed[0]["numbers"]["candidate_p99_ms"] > 70 and failed[0]["numbers"]["baseline_p99_ms"] < 11
    assert weights(canaried) == {}
    entry = AuditEntry.objects.get(action="rollout.roll_back")
    assert entry.actor_name == "system" and "p99" in entry.after["reason"]


def test_an_erroring_candidate_is_rolled_back_by_the_error_gate(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"])
    t0 = rollout.phase_started_at
    feed("canaried", 1, 500, at=t0, errors=5)  # 1%
    feed("canaried", 2, 100, at=t0, errors=10)  # 10%
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=1))
    assert rollout.state == RolloutState.ROLLED_BACK and "gate error_rate failed" in rollout.reason
    assert "10.00%" in rollout.reason and "1.00%" in rollout.reason


def test_a_phase_without_evidence_times_out_into_a_rollback(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"], step_timeout_seconds=600)
    t0 = rollout.phase_started_at
    feed("canaried", 1, 500, at=t0)
    feed("canaried", 2, 3, at=t0)
    assert transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=599)).state == RolloutState.CANARY
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=600))
    assert rollout.state == RolloutState.ROLLED_BACK and "not enough evidence" in rollout.reason
    assert "candidate 3" in rollout.reason


def test_shadowing_is_judged_by_agreement(people, canaried, monkeypatch) -> None:  # noqa: ANN001
    # without the shadow comparison installed there is no data: shadowing holds (then times out)
    rollout = start(
        canaried,
        people["eng"],
        shadow_seconds=60,
        thresholds=Thresholds(min_agreement=0.95, min_compared=20, min_requests=50),
    )
    t0 = rollout.phase_started_at
    seen = []

    def agreement(model_name: str, baseline: int, candidate: int, since: datetime) -> tuple[float | None, int]:
        seen.append((model_name, baseline, candidate, since))
        return answer

    answer: tuple[float | None, int] = (None, 0)
    monkeypatch.setattr(evidence, "shadow_agreement", agreement)
    assert transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=61)).state == RolloutState.SHADOWING
    assert seen[-1] == ("canaried", 1, 2, t0)
    # agreement above the threshold over enough comparisons, after the shadow time: the first step
    answer = (0.99, 25)
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=61))
    assert (rollout.state, rollout.step) == (RolloutState.CANARY, 0)
    # on the canary step a disagreeing shadow fails it
    answer = (0.60, 25)
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=62))
    assert rollout.state == RolloutState.ROLLED_BACK and "gate agreement failed" in rollout.reason
    assert "60.00%" in rollout.reason


def test_the_shadow_report_is_optional_but_not_hidden_when_broken(monkeypatch) -> None:
    import sys
    import types

    # absent: no data
    monkeypatch.setitem(sys.modules, "rollout.shadow_report", None)
    assert evidence.shadow_agreement("m", 1, 2, timezone.now()) == (None, 0)
    # present but without the function: an error to see, not an absence
    monkeypatch.setitem(sys.modules, "rollout.shadow_report", types.ModuleType("rollout.shadow_report"))
    with pytest.raises(ImportError):
        evidence.shadow_agreement("m", 1, 2, timezone.now())
    # present: its answer
    module = types.ModuleType("rollout.shadow_report")
    module.agreement = lambda name, baseline, candidate, since: (0.97, 123)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rollout.shadow_report", module)
    assert evidence.shadow_agreement("m", 1, 2, timezone.now()) == (0.97, 123)


def test_approval_given_early_promotes_when_the_last_step_passes(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"], steps=[100])
    rollout = transitions.approve(rollout=rollout, actor=people["approver"])
    assert rollout.approved and rollout.state == RolloutState.CANARY
    t0 = rollout.phase_started_at
    feed("canaried", 1, 200, at=t0)
    feed("canaried", 2, 200, at=t0)
    rollout = transitions.evaluate(rollout.pk, now=t0 + timedelta(seconds=61))
    assert rollout.state == RolloutState.PROMOTED and Model.objects.get(pk=canaried.pk).stable_version == 2


def test_self_approval_only_where_the_tenant_allows_it(people, canaried) -> None:  # noqa: ANN001
    approver = people["approver"]
    rollout = start(canaried, approver, steps=[100])
    with pytest.raises(RolloutError) as caught:
        transitions.approve(rollout=rollout, actor=approver)
    assert caught.value.status == 403 and "cannot approve" in caught.value.message
    acme = tenant("acme")
    acme.allow_self_approval = True
    acme.save()
    rollout = transitions.approve(rollout=Rollout.objects.get(pk=rollout.pk), actor=approver)
    assert rollout.approved


def test_promote_needs_the_approval_and_ended_rollouts_refuse_transitions(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"])
    with pytest.raises(RolloutError) as caught:
        transitions.promote(rollout=rollout, actor=people["approver"])
    assert caught.value.status == 409 and "not approved" in caught.value.message
    transitions.approve(rollout=rollout, actor=people["approver"])
    rollout = transitions.promote(rollout=rollout, actor=people["approver"])
    assert rollout.state == RolloutState.PROMOTED
    for move in (transitions.roll_back, transitions.cancel, transitions.advance):
        with pytest.raises(RolloutError) as caught:
            move(rollout=rollout, actor=people["eng"])
        assert caught.value.status == 409 and "promoted" in caught.value.message


def test_a_direct_promotion_is_refused_while_a_rollout_is_active(people, canaried) -> None:  # noqa: ANN001
    # given a rollout of version 2, still in its first canary step and not approved
    rollout = start(canaried, people["eng"])
    # when an engineer promotes version 2 directly: by the action, the REST API and the command
    with pytest.raises(RegistrationError) as caught:
        promote_version(model=canaried, version=2, actor=people["eng"])
    assert caught.value.status == 409 and f"active rollout (#{rollout.pk}" in caught.value.message
    response = client_for(people["approver"]).post("/api/models/canaried/versions/2/promote/")
    assert response.status_code == 409 and f"#{rollout.pk}" in response.json()["error"]
    with pytest.raises(CommandError, match="active rollout"):
        call_command("route_model", "canaried", "--promote", "2")
    # then nothing moved: version 1 is stable, the canary weights stand, the rollout goes on
    canaried.refresh_from_db()
    assert canaried.stable_version == 1 and weights(canaried) == {"1": 0.9, "2": 0.1}
    assert not AuditEntry.objects.filter(action="model.promote").exists()
    assert transitions.evaluate(rollout.pk).state == RolloutState.CANARY
    # and once the rollout has ended, a direct promotion still needs an approval where the tenant requires
    # one (the default: tests/test_promotion_policy.py); where engineers may promote it works again
    transitions.cancel(rollout=rollout, actor=people["eng"])
    with pytest.raises(RegistrationError) as caught:
        promote_version(model=canaried, version=2, actor=people["eng"])
    assert caught.value.status == 409 and "approval" in caught.value.message
    engineers_may_promote("acme")
    assert promote_version(model=canaried, version=2, actor=people["eng"]).stable_version == 2


def test_the_rollout_promotes_through_the_guard(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"])
    transitions.approve(rollout=rollout, actor=people["approver"])
    transitions.promote(rollout=Rollout.objects.get(pk=rollout.pk), actor=people["approver"])
    canaried.refresh_from_db()
    assert canaried.stable_version == 2 and canaried.rollout_weights == {}


# -- two evaluations at once ---------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_evaluations_at_once_advance_one_step(people, canaried) -> None:  # noqa: ANN001
    rollout = start(canaried, people["eng"])
    t0 = rollout.phase_started_at
    feed("canaried", 1, 500, at=t0)
    feed("canaried", 2, 60, at=t0)
    later = t0 + timedelta(seconds=61)
    barrier = threading.Barrier(2)
    results: list = []

    def evaluate() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(transitions.evaluate(rollout.pk, now=later).step)
        except Exception as exc:  # surfaced by the assertion below
            results.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=evaluate) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # both saw step 1 in the end, but only one of them moved it there
    assert results == [1, 1]
    rollout.refresh_from_db()
    assert rollout.step == 1 and len(rollout.verdicts) == 1
    assert actions(rollout) == ["rollout.start", "rollout.step", "rollout.step"]


# -- the REST API ----------------------------------------------------------------------------------------


def test_api_lifecycle_with_roles(people, canaried) -> None:  # noqa: ANN001
    eng, approver, viewer, outsider = (client_for(people[n]) for n in ("eng", "approver", "viewer", "outsider"))
    body = {"model": "canaried", "candidate": 2, "steps": [50, 100], "shadow_seconds": 0, "bake_seconds": 0}
    assert viewer.post("/api/rollouts/", body, format="json").status_code == 403
    response = outsider.post("/api/rollouts/", body, format="json")
    assert response.status_code == 404 and "error" in response.json()
    response = eng.post("/api/rollouts/", body, format="json")
    assert response.status_code == 201, response.content
    doc = response.json()
    rid = doc["id"]
    assert (doc["state"], doc["percent"], doc["started_by"], doc["baseline"]) == ("canary", 50.0, "eng", 1)
    assert eng.post("/api/rollouts/", body, format="json").status_code == 409
    # reading: the tenant's people see it, another tenant's do not know it exists
    assert viewer.get(f"/api/rollouts/{rid}/").status_code == 200
    assert outsider.get(f"/api/rollouts/{rid}/").status_code == 404
    assert outsider.post(f"/api/rollouts/{rid}/roll-back/").status_code == 404
    assert [r["id"] for r in viewer.get("/api/rollouts/?model=canaried&state=canary").json()["results"]] == [rid]
    assert viewer.get("/api/rollouts/?state=nonsense").status_code == 400
    assert viewer.get("/api/rollouts/?model=").status_code == 400
    # roles: an engineer advances but may not approve; the starter may not approve alone
    assert eng.post(f"/api/rollouts/{rid}/approve/").status_code == 403
    response = eng.post(f"/api/rollouts/{rid}/advance/")
    assert response.status_code == 200 and response.json()["percent"] == 100.0
    response = eng.post(f"/api/rollouts/{rid}/advance/")
    assert response.status_code == 200 and response.json()["state"] == "awaiting_approval"
    assert eng.post(f"/api/rollouts/{rid}/advance/").status_code == 409
    response = approver.post(f"/api/rollouts/{rid}/approve/", {"note": "ok"}, format="json")
    assert response.status_code == 200, response.content
    doc = response.json()
    assert doc["state"] == "promoted" and doc["approvals"][0]["username"] == "approver"
    assert [v["by"] for v in doc["verdicts"]] == ["eng", "eng"]
    # ended: every transition is a 409
    for move in ("advance", "approve", "reject", "promote", "roll-back", "cancel"):
        response = approver.post(f"/api/rollouts/{rid}/{move}/")
        assert response.status_code == 409 and "promoted" in response.json()["error"], move
    report = viewer.get(f"/api/rollouts/{rid}/report/").json()
    assert report["rollout"]["state"] == "promoted" and report["current"] is None


def test_api_report_shows_the_gates_now_and_rollback(people, canaried) -> None:  # noqa: ANN001
    eng = client_for(people["eng"])
    rollout = start(canaried, people["eng"])
    feed("canaried", 1, 500, at=rollout.phase_started_at)
    feed("canaried", 2, 60, at=rollout.phase_started_at)
    current = eng.get(f"/api/rollouts/{rollout.pk}/report/").json()["current"]
    assert current["outcome"] == "pass"
    assert {g["gate"]: g["status"] for g in current["gates"]} == {
        "error_rate": "pass",
        "p99": "pass",
        "agreement": "pass",
    }
    response = eng.post(f"/api/rollouts/{rollout.pk}/roll-back/", {"note": "not today"}, format="json")
    assert response.status_code == 200 and response.json()["state"] == "rolled_back"
    assert "not today" in response.json()["reason"] and weights(canaried) == {}


# -- the periodic task in a real Celery worker ---------------------------------------------------------

BROKER = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/6")


@pytest.mark.django_db(transaction=True)
def test_a_celery_worker_evaluates_and_advances(people, canaried, tmp_path) -> None:  # noqa: ANN001
    # given a rollout whose first step has baked, with good evidence on both sides
    rollout = start(canaried, people["eng"], bake_seconds=0)
    feed("canaried", 1, 500, at=rollout.phase_started_at)
    feed("canaried", 2, 60, at=rollout.phase_started_at)
    assert "evaluate-rollouts" in django_settings.CELERY_BEAT_SCHEDULE
    # when the beat's task reaches a worker process through the broker
    with celery_worker(tmp_path, BROKER, FERRY_ARTIFACT_ROOT=str(django_settings.FERRY_ARTIFACT_ROOT)) as worker:
        client = Celery(broker=BROKER, set_as_current=False)  # later tests keep the project app (eager tasks)
        client.send_task(django_settings.CELERY_BEAT_SCHEDULE["evaluate-rollouts"]["task"])
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and worker.poll() is None:
            rollout.refresh_from_db()
            if rollout.step != 0:
                break
            time.sleep(0.2)
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
    # then the worker moved it one step, and the registry with it
    assert (rollout.state, rollout.step) == (RolloutState.CANARY, 1), (tmp_path / "worker.log").read_text()
    assert weights(canaried) == {"2": 0.5, "1": 0.5}
    assert AuditEntry.objects.filter(action="rollout.step", actor_name="system").count() == 1


# -- the console's panel --------------------------------------------------------------------------------


def test_console_panel_shows_buttons_only_to_those_allowed_and_checks_again(people, canaried) -> None:  # noqa: ANN001
    from django.test import Client

    rollout = start(canaried, people["eng"], steps=[100])

    def page(user: str) -> str:
        client = Client()
        client.force_login(people[user])
        response = client.get("/console/models/canaried/")
        assert response.status_code == 200
        return response.content.decode()

    viewer_page, eng_page, approver_page = page("viewer"), page("eng"), page("approver")
    assert "version 1 → 2" in viewer_page and "100%" in viewer_page
    assert ">Approve<" not in viewer_page and ">Roll back<" not in viewer_page
    # the starter, an engineer: roll back only (approving is someone else's)
    assert ">Roll back<" in eng_page and ">Approve<" not in eng_page and ">Promote<" not in eng_page
    assert ">Approve<" in approver_page and ">Reject<" in approver_page and ">Promote<" not in approver_page
    # a viewer's forged POST is refused; another tenant's person does not find it
    viewer, outsider, approver = Client(), Client(), Client()
    viewer.force_login(people["viewer"])
    outsider.force_login(people["outsider"])
    approver.force_login(people["approver"])
    assert viewer.post(f"/console/rollouts/{rollout.pk}/approve/").status_code == 403
    assert outsider.post(f"/console/rollouts/{rollout.pk}/approve/").status_code == 404
    # the approver approves: promoted once the step passes; the page then offers nothing
    response = approver.post(f"/console/rollouts/{rollout.pk}/approve/")
    assert response.status_code == 302
    rollout.refresh_from_db()
    assert rollout.approved and rollout.state == RolloutState.CANARY
    assert ">Promote<" in page("approver")
    assert approver.post(f"/console/rollouts/{rollout.pk}/promote/").status_code == 302
    after = page("approver")
    assert "Promoted" in after and ">Approve<" not in after and ">Roll back<" not in after
    # and an engineer may start the next one from the page (version 1 is the only other ready version now)
    eng_page = page("eng")
    assert "Start rollout" in eng_page and '<option value="1">1</option>' in eng_page
    assert "Start rollout" not in page("viewer")
    eng = Client()
    eng.force_login(people["eng"])
    response = eng.post(
        "/console/models/canaried/rollouts/",
        {"candidate": "1", "steps": "50 100", "shadow_seconds": "0", "bake_seconds": "30"},
    )
    assert response.status_code == 302
    latest = Rollout.objects.get(state=RolloutState.CANARY)
    assert (latest.baseline, latest.candidate, latest.steps, latest.bake_seconds) == (2, 1, [50, 100], 30)
    assert eng.post("/console/models/canaried/rollouts/", {"candidate": "1"}).status_code == 409


def test_self_approval_is_set_by_staff_in_the_admin_and_audited(people) -> None:  # noqa: ANN001
    from django.test import Client

    staff = User.objects.create_user("staff", "staff@example.org", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    acme = tenant("acme")
    form = {
        "name": acme.name,
        "slug": acme.slug,
        "allow_self_approval": "on",
        "promotion_policy": acme.promotion_policy,
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    response = client.post(f"/admin/tenants/tenant/{acme.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    acme.refresh_from_db()
    assert acme.allow_self_approval
    entry = AuditEntry.objects.get(action="tenant.self_approval")
    assert (entry.actor_name, entry.before, entry.after) == (
        "staff",
        {"allow_self_approval": False},
        {"allow_self_approval": True},
    )
    assert client_for(people["viewer"]).get("/api/tenants/acme/").json()["allow_self_approval"] is True


def test_the_admin_shows_rollouts_read_only(people, canaried) -> None:  # noqa: ANN001
    from django.test import Client

    rollout = start(canaried, people["eng"])
    staff = User.objects.create_user("staff", "staff@example.org", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(staff)
    assert client.get("/admin/rollout/rollout/").status_code == 200
    assert client.get(f"/admin/rollout/rollout/{rollout.pk}/change/").status_code == 200  # a view, not a form
    client.post(f"/admin/rollout/rollout/{rollout.pk}/change/", {"state": "promoted"})
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.CANARY
