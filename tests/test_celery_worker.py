"""Validation as a real Celery worker runs it in distributed mode: broker on the real Redis."""

import os
import time

import pytest
from celery import Celery
from django.conf import settings as django_settings

from serving.actions import register_version
from serving.models import ModelVersion, State
from tests.conftest import DIGITS_IO, celery_worker

# A broker of its own, so a worker here never takes another suite's tasks (FERRY_TEST_CELERY_BROKER_URL when
# several suites run at once on one Redis).
BROKER = os.environ.get("FERRY_TEST_CELERY_BROKER_URL") or (
    os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15").rsplit("/", 1)[0] + "/14"
)


@pytest.fixture
def worker(transactional_db, tmp_path):  # noqa: ANN001, ANN201
    with celery_worker(tmp_path, BROKER, FERRY_ARTIFACT_ROOT=str(django_settings.FERRY_ARTIFACT_ROOT)) as proc:
        yield proc


def test_worker_validates_a_queued_version(worker, model_files) -> None:  # noqa: ANN001
    # given a registered version, not yet validated
    with model_files.digits.open("rb") as f:
        version = register_version(
            model_name="digits",
            artifact_file=f,
            fmt="torchscript",
            inputs=DIGITS_IO["inputs"],
            outputs=DIGITS_IO["outputs"],
            validate="none",
        )
    assert version.state == State.REGISTERED
    # when the task goes through the broker to a worker process
    client = Celery(broker=BROKER, set_as_current=False)  # later tests keep the project app (eager tasks)
    client.send_task("serving.tasks.validate_version", args=[version.pk])
    # then the worker loads, profiles and marks it ready
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and worker.poll() is None:
        version.refresh_from_db()
        if version.state in (State.READY, State.FAILED):
            break
        time.sleep(0.2)
    assert worker.poll() is None, "worker exited"
    assert version.state == State.READY, version.failure_reason
    assert ModelVersion.objects.get(pk=version.pk).latency_profile
