"""The registry's Celery tasks, and the calls that queue them.

Tasks import the domain (validation, publishing, the reconciler, the wiring's writers); the domain never
imports tasks. A caller that wants work queued calls one of the functions here (`register_and_validate`,
`request_reconcile`), so the dependency stays one way and readable from each file's imports.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import transaction

from serving import node_tasks
from serving.actions import register_version
from serving.dataplane.node.packing import LoadReport
from serving.models import ModelVersion
from serving.publish import publish_snapshot
from serving.reconciler import reconcile
from serving.validation import validate
from serving.wiring import write_placement


@shared_task(acks_late=True)
def validate_version(version_id: int) -> str:
    version = ModelVersion.objects.select_related("model").get(pk=version_id)
    return validate(version).state


def register_and_validate(**kwargs: Any) -> ModelVersion:
    """`serving.actions.register_version`, then its validation queued after the transaction commits (run
    inline there when Celery runs eagerly, as in embedded mode)."""
    version = register_version(validate="none", **kwargs)
    transaction.on_commit(lambda: validate_version.delay(version.pk))
    return version


@shared_task(ignore_result=True)
def publish_routing_snapshot() -> int:
    """Periodic repair: republish so a gateway that missed an announcement converges."""
    return publish_snapshot().serial


@shared_task(ignore_result=True)
def reconcile_placements() -> dict:
    """One placement reconciler step (beat, and on a change of a version's desired replicas)."""
    outcome = reconcile(send=node_tasks.send_plan)
    if outcome.plan is None:
        return {"skipped": outcome.skipped}
    plan = outcome.plan
    return {
        "nodes": outcome.nodes,
        "loads": len(plan.loads),
        "unloads": len(plan.unloads),
        "releases": len(plan.releases),
        "unschedulable": sorted(plan.unschedulable),
    }


def request_reconcile() -> None:
    """Ask for a reconciler step soon (a version's desired state changed): queued on the broker, never run
    inline (embedded mode, with Celery eager and no Redis, has no fleet to place on)."""
    if settings.REDIS_URL and not settings.CELERY_TASK_ALWAYS_EAGER:
        reconcile_placements.delay()


@shared_task(ignore_result=True)
def record_placement(report: dict) -> None:
    """A node's measurements after a load (footprint and cold start on its accelerator type), or why a version
    can never fit it: sent by `manage.py runnode`, which cannot reach the registry itself."""
    write_placement(LoadReport(**report))
