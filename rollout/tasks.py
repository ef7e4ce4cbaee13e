import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def evaluate_rollouts() -> dict[int, str]:
    """Evaluate every active rollout once (Celery beat runs this every FERRY_ROLLOUT_EVALUATE_SECONDS; the
    embedded process's loop does in embedded mode). One rollout's failure does not stop the others."""
    from rollout.transitions import active_ids, evaluate

    states = {}
    for rollout_id in active_ids():
        try:
            states[rollout_id] = evaluate(rollout_id).state
        except Exception:
            log.exception("evaluating rollout #%s failed", rollout_id)
            states[rollout_id] = "error"
    return states


@shared_task(acks_late=True, ignore_result=True)
def record_shadow(batch_id: str, rows: list[dict], samples: list[dict]) -> int:
    """Add one flushed batch of shadow comparison (a data-plane process's flush sends it); safe to run twice."""
    from rollout.shadow_ingest import ingest

    return ingest(batch_id, rows, samples)
