"""Which models' fallbacks a caller may be told about.

A model's fallback names another model, and that one need not be visible to everyone who sees the
first: a public model's fallback may be a private model of its own tenant, or one shared with it that
was unshared since. Its name is another tenant's business, so where a caller may not see the fallback,
the API answers `fallback: null` with `fallback_hidden: true`, and the console says "hidden".
"""

from __future__ import annotations

from collections.abc import Iterable

from serving.models import Model
from tenants.scoping import visible_models


def hidden_fallbacks(user: object, models: Iterable[Model]) -> set[int]:
    """The pks of those `models` whose fallback `user` may not see (one query)."""
    models = list(models)
    ids = {m.fallback_id for m in models if m.fallback_id is not None}
    if not ids:
        return set()
    seen = set(visible_models(user).filter(pk__in=ids).values_list("pk", flat=True))
    return {m.pk for m in models if m.fallback_id is not None and m.fallback_id not in seen}
