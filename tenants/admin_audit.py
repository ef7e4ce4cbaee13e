"""The audit log for changes made in Django's /admin/: the same `tenants.audit.record` entries the API and the
console write (who, the action, the object, before and after), so a change made by platform staff in the admin
is as visible in the log as one made through the API.

`AuditedAdmin` is mixed into a ModelAdmin (before `admin.ModelAdmin`). It records `<audit_name>.create` with the
new object's fields, `<audit_name>.change` with the fields the form changed (before and after), and
`<audit_name>.delete` with the object's state, for the delete page and the changelist's bulk "delete selected"
action alike. Fields an admin records under an action of its own (e.g. `model.rename`, `key.revoke`) are listed
in `audit_elsewhere`, so a change is not logged twice. Everything is written in the transaction of the change.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from django.core.exceptions import FieldDoesNotExist
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.forms import BaseModelFormSet, ModelForm
from django.http import HttpRequest

from tenants import audit
from tenants.models import Tenant


def as_json(value: object) -> object:
    """`value` as the audit log's JSON keeps it: a related object by its primary key, a list of them sorted,
    datetimes and decimals as DjangoJSONEncoder writes them."""
    if isinstance(value, models.Model):
        return as_json(value.pk)
    if isinstance(value, (list, tuple, set, frozenset)) and value and isinstance(next(iter(value)), models.Model):
        return sorted(value_.pk for value_ in value)
    return json.loads(json.dumps(value, cls=DjangoJSONEncoder))


def model_fields(obj: models.Model, names: Iterable[str]) -> list[str]:
    """Those of `names` that are fields of `obj`'s model (a form may have others)."""
    kept = []
    for name in names:
        try:
            obj._meta.get_field(name)
        except FieldDoesNotExist:
            continue
        kept.append(name)
    return kept


def values(obj: models.Model, names: Iterable[str]) -> dict[str, object]:
    """`obj`'s fields `names`, now (many-to-many ones read from the database)."""
    return {name: as_json(obj._meta.get_field(name).value_from_object(obj)) for name in names}


def changes(form: ModelForm, skip: Iterable[str] = ()) -> tuple[dict, dict]:
    """What a bound, saved `form` changed, as (before, after): the values it was built from (the object as the
    request found it) and the object's now, for the fields it changed that are not in `skip` and whose stored
    value differs."""
    names = [n for n in model_fields(form.instance, form.changed_data) if n not in set(skip)]
    before = {n: as_json(form.initial.get(n)) for n in names}
    after = values(form.instance, names)
    differ = [n for n in names if before[n] != after[n]]
    return {n: before[n] for n in differ}, {n: after[n] for n in differ}


class AuditedAdmin:
    """Audits the admin's creates, changes and deletes of its model (see the module's docstring). Set
    `audit_name`, and override `audit_target` and `audit_tenant` (and `audit_state` for what a delete keeps:
    by default every concrete field) to name the object as the API's entries do."""

    audit_name = ""
    audit_elsewhere: tuple[str, ...] = ()

    def audit_target(self, obj: Any) -> str:
        return f"{self.audit_name} {obj}"

    def audit_tenant(self, obj: Any) -> Tenant | None:
        return None

    def audit_state(self, obj: Any) -> dict:
        return values(obj, [f.name for f in obj._meta.concrete_fields])

    def save_related(self, request: HttpRequest, form: ModelForm, formsets: list, change: bool) -> None:
        # Here, not in save_model: many-to-many fields are saved by save_related.
        super().save_related(request, form, formsets, change)  # type: ignore[misc]
        obj = form.instance
        if not change:
            after = values(obj, model_fields(obj, form.fields))
            audit.record(
                request.user,
                f"{self.audit_name}.create",
                self.audit_target(obj),
                tenant=self.audit_tenant(obj),
                after=after,
            )
            return
        before, after = changes(form, self.audit_elsewhere)
        if after:
            audit.record(
                request.user,
                f"{self.audit_name}.change",
                self.audit_target(obj),
                tenant=self.audit_tenant(obj),
                before=before,
                after=after,
            )

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        with transaction.atomic():
            self.audit_delete(request, obj)
            super().delete_model(request, obj)  # type: ignore[misc]

    def delete_queryset(self, request: HttpRequest, queryset: models.QuerySet) -> None:
        """The changelist's "delete selected" action: one entry per object. Its own transaction: the action's
        view, unlike the delete page, runs in none."""
        with transaction.atomic():
            for obj in queryset:
                self.audit_delete(request, obj)
            super().delete_queryset(request, queryset)  # type: ignore[misc]

    def audit_delete(self, request: HttpRequest, obj: Any) -> None:
        audit.record(
            request.user,
            f"{self.audit_name}.delete",
            self.audit_target(obj),
            tenant=self.audit_tenant(obj),
            before=self.audit_state(obj),
        )

    def audit_formset(
        self,
        request: HttpRequest,
        formset: BaseModelFormSet,
        name: str,
        target: Callable[[Any], str],
        tenant: Callable[[Any], Tenant | None],
    ) -> None:
        """Audit what a saved inline `formset` created, changed and deleted, as `<name>.create` (and so on)
        naming each object by `target`."""
        forms = {id(f.instance): f for f in formset.initial_forms}
        for obj in formset.new_objects:
            after = values(obj, model_fields(obj, formset.form.base_fields))
            audit.record(request.user, f"{name}.create", target(obj), tenant=tenant(obj), after=after)
        for obj, _ in formset.changed_objects:
            before, after = changes(forms[id(obj)])
            if after:
                audit.record(
                    request.user, f"{name}.change", target(obj), tenant=tenant(obj), before=before, after=after
                )
        for obj in formset.deleted_objects:  # deleted by now: its form's initial values are what it was
            before = {n: as_json(v) for n, v in forms[id(obj)].initial.items()}
            audit.record(request.user, f"{name}.delete", target(obj), tenant=tenant(obj), before=before)
