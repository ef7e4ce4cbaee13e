"""Registry, API key, tenant and quota changes republish the routing snapshot once the transaction commits."""

from django.db import transaction
from django.db.models.signals import m2m_changed, post_delete, post_init, post_save
from django.dispatch import receiver
from django.utils import timezone

from serving.models import Model, ModelVersion, Pipeline, PipelineVersion
from tenants.models import ApiKey, Quota, Tenant


@receiver(post_save, sender=ModelVersion)
@receiver(post_delete, sender=ModelVersion)
@receiver(post_save, sender=Model)
@receiver(post_delete, sender=Model)
@receiver(post_save, sender=ApiKey)
@receiver(post_delete, sender=ApiKey)
@receiver(post_delete, sender=Tenant)
@receiver(post_save, sender=Tenant)  # its share_shadow_samples travels in the snapshot
@receiver(post_save, sender=Quota)
@receiver(post_save, sender=PipelineVersion)
@receiver(post_save, sender=Pipeline)
@receiver(post_delete, sender=Pipeline)
def registry_changed(**_: object) -> None:
    from serving.publish import publish_snapshot

    transaction.on_commit(publish_snapshot)


@receiver(m2m_changed, sender=Model.shared_with.through)
def sharing_changed(instance: object, action: str, reverse: bool, pk_set: set | None, **_: object) -> None:
    """A model's shared_with changed: touch the model's updated_at, so another process's refresh
    fingerprint notices, and republish here."""
    if action not in ("post_add", "post_remove", "post_clear"):
        return
    if not reverse:
        Model.objects.filter(pk=instance.pk).update(updated_at=timezone.now())  # type: ignore[attr-defined]
    elif pk_set:
        Model.objects.filter(pk__in=pk_set).update(updated_at=timezone.now())
    registry_changed()


# What the placement reconciler acts on: a change to any of it asks for a reconciler step after the commit.
_PLACED_BY = ("min_replicas", "desired_replicas", "state", "loaded", "min_memory_bytes", "accelerators", "pinned")


@receiver(post_init, sender=ModelVersion)
def _remember_placement(instance: ModelVersion, **_: object) -> None:
    instance._placed_by = tuple(getattr(instance, f, None) for f in _PLACED_BY)  # type: ignore[attr-defined]


@receiver(post_save, sender=ModelVersion)
def placement_changed(instance: ModelVersion, created: bool, **_: object) -> None:
    now = tuple(getattr(instance, f, None) for f in _PLACED_BY)
    if created or now != getattr(instance, "_placed_by", None):
        instance._placed_by = now  # type: ignore[attr-defined]
        from serving.tasks import request_reconcile  # noqa: PLC0415 (tasks import the models this module watches)

        transaction.on_commit(request_reconcile)
