"""The autoscaler's tick against the live system's records: real PostgreSQL and Redis, version streams fed with
XADD as a gateway sends requests, and node heartbeats written as a node writes them (`NodeInfo.to_hash`). Time is
Redis' clock, so the tests wait real seconds between ticks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import pytest
import redis
from django.http import HttpResponse
from django.test import Client

from autoscaling import observe
from autoscaling.models import ScalingPolicy
from autoscaling.providers import Pool
from autoscaling.tick import LOCK_KEY, STATE_KEY, _write, run_tick
from serving.dataplane.transport import fleet, stream_bound
from serving.dataplane.transport.stream_codec import GROUP, request_stream
from serving.models import ModelVersion
from serving.policies.autoscale import Decision
from serving.reconciler import read_loads
from serving.tasks import request_reconcile
from tenants.models import AuditEntry
from tests.conftest import register

REDIS_URL = os.environ.get("FERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
MiB = 1 << 20


@pytest.fixture
def client() -> redis.Redis:
    c = redis.Redis.from_url(REDIS_URL)
    c.flushdb()
    yield c
    c.flushdb()
    c.close()


@pytest.fixture
def version(db, model_files) -> ModelVersion:  # noqa: ANN001
    v = register(model_files.digits, "scaled", max_batch_size=8, default_timeout_ms=1000)
    # A profile worked by hand: 8 rows in 20 ms fit 80% of the 1 s budget twice over, so one replica serves
    # 400 requests a second, sized at 70% for 280.
    v.latency_profile = {"1": 0.010, "8": 0.020}  # seconds, as validation stores them
    v.placement_measurements = {"cpu": {"memory_bytes": 10 * MiB, "cold_start_seconds": 1.5}}
    v.save()
    return v


def heartbeat(
    client: redis.Redis, name: str, hot: set[str], budget: int = 256 * MiB, assigned: frozenset[str] = frozenset()
) -> None:
    now = time.time()
    info = fleet.NodeInfo(
        name, "i1", "host", 1, "cpu", "cpu", 0, budget, budget, 0, {}, now, now, 0, frozenset(hot), frozenset(hot)
    )
    info = dataclasses.replace(info, assigned=assigned)
    client.hset(fleet.node_key(name), mapping=info.to_hash())
    client.expire(fleet.node_key(name), 30)
    client.sadd(fleet.NODES_KEY, name)


def send(client: redis.Redis, key: str, n: int) -> None:
    stream = request_stream(key)
    pipe = client.pipeline(transaction=False)
    for _ in range(n):
        pipe.xadd(stream, {"r": b"x"})
    pipe.execute()


def tick(client: redis.Redis, **kw):  # noqa: ANN003, ANN201
    return run_tick(client, pools={"cpu": Pool("cpu", 256 * MiB, max_nodes=3)}, **kw)


def test_streams_give_arrivals_and_the_backlog_no_node_has_taken(client: redis.Redis) -> None:
    # given a version stream with 5 requests, 2 of them read by a node and one of those answered (acked, deleted)
    stream = request_stream("m:1")
    ids = [client.xadd(stream, {"r": b"x"}) for _ in range(5)]
    client.xgroup_create(stream, GROUP, id="0")
    client.xreadgroup(GROUP, "node-a", {stream: ">"}, count=2)
    client.xack(stream, GROUP, ids[0])
    client.xdel(stream, ids[0])
    # when the streams are read, with one version that was never sent anything
    stats = observe.read_streams(client, ["m:1", "never:1"])
    # then 5 arrived, 3 wait for a node (4 in the stream, 1 held by a node), and the other has none
    assert stats["m:1"] == observe.StreamStats(added=5, backlog=3)
    assert stats["never:1"] == observe.StreamStats(0, 0)


def test_requests_refused_before_the_stream_count_as_asked_for(client: redis.Redis) -> None:
    # given a version with 5 requests in its stream and 40 its gateways refused before it (stream_bound's counter),
    # and one that had every request refused and so has no stream at all
    send(client, "m:1", 5)
    client.incrby(stream_bound.refused_key("m:1"), 40)
    client.incrby(stream_bound.refused_key("shut:1"), 7)
    # when the streams are read
    stats = observe.read_streams(client, ["m:1", "shut:1"])
    # then the autoscaler's arrivals are what was asked, admitted or not; the backlog is the stream's alone
    assert (stats["m:1"].asked, stats["m:1"].backlog) == (45, 5)
    assert (stats["shut:1"].asked, stats["shut:1"].backlog) == (7, 0)


def test_a_replica_seen_saturated_sizes_the_version_by_what_it_answered_not_by_its_profile(
    client: redis.Redis, version: ModelVersion
) -> None:
    ScalingPolicy.objects.create(version=version, max_replicas=3, cool_down_seconds=300)
    heartbeat(client, "n1", {"scaled:1"})
    stream = request_stream("scaled:1")
    first = tick(client)
    # given a backlog of 2,000 requests no node has taken at the second tick
    send(client, "scaled:1", 2000)
    time.sleep(1.0)
    second = tick(client)
    assert not second.plan.decisions["scaled:1"].capacity.observed  # a backlog at one end only: nothing learnt
    # when, before the third, the node answers 100 of them (read, acked, deleted) while 200 more arrive
    client.xgroup_create(stream, GROUP, id="0")
    answered = client.xreadgroup(GROUP, "n1", {stream: ">"}, count=100)[0][1]
    client.xack(stream, GROUP, *[entry_id for entry_id, _ in answered])
    client.xdel(stream, *[entry_id for entry_id, _ in answered])
    send(client, "scaled:1", 200)
    time.sleep(1.0)
    third = tick(client)
    # then the capacity is the 100 answered over the interval, far below the profile's 400 a second
    capacity = third.plan.decisions["scaled:1"].capacity
    assert capacity.observed
    assert capacity.rate == pytest.approx(100 / (third.now - second.now))
    assert first.plan.decisions["scaled:1"].reason == "no_data"


def test_a_version_whose_gateways_refuse_most_requests_is_sized_for_all_it_was_asked(
    client: redis.Redis, version: ModelVersion
) -> None:
    ScalingPolicy.objects.create(version=version, max_replicas=10, cool_down_seconds=300)
    heartbeat(client, "n1", {"scaled:1"})
    first = tick(client)
    # given, before the second tick, 100 requests admitted into the stream and 900 refused by the gateways'
    # admission (one replica serves 400 a second: this is the overload admission was for)
    send(client, "scaled:1", 100)
    client.incrby(stream_bound.refused_key("scaled:1"), 900)
    time.sleep(1.0)
    second = tick(client)
    # then the version is sized for the 1,000 asked over the interval, not the 100 that got in: at 280 a
    # replica (70% of 400), 1,000 a second over about a second wants 3 or 4 replicas, not 1
    decision = second.plan.decisions["scaled:1"]
    assert decision.short_rate == pytest.approx(1000 / (second.now - first.now))
    assert decision.replicas >= 3


def test_a_load_step_raises_desired_replicas_with_an_audit_entry_and_the_cool_down_holds_it(
    client: redis.Redis,
    version: ModelVersion,
    settings,  # noqa: ANN001
) -> None:
    settings.FERRY_AUTOSCALE_SHORT_WINDOW_S = 2  # so the step leaves the short window within the test
    settings.FERRY_AUTOSCALE_LONG_WINDOW_S = 10
    ScalingPolicy.objects.create(version=version, max_replicas=3, cool_down_seconds=300)
    heartbeat(client, "n1", {"scaled:1"})
    changed = []
    # given a first tick, which only learns the counter (and holds what runs: the one hot replica)
    first = tick(client, after_change=lambda: changed.append(True))
    assert first.plan.decisions["scaled:1"].reason == "no_data"
    version.refresh_from_db()
    assert version.desired_replicas == 1
    assert changed == [True]
    # when 2,000 requests arrive before the next tick (well past one replica's 280 a second)
    send(client, "scaled:1", 2000)
    time.sleep(1.0)
    second = tick(client)
    # then it asks for the pool's maximum of 3 replicas, says why, and audits the change
    decision = second.plan.decisions["scaled:1"]
    assert decision.replicas == 3 and decision.reason == "max"
    assert decision.short_rate > 280
    version.refresh_from_db()
    assert version.desired_replicas == 3
    assert second.changed == {"scaled:1": (1, 3)}
    entry = AuditEntry.objects.filter(action="version.scaled").latest("id")
    assert entry.actor_name == "system" and entry.target == "model scaled version 1"
    assert entry.before == {"desired_replicas": 1} and entry.after["desired_replicas"] == 3
    assert entry.after["reason"] == "max"
    assert entry.after["capacity_per_s"] == pytest.approx(400.0) and entry.after["capacity_observed"] is False
    # and each replica's planned device share is in Redis for the placement reconciler, which places by it
    assert read_loads(client)["scaled:1"] > 0
    # and the history is in Redis, so the next tick (any worker's) holds 3 through the cool-down
    assert "scaled:1" in json.loads(client.get(STATE_KEY))["tracks"]
    # once the replicas have answered the backlog (nodes delete what they answered) and no more requests
    # come, what the rate alone asks for falls, and the cool-down keeps the 3
    client.xtrim(request_stream("scaled:1"), maxlen=0)
    reasons = []
    for _ in range(10):
        time.sleep(1.0)
        later = tick(client)
        assert later.plan.decisions["scaled:1"].replicas == 3 and later.changed == {}
        reasons.append(later.plan.decisions["scaled:1"].reason)
        if reasons[-1] == "cool_down":
            break
    assert reasons[-1] == "cool_down", reasons
    assert AuditEntry.objects.filter(action="version.scaled").count() == 2


def test_an_idle_version_goes_to_zero_and_a_request_brings_it_back(client: redis.Redis, version: ModelVersion) -> None:
    # given a version with min_replicas 0 that may go to zero after 1.5 s without a request
    ScalingPolicy.objects.create(version=version, idle_to_zero_seconds=1.5, cool_down_seconds=0)
    heartbeat(client, "n1", {"scaled:1"})
    tick(client)
    send(client, "scaled:1", 3)
    time.sleep(0.6)
    assert tick(client).plan.decisions["scaled:1"].replicas == 1
    # when no request comes for longer than that
    time.sleep(1.8)
    idle = tick(client)
    # then the autoscaler asks for zero replicas
    assert idle.plan.decisions["scaled:1"].reason == "idle"
    version.refresh_from_db()
    assert version.desired_replicas == 0
    # and when a request for it arrives (a node loads it on demand, the packing path) the next tick asks for
    # one again, instead of unloading what the request loaded
    heartbeat(client, "n1", {"scaled:1"})
    send(client, "scaled:1", 1)
    time.sleep(0.6)
    back = tick(client)
    assert back.plan.decisions["scaled:1"].replicas == 1
    version.refresh_from_db()
    assert version.desired_replicas == 1


def test_versions_without_an_enabled_policy_or_a_pool_are_left_alone(
    client: redis.Redis, version: ModelVersion
) -> None:
    # given a disabled policy on a version whose desired count somebody set
    ScalingPolicy.objects.create(version=version, enabled=False)
    version.desired_replicas = 2
    version.save(update_fields=["desired_replicas"])
    report = tick(client)
    # then nothing is sized and the desired count somebody set stays
    assert report.plan.decisions == {}
    version.refresh_from_db()
    assert version.desired_replicas == 2
    # and with the policy on but tied to an accelerator type nothing runs, it is skipped with the reason
    ScalingPolicy.objects.filter(version=version).update(enabled=True, accelerator="h100")
    report = tick(client)
    assert "h100" in report.skipped["scaled:1"]
    version.refresh_from_db()
    assert version.desired_replicas == 2


def test_a_tick_running_elsewhere_is_not_doubled(client: redis.Redis, version: ModelVersion) -> None:
    ScalingPolicy.objects.create(version=version)
    client.set(LOCK_KEY, "another-worker", ex=60)
    assert tick(client) is None
    assert client.get(LOCK_KEY) == b"another-worker"  # its holder's lock is not released by the skipped tick
    client.delete(LOCK_KEY)
    assert tick(client) is not None
    assert client.get(LOCK_KEY) is None


def test_a_tick_whose_lock_lapsed_asks_no_nodes_and_leaves_the_new_holders_lock(
    client: redis.Redis, version: ModelVersion
) -> None:
    # given a tick that will change a desired count, and a provider that records what it is asked
    ScalingPolicy.objects.create(version=version, max_replicas=3)
    heartbeat(client, "n1", {"scaled:1"})
    recorder = Recorder()

    # when the tick's lock lapses after its writes and another tick takes it (as one would after LOCK_SECONDS)
    def lapse() -> None:
        client.set(LOCK_KEY, "the next tick", ex=60)

    report = tick(client, provider=recorder, after_change=lapse)
    # then it stops before asking for nodes, and the next tick's lock stays
    assert report is None
    assert recorder.asked == []
    assert client.get(LOCK_KEY) == b"the next tick"


def test_node_demand_reaches_the_provider(client: redis.Redis, version: ModelVersion) -> None:
    # given a provider that records what it is asked
    ScalingPolicy.objects.create(version=version, max_replicas=3)
    heartbeat(client, "n1", {"scaled:1"})
    recorder = Recorder()
    tick(client, provider=recorder)
    send(client, "scaled:1", 2000)
    time.sleep(1.0)
    tick(client, provider=recorder)
    # then three replicas of one version need three nodes, though their memory fits one
    assert recorder.asked == [{"cpu": 1}, {"cpu": 3}]


class Recorder:
    """A provider that records what it is asked (the providers themselves are tested in test_node_providers)."""

    def __init__(self) -> None:
        self.asked: list[dict[str, int]] = []

    def apply(self, wanted: dict[str, int]) -> dict[str, int]:
        self.asked.append(dict(wanted))
        return dict(wanted)


def test_pools_are_sized_by_packing_every_placed_versions_replicas_and_keep_nodes_that_hold_them(
    client: redis.Redis,
    version: ModelVersion,
    model_files,  # noqa: ANN001
) -> None:
    # given three versions of 13 MiB with one minimum replica each on a pool of 24 MiB nodes: one autoscaled,
    # two with no policy at all
    others = [register(model_files.digits, name) for name in ("plain", "other")]
    for v in [version, *others]:
        v.placement_measurements = {"cpu": {"memory_bytes": 13 * MiB, "cold_start_seconds": 1.5}}
        v.min_replicas = 1
        v.save()
    ScalingPolicy.objects.create(version=version, max_replicas=3)
    recorder = Recorder()
    pools = {"cpu": Pool("cpu", 24 * MiB, max_nodes=8)}
    # when a tick asks the provider for nodes
    run_tick(client, provider=recorder, pools=pools)
    # then it asks for three: no two replicas fit one node (39 MiB of memory would say two), and the
    # versions without a policy need their minimum replicas placed as much as the autoscaled one
    assert recorder.asked == [{"cpu": 3}]
    # and when the provider's node numbered 5 (the sixth) holds an assigned replica, a scale-in, which stops
    # the highest-numbered nodes first, keeps it
    heartbeat(client, "local-cpu-5", {"plain:1"}, assigned=frozenset({"plain:1"}))
    run_tick(client, provider=recorder, pools=pools)
    assert recorder.asked[-1] == {"cpu": 6}


def test_the_command_turns_scaling_on_and_off_with_audit(version: ModelVersion) -> None:
    from django.core.management import CommandError, call_command

    call_command("autoscale_version", "scaled", "1", "--max", "5", "--idle-to-zero", "600", "--cool-down", "60")
    policy = ScalingPolicy.objects.get(version=version)
    assert (policy.enabled, policy.max_replicas, policy.idle_to_zero_seconds, policy.cool_down_seconds) == (
        True,
        5,
        600.0,
        60.0,
    )
    with pytest.raises(CommandError, match="target_utilisation"):
        call_command("autoscale_version", "scaled", "1", "--target-utilisation", "1.5")
    ModelVersion.objects.filter(pk=version.pk).update(desired_replicas=3)
    call_command("autoscale_version", "scaled", "1", "--off")
    policy.refresh_from_db()
    version.refresh_from_db()
    assert not policy.enabled and policy.max_replicas == 5
    assert version.desired_replicas is None  # the reconciler keeps min_replicas again
    entries = AuditEntry.objects.filter(action="version.scaling").order_by("id")
    assert [e.after["enabled"] for e in entries] == [True, False]
    assert entries[0].before is None and entries[1].before["max_replicas"] == 5


def admin_save(browser: Client, policy: ScalingPolicy, **changes: object) -> HttpResponse:
    data = {
        "version": policy.version_id,
        "enabled": "on" if policy.enabled else "",
        "max_replicas": policy.max_replicas,
        "target_utilisation": policy.target_utilisation,
        "warm_pool": policy.warm_pool,
        "cool_down_seconds": policy.cool_down_seconds,
        "idle_to_zero_seconds": "",
        "accelerator": policy.accelerator,
        "_save": "Save",
        **changes,
    }
    return browser.post(f"/admin/autoscaling/scalingpolicy/{policy.pk}/change/", data)


def test_unchecking_enabled_in_the_admin_clears_desired_and_asks_the_reconciler(
    version: ModelVersion,
    django_user_model,  # noqa: ANN001
    django_capture_on_commit_callbacks,  # noqa: ANN001
) -> None:
    # given a version the autoscaler scaled out to 3
    policy = ScalingPolicy.objects.create(version=version, max_replicas=5)
    ModelVersion.objects.filter(pk=version.pk).update(desired_replicas=3)
    browser = Client()
    browser.force_login(django_user_model.objects.create_superuser("root", "root@example.org", "unused"))
    # when an operator saves the policy in the admin with everything but `enabled` as it was
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = admin_save(browser, policy, enabled="")
    assert response.status_code == 302, response.content.decode()[-2000:]
    # then the policy is off, the version is back to its min_replicas, and a reconciler step is asked for
    policy.refresh_from_db()
    version.refresh_from_db()
    assert not policy.enabled
    assert version.desired_replicas is None
    assert request_reconcile in callbacks
    # and a later save of the policy, still off, leaves a count somebody set by hand alone
    ModelVersion.objects.filter(pk=version.pk).update(desired_replicas=2)
    assert admin_save(browser, policy, enabled="", max_replicas=6).status_code == 302
    version.refresh_from_db()
    assert version.desired_replicas == 2


def test_deleting_an_enabled_policy_clears_desired(version: ModelVersion) -> None:
    policy = ScalingPolicy.objects.create(version=version)
    ModelVersion.objects.filter(pk=version.pk).update(desired_replicas=4)
    policy.delete()
    version.refresh_from_db()
    assert version.desired_replicas is None


def test_a_tick_whose_policy_was_turned_off_after_it_read_it_writes_nothing(version: ModelVersion) -> None:
    # given a tick that decided 3 replicas for a version whose policy it read as on
    ScalingPolicy.objects.create(version=version)
    decision = Decision("scaled:1", 3, "forecast", 900.0, 900.0, 900.0, 900.0, None)
    # when the policy is turned off before the tick writes (and its release has already run: desired is null)
    ScalingPolicy.objects.filter(version=version).update(enabled=False)
    # then the write finds the policy off under the version's lock and leaves desired_replicas as it is
    assert _write(version.pk, "scaled:1", decision) is False
    version.refresh_from_db()
    assert version.desired_replicas is None
    assert not AuditEntry.objects.filter(action="version.scaled").exists()
