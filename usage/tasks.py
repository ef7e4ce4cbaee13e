from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from usage.ingest import ingest
from usage.models import UsageBatch, UsageMinute


# Acked after it runs, and handed back if its worker process dies (a SIGKILL, the OOM killer) rather than acked
# and lost: ingest() keeps each batch id once, so running it again adds nothing twice. One batch is one transaction.
@shared_task(acks_late=True, reject_on_worker_lost=True, ignore_result=True, soft_time_limit=60, time_limit=90)
def record_usage(batch_id: str, rows: list[dict]) -> int:
    """Add one drained batch of usage (a data-plane process's flusher sends it); safe to run twice."""
    return ingest(batch_id, rows)


@shared_task(ignore_result=True, soft_time_limit=600, time_limit=660)  # hourly bulk deletes
def prune_usage() -> tuple[int, int]:
    """Delete usage older than FERRY_USAGE_RETENTION_DAYS, and batch ids older than FERRY_USAGE_BATCH_DAYS
    (a task retried later than that would be added twice)."""
    now = timezone.now()
    usage_cutoff = now - timedelta(days=settings.FERRY_USAGE_RETENTION_DAYS)
    batch_cutoff = now - timedelta(days=settings.FERRY_USAGE_BATCH_DAYS)
    minutes, _ = UsageMinute.objects.filter(minute__lt=usage_cutoff).delete()
    batches, _ = UsageBatch.objects.filter(recorded_at__lt=batch_cutoff).delete()
    return minutes, batches
