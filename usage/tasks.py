from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from usage.ingest import ingest
from usage.models import UsageBatch, UsageMinute


@shared_task(acks_late=True, ignore_result=True)
def record_usage(batch_id: str, rows: list[dict]) -> int:
    """Add one drained batch of usage (a data-plane process's flusher sends it); safe to run twice."""
    return ingest(batch_id, rows)


@shared_task(ignore_result=True)
def prune_usage() -> tuple[int, int]:
    """Delete usage older than FERRY_USAGE_RETENTION_DAYS, and batch ids older than FERRY_USAGE_BATCH_DAYS
    (a task retried later than that would be added twice)."""
    now = timezone.now()
    usage_cutoff = now - timedelta(days=settings.FERRY_USAGE_RETENTION_DAYS)
    batch_cutoff = now - timedelta(days=settings.FERRY_USAGE_BATCH_DAYS)
    minutes, _ = UsageMinute.objects.filter(minute__lt=usage_cutoff).delete()
    batches, _ = UsageBatch.objects.filter(recorded_at__lt=batch_cutoff).delete()
    return minutes, batches
