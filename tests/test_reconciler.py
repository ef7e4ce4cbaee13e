"""The placement reconciler: its plan (serving.reconciler.plan), pure, on heartbeats as the nodes write them;
and its step (`reconcile()`) on the real PostgreSQL and Redis."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from serving.dataplane.gateway.snapshot import hub as process_hub
from serving.dataplane.gateway.snapshot_redis import SERIAL_KEY
from serving.dataplane.transport.fleet import NODES_KEY, NodeInfo, node_key
from serving.models import ModelVersion
from serving.node_tasks import send_plan
from serving.policies.placement import Move, VersionSpec
from serving.reconciler import (
    LOAD_KEY,
    LOCK_KEY,
    MOVES_KEY,
    REASON_PREFIX,
    Consolidating,
    Pending,
    Plan,
    holdings,
    plan,
    reconcile,
)
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


def test_a_task_done_between_the_steps_reads_is_seen_by_one_of_them(db, fleet_redis, model_files, monkeypatch) -> None:  # noqa: ANN001
    """Issue 19's race: an unload finishing while a step reads Redis must not look undone to that step."""
    import serving.reconciler as reconciler
    from serving.dataplane.transport import fleet

    register(model_files.digits, "digits")
    version = ModelVersion.objects.get(model__name="digits")
    key = version.key

    def beat(info: NodeInfo) -> None:
        fleet_redis.delete(fleet.node_key(info.name))
        fleet_redis.hset(fleet.node_key(info.name), mapping=info.to_hash())
        fleet_redis.sadd(fleet.NODES_KEY, info.name)

    # given one replica desired, held on b, and on a until the unload an earlier step sent it finishes
    version.desired_replicas = 1
    version.save()
    beat(node("a", hot={key}, assigned={key}))
    beat(node("b", hot={key}, assigned={key}))
    fleet_redis.hset(reconciler.PENDING_KEY, Pending("unload", "a", key).field, 1e12)

    # when a's unload finishes right after the step's first read of Redis, as the node finishes one: the
    # heartbeat that shows the outcome first, then the task's record cleared
    reads = {"done": False}

    def finish_after(read):  # noqa: ANN001, ANN202
        def wrapped(*args: object):  # noqa: ANN202
            answer = read(*args)
            if not reads["done"]:
                reads["done"] = True
                beat(node("a"))
                fleet_redis.hdel(reconciler.PENDING_KEY, Pending("unload", "a", key).field)
            return answer

        return wrapped

    monkeypatch.setattr(reconciler, "read_fleet", finish_after(reconciler.read_fleet))
    monkeypatch.setattr(reconciler, "read_pending", finish_after(reconciler.read_pending))
    sent = []
    outcome = reconcile(send=lambda client, plan, now: sent.append(plan), url=REDIS_URL)
    # then the step sees one replica, b's, and sends nothing: not b's unload (none left), not a's again
    assert reads["done"] and outcome.plan is not None and len(sent) == 1
    assert (outcome.plan.loads, outcome.plan.unloads, outcome.plan.releases) == ([], [], [])
    assert outcome.plan.placed[key] == ("b",)


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


# -- consolidation: two quiet nodes become one, load first, then unload ---------------------------------

QUIET_SPECS = {"x:1": spec("x:1", load=0.1), "y:1": spec("y:1", load=0.2)}
NOW_CONSOLIDATING = Consolidating(moves=2, hold=30.0)


def test_a_move_loads_first_holds_both_copies_while_it_loads_then_unloads_the_old() -> None:
    wants = {"x:1": 1, "y:1": 1}
    # given x on a and y on b, each planning on a tenth or a fifth of its device
    fleet = [node("a", hot={"x:1"}, assigned={"x:1"}), node("b", hot={"y:1"}, assigned={"y:1"})]
    first = plan(wants, QUIET_SPECS, fleet, now=1000.0, consolidating=NOW_CONSOLIDATING)
    # then the first step only notes since when both are quiet
    assert first.loads == [] and first.unloads == [] and first.moves == []
    assert first.quiet == {"a": 1000.0, "b": 1000.0}
    # when the hold has passed, then x (the lighter) is loaded on b, and nothing is unloaded yet
    second = plan(
        wants, QUIET_SPECS, fleet, now=1030.0, moves=first.moves, quiet=first.quiet, consolidating=NOW_CONSOLIDATING
    )
    assert second.loads == [("b", "x:1")] and second.unloads == []
    assert [(m.key, m.source, m.target) for m in second.moves] == [("x:1", "a", "b")]
    # when b has it assigned but still loading, then both copies stay: x never has fewer replicas than wanted
    loading = [
        node("a", hot={"x:1"}, assigned={"x:1"}),
        NodeInfo(**{**node("b", hot={"y:1"}, assigned={"x:1", "y:1"}).__dict__, "loading": frozenset({"x:1"})}),
    ]
    third = plan(
        wants, QUIET_SPECS, loading, now=1040.0, moves=second.moves, quiet=second.quiet, consolidating=NOW_CONSOLIDATING
    )
    assert third.loads == [] and third.unloads == [] and len(third.moves) == 1
    # when b's copy is hot, then a's is unloaded (the unload drains first) and the move is over
    made = [node("a", hot={"x:1"}, assigned={"x:1"}), node("b", hot={"x:1", "y:1"}, assigned={"x:1", "y:1"})]
    fourth = plan(
        wants, QUIET_SPECS, made, now=1050.0, moves=third.moves, quiet=third.quiet, consolidating=NOW_CONSOLIDATING
    )
    assert fourth.unloads == [("a", "x:1")] and fourth.loads == [] and fourth.moves == []
    assert fourth.placed == {"x:1": ("b",), "y:1": ("b",)}


def test_a_move_whose_copy_failed_to_load_is_given_up_and_the_old_copy_stays() -> None:
    wants = {"x:1": 1, "y:1": 1}
    fleet = [node("a", hot={"x:1"}, assigned={"x:1"}), node("b", hot={"y:1"}, assigned={"y:1"})]
    started = plan(wants, QUIET_SPECS, fleet, now=1030.0, quiet={"a": 0.0, "b": 0.0}, consolidating=NOW_CONSOLIDATING)
    assert started.loads == [("b", "x:1")]
    failed = [fleet[0], NodeInfo(**{**fleet[1].__dict__, "failures": {"x:1": "RuntimeError: bad archive"}})]
    after = plan(
        wants,
        QUIET_SPECS,
        failed,
        now=1040.0,
        moves=started.moves,
        quiet=started.quiet,
        consolidating=NOW_CONSOLIDATING,
    )
    assert after.unloads == [] and after.moves == [] and after.loads == []


def test_two_busy_nodes_are_not_consolidated() -> None:
    # given x and y each planning on 45% of a device: together over the 85% placement plans on
    specs = {"x:1": spec("x:1", load=0.45), "y:1": spec("y:1", load=0.45)}
    fleet = [node("a", hot={"x:1"}, assigned={"x:1"}), node("b", hot={"y:1"}, assigned={"y:1"})]
    result = plan(
        {"x:1": 1, "y:1": 1}, specs, fleet, now=1e6, quiet={"a": 0.0, "b": 0.0}, consolidating=NOW_CONSOLIDATING
    )
    assert result.loads == [] and result.moves == []


def test_a_node_whose_replicas_outgrew_it_is_relieved_make_before_break() -> None:
    # given x and y placed together on a when quiet, now sized at 60% of a device each, and c serving little
    specs = {"x:1": spec("x:1", load=0.6), "y:1": spec("y:1", load=0.6), "z:1": spec("z:1", load=0.1)}
    wants = {"x:1": 1, "y:1": 1, "z:1": 1}
    fleet = [node("a", hot={"x:1", "y:1"}, assigned={"x:1", "y:1"}), node("c", hot={"z:1"}, assigned={"z:1"})]
    first = plan(wants, specs, fleet, now=1000.0, consolidating=Consolidating(moves=0))
    # then one of them loads on c, recorded as a move, and nothing is unloaded yet
    assert first.loads == [("c", "x:1")] and first.unloads == []
    assert [(m.key, m.source, m.target) for m in first.moves] == [("x:1", "a", "c")]
    # when c's copy is hot, then a's is unloaded: a and c each hold what they can serve
    made = [
        node("a", hot={"x:1", "y:1"}, assigned={"x:1", "y:1"}),
        node("c", hot={"x:1", "z:1"}, assigned={"x:1", "z:1"}),
    ]
    second = plan(wants, specs, made, now=1030.0, moves=first.moves, consolidating=Consolidating(moves=0))
    assert second.unloads == [("a", "x:1")] and second.loads == [] and second.moves == []
    # and with relief off, nothing moves
    assert plan(wants, specs, fleet, now=1000.0, consolidating=Consolidating(moves=0, relieve_moves=0)).moves == []


def test_two_lightly_loaded_nodes_converge_to_one_through_the_step(db, fleet_redis, model_files) -> None:  # noqa: ANN001
    # given two versions with a replica each on its own node of a two-node fleet, each planning on a tenth of it
    register(model_files.digits, "digits")
    register(model_files.digits, "digits-b")
    versions = {v.model.name: v for v in ModelVersion.objects.filter(model__name__in=["digits", "digits-b"])}
    for v in versions.values():
        v.desired_replicas = 1
        v.save()
    x, y = versions["digits"].key, versions["digits-b"].key
    fleet_redis.hset(LOAD_KEY, mapping={x: 0.1, y: 0.1})
    sent: list[Plan] = []

    def send(client: redis.Redis, result: Plan, now: float) -> None:  # the nodes' side is the heartbeats below
        sent.append(result)

    def beat(**holding: set[str]) -> None:
        fleet_redis.delete(NODES_KEY)
        for name, keys in holding.items():
            fleet_redis.sadd(NODES_KEY, name)
            fleet_redis.hset(node_key(name), mapping=node(name, hot=keys, assigned=keys).to_hash())

    def step(now: float) -> Plan:
        outcome = reconcile(send=send, url=REDIS_URL, now=now, consolidating=Consolidating(moves=2, hold=30.0))
        assert outcome.plan is not None
        return outcome.plan

    beat(a={x}, b={y})
    assert step(1000.0).loads == []  # quiet since now: nothing moves before the hold
    moved = step(1031.0)
    (load,) = moved.loads
    source = "a" if load[0] == "b" else "b"
    key = x if source == "a" else y
    assert load == ("b" if source == "a" else "a", key) and moved.unloads == []
    assert fleet_redis.hlen(MOVES_KEY) == 1
    # when the target has loaded the copy, then the old one is unloaded, and only then
    beat(**{source: {key}, load[0]: {x, y}})
    done = step(1041.0)
    assert done.unloads == [(source, key)] and done.loads == []
    assert fleet_redis.hlen(MOVES_KEY) == 0
    # when the source has unloaded it, then the fleet holds both on one node and plans nothing more
    beat(**{source: set(), load[0]: {x, y}})
    settled = step(1051.0)
    assert settled.loads == [] and settled.unloads == [] and settled.moves == []
    assert settled.placed == {x: (load[0],), y: (load[0],)}


def test_a_version_scaled_in_during_a_move_loses_the_copy_on_the_device_being_emptied() -> None:
    # given x with two replicas (a, c), the one on a moving to b and still loading there
    specs = {**QUIET_SPECS, "z:1": spec("z:1", load=0.6)}
    fleet = [
        node("a", hot={"x:1"}, assigned={"x:1"}),
        NodeInfo(**{**node("b", hot={"y:1"}, assigned={"x:1", "y:1"}).__dict__, "loading": frozenset({"x:1"})}),
        node("c", hot={"x:1", "z:1"}, assigned={"x:1", "z:1"}),
    ]
    moves = [Move("x:1", "a", "b", 1000.0)]
    # while two are wanted, nothing is unloaded
    kept = plan({"x:1": 2, "y:1": 1, "z:1": 1}, specs, fleet, now=1010.0, moves=moves, consolidating=NOW_CONSOLIDATING)
    assert kept.unloads == [] and kept.moves == moves
    # when x scales in to one, then the copy on a goes (the device the move empties), not the one loading on b
    scaled = plan(
        {"x:1": 1, "y:1": 1, "z:1": 1}, specs, fleet, now=1010.0, moves=moves, consolidating=NOW_CONSOLIDATING
    )
    assert scaled.unloads == [("a", "x:1")] and scaled.moves == moves


def test_a_moves_old_copy_is_kept_while_it_is_the_last_one_hot() -> None:
    # given x hot only on a, moving to b, and a second replica of x still loading on c
    fleet = [
        node("a", hot={"x:1"}, assigned={"x:1"}),
        NodeInfo(**{**node("b", hot={"y:1"}, assigned={"x:1", "y:1"}).__dict__, "loading": frozenset({"x:1"})}),
        NodeInfo(**{**node("c", assigned={"x:1"}).__dict__, "loading": frozenset({"x:1"})}),
    ]
    moves = [Move("x:1", "a", "b", 1000.0)]
    # when x scales in to one, then a copy still loading goes, never the one copy that serves
    scaled = plan({"x:1": 1, "y:1": 1}, QUIET_SPECS, fleet, now=1010.0, moves=moves, consolidating=NOW_CONSOLIDATING)
    assert len(scaled.unloads) == 1 and scaled.unloads[0][0] != "a"


def test_a_step_whose_lock_lapsed_writes_nothing_more_and_leaves_the_new_holders_lock(
    db, fleet_redis, model_files
) -> None:  # noqa: ANN001
    # given a version no node can hold (the fleet is empty), so a step would mark it unschedulable
    register(model_files.digits, "digits")
    ModelVersion.objects.filter(model__name="digits").update(desired_replicas=2)

    # when the step's lock lapses while it sends and another step takes it (as one would after LOCK_SECONDS)
    def send_slowly(client: redis.Redis, plan: Plan, now: float) -> None:
        client.set(LOCK_KEY, "the next step", ex=30)

    outcome = reconcile(send=send_slowly, url=REDIS_URL)
    # then the step stops before its next write: the reason is not written, and the new holder's lock stays
    assert outcome.plan is None and "lapsed" in outcome.skipped
    assert ModelVersion.objects.get(model__name="digits").unschedulable_reason == ""
    assert fleet_redis.get(LOCK_KEY) == b"the next step"


def test_a_step_that_marks_several_versions_publishes_the_snapshot_once(  # noqa: ANN001
    db, fleet_redis, model_files, settings, monkeypatch
) -> None:
    # This process's snapshot hub keeps the highest serial it is handed, and Redis' serials are far above the
    # process's own: put back what it held, or the next tests' snapshots in this process would be ignored.
    monkeypatch.setattr(process_hub, "current", process_hub.current)
    # given two versions no node can hold, and the snapshot published to Redis (as in production)
    for name in ("digits", "other"):
        register(model_files.digits, name)
    ModelVersion.objects.update(desired_replicas=1)
    settings.REDIS_URL = REDIS_URL
    fleet_redis.set(SERIAL_KEY, 100)  # each publication takes the next serial
    # when one step marks both unschedulable
    reconcile(send=send_plan, url=REDIS_URL)
    # then both carry the reason, and the routing snapshot was published once for the step, not once per version
    reasons = ModelVersion.objects.values_list("unschedulable_reason", flat=True)
    assert all(r.startswith(REASON_PREFIX) for r in reasons) and len(reasons) == 2
    assert int(fleet_redis.get(SERIAL_KEY)) == 101
