"""Celery's bounds on the control plane's tasks, read from the configured app as a worker loads it: periodic runs
that expire when the next is due, time limits on every task, and the idempotent ingest tasks handed back when
their worker process dies. And a node's load task cut off at its deadline: the node's heartbeat shows the outcome
before the reconciler's record of the task goes (0020: records before heartbeats), on the real Redis."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.exceptions import SoftTimeLimitExceeded

from autoscaling import tick
from config.celery import app
from rollout import tasks as rollout_tasks
from serving import node_tasks, reconciler
from serving.dataplane.gateway.snapshot import ModelEntry, RoutingSnapshot
from serving.dataplane.node.node import Node
from serving.dataplane.node.node_process import Facts, NodeProcess
from serving.dataplane.transport import fleet
from tests.test_packing_node import digits
from tests.test_streams_processes import REDIS_URL, clear

# The node's tasks run on its solo pool, which enforces no time limit: they carry deadlines of their own.
NODE_TASKS = {"serving.node.load", "serving.node.unload"}
OURS = ("serving.", "rollout.", "usage.", "autoscaling.", "tenants.")


@pytest.fixture(scope="module")
def tasks() -> dict:
    app.loader.import_default_modules()  # autodiscovery, as a worker's start-up does
    found = {name: task for name, task in app.tasks.items() if name.startswith(OURS) and name not in NODE_TASKS}
    assert "usage.tasks.record_usage" in found and "serving.tasks.reconcile_placements" in found
    return found


def test_every_periodic_run_expires_when_the_next_is_due(settings) -> None:  # noqa: ANN001
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


# -- a node's load cut off at its deadline: the heartbeat shows it before the task's record goes -----------------


@pytest.fixture
def node_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop on a thread of its own, as `runnode` runs its node beside the Celery thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_a_load_cut_off_at_its_deadline_is_in_a_heartbeat_before_its_pending_record_goes(
    model_files,  # noqa: ANN001
    node_loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    settings,  # noqa: ANN001
) -> None:
    settings.REDIS_URL = REDIS_URL  # where the node task clears its record
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    stuck, release = threading.Event(), threading.Event()

    def artifact(sha: str) -> Path:
        if stuck.is_set():
            release.wait(30)  # a read that hangs (a stalled disk or network)
        return model_files.digits

    def on_loop(coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, node_loop).result(30)

    # given a node process whose budget holds one digits model, hot:1 loaded, and a load of cold:1 that hangs
    node = Node(artifact_path=artifact, device="cpu", memory_budget=30_000)
    process = NodeProcess(node, REDIS_URL, Facts("stuck", "cpu", "cpu", 0, 30_000, 30_000))
    hot, cold = digits("hot"), digits("cold")
    snapshot = RoutingSnapshot(
        serial=1, built_at=0.0, models={e.model: ModelEntry(e.model, "t", "", None, {1: e}) for e in (hot, cold)}
    )
    monkeypatch.setattr(node_tasks, "_node", (process, node_loop))  # what NodeWorker sets in `runnode`
    monkeypatch.setattr(node_tasks, "LOAD_DEADLINE_S", 0.5)
    field = reconciler.Pending("load", "stuck", "cold:1").field
    try:
        on_loop(process.claim_name())
        on_loop(process.reconcile(snapshot))
        stuck.set()
        client.delete(fleet.node_key("stuck"))  # only a heartbeat written from here on shows
        client.hset(reconciler.PENDING_KEY, field, 1e12)
        # when the reconciler's load task runs past its deadline
        with pytest.raises(TimeoutError):
            node_tasks.load_version.run("cold:1", pending=field)
        # then its record is gone only once a heartbeat shows the outcome: cold:1 not assigned there
        assert not client.hexists(reconciler.PENDING_KEY, field)
        raw = client.hgetall(fleet.node_key("stuck"))
        assert raw, "the pending record went before any heartbeat showed the load's outcome"
        assert "cold:1" not in fleet.NodeInfo.from_hash(raw).assigned
    finally:
        release.set()
        on_loop(process.stop(drain_seconds=1))
        clear(client)
        client.close()


def test_rollout_evaluation_stops_at_its_soft_time_limit(monkeypatch) -> None:  # noqa: ANN001
    # given three active rollouts, the first of which is evaluated when the task's soft time limit fires
    evaluated: list[int] = []

    def evaluate(rollout_id: int) -> None:
        evaluated.append(rollout_id)
        raise SoftTimeLimitExceeded()

    monkeypatch.setattr(rollout_tasks, "active_ids", lambda: [1, 2, 3])
    monkeypatch.setattr(rollout_tasks, "evaluate", evaluate)
    # when the task runs / then it stops there, as the limit asks, instead of taking it for one rollout's failure
    with pytest.raises(SoftTimeLimitExceeded):
        rollout_tasks.evaluate_rollouts()
    assert evaluated == [1]
