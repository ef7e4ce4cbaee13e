from celery import shared_task


@shared_task(acks_late=True)
def validate_version(version_id: int) -> str:
    from serving.models import ModelVersion
    from serving.validation import validate

    version = ModelVersion.objects.select_related("model").get(pk=version_id)
    return validate(version).state


@shared_task(ignore_result=True)
def publish_routing_snapshot() -> int:
    """Periodic repair: republish so a gateway that missed an announcement converges."""
    from serving.publish import publish_snapshot

    return publish_snapshot().serial


@shared_task(ignore_result=True)
def reconcile_placements() -> dict:
    """One placement reconciler step (beat, and on a change of a version's desired replicas)."""
    from serving.reconciler import reconcile

    outcome = reconcile()
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


@shared_task(ignore_result=True)
def record_placement(report: dict) -> None:
    """A node's measurements after a load (footprint and cold start on its accelerator type), or why a version
    can never fit it: sent by `manage.py runnode`, which cannot reach the registry itself."""
    from serving.dataplane.node.packing import LoadReport
    from serving.wiring import write_placement

    write_placement(LoadReport(**report))
