"""The tenant's promotion policy (issue 17, finding 6): under "approval required" (the default) every change of
a model's stable version goes through an approval, a rollout's or an accepted promotion request's, and traffic
set by hand gives an unapproved version no more than a running rollout does; under "engineers may promote"
engineers promote directly. Only platform staff change the policy, audited.

On PostgreSQL, through the real API, console views, command and actions.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.test import Client

from rollout import promotion, transitions
from rollout.models import PromotionRequest, PromotionState, RolloutState
from serving.actions import RegistrationError, register_version, set_routing
from serving.actions import promote as promote_version
from serving.models import Model
from serving.validation import validate
from tenants.models import AuditEntry, Membership, PromotionPolicy, Role
from tests.conftest import DIGITS_IO, engineers_may_promote, register, tenant
from tests.test_api import client_for
from tests.test_rollouts import LIMITS


@pytest.fixture
def people(db):  # noqa: ANN001, ANN201
    acme, other = tenant("acme"), tenant("other")
    users = {}
    for name, t, role in [
        ("eng", acme, Role.ENGINEER),
        ("approver", acme, Role.APPROVER),
        ("approver2", acme, Role.APPROVER),
        ("admin", acme, Role.ADMIN),
        ("viewer", acme, Role.VIEWER),
        ("outsider", other, Role.ADMIN),
    ]:
        users[name] = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=users[name], tenant=t, role=role)
    users["staff"] = User.objects.create_user("staff", "staff@example.org", is_staff=True)
    return users


@pytest.fixture
def model(people, model_files) -> Model:  # noqa: ANN001
    """`guarded` of tenant acme (approval required, the default), private: version 1 stable, 2 ready."""
    acme = tenant("acme")
    assert acme.promotion_policy == PromotionPolicy.APPROVAL
    register(model_files.digits, "guarded", owner=acme, visibility="private", max_batch_size=2)
    register(model_files.digits, "guarded", owner=acme, visibility="private", max_batch_size=2)
    m = Model.objects.get(name="guarded")
    assert m.stable_version == 1
    return m


def stable() -> int | None:
    return Model.objects.get(name="guarded").stable_version


def promote_api(user: User, version: int = 2, **body: object):  # noqa: ANN201
    return client_for(user).post(f"/api/models/guarded/versions/{version}/promote/", body, format="json")


# -- the review's walk-around --------------------------------------------------------------------------


def test_cancelling_an_approved_rollout_then_promoting_directly_changes_nothing(people, model) -> None:  # noqa: ANN001
    # given a rollout of version 2, approved by an approver, then cancelled by the engineer
    rollout = transitions.start(
        model=model, candidate=2, actor=people["eng"], steps=[10, 100], shadow_seconds=0, thresholds=LIMITS
    )
    transitions.approve(rollout=rollout, actor=people["approver"])
    rollout = transitions.cancel(rollout=rollout, actor=people["eng"])
    assert rollout.state == RolloutState.CANCELLED
    # when the engineer promotes the candidate directly: the API files a request, the stable version stays
    response = promote_api(people["eng"], note="the rollout was slow")
    assert response.status_code == 202, response.content
    assert (response.json()["state"], response.json()["version"], response.json()["baseline"]) == ("pending", 2, 1)
    assert stable() == 1
    # and the action and the command refuse outright: the cancelled rollout's approval does not carry over
    with pytest.raises(RegistrationError) as caught:
        promote_version(model=model, version=2, actor=people["eng"])
    assert caught.value.status == 409 and "approval" in caught.value.message
    with pytest.raises(CommandError, match="approval"):
        call_command("route_model", "guarded", "--promote", "2")
    assert stable() == 1 and not AuditEntry.objects.filter(action="model.promote").exists()
    # then an approver's acceptance does change it
    pending = PromotionRequest.objects.get(state=PromotionState.PENDING)
    response = client_for(people["approver"]).post(
        f"/api/promotion-requests/{pending.pk}/approve/", {"note": "checked"}, format="json"
    )
    assert response.status_code == 200, response.content
    assert (response.json()["state"], response.json()["decided_by"]) == ("accepted", "approver")
    assert stable() == 2
    actions = list(
        AuditEntry.objects.filter(action__startswith="promotion.").order_by("pk").values_list("action", "actor_name")
    )
    assert actions == [("promotion.request", "eng"), ("promotion.accept", "approver")]
    assert AuditEntry.objects.get(action="model.promote").actor_name == "approver"
    # and it is decided once
    again = client_for(people["approver2"]).post(f"/api/promotion-requests/{pending.pk}/reject/")
    assert again.status_code == 409 and "accepted" in again.json()["error"]


def test_the_requester_cannot_accept_their_own_request_unless_the_tenant_allows_it(people, model) -> None:  # noqa: ANN001
    # given an approver's own request
    assert promote_api(people["approver"]).status_code == 202
    pending = PromotionRequest.objects.get()
    # when they accept it: 403, nothing changes
    response = client_for(people["approver"]).post(f"/api/promotion-requests/{pending.pk}/approve/")
    assert response.status_code == 403 and "another approver" in response.json()["error"]
    assert stable() == 1
    # an engineer may not decide at all
    assert client_for(people["eng"]).post(f"/api/promotion-requests/{pending.pk}/approve/").status_code == 403
    # where the tenant allows self-approval, they may
    acme = tenant("acme")
    acme.allow_self_approval = True
    acme.save(update_fields=["allow_self_approval"])
    response = client_for(people["approver"]).post(f"/api/promotion-requests/{pending.pk}/approve/")
    assert response.status_code == 200, response.content
    assert stable() == 2


def test_a_request_is_for_the_stable_version_it_was_filed_against(people, model, model_files) -> None:  # noqa: ANN001
    register(model_files.digits, "guarded", owner=tenant("acme"), visibility="private", max_batch_size=2)
    # given a request 1 -> 2 accepted, and a request 2 -> 3 pending
    first = promotion.request(model=model, version=2, actor=people["eng"])
    promotion.accept(request=first, actor=people["approver"])
    second = promotion.request(model=model, version=3, actor=people["eng"])
    # one pending request per model
    assert promote_api(people["eng"], version=1).status_code == 409
    # when the stable version moves under it (here by the policy's other door, engineers promoting)
    engineers_may_promote("acme")
    promote_version(model=model, version=1, actor=people["eng"])
    tenant_ = tenant("acme")
    tenant_.promotion_policy = PromotionPolicy.APPROVAL
    tenant_.save(update_fields=["promotion_policy"])
    # then accepting it is refused: the approver would approve 1 -> 3, which nobody was shown
    with pytest.raises(promotion.PromotionError) as caught:
        promotion.accept(request=second, actor=people["approver"])
    assert caught.value.status == 409 and "reject it and file it again" in caught.value.message
    assert stable() == 1
    assert PromotionRequest.objects.get(pk=second.pk).state == PromotionState.PENDING


def test_retiring_the_stable_version_does_not_make_the_next_one_stable_unapproved(
    people,
    model,  # noqa: ANN001
    model_files,
) -> None:
    # given version 3 registered, validating, while the engineer retires stable version 1 and ready 2
    with model_files.digits.open("rb") as f:
        v3 = register_version(
            model_name="guarded",
            artifact_file=f,
            fmt="torchscript",
            inputs=DIGITS_IO["inputs"],
            outputs=DIGITS_IO["outputs"],
            validate="none",
            max_batch_size=2,
        )
    model.versions.get(version=2).retire()
    model.versions.get(version=1).retire()
    assert stable() is None
    # when version 3 passes validation it is not stable by itself: it needs an approved promotion
    validate(v3)
    assert stable() is None
    assert promote_api(people["eng"], version=3).status_code == 202
    promotion.accept(request=PromotionRequest.objects.get(), actor=people["approver"])
    assert stable() == 3


# -- traffic by hand ------------------------------------------------------------------------------------


def test_weights_arms_and_pins_to_an_unapproved_version_are_refused(people, model) -> None:  # noqa: ANN001
    pinned = tenant("pinned")
    for rules in (
        {"rollout_weights": {1: 0.0, 2: 1.0}},
        {"experiment_arms": {1: 0.5, 2: 0.5}},
        {"tenant_versions": {pinned.pk: 2}},
    ):
        with pytest.raises(RegistrationError) as caught:
            set_routing(model=model, actor=people["eng"], **rules)
        assert caught.value.status == 409 and "not approved" in caught.value.message
    with pytest.raises(CommandError, match="not approved"):
        call_command("route_model", "guarded", "--weights", "1=0.5,2=0.5")
    with pytest.raises(CommandError, match="not approved"):
        call_command("route_model", "guarded", "--tenant", "pinned=2")
    model.refresh_from_db()
    assert (model.rollout_weights, model.experiment_arms, model.tenant_versions) == ({}, {}, {})
    # the approved (stable) version may be pinned
    set_routing(model=model, actor=people["eng"], tenant_versions={pinned.pk: 1})


def test_a_running_rollout_allows_its_own_step_and_no_more(people, model) -> None:  # noqa: ANN001
    # given a rollout of version 2 in its first step, 10%
    rollout = transitions.start(
        model=model, candidate=2, actor=people["eng"], steps=[10, 100], shadow_seconds=0, thresholds=LIMITS
    )
    model.refresh_from_db()
    assert model.rollout_weights == {"2": 0.1, "1": 0.9}
    # the same share by hand is allowed; more, by weights or by an experiment arm on top, is not
    set_routing(model=model, actor=people["eng"], rollout_weights={1: 0.9, 2: 0.1})
    for rules in ({"rollout_weights": {1: 0.5, 2: 0.5}}, {"experiment_arms": {1: 0.9, 2: 0.1}}):
        with pytest.raises(RegistrationError, match="not approved"):
            set_routing(model=model, actor=people["eng"], **rules)
    # and the rollout's own next step moves on as before
    rollout = transitions.advance(rollout=rollout, actor=people["eng"])
    model.refresh_from_db()
    assert rollout.step == 1 and model.rollout_weights == {"2": 1.0, "1": 0.0}


def test_under_engineers_may_promote_weights_and_promotion_are_direct(people, model) -> None:  # noqa: ANN001
    engineers_may_promote("acme")
    set_routing(model=model, actor=people["eng"], rollout_weights={1: 0.5, 2: 0.5})
    response = promote_api(people["eng"])
    assert response.status_code == 200, response.content
    assert response.json()["stable_version"] == 2 and stable() == 2
    assert not PromotionRequest.objects.exists()
    # the console's form says so and does the same
    eng = Client()
    eng.force_login(people["eng"])
    page = eng.get("/console/models/guarded/").content.decode()
    assert "Engineers may promote directly" in page and ">Promote<" in page
    assert eng.post("/console/models/guarded/promote/", {"version": "1"}).status_code == 302
    assert stable() == 1


# -- the console ----------------------------------------------------------------------------------------


def test_the_console_shows_requests_to_approvers_and_the_requester_awaits(people, model) -> None:  # noqa: ANN001
    def client(name: str) -> Client:
        c = Client()
        c.force_login(people[name])
        return c

    eng = client("eng")
    page = eng.get("/console/models/guarded/").content.decode()
    assert ">Request promotion<" in page
    assert eng.post("/console/models/guarded/promote/", {"version": "2", "note": "faster"}).status_code == 302
    assert stable() == 1
    pending = PromotionRequest.objects.get()
    mine = eng.get("/console/models/guarded/").content.decode()
    assert "awaiting approval" in mine and "your request" in mine and ">Approve promotion<" not in mine
    approver_page = client("approver").get("/console/models/guarded/").content.decode()
    assert ">Approve promotion<" in approver_page and ">Reject promotion<" in approver_page
    # a forged POST by the engineer is refused; another tenant's person does not find it
    assert eng.post(f"/console/promotion-requests/{pending.pk}/approve/").status_code == 403
    assert client("outsider").post(f"/console/promotion-requests/{pending.pk}/approve/").status_code == 404
    assert client("approver").post(f"/console/promotion-requests/{pending.pk}/approve/").status_code == 302
    assert stable() == 2
    assert "accepted by approver" in client("viewer").get("/console/models/guarded/").content.decode().lower()


def test_the_api_scopes_requests_to_the_owning_tenant(people, model) -> None:  # noqa: ANN001
    assert promote_api(people["eng"]).status_code == 202
    pending = PromotionRequest.objects.get()
    listed = client_for(people["viewer"]).get("/api/promotion-requests/?state=pending").json()
    assert [r["id"] for r in listed["results"]] == [pending.pk]
    outsider = client_for(people["outsider"])
    assert outsider.get("/api/promotion-requests/").json()["results"] == []
    assert outsider.get(f"/api/promotion-requests/{pending.pk}/").status_code == 404
    assert client_for(people["staff"]).get(f"/api/promotion-requests/{pending.pk}/").status_code == 200
    schema = client_for(people["viewer"]).get("/api/schema/", {"format": "json"}).json()
    assert {
        "/api/promotion-requests/",
        "/api/promotion-requests/{id}/approve/",
        "/api/promotion-requests/{id}/reject/",
        "/api/tenants/{slug}/promotion-policy/",
    } <= set(schema["paths"])
    assert "202" in schema["paths"]["/api/models/{model_name}/versions/{version}/promote/"]["post"]["responses"]


# -- who sets the policy --------------------------------------------------------------------------------


def test_only_staff_change_the_policy_audited_and_members_read_it(people, model) -> None:  # noqa: ANN001
    url = "/api/tenants/acme/promotion-policy/"
    body = {"promotion_policy": "engineers"}
    # a tenant admin: 403, in the API and the console; another tenant's admin: 404
    assert client_for(people["admin"]).put(url, body, format="json").status_code == 403
    assert client_for(people["outsider"]).put(url, body, format="json").status_code == 404
    admin = Client()
    admin.force_login(people["admin"])
    assert admin.post("/console/tenants/acme/promotion-policy/", body).status_code == 403
    assert tenant("acme").promotion_policy == PromotionPolicy.APPROVAL
    assert not AuditEntry.objects.filter(action="tenant.promotion_policy").exists()
    # members read it on the tenant, and its page shows it without the form
    assert client_for(people["viewer"]).get("/api/tenants/acme/").json()["promotion_policy"] == "approval"
    page = admin.get("/console/tenants/acme/").content.decode()
    assert "Approval required" in page and "Set policy" not in page
    # staff change it, audited
    response = client_for(people["staff"]).put(url, body, format="json")
    assert response.status_code == 200 and response.json() == {"promotion_policy": "engineers"}
    assert client_for(people["staff"]).put(url, {"promotion_policy": "anyone"}, format="json").status_code == 400
    entry = AuditEntry.objects.get(action="tenant.promotion_policy")
    assert (entry.actor_name, entry.before, entry.after) == (
        "staff",
        {"promotion_policy": "approval"},
        {"promotion_policy": "engineers"},
    )
    staff = Client()
    staff.force_login(people["staff"])
    assert "Set policy" in staff.get("/console/tenants/acme/").content.decode()
    assert staff.post("/console/tenants/acme/promotion-policy/", {"promotion_policy": "approval"}).status_code == 302
    assert tenant("acme").promotion_policy == PromotionPolicy.APPROVAL
    assert AuditEntry.objects.filter(action="tenant.promotion_policy").count() == 2
    assert "Engineers may promote" not in admin.get("/console/tenants/acme/").content.decode()


def test_staff_changing_the_policy_in_the_admin_is_audited(people) -> None:  # noqa: ANN001
    superuser = User.objects.create_user("root", "root@example.org", is_staff=True, is_superuser=True)
    client = Client()
    client.force_login(superuser)
    acme = tenant("acme")
    form = {
        "name": acme.name,
        "slug": acme.slug,
        "promotion_policy": "engineers",
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    response = client.post(f"/admin/tenants/tenant/{acme.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    assert tenant("acme").promotion_policy == PromotionPolicy.ENGINEERS
    entry = AuditEntry.objects.get(action="tenant.promotion_policy")
    assert (entry.actor_name, entry.before, entry.after) == (
        "root",
        {"promotion_policy": "approval"},
        {"promotion_policy": "engineers"},
    )
