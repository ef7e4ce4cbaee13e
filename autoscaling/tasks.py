from celery import shared_task

from autoscaling.provider_settings import provider_from_settings
from autoscaling.tick import run_tick
from serving.tasks import request_reconcile


# Ends before the tick's lock (tick.LOCK_SECONDS, 60 s) could lapse; a local provider starting nodes is the slow part.
@shared_task(ignore_result=True, soft_time_limit=45, time_limit=55)
def autoscale() -> dict | None:
    """One autoscaler tick (Celery beat, every FERRY_AUTOSCALE_SECONDS); what changed, for the worker's log."""
    # desired_replicas is written with update() (no signal), so the reconciler is asked here.
    report = run_tick(provider=provider_from_settings(), after_change=request_reconcile)
    if report is None:
        return None
    decisions = report.plan.decisions if report.plan else {}
    return {
        "changed": {k: list(v) for k, v in report.changed.items()},
        "decided": {k: [d.replicas, d.reason, round(d.demand, 2)] for k, d in decisions.items()},
        "nodes": report.nodes,
        "skipped": report.skipped,
        "provider_error": report.provider_error,
    }
