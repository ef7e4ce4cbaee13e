"""Old migrations' data steps, run as the migration runs them (with the app registry, on the test database):
tenants/0003's reverse raises nobody (an approver must not become the old top role, operator), and
serving/0012 names the rows that already hold the name it reserves."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.contrib.auth.models import User

from serving.models import Model
from tenants.models import Membership
from tests.conftest import tenant

roles_migration = importlib.import_module("tenants.migrations.0003_roles_quota_audit")
reserved_migration = importlib.import_module("serving.migrations.0012_reserved_names")


@pytest.mark.django_db
def test_the_roles_reverse_gives_no_one_more_than_they_had() -> None:
    # Given one member of each role
    team = tenant("rollback")
    for role in ("viewer", "engineer", "approver", "admin"):
        Membership.objects.create(user=User.objects.create(username=f"rb-{role}"), tenant=team, role=role)
    # When the roles migration is reversed
    roles_migration.backwards(apps, None)
    # Then admin, the old operator, is operator again, and the approver an engineer, not an operator
    now = dict(Membership.objects.filter(tenant=team).values_list("user__username", "role"))
    assert now == {"rb-viewer": "viewer", "rb-engineer": "engineer", "rb-approver": "engineer", "rb-admin": "operator"}


@pytest.mark.django_db
def test_reserving_stats_names_the_model_that_holds_it(capsys) -> None:  # noqa: ANN001
    # Given a model registered as "stats" before the name was reserved (the validator runs on forms, not here)
    Model.objects.create(name="stats", tenant=tenant())
    Model.objects.create(name="digits-stats", tenant=tenant())
    # When the migration's data step runs
    reserved_migration.warn_reserved(apps, None)
    # Then it says which one GET /v2/models/<name> no longer describes, and where its versions are
    out = capsys.readouterr().out
    assert "model 'stats' holds a name the inference protocol now reserves" in out
    assert "/v2/models/stats/versions/<v>" in out
    assert "digits-stats" not in out
