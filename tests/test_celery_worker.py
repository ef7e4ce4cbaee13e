"""Validation as a real Celery worker runs it in distributed mode: broker on the real Redis."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from celery import Celery
from django.conf import settings as django_settings
from django.db import connection

from serving.actions import register_version
from serving.models import ModelVersion, State
from tests.conftest import DIGITS_IO

BROKER = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15").rsplit("/", 1)[0] + "/14"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def worker(transactional_db, tmp_path):  # noqa: ANN001, ANN201
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": BROKER,
        "FERRY_ARTIFACT_ROOT": str(django_settings.FERRY_ARTIFACT_ROOT),
        "FERRY_DATA_DIR": str(tmp_path),
        "CELERY_TASK_ALWAYS_EAGER": "false",
    }
    log = (tmp_path / "worker.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-P", "solo", "-Q", "celery",
         "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", "info"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    yield proc
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_worker_validates_a_queued_version(worker, model_files) -> None:  # noqa: ANN001
    # given a registered version, not yet validated
    with model_files.digits.open("rb") as f:
        version = register_version(model_name="digits", artifact_file=f, fmt="torchscript",
                                   inputs=DIGITS_IO["inputs"], outputs=DIGITS_IO["outputs"], validate="none")
    assert version.state == State.REGISTERED
    # when the task goes through the broker to a worker process
    client = Celery(broker=BROKER)
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
