"""The placement reconciler: its plan (serving.reconciler.plan), pure, on heartbeats as the nodes write them;
and its step (`reconcile()`) on the real PostgreSQL and Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from serving.dataplane.transport.fleet import NodeInfo
from serving.models import ModelVersion
from serving.node_tasks import send_plan
from serving.policies.placement import VersionSpec
from serving.reconciler import LOCK_KEY, REASON_PREFIX, Pending, holdings, plan, reconcile
from tests.conftest import register
from tests.test_streams_processes import REDIS_URL, clear

GIB = 1024**3


def node(
    name: str,
    *,
    hot: set[str] = frozenset(),
    assigned: set[str] = frozenset(),
    accelerator: str = "a10g",
    budget: int = 24 * GIB,
) -> NodeInfo:
    return NodeInfo(
        name=name,
        instance=name,
        host="h",
        pid=1,
        device="cpu",
        accelerator=accelerator,
        accelerator_count=1,
        memory_total=budget,
        memory_budget=budget,
        memory_used=0,
        labels={},
        started_at=0.0,
        heartbeat_at=0.0,
        serial=1,
        ready=frozenset(hot),
        hot=frozenset(hot),
        assigned=frozenset(assigned),
    )


def spec(key: str, footprint: int = GIB, **kwargs: object) -> VersionSpec:
    return VersionSpec(key, footprint, **kwargs)  # type: ignore[arg-type]


SPECS = {
    "m:1": spec("m:1"),
    "m:2": spec("m:2"),
    "big:1": spec("big:1", 30 * GIB),
    "h100:1": spec("h100:1", accelerators=frozenset({"h100"})),
}


def test_desired_two_loads_on_both_nodes() -> None:
    # given two empty nodes, when m:1 wants two replicas
    result = plan({"m:1": 2}, SPECS, [node("a"), node("b")])
    # then each node gets a load, nothing is unloaded
    assert sorted(result.loads) == [("a", "m:1"), ("b", "m:1")]
    assert result.unloads == [] and result.releases == [] and result.unschedulable == {}


def test_a_replica_hot_on_demand_is_assigned_in_place() -> None:
    # given m:1 already hot on b (loaded on demand), when one replica is wanted
    result = plan({"m:1": 1}, SPECS, [node("a"), node("b", hot={"m:1"})])
    # then it is assigned where it is: no second copy loaded elsewhere
    assert result.loads == [("b", "m:1")]
    assert result.placed["m:1"] == ("b",)


def test_scale_in_unloads_one_never_below_desired() -> None:
    # given m:1 assigned on both nodes, when the desired count drops to 1
    nodes = [node("a", hot={"m:1"}, assigned={"m:1"}), node("b", hot={"m:1"}, assigned={"m:1"})]
    result = plan({"m:1": 1}, SPECS, nodes)
    # then exactly one replica is unloaded and one stays
    assert len(result.unloads) == 1 and result.loads == []
    (gone,) = result.unloads
    assert len(result.placed["m:1"]) == 1 and gone[0] not in result.placed["m:1"]


def test_desired_zero_releases_without_unloading() -> None:
    # given m:1 assigned on a, when nothing is desired of it any more
    result = plan({"m:1": 0}, SPECS, [node("a", hot={"m:1"}, assigned={"m:1"})])
    # then it is released (it stays loaded, evictable, on demand as any version), not unloaded
    assert result.releases == [("a", "m:1")] and result.unloads == [] and result.loads == []


def test_pending_tasks_are_not_sent_twice() -> None:
    # given a load of m:1 to a already sent, not yet done
    nodes = [node("a"), node("b")]
    pending = [Pending("load", "a", "m:1")]
    # when the next step plans two replicas
    result = plan({"m:1": 2}, SPECS, nodes, pending)
    # then only b's load is sent
    assert result.loads == [("b", "m:1")]
    # and an unload sent and not done counts that replica as gone already
    nodes = [node("a", hot={"m:1"}, assigned={"m:1"}), node("b", hot={"m:1"}, assigned={"m:1"})]
    assert holdings(nodes, [Pending("unload", "b", "m:1")]) == {"a": {"m:1"}, "b": set()}
    assert plan({"m:1": 1}, SPECS, nodes, [Pending("unload", "b", "m:1")]).unloads == []


def test_the_same_fleet_twice_plans_nothing_new() -> None:
    # given the fleet after the first plan's loads landed
    nodes = [node("a", hot={"m:1"}, assigned={"m:1"}), node("b", hot={"m:1"}, assigned={"m:1"})]
    # when the reconciler runs again with the same wish, then it does nothing (idempotent)
    result = plan({"m:1": 2}, SPECS, nodes)
    assert (result.loads, result.unloads, result.releases, result.unschedulable) == ([], [], [], {})


def test_unschedulable_with_the_reason() -> None:
    nodes = [node("a"), node("b")]
    # a version over every node's budget
    result = plan({"big:1": 1}, SPECS, nodes)
    assert "big:1" in result.unschedulable and "budget" in result.unschedulable["big:1"]
    assert result.loads == []
    # a version allowed only on a type the fleet lacks
    assert "h100" in plan({"h100:1": 1}, SPECS, nodes).unschedulable["h100:1"]
    # more replicas than nodes: the ones that fit are placed, and the shortfall is reported
    result = plan({"m:1": 3}, SPECS, nodes)
    assert len(result.loads) == 2 and "3 replicas" in result.unschedulable["m:1"]


def test_constraints_pick_the_node() -> None:
    # given an a10g and an h100 node, when a version allowed only on h100 wants one replica
    result = plan({"h100:1": 1}, SPECS, [node("a"), node("b", accelerator="h100")])
    # then it goes to the h100 node
    assert result.loads == [("b", "h100:1")]


def test_a_lost_node_is_replaced() -> None:
    # given m:1 was assigned on a and b, and b's heartbeat expired (it is not in the fleet read)
    nodes = [node("a", hot={"m:1"}, assigned={"m:1"}), node("c")]
    # when two replicas are wanted, then the one missing goes to the live node left
    assert plan({"m:1": 2}, SPECS, nodes).loads == [("c", "m:1")]


def test_a_node_where_it_is_warm_is_preferred() -> None:
    # given two empty nodes, b holding m:1 warm in host memory
    warm = node("b")
    warm = NodeInfo(**{**warm.__dict__, "warm": frozenset({"m:1"})})
    # when one replica is wanted, then it goes to b (its load skips the disk)
    assert plan({"m:1": 1}, SPECS, [node("a"), warm]).loads == [("b", "m:1")]


# -- the step, on the real PostgreSQL and Redis ------------------------------------------------------------


@pytest.fixture
def fleet_redis() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    clear(client)
    yield client
    clear(client)
    client.close()


def test_a_step_skips_while_another_runs_and_marks_what_no_node_can_hold(db, fleet_redis, model_files) -> None:  # noqa: ANN001
    register(model_files.digits, "digits")
    version = ModelVersion.objects.get(model__name="digits")
    version.desired_replicas = 2
    version.save()
    # given another step holds the lock, when a step starts, then it does nothing
    fleet_redis.set(LOCK_KEY, "another", ex=30)
    assert reconcile(send=send_plan, url=REDIS_URL).skipped == "another reconciler step is running"
    version.refresh_from_db()
    assert version.unschedulable_reason == ""
    # when the lock is free and the fleet is empty, then the version is marked unschedulable with the reason
    fleet_redis.delete(LOCK_KEY)
    outcome = reconcile(send=send_plan, url=REDIS_URL)
    assert outcome.nodes == 0 and outcome.plan is not None and outcome.plan.loads == []
    version.refresh_from_db()
    assert version.unschedulable_reason.startswith(REASON_PREFIX) and "0 eligible nodes" in version.unschedulable_reason
    assert not fleet_redis.exists(LOCK_KEY)  # released
    # and once nothing is desired, the reconciler's own verdict is cleared
    version.desired_replicas = 0
    version.save()
    reconcile(send=send_plan, url=REDIS_URL)
    version.refresh_from_db()
    assert version.unschedulable_reason == ""


def test_a_node_where_the_load_failed_is_not_sent_it_again() -> None:
    # given m:1's load failed on a (its heartbeat says why)
    failed = NodeInfo(**{**node("a").__dict__, "failures": {"m:1": "RuntimeError: bad archive"}})
    # when the reconciler plans a replica there, then no load is sent, and the version says why
    result = plan({"m:1": 1}, SPECS, [failed])
    assert result.loads == []
    assert "failed to load on a: RuntimeError: bad archive" in result.unschedulable["m:1"]


def test_a_node_records_hot_then_warm_then_cold_for_what_is_on_its_disk() -> None:
    from serving.replicas import tiers

    # given a node holding a:1 on the device, b:1 in host memory, and the artifacts of a, b and c on its disk,
    # and serving d:1 whose artifact it would have to fetch
    node = NodeInfo(
        name="n",
        instance="i",
        host="h",
        pid=1,
        device="cpu",
        accelerator="a10g",
        accelerator_count=1,
        memory_total=1,
        memory_budget=1,
        memory_used=0,
        labels={},
        started_at=0.0,
        heartbeat_at=0.0,
        serial=1,
        ready=frozenset({"a:1", "b:1", "c:1", "d:1"}),
        hot=frozenset({"a:1"}),
        warm=frozenset({"b:1"}),
        cached=frozenset({"a:1", "b:1", "c:1"}),
    )
    # then each is recorded at its hottest tier, and d:1 (on no disk here) not at all
    assert tiers(node) == {"a:1": "hot", "b:1": "warm", "c:1": "cold"}
    # and the heartbeat carries the cold tier through Redis's hash
    assert NodeInfo.from_hash({k.encode(): v for k, v in node.to_hash().items()}).cached == node.cached


def test_a_node_whose_replicas_plan_on_its_compute_gets_no_other_hot_one() -> None:
    # given node a holding a replica planned at 70% of its device and node b holding a quiet one, a the tighter fit
    specs = {"hot:1": spec("hot:1", 20 * GIB, load=0.7), "quiet:1": spec("quiet:1", load=0.05)}
    nodes = [node("a", assigned={"hot:1"}), node("b", assigned={"quiet:1"})]
    # when a second hot version, planned at 50% a replica, wants one: memory alone would put it on a
    specs["hot:2"] = spec("hot:2", load=0.5)
    result = plan({"hot:1": 1, "quiet:1": 1, "hot:2": 1}, specs, nodes)
    # then it goes to b, as the simulator's placement would put it (the same `placement.place`)
    assert result.loads == [("b", "hot:2")]
    assert plan({"hot:1": 1, "quiet:1": 1, "hot:2": 1}, {**specs, "hot:2": spec("hot:2")}, nodes).loads == [
        ("a", "hot:2")
    ]
