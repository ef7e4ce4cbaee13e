"""Tests for serving.policies.placement: fitting a version into a node, placing replicas on a fleet, and the
nodes wanted per accelerator type. Plain Python, time passed in."""

from __future__ import annotations

import pytest

from serving.policies.placement import (
    ACCELERATOR,
    HELD,
    MEMORY,
    MIN_MEMORY,
    REPLICAS,
    NodeState,
    Resident,
    VersionSpec,
    fit,
    nodes_wanted,
    place,
    replica_load,
)

GB = 1 << 30


def spec(key: str, gb: float = 1, **kw: object) -> VersionSpec:
    return VersionSpec(key, int(gb * GB), **kw)  # type: ignore[arg-type]


def node(
    name: str = "n1",
    budget_gb: float = 10,
    accelerator: str = "a10g",
    hot: dict | None = None,
    warm: frozenset[str] = frozenset(),
    total_gb: float | None = None,
) -> NodeState:
    residents = {}
    for key, (gb, last_used, *rest) in (hot or {}).items():
        flags = rest[0] if rest else {}
        in_flight = flags.pop("in_flight", 0) if flags else 0
        residents[key] = Resident(spec(key, gb, **flags), last_used, in_flight)
    return NodeState(
        name, accelerator, int(budget_gb * GB), residents, warm, None if total_gb is None else int(total_gb * GB)
    )


# -- fit --------------------------------------------------------------------------------------------


def test_fits_in_free_memory_without_evicting():
    verdict = fit(spec("m:1", 3), node(hot={"a:1": (6, 0.0)}))
    assert verdict.fits and verdict.evict == ()


def test_already_hot_fits_as_is():
    verdict = fit(spec("a:1", 6), node(budget_gb=6, hot={"a:1": (6, 0.0)}))
    assert verdict.fits and verdict.evict == ()


def test_evicts_least_recently_used_first_and_only_as_much_as_needed():
    # given a full node of four idle versions used at different times
    n = node(hot={"a:1": (3, 30.0), "b:1": (3, 10.0), "c:1": (2, 20.0), "d:1": (2, 40.0)})
    # when a 4 GB version comes: b (oldest) frees 3, c (next) 2 more
    verdict = fit(spec("new:1", 4), n, now=50.0)
    # then exactly those two go, oldest first
    assert verdict.fits and verdict.evict == ("b:1", "c:1")


def test_lru_ties_break_by_key_so_the_answer_is_deterministic():
    n = node(budget_gb=4, hot={"z:1": (2, 5.0), "a:1": (2, 5.0)})
    assert fit(spec("new:1", 2), n, now=9.0).evict == ("a:1",)


@pytest.mark.parametrize("flags", [{"pinned": True}, {"stable": True, "min_replicas": 1}, {"in_flight": 2}])
def test_never_evicts_what_must_stay(flags):
    # given the least recently used version is pinned, a stable one with minimum replicas, or busy
    n = node(budget_gb=6, hot={"old:1": (3, 0.0, dict(flags)), "young:1": (3, 10.0)})
    verdict = fit(spec("new:1", 3), n, now=20.0)
    # then the younger idle one goes instead
    assert verdict.fits and verdict.evict == ("young:1",)


def test_stable_without_minimum_replicas_may_be_evicted():
    n = node(budget_gb=3, hot={"s:1": (3, 0.0, {"stable": True, "min_replicas": 0})})
    assert fit(spec("new:1", 3), n, now=1.0).evict == ("s:1",)


def test_held_memory_is_a_transient_refusal_with_the_shortfall():
    n = node(
        budget_gb=8, hot={"p:1": (5, 0.0, {"pinned": True}), "busy:1": (2, 0.0, {"in_flight": 1}), "idle:1": (1, 0.0)}
    )
    verdict = fit(spec("new:1", 4), n, now=5.0)
    assert not verdict.fits and verdict.constraint == HELD and not verdict.permanent
    assert verdict.short_bytes == 3 * GB  # 0 free + 1 GB evictable, 4 needed
    # what holds the memory is counted, never named: the reason reaches the refused version's tenant, and the
    # holders may be other tenants' private versions
    assert "held by 2 other versions that must stay" in verdict.reason
    assert "p:1" not in verdict.reason and "busy:1" not in verdict.reason


def test_min_idle_spares_recently_used_versions():
    n = node(budget_gb=4, hot={"recent:1": (2, 99.0), "older:1": (2, 50.0)})
    verdict = fit(spec("new:1", 4), n, now=100.0, min_idle=10.0)
    assert not verdict.fits and verdict.constraint == HELD
    assert fit(spec("new:1", 2), n, now=100.0, min_idle=10.0).evict == ("older:1",)


def test_keep_protects_what_a_caller_just_placed():
    n = node(budget_gb=4, hot={"placed:1": (2, 0.0), "other:1": (2, 1.0)})
    assert fit(spec("new:1", 2), n, now=5.0, keep={"placed:1"}).evict == ("other:1",)


def test_footprint_over_the_whole_budget_is_permanent():
    verdict = fit(spec("big:1", 12), node(budget_gb=10))
    assert not verdict.fits and verdict.constraint == MEMORY and verdict.permanent
    assert verdict.short_bytes == 2 * GB
    assert "big:1" in verdict.reason and "2.0 GiB short" in verdict.reason


def test_accelerator_type_not_allowed_is_permanent():
    verdict = fit(spec("m:1", 1, accelerators=frozenset({"h100", "a100"})), node(accelerator="a10g"))
    assert not verdict.fits and verdict.constraint == ACCELERATOR and verdict.permanent
    assert "a100, h100" in verdict.reason and "a10g" in verdict.reason


def test_minimum_memory_reads_the_device_total_not_the_budget():
    s = spec("m:1", 1, min_memory=40 * GB)
    assert fit(s, node(budget_gb=10, total_gb=24)).constraint == MIN_MEMORY
    assert fit(s, node(budget_gb=10, total_gb=24)).short_bytes == 16 * GB
    assert fit(s, node(budget_gb=10, total_gb=80)).fits


def test_spec_refuses_negative_numbers():
    with pytest.raises(ValueError):
        VersionSpec("m:1", -1)


# -- place ------------------------------------------------------------------------------------------


def test_best_fit_chooses_the_tightest_node():
    nodes = [node("roomy", 20), node("snug", 10, hot={"x:1": (6, 0.0)}), node("middle", 12)]
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 4)}, nodes)
    assert plan.assignments["m:1"] == ("snug",) and plan.loads == {"snug": ("m:1",)}
    assert plan.evictions == {} and plan.unschedulable == {}


def test_prefers_a_node_where_the_artifact_is_warm():
    nodes = [node("snug", 5), node("warm", 20, warm=frozenset({"m:1"}))]
    assert place({"m:1": 1}, {"m:1": spec("m:1", 4)}, nodes).assignments["m:1"] == ("warm",)


def test_prefers_no_eviction_over_a_tighter_fit():
    nodes = [node("full", 4, hot={"old:1": (4, 0.0)}), node("empty", 20)]
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 4)}, nodes, now=10.0)
    assert plan.assignments["m:1"] == ("empty",) and plan.evictions == {}


def test_evicts_lru_when_no_node_has_room():
    nodes = [node("a", 4, hot={"old:1": (4, 1.0)}), node("b", 4, hot={"older:1": (4, 0.5, {"pinned": True})})]
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 3)}, nodes, now=10.0)
    assert plan.assignments["m:1"] == ("a",) and plan.evictions == {"a": ("old:1",)}


def test_only_allowed_accelerator_types():
    nodes = [node("cheap", 24, "t4"), node("fast", 80, "h100")]
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 4, accelerators=frozenset({"h100"}))}, nodes)
    assert plan.assignments["m:1"] == ("fast",)


def test_replicas_go_to_distinct_nodes():
    nodes = [node("a", 10), node("b", 10), node("c", 10)]
    plan = place({"m:1": 3}, {"m:1": spec("m:1", 2)}, nodes)
    assert sorted(plan.assignments["m:1"]) == ["a", "b", "c"]


def test_too_few_nodes_for_the_replicas_is_reported_with_what_was_placed():
    plan = place({"m:1": 3}, {"m:1": spec("m:1", 2)}, [node("a", 10), node("b", 10)])
    refused = plan.unschedulable["m:1"]
    assert refused.constraint == REPLICAS and (refused.placed, refused.wanted) == (2, 3)
    assert "2 eligible" in refused.reason


def test_hot_replicas_stay_where_they_are():
    nodes = [node("a", 20), node("b", 5, hot={"m:1": (4, 3.0)})]
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 4)}, nodes)
    assert plan.assignments["m:1"] == ("b",) and plan.loads == {} and plan.evictions == {}


def test_scale_in_unloads_the_least_recently_used_extra_replicas():
    nodes = [node("a", 10, hot={"m:1": (2, 5.0)}), node("b", 10, hot={"m:1": (2, 9.0)})]
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 2)}, nodes)
    assert plan.assignments["m:1"] == ("b",) and plan.evictions == {"a": ("m:1",)}


def test_scale_in_of_a_stable_version_with_a_minimum_stops_at_the_desired_count():
    # given a stable version with min_replicas 1 (kept from eviction by others) hot on two nodes
    kept = {"stable": True, "min_replicas": 1}
    nodes = [node("a", 10, hot={"m:1": (2, 5.0, dict(kept))}), node("b", 10, hot={"m:1": (2, 9.0, dict(kept))})]
    # when the autoscaler's ask drops to one (its minimum)
    plan = place({"m:1": 1}, {"m:1": spec("m:1", 2, **kept)}, nodes)
    # then the least recently used extra replica goes, and the other stays
    assert plan.assignments["m:1"] == ("b",) and plan.evictions == {"a": ("m:1",)}
    # and another version's placement still may not evict it
    crowded = [node("a", 3, hot={"m:1": (2, 5.0, dict(kept))})]
    other = place({"n:1": 1}, {"m:1": spec("m:1", 2, **kept), "n:1": spec("n:1", 2)}, crowded)
    assert other.evictions == {} and "n:1" in other.unschedulable


def test_scale_to_zero_unloads_idle_replicas_but_not_busy_ones():
    nodes = [node("a", 10, hot={"m:1": (2, 5.0)}), node("b", 10, hot={"m:1": (2, 9.0, {"in_flight": 1})})]
    plan = place({"m:1": 0}, {"m:1": spec("m:1", 2)}, nodes)
    assert plan.assignments["m:1"] == () and plan.evictions == {"a": ("m:1",)}


def test_a_placement_never_evicts_what_the_same_plan_wants():
    # given one node holding a (idle, least recently used) that the plan still wants
    nodes = [node("a", 4, hot={"keep:1": (2, 0.0)})]
    specs = {"keep:1": spec("keep:1", 2), "new:1": spec("new:1", 4)}
    # when the plan also wants a version that only fits by evicting it
    plan = place({"keep:1": 1, "new:1": 1}, specs, nodes, now=10.0)
    # then the wanted version stays and the newcomer is refused as held
    assert plan.assignments["keep:1"] == ("a",) and plan.evictions == {}
    assert plan.unschedulable["new:1"].constraint == HELD


def test_largest_first_so_the_big_version_keeps_its_hole():
    # two 6 GB nodes; a 5 GB and two 3 GB versions: placing the small ones first would strand the big one
    specs = {"small:1": spec("small:1", 3), "small:2": spec("small:2", 3), "big:1": spec("big:1", 5)}
    plan = place({"small:1": 1, "small:2": 1, "big:1": 1}, specs, [node("a", 6), node("b", 6)])
    assert plan.unschedulable == {}
    assert plan.assignments["small:1"] == plan.assignments["small:2"] != plan.assignments["big:1"]


def test_pinned_versions_are_placed_first():
    specs = {"big:1": spec("big:1", 6), "pin:1": spec("pin:1", 4, pinned=True)}
    plan = place({"big:1": 1, "pin:1": 1}, specs, [node("a", 6)])
    # then the pinned one holds the node although the other is larger, and the larger is blocked, not hopeless
    assert plan.assignments["pin:1"] == ("a",) and plan.assignments["big:1"] == ()
    assert plan.unschedulable["big:1"].constraint == HELD and plan.unschedulable["big:1"].short_bytes == 4 * GB


def test_unschedulable_names_the_constraint_and_shortfall():
    nodes = [node("a", 10, "a10g"), node("b", 24, "l4")]
    specs = {
        "huge:1": spec("huge:1", 30),
        "picky:1": spec("picky:1", 1, accelerators=frozenset({"h100"})),
        "roomy:1": spec("roomy:1", 1, min_memory=40 * GB),
    }
    plan = place({"huge:1": 1, "picky:1": 1, "roomy:1": 1}, specs, nodes)
    huge = plan.unschedulable["huge:1"]
    assert huge.constraint == MEMORY and huge.permanent and huge.short_bytes == 6 * GB  # the nearest miss
    assert plan.unschedulable["picky:1"].constraint == ACCELERATOR
    assert plan.unschedulable["roomy:1"].constraint == MIN_MEMORY
    assert plan.unschedulable["roomy:1"].short_bytes == 16 * GB


def test_a_transient_refusal_is_reported_before_a_permanent_one():
    # one node too small for good, one full of pinned work: the version is not hopeless, only blocked
    nodes = [node("small", 2), node("busy", 8, hot={"p:1": (8, 0.0, {"pinned": True})})]
    refused = place({"m:1": 1}, {"m:1": spec("m:1", 4)}, nodes).unschedulable["m:1"]
    assert refused.constraint == HELD and not refused.permanent and refused.short_bytes == 4 * GB


def test_place_refuses_duplicate_node_names_and_unknown_versions():
    with pytest.raises(ValueError):
        place({}, {}, [node("a"), node("a")])
    with pytest.raises(ValueError):
        place({"m:1": 1}, {}, [node("a")])


def test_no_nodes_at_all():
    refused = place({"m:1": 1}, {"m:1": spec("m:1", 1)}, []).unschedulable["m:1"]
    assert refused.constraint == REPLICAS and refused.placed == 0


def test_packs_many_versions_into_a_fleet_without_overfilling_any_node():
    specs = {f"m:{i}": spec(f"m:{i}", 0.5 + (i % 5) * 0.5) for i in range(40)}
    nodes = [node(f"n{i}", 12) for i in range(4)]
    plan = place(dict.fromkeys(specs, 1), specs, nodes)
    per_node: dict[str, int] = {}
    for key, where in plan.assignments.items():
        for name in where:
            per_node[name] = per_node.get(name, 0) + specs[key].footprint
    assert all(used <= 12 * GB for used in per_node.values())
    total = sum(s.footprint for s in specs.values())  # 60 GB for 48 GB of nodes
    placed = sum(specs[k].footprint for k, w in plan.assignments.items() if w)
    assert placed >= 46 * GB  # best fit decreasing leaves little unused
    assert set(plan.unschedulable) == {k for k, w in plan.assignments.items() if not w}
    assert total - placed == sum(specs[k].footprint for k in plan.unschedulable)


# -- nodes wanted ---------------------------------------------------------------------------------


def test_nodes_wanted_packs_first_fit_decreasing_per_type():
    specs = {"a:1": spec("a:1", 6), "b:1": spec("b:1", 6), "c:1": spec("c:1", 4), "d:1": spec("d:1", 4)}
    wanted, impossible = nodes_wanted(dict.fromkeys(specs, 1), specs, {"a10g": 10 * GB})
    assert wanted == {"a10g": 2} and impossible == {}  # 6+4 and 6+4; memory alone says 2 as well


def test_nodes_wanted_counts_bins_not_bytes():
    specs = {f"m:{i}": spec(f"m:{i}", 6) for i in range(3)}  # 18 GB: two nodes by bytes, three by packing
    assert nodes_wanted(dict.fromkeys(specs, 1), specs, {"a10g": 10 * GB})[0] == {"a10g": 3}


def test_nodes_wanted_puts_replicas_of_one_version_on_distinct_nodes():
    specs = {"m:1": spec("m:1", 1)}
    assert nodes_wanted({"m:1": 4}, specs, {"a10g": 10 * GB})[0] == {"a10g": 4}


def test_nodes_wanted_uses_the_first_allowed_type_that_holds_it():
    specs = {
        "any:1": spec("any:1", 4),
        "big:1": spec("big:1", 30),  # too big for an l4: goes to the h100s
        "h:1": spec("h:1", 1, accelerators=frozenset({"h100"})),
        "never:1": spec("never:1", 100),
        "zero:1": spec("zero:1", 1),
    }
    wanted, impossible = nodes_wanted(
        {"any:1": 1, "big:1": 1, "h:1": 1, "never:1": 1, "zero:1": 0}, specs, {"l4": 24 * GB, "h100": 80 * GB}
    )
    assert wanted == {"l4": 1, "h100": 1}
    assert list(impossible) == ["never:1"]


def test_nodes_wanted_honours_minimum_device_memory():
    specs = {"m:1": spec("m:1", 1, min_memory=40 * GB)}
    wanted, impossible = nodes_wanted(
        {"m:1": 1}, specs, {"l4": 20 * GB, "a100": 20 * GB}, device_memory={"l4": 24 * GB, "a100": 80 * GB}
    )
    assert wanted == {"l4": 0, "a100": 1} and impossible == {}


# --- compute -----------------------------------------------------------------------------------


def test_a_node_whose_residents_plan_on_its_compute_refuses_a_hot_replica_memory_would_allow() -> None:
    # given two nodes with memory for both versions, one already holding a replica planned at 60% of the device
    busy = VersionSpec("busy:1", 6 * GB, load=0.6)
    hot = VersionSpec("hot:1", GB, load=0.5)
    nodes = [
        NodeState("a", "gpu", 8 * GB, {"busy:1": Resident(busy, 0.0)}),
        NodeState("b", "gpu", 8 * GB, {"other:1": Resident(VersionSpec("other:1", GB, load=0.1), 0.0)}),
    ]
    assert place({"hot:1": 1}, {"hot:1": VersionSpec("hot:1", GB)}, nodes).assignments["hot:1"] == ("a",)
    # when a replica planned at 50% is placed, where best fit by memory alone picks a (the tighter fit)
    plan = place({"hot:1": 1}, {"hot:1": hot}, nodes, max_load=0.85)
    # then it goes to b, whose residents plan on 10%
    assert plan.assignments["hot:1"] == ("b",)
    # and where no node has compute to spare, it is refused transiently, saying why
    verdict = fit(hot, nodes[0], max_load=0.85)
    assert (verdict.fits, verdict.constraint, verdict.permanent) == (False, "compute", False)
    assert "60%" in verdict.reason
    # while an empty node takes any load, and a load of 0 (not known) packs by memory alone as before
    assert fit(VersionSpec("huge:1", GB, load=2.0), NodeState("c", "gpu", 8 * GB), max_load=0.85).fits
    assert fit(VersionSpec("plain:1", GB), nodes[0], max_load=0.85).fits


def test_a_replicas_load_pays_the_fixed_cost_of_the_small_batches_it_runs() -> None:
    # given a profile of 5 ms + 1 ms a row
    def estimate(rows: int) -> float:
        return 0.005 + 0.001 * rows

    # a quiet replica runs batches of one: 10 a second take 10 x 6 ms of the device
    assert replica_load(10.0, estimate, 32, window=0.005) == pytest.approx(0.06)
    # a busy one gathers 1000 x (5 ms + 6 ms) = 11 rows a batch, each batch 16 ms
    assert replica_load(1000.0, estimate, 32, window=0.005) == pytest.approx(1000 * 0.016 / 11)
    # no batch window known: the smallest batches, the safe side
    assert replica_load(1000.0, estimate, 32) >= replica_load(1000.0, estimate, 32, window=0.005)
    assert replica_load(0.0, estimate, 32) == 0.0
