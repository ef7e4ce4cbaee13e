import os

from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("ferry")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.celeryd_init.connect
def check_sandbox(conf: object = None, options: dict | None = None, **kwargs: object) -> None:
    """`celery worker` (not beat, and not a node's own consumer, which runnode checks): the worker inspects
    every registered artifact in a sandboxed runtime process, so where the sandbox's walls cannot be built it
    would refuse every validation while it looked healthy. Build them once here (sandbox.self_check) and exit
    1, saying why, where they cannot be, unless FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX allows it. SystemExit,
    because Celery logs and ignores an Exception raised by a signal's receiver. A worker of other queues only
    (-Q without the default queue, where validation runs: the autoscaler's) runs no model and is not checked."""
    queues = (options or {}).get("queues")
    if queues and getattr(conf, "task_default_queue", "celery") not in queues:
        return
    # Imported here: this module is imported while Django's settings load (config/__init__.py), before the
    # apps the runtime's modules need are ready.
    from django.conf import settings

    from serving.dataplane.node import runtime_process, sandbox

    if settings.FERRY_RUNTIME_ISOLATION == "inline":
        return
    try:
        sandbox.self_check(
            hidden=runtime_process.hidden_paths(),
            project_root=runtime_process.PROJECT_ROOT,
            device="cpu",  # validation inspects on the CPU (runtime_process.inspect_operators)
            required=not settings.FERRY_RUNTIME_ALLOW_PARTIAL_SANDBOX,
            timeout_s=settings.FERRY_RUNTIME_START_TIMEOUT_S,
        )
    except sandbox.ConfinementError as exc:
        raise SystemExit(
            f"ferry worker: the model sandbox cannot be built on this machine, so every validation would fail:"
            f" {exc}. {sandbox.REQUIREMENT}"
        ) from None
