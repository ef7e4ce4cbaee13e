"""Tests for serving.policies.placement.consolidate: make-before-break moves that empty the least-loaded devices,
with a hold time and a bound on moves in flight. Plain Python, time passed in."""

from __future__ import annotations

from serving.policies.placement import MAX_LOAD, Move, NodeState, Resident, VersionSpec, consolidate

GB = 1 << 30


def node(
    name: str, residents: dict[str, tuple[float, float]], budget_gb: float = 16, accelerator: str = "t4"
) -> NodeState:
    """`residents`: key -> (footprint GB, planned load)."""
    hot = {k: Resident(VersionSpec(k, int(gb * GB), load=load), 0.0) for k, (gb, load) in residents.items()}
    return NodeState(name, accelerator, int(budget_gb * GB), hot)


def test_two_quiet_devices_merge_onto_one_after_the_hold() -> None:
    # given two devices each holding one quiet replica (10% and 20% of a device)
    nodes = [node("a", {"x:1": (2, 0.1)}), node("b", {"y:1": (2, 0.2)})]
    # when they have just become quiet, then nothing moves yet, and the step remembers since when
    first = consolidate(nodes, now=100.0, quiet={}, hold=30.0)
    assert first.moves == () and first.quiet == {"a": 100.0, "b": 100.0}
    # when they have stayed quiet for less than the hold, still nothing
    assert consolidate(nodes, now=129.0, quiet=first.quiet, hold=30.0).moves == ()
    # when the hold has passed, then the least loaded one moves onto the other: one move, make before break
    later = consolidate(nodes, now=130.0, quiet=first.quiet, hold=30.0)
    assert later.moves == (Move("x:1", "a", "b", 130.0),)
    assert later.emptying == ("a",)


def test_a_device_whose_load_rose_starts_its_hold_again() -> None:
    quiet = consolidate([node("a", {"x:1": (2, 0.1)}), node("b", {"y:1": (2, 0.2)})], now=0.0, quiet={}).quiet
    # given a's load rose over the threshold, then it is no longer quiet
    busy = [node("a", {"x:1": (2, 0.6)}), node("b", {"y:1": (2, 0.2)})]
    again = consolidate(busy, now=10.0, quiet=quiet, hold=5.0)
    assert "a" not in again.quiet
    # and only b, quiet long enough, is a candidate: but a (now 60%) takes its 20% within the cap
    assert again.moves == (Move("y:1", "b", "a", 10.0),)


def test_nothing_moves_past_the_compute_cap() -> None:
    # given two devices at 45% each: together 90%, over the 85% placement plans on
    nodes = [node("a", {"x:1": (2, 0.45)}), node("b", {"y:1": (2, 0.45)})]
    # then neither is emptied onto the other, whatever the hold
    result = consolidate(nodes, now=1000.0, quiet={"a": 0.0, "b": 0.0}, hold=1.0, below=0.5)
    assert result.moves == ()
    # and with a laxer cap than placement's, they would be
    assert consolidate(nodes, now=1000.0, quiet={"a": 0.0, "b": 0.0}, hold=1.0, max_load=0.95).moves
    assert MAX_LOAD == 0.85


def test_nothing_moves_past_the_memory_budget() -> None:
    # given a quiet device whose 10 GB replica fits nowhere else (the other has 8 GB free)
    nodes = [node("a", {"x:1": (10, 0.1)}), node("b", {"y:1": (8, 0.1)})]
    result = consolidate(nodes, now=100.0, quiet={"a": 0.0, "b": 0.0}, hold=1.0)
    # then neither moves: together they are 18 GB, over either device's 16
    assert result.moves == ()


def test_a_device_is_emptied_only_when_every_replica_has_a_target() -> None:
    # given a quiet device holding x (fits on b) and z (a version b already holds: one replica per node)
    nodes = [node("a", {"x:1": (1, 0.05), "z:1": (1, 0.05)}), node("b", {"z:1": (1, 0.3)})]
    result = consolidate(nodes, now=100.0, quiet={"a": 0.0}, hold=1.0)
    # then nothing moves: moving x alone would free no device
    assert result.moves == ()


def test_moves_in_flight_are_bounded_and_draining_sources_go_first() -> None:
    # given four quiet one-replica devices and one busy device with room for all of them
    nodes = [node(f"q{i}", {f"v{i}:1": (1, 0.05)}) for i in range(4)] + [node("busy", {"b:1": (1, 0.6)})]
    quiet = {f"q{i}": 0.0 for i in range(4)}
    # when at most two moves may be in flight
    first = consolidate(nodes, now=100.0, quiet=quiet, hold=1.0, max_moves=2)
    # then two start, each to the fullest device that takes it
    assert len(first.moves) == 2
    assert all(m.target == "busy" for m in first.moves)
    # and while they are in flight, none more
    assert consolidate(nodes, now=101.0, quiet=quiet, hold=1.0, max_moves=2, moving=first.moves).moves == ()
    # and a device that receives a move is never a source while it does
    assert "busy" not in {m.source for m in first.moves}


def test_a_device_with_more_replicas_than_the_budget_keeps_draining_next_step() -> None:
    # given a quiet device with three small replicas and room on another, one move at a time
    nodes = [node("a", {"x:1": (1, 0.05), "y:1": (1, 0.05), "z:1": (1, 0.05)}), node("b", {"b:1": (1, 0.5)})]
    first = consolidate(nodes, now=100.0, quiet={"a": 0.0}, hold=1.0, max_moves=1)
    assert len(first.moves) == 1 and first.emptying == ("a",)
    # when that move is done (the copy is on b, a's unloaded) a goes on draining first
    moved = first.moves[0].key
    after = [
        node("a", {k: (1, 0.05) for k in ("x:1", "y:1", "z:1") if k != moved}),
        node("b", {"b:1": (1, 0.5), moved: (1, 0.05)}),
    ]
    second = consolidate(after, now=101.0, quiet=first.quiet, hold=1.0, max_moves=1)
    assert len(second.moves) == 1 and second.moves[0].source == "a"


def test_only_placed_replicas_move_and_a_node_without_any_takes_none() -> None:
    # given node c holds only an on-demand copy (not placed): it is neither emptied nor a target
    nodes = [node("a", {"x:1": (1, 0.05)}), node("c", {"od:1": (1, 0.0)})]
    placed = {"a": {"x:1"}, "c": set()}
    assert consolidate(nodes, now=100.0, quiet={"a": 0.0, "c": 0.0}, placed=placed, hold=1.0).moves == ()


def test_the_same_state_gives_the_same_moves() -> None:
    nodes = [node(f"q{i}", {f"v{i}:1": (1, 0.05 * (i + 1))}) for i in range(5)]
    quiet = {f"q{i}": 0.0 for i in range(5)}
    a = consolidate(nodes, now=50.0, quiet=quiet, hold=1.0, max_moves=4)
    b = consolidate(list(reversed(nodes)), now=50.0, quiet=quiet, hold=1.0, max_moves=4)
    assert a.moves == b.moves
    # and the least loaded go first, onto the fullest that take them, never onto a device being emptied
    assert a.moves[0].source == "q0"
    assert not {m.target for m in a.moves} & {m.source for m in a.moves}
