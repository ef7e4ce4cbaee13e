from celery import shared_task


@shared_task(acks_late=True, ignore_result=True)
def record_shadow(batch_id: str, rows: list[dict], samples: list[dict]) -> int:
    """Add one flushed batch of shadow comparison (a data-plane process's flush sends it); safe to run twice."""
    from rollout.shadow_ingest import ingest

    return ingest(batch_id, rows, samples)
