"""A policy turned off or deleted, by any path (the admin, `manage.py autoscale_version --off`, the ORM), hands its
version back to min_replicas: 0018's "turning a policy off clears desired_replicas" held for the command only, and
a version scaled out by a policy unchecked in the admin stayed scaled out."""

from django.db import transaction
from django.db.models.signals import post_delete, post_init, post_save
from django.dispatch import receiver

from autoscaling.models import ScalingPolicy
from serving.tasks import request_reconcile


@receiver(post_init, sender=ScalingPolicy)
def _remember_enabled(instance: ScalingPolicy, **_: object) -> None:
    instance._was_enabled = instance.enabled  # type: ignore[attr-defined]


@receiver(post_save, sender=ScalingPolicy)
def _turned_off(instance: ScalingPolicy, created: bool, **_: object) -> None:
    was = instance._was_enabled  # type: ignore[attr-defined]
    instance._was_enabled = instance.enabled  # type: ignore[attr-defined]
    if was and not instance.enabled and not created:  # a policy created off never asked for anything
        _release(instance)


@receiver(post_delete, sender=ScalingPolicy)
def _deleted(instance: ScalingPolicy, **_: object) -> None:
    if instance._was_enabled:  # type: ignore[attr-defined]
        _release(instance)


def _release(policy: ScalingPolicy) -> None:
    # desired_replicas is written with update() (no signal), so the reconciler is asked here.
    if policy.release():
        transaction.on_commit(request_reconcile)
