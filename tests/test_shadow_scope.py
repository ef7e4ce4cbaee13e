"""Who reads a shadow report, and whose traffic it may keep samples of (issue 17, finding 2).

A shadow report shows the inputs and outputs of live requests: only the owning tenant's engineers (approvers,
admins) and platform staff read it, in the API and the console alike; anyone else who sees the model gets a
403, one who does not the 404 of a missing model. Every mirrored request counts in the aggregates, but only
the owner's own requests, or those of a tenant that opted in (`share_shadow_samples`), are kept as samples:
decided by the gateway from the routing snapshot, followed here from the HTTP request to the stored rows."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest
from django.contrib.auth.models import User

from rollout import shadow_compare
from rollout.models import ShadowDisagreement, ShadowMinute
from rollout.routing import RouteTable
from rollout.shadow_ingest import ingest
from serving.actions import set_routing
from serving.dataplane.gateway.shadow import Mirrored, Pair, may_keep_sample
from serving.dataplane.gateway.snapshot import ModelEntry, TenantEntry
from serving.models import Model
from serving.publish import build_snapshot
from tenants.governance import set_shadow_sharing
from tenants.models import AuditEntry, Membership, Role, Tenant
from tests.conftest import LiveServer, mint_key, register, tenant
from tests.test_api import client_for
from tests.test_inference_http import digits_request, infer
from tests.test_shadow import version
from tests.test_shadow_http import permuted_digits, shadow_server, stored_minute  # noqa: F401 (fixtures)

OWNER, GUEST, SHARING = 1, 2, 3


def tenants(*, sharing: bool = True) -> dict[int, TenantEntry]:
    entry = TenantEntry(slug="t", requests_per_second=1.0, burst=1, max_in_flight=1, monthly_requests=1, priority=1)
    return {OWNER: entry, GUEST: entry, SHARING: replace(entry, share_shadow_samples=sharing)}


# -- the rule, and the comparison that applies it (no database) ---------------------------------------------


def test_only_the_owners_traffic_or_an_opted_in_tenants_may_be_kept() -> None:
    owned = ModelEntry("m", "classification", "", None, {}, tenant_id=OWNER, routes=RouteTable(stable=1))
    platform = ModelEntry("p", "classification", "", None, {}, tenant_id=None, routes=RouteTable(stable=1))
    snapshot_tenants = tenants()
    assert may_keep_sample(owned, OWNER, snapshot_tenants)
    assert not may_keep_sample(owned, GUEST, snapshot_tenants)
    assert may_keep_sample(owned, SHARING, snapshot_tenants)
    assert not may_keep_sample(owned, SHARING, tenants(sharing=False))
    assert not may_keep_sample(owned, None, snapshot_tenants)  # no tenant: nobody vouched for it
    assert not may_keep_sample(owned, 99, snapshot_tenants)  # a tenant the snapshot does not know
    # a platform model has no owning tenant: only opted-in tenants' traffic
    assert not may_keep_sample(platform, OWNER, snapshot_tenants) and may_keep_sample(
        platform, SHARING, snapshot_tenants
    )


def mirrored_pair(first: int, rows: int, *, keep_sample: bool) -> Pair:
    """A pair whose rows all disagree (the shadow's classes rolled by one), its inputs numbered from `first`."""
    eye = np.eye(10, dtype=np.float32)
    inputs = {"input": np.arange(first * 64, (first + rows) * 64, dtype=np.float32).reshape(rows, 64)}
    item = Mirrored(
        "classification",
        version(1),
        version(2),
        inputs,
        rows,
        100,
        {"scores": eye[:rows]},
        0.002,
        0.0,
        1.0,
        6000.0,
        keep_sample,
    )
    return Pair(item, {"scores": np.roll(eye[:rows], 1, axis=1)}, 200, 0.004)


def test_foreign_pairs_count_in_the_aggregates_and_leave_no_sample() -> None:
    # given a flush of two foreign requests, an owner's, and a foreign request whose shadow failed
    foreign = [mirrored_pair(0, 3, keep_sample=False), mirrored_pair(10, 2, keep_sample=False)]
    own = mirrored_pair(20, 2, keep_sample=True)
    failed = Pair(mirrored_pair(30, 1, keep_sample=False).item, None, 422, 0.0, "model failed")
    rows, samples = shadow_compare.aggregate([foreign[0], own, foreign[1], failed])
    # then all of them count, rows compared, agreement, errors and latency alike
    (row,) = rows
    assert (row["mirrored"], row["compared"], row["agreed"], row["shadow_errors"]) == (4, 7, 0, 1)
    assert sum(row["primary_latency"].values()) == 3
    # and only the owner's two rows are samples, with the owner's own inputs
    assert [s["inputs"]["input"][0] for s in samples] == [20 * 64.0, 21 * 64.0]


# -- reading the report ------------------------------------------------------------------------------------


@pytest.fixture
def people(transactional_db, model_files) -> dict[str, User]:  # noqa: ANN001
    acme, other = tenant("acme"), tenant("other")
    users = {}
    for name, t, role in [
        ("viewer", acme, Role.VIEWER),
        ("eng", acme, Role.ENGINEER),
        ("approver", acme, Role.APPROVER),
        ("admin", acme, Role.ADMIN),
        ("outsider", other, Role.VIEWER),
        ("outside-eng", other, Role.ENGINEER),
        ("other-admin", other, Role.ADMIN),
    ]:
        users[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=users[name], tenant=t, role=role)
    users["staff"] = User.objects.create_user("staff", "staff@example.org", is_staff=True)
    for _ in range(2):
        register(model_files.digits, "acme-digits", owner=acme, visibility="public", max_batch_size=4)
    register(model_files.digits, "acme-private", owner=acme, visibility="private", max_batch_size=4)
    register(model_files.digits, "platform-digits", owner=None, visibility="public", max_batch_size=4)
    now = int(time.time() // 60)
    sample = {
        "model": "acme-digits",
        "baseline": 1,
        "candidate": 2,
        "at": time.time(),
        "summary": "class 3 vs 4",
        "difference": 0.9,
        "inputs": {"input": [7.0] * 64},
        "output": "scores",
        "primary": [0.0] * 10,
        "shadow": [1.0] * 10,
    }
    ingest("scope", [stored_minute(2, 9, 10, now - 1)], [sample])
    return users


READERS = ("eng", "approver", "admin", "staff")
REFUSED = ("viewer", "outsider", "outside-eng")  # they see the public model, not its report


@pytest.mark.parametrize("who", READERS + REFUSED)
def test_the_owners_engineers_and_approvers_read_the_report_others_are_refused(people, who: str) -> None:  # noqa: ANN001
    client = client_for(people[who])
    api = client.get("/api/models/acme-digits/shadow/?candidate=2")
    console = client.get("/console/models/acme-digits/shadow/?candidate=2")
    page = client.get("/console/models/acme-digits/")
    assert page.status_code == 200  # every one of them sees the model itself
    if who in READERS:
        assert api.status_code == 200, api.content
        assert api.json()["disagreements"][0]["inputs"] == {"input": [7.0] * 64}
        assert console.status_code == 200 and b"class 3 vs 4" in console.content
        assert b"shadow-link" in page.content
    else:
        # the same refusal in both, naming the role; nothing of the report (the sample's inputs) in either
        assert api.status_code == 403, api.content
        assert "engineer role in the tenant that owns the model" in api.json()["error"]
        assert console.status_code == 403 and b"class 3 vs 4" not in console.content
        assert b"shadow-link" not in page.content and b"/shadow/" not in page.content


def test_a_model_the_caller_does_not_see_is_a_404_and_a_platform_models_report_is_staffs(people) -> None:  # noqa: ANN001
    outsider = client_for(people["outside-eng"])
    missing = outsider.get("/api/models/no-such-model/shadow/?candidate=2")
    private = outsider.get("/api/models/acme-private/shadow/?candidate=2")
    assert private.status_code == missing.status_code == 404
    assert private.json() == {
        **missing.json(),
        "error": missing.json()["error"].replace("no-such-model", "acme-private"),
    }
    assert outsider.get("/console/models/acme-private/shadow/").status_code == 404
    # a platform model has no owning tenant: its report is platform staff's
    for who, status in (("eng", 403), ("admin", 403), ("staff", 200)):
        client = client_for(people[who])
        assert client.get("/api/models/platform-digits/shadow/?candidate=1").status_code == status, who
        assert client.get("/console/models/platform-digits/shadow/").status_code == status, who


# -- the tenant's opt-in -----------------------------------------------------------------------------------


def test_the_tenants_admin_sets_the_opt_in_by_api_and_it_is_audited_and_published(people) -> None:  # noqa: ANN001
    acme = Tenant.objects.get(slug="acme")
    assert client_for(people["viewer"]).get("/api/tenants/acme/").json()["share_shadow_samples"] is False
    # others may not: an engineer (403, before the body is read), another tenant's admin (404)
    for who, status in (("eng", 403), ("other-admin", 404)):
        response = client_for(people[who]).patch("/api/tenants/acme/", {"share_shadow_samples": True}, format="json")
        assert response.status_code == status, (who, response.content)
    # a body that is not a JSON boolean, or names another setting, is a 400 naming the field
    admin = client_for(people["admin"])
    for body, field in (({"share_shadow_samples": "true"}, "share_shadow_samples"), ({"name": "x"}, "name")):
        response = admin.patch("/api/tenants/acme/", body, format="json")
        assert response.status_code == 400 and field in response.json()["fields"], response.content
    acme.refresh_from_db()
    assert not acme.share_shadow_samples and not AuditEntry.objects.filter(action="tenant.shadow_samples").exists()
    # the admin turns it on: audited, and in the next routing snapshot
    response = admin.patch("/api/tenants/acme/", {"share_shadow_samples": True}, format="json")
    assert response.status_code == 200 and response.json()["share_shadow_samples"] is True, response.content
    entry = AuditEntry.objects.get(action="tenant.shadow_samples")
    assert (entry.actor_name, entry.tenant_id) == ("admin", acme.pk)
    assert (entry.before, entry.after) == ({"share_shadow_samples": False}, {"share_shadow_samples": True})
    assert build_snapshot().tenants[acme.pk].share_shadow_samples
    # setting what is already set changes nothing and writes no entry
    assert admin.patch("/api/tenants/acme/", {"share_shadow_samples": True}, format="json").status_code == 200
    assert AuditEntry.objects.filter(action="tenant.shadow_samples").count() == 1


def test_the_tenants_admin_sets_the_opt_in_in_the_console(people) -> None:  # noqa: ANN001
    form = {"action": "shadow_samples", "share_shadow_samples": "on"}
    # a viewer reads the setting, has no form, and a POST is refused
    viewer = client_for(people["viewer"])
    page = viewer.get("/console/tenants/acme/")
    assert b"do not keep" in page.content and b'name="share_shadow_samples"' not in page.content
    assert viewer.post("/console/tenants/acme/", form).status_code == 403
    # the admin turns it on, then off (an unchecked box is not sent)
    admin = client_for(people["admin"])
    assert b'name="share_shadow_samples"' in admin.get("/console/tenants/acme/").content
    assert admin.post("/console/tenants/acme/", form).status_code == 302
    assert Tenant.objects.get(slug="acme").share_shadow_samples
    assert b"checked" in admin.get("/console/tenants/acme/").content
    assert admin.post("/console/tenants/acme/", {"action": "shadow_samples"}).status_code == 302
    assert not Tenant.objects.get(slug="acme").share_shadow_samples
    assert [e.after for e in AuditEntry.objects.filter(action="tenant.shadow_samples").order_by("pk")] == [
        {"share_shadow_samples": True},
        {"share_shadow_samples": False},
    ]


# -- end to end: the requesting tenant travels from the HTTP request to the stored rows -----------------------


def send_and_flush(server: LiveServer, requests: list[tuple[np.ndarray, str | None]]) -> None:
    """Send each (image, token) as one request, wait until every mirror has been answered, then flush."""
    plane = server.plane()
    for image, token in requests:
        resp = infer(server, "shadowed", digits_request(image[None, :]), auth=token if token else server.key)
        assert resp.status == 200, resp.body
    deadline = time.monotonic() + 60
    while len(plane.mirror.pairs) < len(requests):
        assert time.monotonic() < deadline, f"{len(plane.mirror.pairs)} of {len(requests)} mirrors answered"
        time.sleep(0.02)
    sent = asyncio.run_coroutine_threadsafe(plane.flush_shadow(), plane.loop).result(timeout=60)
    assert sent == len(requests)


def kept_inputs() -> list[list[float]]:
    return [d.inputs["input"] for d in ShadowDisagreement.objects.filter(model_name="shadowed", candidate=3)]


def test_another_tenants_traffic_counts_but_is_kept_only_once_it_opts_in(shadow_server, digits_samples) -> None:  # noqa: ANN001, F811
    images, _ = digits_samples
    images = images[np.unique(images, axis=0, return_index=True)[1]]  # each input tells its request apart
    # given the test tenant's public model shadowed at 100% by a version that disagrees on every row, and a
    # guest tenant with a key of its own
    guest_key = mint_key("guest", scopes=("infer",))
    set_routing(model=Model.objects.get(name="shadowed"), shadow_version=3, shadow_fraction=1.0)
    shadow_server.refresh()
    # when the guest's requests and the owner's are mirrored in one flush
    guests, owners = images[:6], images[6:9]
    send_and_flush(
        shadow_server,
        [
            (guests[0], guest_key),
            (owners[0], None),
            (guests[1], guest_key),
            (guests[2], guest_key),
            (owners[1], None),
            (guests[3], guest_key),
            (guests[4], guest_key),
            (owners[2], None),
            (guests[5], guest_key),
        ],
    )
    # then all nine count in the aggregates, and only the owner's three are kept, with the owner's inputs
    totals = ShadowMinute.objects.filter(model_name="shadowed", candidate=3)
    assert sum(m.mirrored for m in totals) == sum(m.compared for m in totals) == 9
    assert sum(m.agreed for m in totals) == 0
    assert sorted(kept_inputs()) == sorted(owners.tolist())

    # given the guest opts in (its admin's change republishes the snapshot)
    set_shadow_sharing(tenant=tenant("guest"), share=True, actor=None)
    shadow_server.refresh()
    assert shadow_server.plane().gateway.hub.current.tenants[tenant("guest").pk].share_shadow_samples
    # when it sends two more
    opted = images[9:11]
    send_and_flush(shadow_server, [(opted[0], guest_key), (opted[1], guest_key)])
    # then they are kept as well, and the earlier ones still are not
    assert sorted(kept_inputs()) == sorted([*owners.tolist(), *opted.tolist()])
    assert not set(map(tuple, guests.tolist())) & set(map(tuple, kept_inputs()))
