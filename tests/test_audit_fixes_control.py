"""Celery's bounds on the control plane's tasks, read from the configured app as a worker loads it: periodic runs
that expire when the next is due, time limits on every task, and the idempotent ingest tasks handed back when
their worker process dies."""

from __future__ import annotations

import pytest
from django.conf import settings

from autoscaling import tick
from config.celery import app
from serving import reconciler

# The node's tasks run on its solo pool, which enforces no time limit: they carry deadlines of their own.
NODE_TASKS = {"serving.node.load", "serving.node.unload"}
OURS = ("serving.", "rollout.", "usage.", "autoscaling.", "tenants.")


@pytest.fixture(scope="module")
def tasks() -> dict:
    app.loader.import_default_modules()  # autodiscovery, as a worker's start-up does
    found = {name: task for name, task in app.tasks.items() if name.startswith(OURS) and name not in NODE_TASKS}
    assert "usage.tasks.record_usage" in found and "serving.tasks.reconcile_placements" in found
    return found


def test_every_periodic_run_expires_when_the_next_is_due() -> None:
    for name, entry in settings.CELERY_BEAT_SCHEDULE.items():
        assert entry["options"]["expires"] == entry["schedule"], name


def test_every_task_has_a_soft_time_limit_below_its_hard_one(tasks: dict) -> None:
    for name, task in tasks.items():
        assert task.soft_time_limit and task.time_limit, name
        assert task.soft_time_limit < task.time_limit, name


def test_a_locked_step_ends_before_its_lock_could_lapse(tasks: dict) -> None:
    assert tasks["serving.tasks.reconcile_placements"].time_limit < reconciler.LOCK_SECONDS
    assert tasks["autoscaling.tasks.autoscale"].time_limit < tick.LOCK_SECONDS


def test_only_the_idempotent_ingest_tasks_are_handed_back_when_their_worker_dies(tasks: dict) -> None:
    handed_back = {name for name, task in tasks.items() if task.acks_late and task.reject_on_worker_lost}
    assert handed_back == {"usage.tasks.record_usage", "rollout.tasks.record_shadow"}
