"""Model lifecycle tasks: routed to one node's own Celery queue (`node.<name>`) and run in that node's process,
where its models live. `manage.py runnode` consumes only its own queue, on a worker thread (pool solo) beside
its event loop (`start_worker`).

A task hands its work to the node's event loop and waits for it with a deadline, so the loop keeps serving
while a load runs (the load itself runs on the node's load thread). A node that is gone leaves its tasks
unread: they expire (`expires` when sent) and the placement reconciler, which no longer sees the node's
heartbeat, places the replicas elsewhere. Tasks are acknowledged on receipt, not after: a node killed
mid-load must not find the load again when it restarts under its name long after.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import redis
from celery import shared_task

from serving import reconciler

log = logging.getLogger(__name__)

LOAD_DEADLINE_S = 300.0  # a load (reading the artifact, moving it to the device, warm-up) past this has hung
UNLOAD_DEADLINE_S = 60.0  # an unload closes the version's batcher, answering what it still queued
EXPIRES_S = 60.0  # a task no node took within this is dropped: its node is gone, the reconciler re-plans
STUCK_LOOP_S = 10.0  # past a task's deadline, the time its clean-up (a heartbeat) may take before the loop is stuck

_node: tuple[Any, asyncio.AbstractEventLoop] | None = None  # (NodeProcess, its loop) in a runnode process


def queue_for(node: str) -> str:
    return f"node.{node}"


def _on_node(work: Callable[[Any], Coroutine[Any, Any, dict]], deadline: float) -> dict:
    if _node is None:
        raise RuntimeError("no node in this process: node tasks run in `manage.py runnode`, on its own queue")
    process, loop = _node
    # The deadline is kept on the loop (wait_for cancels the work and waits for it to finish), so the work's own
    # clean-up, the heartbeat that shows a load cut off, is done before this returns and the caller clears the
    # reconciler's record. The wait here, a little longer, only gives up on a loop that is stuck.
    future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(work(process), deadline), loop)
    try:
        return future.result(timeout=deadline + STUCK_LOOP_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise


@shared_task(name="serving.node.load", acks_late=False, ignore_result=True)
def load_version(key: str, pending: str = "") -> dict:
    """Load `key` on this node and keep it there until released. `pending` is the reconciler's record of this
    task, removed once the node's heartbeat tells the outcome."""
    try:
        result = _on_node(lambda process: process.assign(key), LOAD_DEADLINE_S)
        log.info("placement: load %s -> %s", key, result)
        return result
    finally:
        if pending:
            reconciler.clear_pending(pending)


@shared_task(name="serving.node.unload", acks_late=False, ignore_result=True)
def unload_version(key: str, unload: bool = True, pending: str = "") -> dict:
    """Release `key` from this node's placement; with `unload`, unload it now (scaled in)."""
    try:
        result = _on_node(lambda process: process.release(key, unload=unload), UNLOAD_DEADLINE_S)
        log.info("placement: %s %s -> %s", "unload" if unload else "release", key, result)
        return result
    finally:
        if pending:
            reconciler.clear_pending(pending)


def send_plan(client: redis.Redis, result: reconciler.Plan, now: float) -> None:
    """Send a reconciler step's loads, unloads and releases to their nodes' queues, each recorded as pending
    in Redis first (`reconciler.PENDING_KEY`): its outcome may come back before the send returns."""
    lapse = now + EXPIRES_S + LOAD_DEADLINE_S
    sends = [(reconciler.Pending("load", n, k), load_version, {}) for n, k in result.loads]
    sends += [(reconciler.Pending("unload", n, k), unload_version, {"unload": True}) for n, k in result.unloads]
    sends += [(reconciler.Pending("unload", n, k), unload_version, {"unload": False}) for n, k in result.releases]
    for pending, task, kwargs in sends:
        client.hset(reconciler.PENDING_KEY, pending.field, lapse)
        task.apply_async(
            args=[pending.key],
            kwargs={**kwargs, "pending": pending.field},
            queue=queue_for(pending.node),
            expires=EXPIRES_S,
        )
        log.info(
            "placement: %s %s on %s", pending.op if kwargs.get("unload", True) else "release", pending.key, pending.node
        )


class NodeWorker:
    """A Celery consumer of this node's queue only, on a thread of its own (pool solo: one task at a time,
    which is what the node's single load thread does anyway)."""

    def __init__(self, process: Any, loop: asyncio.AbstractEventLoop) -> None:
        from config.celery import app

        global _node
        _node = (process, loop)
        self.app = app
        self.name = process.facts.name
        self.worker: Any = None
        self._made = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ferry-node-tasks", daemon=True)

    def _run(self) -> None:
        try:
            # Made on this thread, not the event loop's: the worker's start-up closes Django's database
            # connections, which Django refuses to do from a thread running an event loop.
            self.worker = self.app.WorkController(
                concurrency=1,
                pool="solo",
                hostname=f"{queue_for(self.name)}@{socket.gethostname()}",
                queues=[queue_for(self.name)],
                without_heartbeat=True,
                without_mingle=True,
                without_gossip=True,
                loglevel="INFO",
                logfile=None,
                ready_callback=None,
            )
        finally:
            self._made.set()
        try:
            self.worker.start()
        except Exception:  # the node keeps serving what it hosts; the reconciler sees no assignments land
            log.exception("the node's Celery consumer stopped")

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        global _node
        self._made.wait(timeout)
        if self.worker is not None:
            self.worker.stop(in_sighandler=False)
        self.thread.join(timeout)
        _node = None
