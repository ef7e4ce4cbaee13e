"""What the registry says when a model name is taken.

Model names are global (the data plane routes by name), so a name another tenant uses cannot be given
again; but saying "exists already" for a name the caller cannot see tells it that another tenant has a
private model of that name. So a taken name is named as existing only to the tenants that own it (and
to platform staff, who see every model); to anyone else it answers one sentence, the same whether the
name is another tenant's private or public model or a platform model's (reserved).
"""

from __future__ import annotations

from serving.models import Model
from tenants.scoping import member_tenant_ids


def not_available(name: str) -> str:
    return f"the model name {name!r} is not available; choose another name"


def owns(user: object, model: Model) -> bool:
    """Whether `user` may be told about `model` as its own: staff, or a member of its tenant."""
    if getattr(user, "is_staff", False):
        return True
    return model.tenant_id is not None and model.tenant_id in set(member_tenant_ids(user))


def taken(user: object, name: str) -> str:
    """The refusal for creating (or renaming onto) `name`, which a model uses."""
    existing = Model.objects.filter(name=name).only("pk", "tenant_id").first()
    if existing is not None and owns(user, existing):
        return f"a model named {name!r} exists already"
    return not_available(name)
