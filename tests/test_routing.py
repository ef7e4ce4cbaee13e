"""Routing: the stable version, tenant pins, experiments and rollout weights (rollout.routing), the registry
that stores them, promotion, and what callers see over HTTP.

The policy tests are plain Python over hand-built snapshot entries; the rest run on PostgreSQL, and
through the live server with API keys.
"""

from __future__ import annotations

import importlib
import math
import threading
from collections import Counter

import numpy as np
import pytest
from django.apps import apps
from django.core.exceptions import ValidationError

from rollout.routing import NO_ROUTES, RouteError, RouteTable, choose_version, key_points
from serving.actions import RegistrationError, promote, register_version, set_routing
from serving.dataplane.gateway import snapshot_redis
from serving.dataplane.gateway.snapshot import ModelEntry, VersionEntry
from serving.models import Model, ModelVersion, State
from serving.policies.batching import BatchingConfig
from serving.publish import build_snapshot
from serving.validation import validate
from tenants.models import AuditEntry
from tests.conftest import DIGITS_IO, LiveServer, engineers_may_promote, mint_key, register, tenant
from tests.test_inference_http import assert_error, call, digits_request, infer, wait_until

ZERO = digits_request(np.zeros((1, 64), np.float32))


# -- the policy, in plain Python ---------------------------------------------------------------------


def entry(version: int, *, state: str = "ready", loaded: bool = True) -> VersionEntry:
    return VersionEntry(
        model="m",
        version=version,
        state=state,
        loaded=loaded,
        artifact_sha256="0" * 64,
        format="torchscript",
        inputs=(),
        outputs=(),
        default_timeout_ms=1000,
        latency_profile={},
        batching=BatchingConfig(max_batch_size=1, max_queue_delay=0.0, max_queue_size=1),
    )


def model(routes: RouteTable, versions: tuple[int, ...] = (1, 2, 3, 4), **states: dict) -> ModelEntry:
    return ModelEntry(
        name="m",
        task="classification",
        description="",
        fallback=None,
        versions={v: entry(v, **states.get(f"v{v}", {})) for v in versions},
        routes=routes,
    )


def split(m: ModelEntry, keys: int, **kwargs: object) -> Counter:
    return Counter(choose_version(m, routing_key=f"user-{i}", **kwargs).version for i in range(keys))


def within_binomial(count: int, n: int, p: float, sigmas: float = 4.5) -> bool:
    """`count` successes of `n` at `p`, within `sigmas` standard deviations (about 1 in 150,000 outside)."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_rollout_weights_split_keys_within_statistical_tolerance() -> None:
    # given stable 3 and a 10% canary of 4
    m = model(RouteTable(stable=3, weights={3: 0.9, 4: 0.1}))
    # when 10,000 distinct keys are routed
    counts = split(m, 10_000)
    # then about 10% reach the canary, within a binomial bound, and the rest the stable version
    assert set(counts) == {3, 4}
    assert within_binomial(counts[4], 10_000, 0.1), counts
    # and a 1% step is 1% too, not 0 and not 10
    one = split(model(RouteTable(stable=3, weights={3: 0.99, 4: 0.01})), 10_000)
    assert within_binomial(one[4], 10_000, 0.01), one


def test_experiment_arms_split_keys_within_statistical_tolerance() -> None:
    m = model(RouteTable(stable=1, experiment={1: 0.5, 2: 0.3, 3: 0.2}))
    counts = split(m, 10_000)
    assert within_binomial(counts[1], 10_000, 0.5), counts
    assert within_binomial(counts[2], 10_000, 0.3), counts
    assert within_binomial(counts[3], 10_000, 0.2), counts


def test_a_key_sticks_to_its_version_across_requests_and_snapshots() -> None:
    rules = {"stable": 3, "weights": {3: 0.5, 4: 0.5}, "experiment": {}, "tenants": {}}
    first = model(RouteTable.from_dict(rules))
    chosen = {f"user-{i}": choose_version(first, routing_key=f"user-{i}").version for i in range(500)}
    # when the same keys come again, through a snapshot rebuilt from the same rules (a JSON round trip)
    again = model(
        RouteTable.from_dict(
            snapshot_redis.orjson.loads(
                snapshot_redis.orjson.dumps(first.routes.to_dict(), option=snapshot_redis.orjson.OPT_NON_STR_KEYS)
            )
        )
    )
    # then every key is routed where it was
    for key, version in chosen.items():
        assert choose_version(first, routing_key=key).version == version
        assert choose_version(again, routing_key=key).version == version
    # and both sides got keys (the split is not "everyone on one side")
    assert set(chosen.values()) == {3, 4}


def test_canary_grows_by_moving_keys_from_stable_only() -> None:
    # Growing a canary from 5% to 25% moves callers onto it; none of the first 5% leaves it.
    small = model(RouteTable(stable=3, weights={3: 0.95, 4: 0.05}))
    large = model(RouteTable(stable=3, weights={3: 0.75, 4: 0.25}))
    keys = [f"user-{i}" for i in range(2000)]
    on_canary = {k for k in keys if choose_version(small, routing_key=k).version == 4}
    assert on_canary and all(choose_version(large, routing_key=k).version == 4 for k in on_canary)


def test_precedence_is_pinned_then_tenant_then_experiment_then_rollout() -> None:
    # given every rule at once: rollout all to 2, experiment all to 3, tenant 7 pinned to 4, stable 1
    rules = RouteTable(stable=1, weights={2: 1.0}, experiment={3: 1.0}, tenants={7: 4})
    m = model(rules)
    # then a version in the path wins over everything
    assert choose_version(m, 1, tenant_id=7, routing_key="k").version == 1
    # then the tenant's version
    assert choose_version(m, tenant_id=7, routing_key="k").version == 4
    # then the experiment, for any other tenant
    assert choose_version(m, tenant_id=8, routing_key="k").version == 3
    # then the rollout weights, without an experiment
    assert (
        choose_version(
            model(RouteTable(stable=1, weights={2: 1.0}, tenants={7: 4})), tenant_id=8, routing_key="k"
        ).version
        == 2
    )
    # and the stable version without any rule
    assert choose_version(model(RouteTable(stable=1)), tenant_id=8, routing_key="k").version == 1


def test_a_new_version_takes_no_unpinned_traffic() -> None:
    # given stable 1 and a newer, ready version 4 no rule names
    m = model(RouteTable(stable=1))
    # then every key goes to 1, and 4 only when pinned
    assert set(split(m, 1000)) == {1}
    assert choose_version(m, 4).version == 4


def test_unversioned_metadata_describes_the_stable_version() -> None:
    from serving.dataplane.http.consumers import _default

    # given a model whose stable version is 1 of 4 / then unversioned metadata is version 1's
    assert _default(model(RouteTable(stable=1))).version == 1
    # and without a stable version (a model whose versions never became ready): the newest servable one
    assert _default(model(NO_ROUTES, v4={"state": "failed"})).version == 3


def test_a_loading_version_is_never_routed_to() -> None:
    # given version 4 in every rule, but not ready on any node (still loading)
    rules = RouteTable(stable=1, weights={1: 0.5, 4: 0.5}, experiment={4: 1.0}, tenants={7: 4})
    m = model(rules)

    def loading_4(key: str) -> bool:
        return key != "m:4"

    # then no caller, whichever rule applies, reaches it: its share goes to the stable version
    assert set(split(m, 2000, ready=loading_4)) == {1}
    assert choose_version(m, tenant_id=7, routing_key="k", ready=loading_4).version == 1
    # and a request pinned to it is a 503 saying it is loading
    with pytest.raises(RouteError) as caught:
        choose_version(m, 4, ready=loading_4)
    assert caught.value.status == 503 and "loading" in caught.value.message
    # and once it is ready the rules apply again
    assert set(split(m, 200, ready=lambda key: True)) == {4}


def test_unready_rules_fall_through_in_order() -> None:
    # the experiment's chosen arm not ready: the rollout decides; the canary not ready either: stable
    rules = RouteTable(stable=1, weights={2: 1.0}, experiment={3: 1.0})
    m = model(rules, v3={"state": "validating"})
    assert choose_version(m, routing_key="k").version == 2
    m = model(rules, v2={"loaded": False}, v3={"state": "failed"})
    assert choose_version(m, routing_key="k").version == 1


def test_no_ready_stable_version_is_503_and_never_a_newer_one() -> None:
    m = model(RouteTable(stable=1), v1={"loaded": False})
    with pytest.raises(RouteError) as caught:
        choose_version(m)
    assert caught.value.status == 503 and "stable version 1 is unloaded" in caught.value.message
    with pytest.raises(RouteError) as caught:
        choose_version(model(RouteTable()))
    assert caught.value.status == 503 and "none is stable" in caught.value.message


@pytest.mark.parametrize(
    ("rules", "fragment"),
    [
        ({"weights": {3: 0.9, 4: 0.2}}, "sum to 1"),
        ({"weights": {3: 1.1, 4: -0.1}}, "from 0 to 1"),
        ({"experiment": {3: 0.5}}, "sum to 1"),
        ({"experiment": {0: 1.0}}, "not a version"),
        ({"weights": {3: float("nan"), 4: 1.0}}, "from 0 to 1"),
        ({"stable": 0}, "not a version"),
        ({"tenants": {1: "two"}}, "tenant id"),
    ],
)
def test_invalid_rules_are_refused(rules: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        RouteTable(**rules)


def test_key_points_are_stable_and_per_model() -> None:
    # the same key hashes to the same points in every process and every release (computed once, at this
    # writing): a caller's canary and experiment arm stay put across restarts and upgrades, so a change here
    # moves callers and must be deliberate. Another model puts the key elsewhere.
    assert key_points("m", "alice") == (0.19808105853827843, 0.3845417864571777)
    assert key_points("n", "alice") == (0.09587686028461828, 0.6720709748611116)
    assert all(0.0 <= p < 1.0 for p in key_points("m", "alice"))


# -- the registry: stable version, rules, promotion ----------------------------------------------------


def register_unvalidated(path, name: str) -> ModelVersion:  # noqa: ANN001
    with path.open("rb") as f:
        return register_version(
            model_name=name,
            artifact_file=f,
            fmt="torchscript",
            inputs=DIGITS_IO["inputs"],
            outputs=DIGITS_IO["outputs"],
            validate="none",
            max_batch_size=2,
        )


@pytest.mark.django_db
def test_first_version_becomes_stable_once_ready_and_later_ones_wait(model_files) -> None:
    # given a first version registered, not validated yet
    v1 = register_unvalidated(model_files.digits, "routed")
    assert Model.objects.get(name="routed").stable_version is None
    # when it passes validation it is the stable version
    validate(v1)
    assert Model.objects.get(name="routed").stable_version == 1
    # and a second ready version leaves it so: it takes no unpinned traffic
    register(model_files.digits, "routed", max_batch_size=2)
    assert Model.objects.get(name="routed").stable_version == 1
    m = build_snapshot().models["routed"]
    assert choose_version(m, routing_key="anyone").version == 1


@pytest.mark.django_db
def test_when_the_first_version_fails_the_first_ready_one_is_stable(model_files) -> None:
    register(model_files.wrong_dtype, "routed", max_batch_size=2)
    assert Model.objects.get(name="routed").stable_version is None
    register(model_files.digits, "routed", max_batch_size=2)
    assert Model.objects.get(name="routed").stable_version == 2


@pytest.mark.django_db
def test_promote_moves_stable_ends_the_rollout_and_is_audited(model_files) -> None:
    engineers_may_promote()  # promotion's mechanics; the approval policy: tests/test_promotion_policy.py
    register(model_files.digits, "routed", max_batch_size=2)
    register(model_files.digits, "routed", max_batch_size=2)
    m = set_routing(model=Model.objects.get(name="routed"), rollout_weights={1: 0.9, 2: 0.1})
    # when version 2 is promoted
    m = promote(model=m, version=2, actor=None)
    # then it is stable, the weights are gone, and the audit log says who and what
    m.refresh_from_db()
    assert m.stable_version == 2 and m.rollout_weights == {}
    entry = AuditEntry.objects.filter(action="model.promote").get()
    assert entry.before["stable_version"] == 1 and entry.after["stable_version"] == 2
    assert entry.before["rollout_weights"] == {"1": 0.9, "2": 0.1}
    assert build_snapshot().models["routed"].routes.stable == 2


@pytest.mark.django_db
def test_only_a_ready_version_can_be_promoted(model_files) -> None:
    register(model_files.digits, "routed", max_batch_size=2)
    register(model_files.wrong_dtype, "routed", max_batch_size=2)
    m = Model.objects.get(name="routed")
    with pytest.raises(RegistrationError) as caught:
        promote(model=m, version=2)
    assert caught.value.status == 409 and "failed" in caught.value.message
    with pytest.raises(RegistrationError) as caught:
        promote(model=m, version=9)
    assert caught.value.status == 404
    assert Model.objects.get(name="routed").stable_version == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("rules", "field"),
    [
        ({"rollout_weights": {1: 0.5, 3: 0.5}}, "__all__"),  # version 3 does not exist
        ({"rollout_weights": {1: 0.5, 2: 0.4}}, "rollout_weights"),
        ({"experiment_arms": {"x": 1.0}}, "experiment_arms"),
        ({"tenant_versions": {999999: 1}}, "tenant_versions"),
        ({"tenant_versions": ["not", "a", "map"]}, "tenant_versions"),
    ],
)
def test_set_routing_validates_and_changes_nothing_when_invalid(model_files, rules: dict, field: str) -> None:
    register(model_files.digits, "routed", max_batch_size=2)
    register(model_files.digits, "routed", max_batch_size=2)
    with pytest.raises(ValidationError) as caught:
        set_routing(model=Model.objects.get(name="routed"), **rules)
    assert field in caught.value.message_dict
    m = Model.objects.get(name="routed")
    assert (m.rollout_weights, m.experiment_arms, m.tenant_versions) == ({}, {}, {})
    assert not AuditEntry.objects.filter(action="model.routing").exists()


@pytest.mark.django_db
def test_rules_reach_the_snapshot_and_survive_redis_encoding(model_files) -> None:
    engineers_may_promote()  # rules set by hand, to an unapproved version
    register(model_files.digits, "routed", max_batch_size=2)
    register(model_files.digits, "routed", max_batch_size=2)
    t = tenant("pinned")
    set_routing(
        model=Model.objects.get(name="routed"),
        rollout_weights={1: 0.75, 2: 0.25},
        experiment_arms={1: 0.5, 2: 0.5},
        tenant_versions={t.pk: 2},
        actor=None,
    )
    snapshot = build_snapshot()
    routes = snapshot.models["routed"].routes
    assert routes == RouteTable(stable=1, weights={1: 0.75, 2: 0.25}, experiment={1: 0.5, 2: 0.5}, tenants={t.pk: 2})
    decoded = snapshot_redis.decode(snapshot_redis.encode(snapshot))
    assert decoded == snapshot
    # and the decoded table routes every key as the original does
    for i in range(300):
        assert (
            choose_version(decoded.models["routed"], routing_key=str(i)).version
            == choose_version(snapshot.models["routed"], routing_key=str(i)).version
        )


@pytest.mark.django_db
def test_retiring_a_version_drops_it_from_the_rules(model_files) -> None:
    engineers_may_promote()  # rules set by hand, to an unapproved version
    register(model_files.digits, "routed", max_batch_size=2)
    v2 = register(model_files.digits, "routed", max_batch_size=2)
    t = tenant("pinned")
    set_routing(model=Model.objects.get(name="routed"), rollout_weights={1: 0.9, 2: 0.1}, tenant_versions={t.pk: 2})
    v2.retire()
    m = Model.objects.get(name="routed")
    assert (m.stable_version, m.rollout_weights, m.tenant_versions) == (1, {}, {})


@pytest.mark.django_db
def test_data_migration_makes_the_newest_ready_version_stable(model_files) -> None:
    # given models as an older build left them: no stable version
    register(model_files.digits, "two", max_batch_size=2)
    register(model_files.digits, "two", max_batch_size=2)
    register(model_files.wrong_dtype, "two", max_batch_size=2)
    register(model_files.wrong_dtype, "none-ready", max_batch_size=2)
    Model.objects.update(stable_version=None)
    # when the migration's data step runs
    importlib.import_module("serving.migrations.0003_routing").stable_is_newest_ready(apps, None)
    # then each model serves what it served before: its newest ready version
    assert dict(Model.objects.values_list("name", "stable_version")) == {"two": 2, "none-ready": None}


# -- the API: promote, retire ---------------------------------------------------------------------------


@pytest.fixture
def people(db):  # noqa: ANN001, ANN201
    from django.contrib.auth.models import User

    from tenants.models import Membership, Role
    from tests.test_api import client_for

    acme, other = tenant("acme"), tenant("other")
    clients = {}
    for name, t, role in [
        ("eng", acme, Role.ENGINEER),
        ("viewer", acme, Role.VIEWER),
        ("outsider", other, Role.ENGINEER),
    ]:
        user = User.objects.create_user(name, f"{name}@example.org")
        Membership.objects.create(user=user, tenant=t, role=role)
        clients[name] = client_for(user)
    return clients


@pytest.fixture
def private_model(people, model_files) -> Model:  # noqa: ANN001
    acme = tenant("acme")
    register(model_files.digits, "routed", owner=acme, visibility="private", max_batch_size=2)
    register(model_files.digits, "routed", owner=acme, visibility="private", max_batch_size=2)
    register(model_files.wrong_dtype, "routed", owner=acme, visibility="private", max_batch_size=2)
    return Model.objects.get(name="routed")


def test_engineer_promotes_through_the_api(people, private_model) -> None:  # noqa: ANN001
    engineers_may_promote("acme")  # where approval is required the same POST files a request (test_promotion_policy)
    response = people["eng"].post("/api/models/routed/versions/2/promote/")
    assert response.status_code == 200, response.content
    assert response.json()["stable_version"] == 2
    assert Model.objects.get(name="routed").stable_version == 2
    assert AuditEntry.objects.filter(action="model.promote", actor__username="eng").count() == 1


def test_promote_refusals_are_json(people, private_model) -> None:  # noqa: ANN001
    # a viewer of the owning tenant: 403; an engineer of another tenant: the private model is a 404
    assert people["viewer"].post("/api/models/routed/versions/2/promote/").status_code == 403
    response = people["outsider"].post("/api/models/routed/versions/2/promote/")
    assert response.status_code == 404 and "error" in response.json()
    # an unknown version: 404; a failed one: 409
    assert people["eng"].post("/api/models/routed/versions/9/promote/").status_code == 404
    response = people["eng"].post("/api/models/routed/versions/3/promote/")
    assert response.status_code == 409 and "failed" in response.json()["error"]
    assert Model.objects.get(name="routed").stable_version == 1


def test_the_stable_version_retires_only_after_another_is_promoted(people, private_model) -> None:  # noqa: ANN001
    engineers_may_promote("acme")
    response = people["eng"].post("/api/models/routed/versions/1/retire/")
    assert response.status_code == 409 and "promote" in response.json()["error"]
    assert people["eng"].post("/api/models/routed/versions/2/promote/").status_code == 200
    assert people["eng"].post("/api/models/routed/versions/1/retire/").status_code == 200


# -- over HTTP, with API keys --------------------------------------------------------------------------


@pytest.fixture
def two_versions_server(transactional_db, model_files, settings):  # noqa: ANN001, ANN201
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    engineers_may_promote()  # these tests route by hand to version 2
    register(model_files.digits, "routed", max_batch_size=4, max_queue_delay_ms=1)
    register(model_files.digits, "routed", max_batch_size=4, max_queue_delay_ms=1)
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def served_version(resp) -> str:  # noqa: ANN001
    assert resp.status == 200, (resp.status, resp.body)
    assert resp.json()["model_version"] == resp.headers["x-ferry-model-version"]
    return resp.headers["x-ferry-model-version"]


def test_every_answer_names_its_version_and_unpinned_goes_to_stable(two_versions_server) -> None:  # noqa: ANN001
    server = two_versions_server
    assert {served_version(infer(server, "routed", ZERO)) for _ in range(5)} == {"1"}
    resp = call(server, "POST", "/v2/models/routed/versions/2/infer", ZERO)
    assert served_version(resp) == "2"


def test_tenant_pin_then_experiment_over_http(two_versions_server) -> None:  # noqa: ANN001
    server = two_versions_server
    pinned_key = mint_key("pinned-tenant")
    m = Model.objects.get(name="routed")
    set_routing(model=m, tenant_versions={tenant("pinned-tenant").pk: 2}, experiment_arms={1: 0.5, 2: 0.5})
    server.refresh()
    # the pinned tenant gets 2 whatever its routing key; a path pin beats its tenant pin
    for i in range(10):
        assert served_version(infer(server, "routed", ZERO, {"X-Ferry-Routing-Key": f"k{i}"}, auth=pinned_key)) == "2"
    assert served_version(call(server, "POST", "/v2/models/routed/versions/1/infer", ZERO, auth=pinned_key)) == "1"
    # other callers follow the experiment, each routing key sticking to its arm
    seen = {}
    for i in range(40):
        key = {"X-Ferry-Routing-Key": f"user-{i}"}
        first = served_version(infer(server, "routed", ZERO, key))
        assert served_version(infer(server, "routed", ZERO, key)) == first
        seen[i] = first
    assert set(seen.values()) == {"1", "2"}
    # without the header, the API key decides: one key, one arm
    assert len({served_version(infer(server, "routed", ZERO)) for _ in range(5)}) == 1


def test_rollout_weights_over_http(two_versions_server) -> None:  # noqa: ANN001
    server = two_versions_server
    set_routing(model=Model.objects.get(name="routed"), rollout_weights={1: 0.0, 2: 1.0})
    server.refresh()
    assert {served_version(infer(server, "routed", ZERO, {"X-Ferry-Routing-Key": f"u{i}"})) for i in range(10)} == {"2"}


def test_registering_a_version_under_load_causes_no_503_and_no_fallback(  # noqa: ANN001
    transactional_db, model_files, settings
) -> None:
    settings.FERRY_LOOP_LAG_TARGET_MS = settings.FERRY_MAX_LOOP_LAG_MS = 60_000
    settings.FERRY_MAX_FRONTEND_WAIT_MS = 60_000
    # given `routed` v1 serving, with a fallback model that would answer if v1 were refused
    engineers_may_promote()  # the promotion at the end is by hand
    small = register(model_files.digits, "small", max_batch_size=4)
    v1 = register(model_files.digits, "routed", max_batch_size=4, max_queue_delay_ms=1)
    Model.objects.filter(pk=v1.model_id).update(fallback=small.model)
    server = LiveServer().start()
    try:
        server.refresh()
        answers: list = []
        stop = threading.Event()

        def drive() -> None:
            while not stop.is_set():
                answers.append(infer(server, "routed", ZERO))

        driver = threading.Thread(target=drive)
        driver.start()
        try:
            wait_until(lambda: len(answers) >= 20, "traffic before the registration")
            # when a second version is registered (and validated) while the traffic runs
            register(model_files.digits_export, "routed", fmt="torch_export", max_batch_size=4)
            # and the server picks it up and loads it
            server.refresh()
            wait_until(lambda: server.plane().node.is_ready("routed:2"), "version 2 loaded")
            seen = len(answers)
            wait_until(lambda: len(answers) >= seen + 20, "traffic after the load")
        finally:
            stop.set()
            driver.join(timeout=60)
        # then every answer was a 200 from the stable version 1, none from the fallback
        assert len(answers) >= 40
        assert [a.status for a in answers if a.status != 200] == []
        assert {served_version(a) for a in answers} == {"1"}
        assert not [a for a in answers if "x-ferry-fallback-from" in a.headers]
        # and version 2 answers only where pinned, until promoted
        assert served_version(call(server, "POST", "/v2/models/routed/versions/2/infer", ZERO)) == "2"
        promote(model=Model.objects.get(name="routed"), version=2)
        server.refresh()
        assert served_version(infer(server, "routed", ZERO)) == "2"
    finally:
        server.stop()


def test_a_pinned_loading_version_is_503_with_retry_after(two_versions_server) -> None:  # noqa: ANN001
    server = two_versions_server
    # given version 2 registered but not loaded on the node (its load failed or is pending)
    plane = server.plane()
    import asyncio

    asyncio.run_coroutine_threadsafe(plane.node.unload("routed:2"), plane.loop).result(timeout=30)
    resp = call(server, "POST", "/v2/models/routed/versions/2/infer", ZERO)
    assert_error(resp, 503, "loading")
    assert int(resp.headers["retry-after"]) >= 1
    # and unpinned traffic keeps going to the stable version
    assert served_version(infer(server, "routed", ZERO)) == "1"
    assert State.READY == ModelVersion.objects.get(model__name="routed", version=2).state


@pytest.mark.django_db
def test_route_model_command_promotes_weights_and_pins(model_files) -> None:
    from django.core.management import CommandError, call_command

    engineers_may_promote()  # the command under the approval policy: tests/test_promotion_policy.py
    register(model_files.digits, "routed", max_batch_size=2)
    register(model_files.digits, "routed", max_batch_size=2)
    t = tenant("pinned")
    call_command("route_model", "routed", "--weights", "1=0.9,2=0.1", "--tenant", "pinned=2")
    m = Model.objects.get(name="routed")
    assert m.route_table() == RouteTable(stable=1, weights={1: 0.9, 2: 0.1}, tenants={t.pk: 2})
    call_command("route_model", "routed", "--promote", "2", "--tenant", "pinned=")
    m.refresh_from_db()
    assert m.route_table() == RouteTable(stable=2)
    with pytest.raises(CommandError, match="sum to 1"):
        call_command("route_model", "routed", "--experiment", "1=0.5")
    assert AuditEntry.objects.filter(action__in=["model.routing", "model.promote"]).count() == 3
