"""Audit fixes on PostgreSQL: a validation that finds its version retired meanwhile, or delivered again after it
ran, leaves the version as it is; `advance` does not promote a canary its gates have not judged."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db.models.signals import post_save
from django.utils import timezone

from rollout import transitions
from rollout.gates import Thresholds
from rollout.models import RolloutState
from rollout.transitions import RolloutError
from serving.actions import register_version
from serving.models import Model, ModelVersion, State
from serving.tasks import validate_version
from serving.validation import validate
from tenants.models import Membership, Role
from tests.conftest import DIGITS_IO, register, tenant
from tests.test_api import client_for
from tests.test_rollouts import feed

pytestmark = pytest.mark.django_db

LIMITS = Thresholds(min_requests=50, min_compared=20, min_agreement=None)


@pytest.fixture
def people(db) -> dict[str, User]:  # noqa: ANN001
    acme = tenant("acme")
    users = {}
    for name, role in [("eng", Role.ENGINEER), ("approver", Role.APPROVER)]:
        users[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=users[name], tenant=acme, role=role)
    return users


def register_unvalidated(path: Path, name: str) -> ModelVersion:
    with path.open("rb") as f:
        return register_version(
            model_name=name,
            artifact_file=f,
            fmt="torchscript",
            inputs=DIGITS_IO["inputs"],
            outputs=DIGITS_IO["outputs"],
            validate="none",
            tenant=tenant("acme"),
            max_batch_size=2,
        )


@contextmanager
def on_save(version: ModelVersion, then: Callable[[str], None]) -> Iterator[list[str]]:
    """Every state saved for `version` while inside, each handed to `then` as it is saved: the moment a
    person or the beat acts while the validation runs."""
    saved: list[str] = []

    def receiver(sender: type, instance: ModelVersion, **kwargs: object) -> None:
        if instance.pk == version.pk:
            saved.append(instance.state)
            then(instance.state)

    post_save.connect(receiver, sender=ModelVersion, weak=False)
    try:
        yield saved
    finally:
        post_save.disconnect(receiver, sender=ModelVersion)


def test_a_version_retired_while_it_validates_stays_retired(people, model_files) -> None:  # noqa: ANN001
    # given a model's first version, registered and not validated yet
    version = register_unvalidated(model_files.digits, "retiring")
    eng = client_for(people["eng"])

    def retire_once_validating(state: str) -> None:
        if state == State.VALIDATING:
            response = eng.post("/api/models/retiring/versions/1/retire/")
            assert response.status_code == 200, response.content

    # when an engineer retires it while its validation runs
    with on_save(version, retire_once_validating) as saved:
        result = validate(version)
    # then the validation's verdict does not bring it back: retired, and not the model's stable version
    assert saved == [State.VALIDATING, State.RETIRED]
    version.refresh_from_db()
    assert version.state == State.RETIRED and result.state == State.RETIRED
    assert version.latency_profile == {}
    assert Model.objects.get(name="retiring").stable_version is None


def test_a_second_delivery_of_the_task_leaves_a_ready_version_and_its_rollout_alone(people, model_files) -> None:  # noqa: ANN001
    # given version 2 ready and rolling out against version 1
    acme = tenant("acme")
    register(model_files.digits, "redelivered", owner=acme, visibility="private", max_batch_size=2)
    v2 = register(model_files.digits, "redelivered", owner=acme, visibility="private", max_batch_size=2)
    model = Model.objects.get(name="redelivered")
    rollout = transitions.start(model=model, candidate=2, actor=people["eng"], shadow_seconds=0, thresholds=LIMITS)
    updated = ModelVersion.objects.get(pk=v2.pk).updated_at

    def evaluate_meanwhile(state: str) -> None:
        transitions.evaluate(rollout.pk)  # the beat's evaluation while a validation runs

    # when Celery delivers its validation task again (acks_late: a worker died after running it)
    with on_save(v2, evaluate_meanwhile) as saved:
        assert validate_version(v2.pk) == State.READY
    # then the version is not touched, and the rollout goes on
    assert saved == []
    assert ModelVersion.objects.get(pk=v2.pk).updated_at == updated
    rollout.refresh_from_db()
    assert rollout.state == RolloutState.CANARY, rollout.reason


def test_an_approved_rollout_is_not_advanced_into_promotion_without_evidence(people, model_files) -> None:  # noqa: ANN001
    # given a rollout of version 2 approved beforehand, at its last step, with no traffic metered
    acme = tenant("acme")
    register(model_files.digits, "unjudged", owner=acme, visibility="private", max_batch_size=2)
    register(model_files.digits, "unjudged", owner=acme, visibility="private", max_batch_size=2)
    model = Model.objects.get(name="unjudged")
    t0 = (timezone.now() + timedelta(minutes=1)).replace(second=5, microsecond=0)
    rollout = transitions.start(
        model=model, candidate=2, actor=people["eng"], steps=[10, 100], shadow_seconds=0, thresholds=LIMITS, now=t0
    )
    rollout = transitions.approve(rollout=rollout, actor=people["approver"], now=t0)
    rollout = transitions.advance(rollout=rollout, actor=people["eng"], now=t0)  # a step before the last: allowed
    assert (rollout.state, rollout.step, rollout.approved) == (RolloutState.CANARY, 1, True)
    # when the engineer advances again, which would promote / then it is refused, naming what is missing
    with pytest.raises(RolloutError) as refused:
        transitions.advance(rollout=rollout, actor=people["eng"], now=t0)
    assert refused.value.status == 409 and "error_rate" in refused.value.message
    response = client_for(people["eng"]).post(f"/api/rollouts/{rollout.pk}/advance/")
    assert response.status_code == 409, response.content
    rollout.refresh_from_db()
    assert (rollout.state, rollout.step) == (RolloutState.CANARY, 1)
    assert Model.objects.get(name="unjudged").stable_version == 1
    # and once the gates pass on metered answers, the same click promotes
    feed("unjudged", 1, 100, at=t0, tenant_id=acme.pk)
    feed("unjudged", 2, 100, at=t0, tenant_id=acme.pk)
    rollout = transitions.advance(rollout=rollout, actor=people["eng"], now=t0 + timedelta(seconds=1))
    assert rollout.state == RolloutState.PROMOTED
    assert Model.objects.get(name="unjudged").stable_version == 2
