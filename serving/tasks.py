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
