import logging
from datetime import timedelta

from celery import shared_task
from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.utils import timezone

from rollout.models import ShadowBatch, ShadowDisagreement, ShadowMinute
from rollout.shadow_ingest import ingest
from rollout.transitions import active_ids, evaluate

log = logging.getLogger(__name__)


@shared_task(ignore_result=True, soft_time_limit=60, time_limit=90)  # a few queries a rollout
def evaluate_rollouts() -> dict[int, str]:
    """Evaluate every active rollout once (Celery beat runs this every FERRY_ROLLOUT_EVALUATE_SECONDS; the
    embedded process's loop does in embedded mode). One rollout's failure does not stop the others."""
    states = {}
    for rollout_id in active_ids():
        try:
            states[rollout_id] = evaluate(rollout_id).state
        except SoftTimeLimitExceeded:
            raise  # the task's time is up: stop here, not at the hard limit's kill after the next rollouts
        except Exception:
            log.exception("evaluating rollout #%s failed", rollout_id)
            states[rollout_id] = "error"
    return states


# As usage.tasks.record_usage: handed back, not lost, when its worker process dies; ingest() is idempotent.
@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True, soft_time_limit=60, time_limit=90)
def record_shadow(batch_id: str, rows: list[dict], samples: list[dict]) -> int:
    """Add one flushed batch of shadow comparison (a data-plane process's flush sends it); safe to run twice."""
    return ingest(batch_id, rows, samples)


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)  # hourly bulk deletes
def prune_shadow() -> tuple[int, int, int]:
    """Delete shadow comparisons and disagreements older than FERRY_SHADOW_RETENTION_DAYS, and batch ids older
    than FERRY_USAGE_BATCH_DAYS (a flush retried later than that would be added twice)."""
    now = timezone.now()
    cutoff = now - timedelta(days=settings.FERRY_SHADOW_RETENTION_DAYS)
    minutes, _ = ShadowMinute.objects.filter(minute__lt=cutoff).delete()
    samples, _ = ShadowDisagreement.objects.filter(at__lt=cutoff).delete()
    batches, _ = ShadowBatch.objects.filter(
        recorded_at__lt=now - timedelta(days=settings.FERRY_USAGE_BATCH_DAYS)
    ).delete()
    return minutes, samples, batches
