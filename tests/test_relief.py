"""Tests for serving.policies.placement.relieve: make-before-break moves off a device whose co-located replicas
grew past its compute. Plain Python, time passed in."""

from __future__ import annotations

from serving.policies.placement import MAX_LOAD, Move, relieve
from tests.test_consolidation import node  # the same devices: key -> (footprint GB, planned load)


def test_a_device_whose_replicas_outgrew_it_sheds_its_largest_onto_the_least_loaded_device() -> None:
    # given three replicas placed on one device when quiet, now planned at 50%, 40% and 30% of it (120%)
    nodes = [
        node("a", {"x:1": (2, 0.5), "y:1": (2, 0.4), "z:1": (2, 0.3)}),
        node("b", {"w:1": (2, 0.6)}),
        node("c", {"v:1": (2, 0.2)}),
    ]
    moves = relieve(nodes, now=10.0)
    # then the largest moves (one move brings a within its 85%), to c, the device with the most room
    assert moves == (Move("x:1", "a", "c", 10.0),)


def test_relief_moves_until_what_stays_is_within_the_cap() -> None:
    # given a device at 150% and an empty one on offer
    nodes = [node("a", {"x:1": (2, 0.5), "y:1": (2, 0.5), "z:1": (2, 0.5)}), node("spare", {})]
    moves = relieve(nodes, now=1.0)
    # then the first leaves for the empty device; a second would not fit beside it within the cap, and nothing
    # else has room, so a stays at 100% until more room is offered
    assert [m.key for m in moves] == ["x:1"]
    assert moves[0].target == "spare"
    # with a second empty device, both leave and a keeps one
    moves = relieve([*nodes, node("spare2", {})], now=1.0)
    assert sorted((m.key, m.target) for m in moves) == [("x:1", "spare"), ("y:1", "spare2")]


def test_a_device_within_its_compute_is_left_alone() -> None:
    nodes = [node("a", {"x:1": (2, 0.5), "y:1": (2, 0.45)}), node("b", {})]
    # 95% planned: over placement's cap but within the device, so no move (the gap is the hysteresis)
    assert relieve(nodes, now=0.0) == ()
    # a lower threshold moves one
    assert relieve(nodes, now=0.0, above=0.9) == (Move("x:1", "a", "b", 0.0),)


def test_a_replica_alone_on_its_device_is_the_autoscalers_to_multiply() -> None:
    assert relieve([node("a", {"x:1": (2, 1.7)}), node("b", {})], now=0.0) == ()


def test_devices_already_serving_are_preferred_over_empty_ones() -> None:
    nodes = [node("a", {"x:1": (2, 0.6), "y:1": (2, 0.6)}), node("empty", {}), node("b", {"w:1": (2, 0.1)})]
    assert relieve(nodes, now=0.0) == (Move("x:1", "a", "b", 0.0),)


def test_targets_need_memory_and_must_not_hold_the_version() -> None:
    nodes = [
        node("a", {"x:1": (8, 0.6), "y:1": (2, 0.6)}),
        node("small", {"u:1": (10, 0.1)}),  # 6 GiB free: not x:1's 8
        node("has-x", {"x:1": (8, 0.1)}),
        node("has-room", {"t:1": (2, 0.2)}),
    ]
    moves = relieve(nodes, now=0.0)
    assert moves == (Move("x:1", "a", "has-room", 0.0),)


def test_moves_in_flight_count_against_the_bound_and_no_longer_load_their_source() -> None:
    nodes = [node("a", {"x:1": (2, 0.6), "y:1": (2, 0.6)}), node("b", {"x:1": (2, 0.6)}), node("c", {})]
    moving = [Move("x:1", "a", "b", 0.0)]
    # x:1 is leaving a: what stays (60%) is within the cap, so nothing more moves off a
    assert relieve(nodes, now=5.0, moving=moving) == ()
    # and no move starts past the bound
    busy = [node("a", {"x:1": (2, 0.6), "y:1": (2, 0.6)}), node("c", {})]
    assert relieve(busy, now=5.0, moving=[Move("q:1", "d", "e", 0.0)], max_moves=1) == ()


def test_an_overloaded_device_is_not_a_target_and_the_most_loaded_goes_first() -> None:
    nodes = [
        node("a", {"x:1": (2, 0.6), "y:1": (2, 0.5)}),  # 110%
        node("b", {"w:1": (2, 0.7), "v:1": (2, 0.7)}),  # 140%
        node("c", {}),
    ]
    moves = relieve(nodes, now=0.0, max_moves=1)
    assert moves == (Move("v:1", "b", "c", 0.0),)  # of equal loads, by key
    assert MAX_LOAD < 1.0
