"""Registry changes republish the routing snapshot once the transaction commits."""

from django.db import transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from serving.models import Model, ModelVersion


@receiver(post_save, sender=ModelVersion)
@receiver(post_delete, sender=ModelVersion)
@receiver(post_save, sender=Model)
@receiver(post_delete, sender=Model)
def registry_changed(**_: object) -> None:
    from serving.snapshot import publish_snapshot

    transaction.on_commit(publish_snapshot)
