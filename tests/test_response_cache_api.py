"""The registry's opt-in to the response cache: a version's `response_cache`, set by the engineer's PATCH, carried
by the snapshot (also through Redis), and a tenant's `share_response_cache` carried beside its quota."""

from __future__ import annotations

import pytest

from serving.dataplane.gateway import snapshot_redis
from serving.models import ModelVersion
from serving.publish import build_snapshot
from tenants.models import Tenant
from tests.test_api import VERSION, assert_json_error, bob, charlie, people, registry  # noqa: F401

pytestmark = pytest.mark.django_db


def test_an_engineer_opts_a_version_in_and_the_snapshot_carries_it(
    bob,  # noqa: F811 (a fixture)
    registry,  # noqa: F811 (a fixture)
    django_capture_on_commit_callbacks,  # noqa: ANN001
) -> None:
    from serving.dataplane.gateway.snapshot import hub

    # given digits v1, not cached by default
    assert ModelVersion.objects.get(model__name="digits", version=1).response_cache is False
    # when an engineer turns the cache on
    with django_capture_on_commit_callbacks(execute=True):
        response = bob.patch(VERSION, {"response_cache": True}, format="json")
    # then the row, the answer and the republished snapshot say so, and v2 is left alone
    assert response.status_code == 200, response.content
    assert response.json()["response_cache"] is True
    assert ModelVersion.objects.get(model__name="digits", version=1).response_cache is True
    assert hub.current.models["digits"].versions[1].response_cache is True
    assert hub.current.models["digits"].versions[2].response_cache is False
    # and the snapshot through Redis keeps it
    decoded = snapshot_redis.decode(snapshot_redis.encode(build_snapshot()))
    assert decoded.models["digits"].versions[1].response_cache is True


@pytest.mark.parametrize("value", ["true", 1, None])
def test_the_opt_in_takes_a_json_boolean_only(bob, registry, value: object) -> None:  # noqa: ANN001, F811
    assert_json_error(bob.patch(VERSION, {"response_cache": value}, format="json"), 400)
    assert ModelVersion.objects.get(model__name="digits", version=1).response_cache is False


def test_a_viewer_cannot_opt_a_version_in(charlie, registry) -> None:  # noqa: ANN001, F811
    assert_json_error(charlie.patch(VERSION, {"response_cache": True}, format="json"), 403)
    assert ModelVersion.objects.get(model__name="digits", version=1).response_cache is False


def test_a_tenants_sharing_opt_in_is_in_the_snapshot(people) -> None:  # noqa: ANN001, F811
    acme = Tenant.objects.get(slug="acme")
    assert build_snapshot().tenants[acme.pk].share_response_cache is False
    Tenant.objects.filter(pk=acme.pk).update(share_response_cache=True)
    snapshot = snapshot_redis.decode(snapshot_redis.encode(build_snapshot()))
    assert snapshot.tenants[acme.pk].share_response_cache is True
