"""The GPU queue's decision (allocator.backfill): first come first served per GPU type, with
backfill that never delays the head of a line by the predictions it was given, and strict FIFO
wherever a prediction is missing. Pure: plain data in, decisions out (and the worker's setting
that turns backfill off)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frenzy_prefect.allocator.backfill import Holder, Start, Wait, Want, decide
from frenzy_prefect.allocator.placement import place
from frenzy_prefect.spec.cluster import Node

NOW = 1000.0


def _node(name, count, gpu_type="A10"):
    return Node(name=name, host="127.0.0.1", gpu_type=gpu_type, gpu_count=count)


def _holder(*gpus, ends_at):
    return Holder(frozenset(gpus), ends_at)


def _kinds(decisions):
    return [("start", d.placements) if isinstance(d, Start) else ("wait", d.position) for d in decisions]


def test_a_short_run_takes_the_free_gpu_a_blocked_two_gpu_head_cannot_use_yet():
    nodes, free = [_node("a10", 2)], {"a10": [1]}
    holders = [_holder(("a10", 0), ends_at=NOW + 100)]
    line = [Want("A10", 2, predicted_s=50), Want("A10", 1, predicted_s=200), Want("A10", 1, predicted_s=30), Want("A10", 1)]
    head, too_long, short, unpredicted = decide(line, nodes, free, holders, NOW)
    assert isinstance(head, Wait) and head.position == 1 and head.free == 1
    assert head.reservation.at == NOW + 100 and head.reservation.gpus == {("a10", 0), ("a10", 1)}
    assert isinstance(too_long, Wait) and too_long.position == 2  # would still hold GPU 1 at NOW + 100
    assert isinstance(short, Start) and short.passed == head.reservation and short.ends_at == NOW + 30
    assert [(p.node, p.gpus) for p in short.placements] == [("a10", [1])]
    assert isinstance(unpredicted, Wait) and unpredicted.position == 3  # no prediction: never backfills


def test_a_long_run_may_take_a_gpu_the_head_will_not_need():
    nodes, free = [_node("a10", 4)], {"a10": [2, 3]}
    holders = [_holder(("a10", 0), ("a10", 1), ends_at=NOW + 100)]
    line = [Want("A10", 3, predicted_s=10), Want("A10", 1, predicted_s=500), Want("A10", 1, predicted_s=500)]
    head, first, second = decide(line, nodes, free, holders, NOW)
    assert head.reservation.gpus == {("a10", 0), ("a10", 1), ("a10", 2)}
    assert isinstance(first, Start) and first.placements[0].gpus == [3]
    assert isinstance(second, Wait)  # only GPU 2 is left, and the head needs it at NOW + 100


def test_a_run_started_in_the_same_decision_counts_as_a_holder_with_its_predicted_end():
    first, head, short = decide(
        [Want("A10", 1, predicted_s=100), Want("A10", 2, predicted_s=1), Want("A10", 1, predicted_s=10)],
        [_node("a10", 2)],
        {"a10": [0, 1]},
        [],
        NOW,
    )
    assert isinstance(first, Start) and head.reservation.at == NOW + 100 and isinstance(short, Start)


def test_a_holder_past_its_predicted_end_counts_as_ending_now_so_nothing_backfills_behind_it():
    nodes, free = [_node("a10", 2)], {"a10": [1]}
    holders = [_holder(("a10", 0), ends_at=NOW - 5)]
    head, short = decide([Want("A10", 2, predicted_s=1), Want("A10", 1, predicted_s=1)], nodes, free, holders, NOW)
    assert head.reservation.at == NOW and isinstance(short, Wait)


def test_busy_gpus_without_a_predicted_release_leave_the_line_first_come_first_served():
    nodes, free = [_node("a10", 2), _node("t4", 2, "T4")], {"a10": [1], "t4": [1]}
    line = [Want("A10", 2, predicted_s=1), Want("A10", 1, predicted_s=1), Want("T4", 2, predicted_s=1), Want("T4", 1, predicted_s=1)]
    holders = [_holder(("a10", 0), ends_at=None)]  # t4's GPU 0: held by a run the queue does not know
    decisions = decide(line, nodes, free, holders, NOW)
    assert all(isinstance(d, Wait) and d.reservation is None for d in decisions)
    assert [d.position for d in decisions] == [1, 2, 1, 2]


def test_without_backfill_a_run_never_starts_behind_a_blocked_head_of_its_type_but_other_types_go_ahead():
    nodes, free = [_node("a10", 2), _node("t4", 1, "T4")], {"a10": [1], "t4": [0]}
    holders = [_holder(("a10", 0), ends_at=NOW + 100)]
    line = [Want("A10", 2, predicted_s=1), Want("A10", 1, predicted_s=1), Want("T4", 1, predicted_s=1)]
    head, behind, other = decide(line, nodes, free, holders, NOW, backfill=False)
    assert head.reservation is None and isinstance(behind, Wait) and isinstance(other, Start) and other.passed is None


def test_runs_that_fit_start_in_order_and_share_no_gpu():
    nodes = [_node("a10", 4)]
    a, b, c = decide([Want("A10", 2), Want("A10", 2), Want("A10", 1)], nodes, {"a10": [0, 1, 2, 3]}, [], NOW)
    assert isinstance(a, Start) and isinstance(b, Start) and isinstance(c, Wait)
    assert {*a.placements[0].gpus, *b.placements[0].gpus} == {0, 1, 2, 3}


@st.composite
def situations(draw, predicted=True, holders_predicted=True):
    """A cluster of one or two GPU types, some GPUs held (each holder a few of them), the rest
    free, and a line of waiting runs, oldest first."""
    types = draw(st.sampled_from([["A10"], ["A10", "T4"]]))
    nodes = [_node(f"{t}-{k}", draw(st.integers(1, 4)), t) for t in types for k in range(draw(st.integers(1, 2)))]
    free: dict[str, list[int]] = {n.name: [] for n in nodes}
    holders: list[Holder] = []
    for n in nodes:
        for i in range(n.gpu_count):
            if draw(st.booleans()):
                free[n.name].append(i)
            elif holders and draw(st.booleans()):
                holders[-1] = Holder(holders[-1].gpus | {(n.name, i)}, holders[-1].ends_at)
            else:
                ends = draw(st.floats(NOW - 20, NOW + 200)) if holders_predicted else None
                holders.append(Holder(frozenset({(n.name, i)}), ends))
    line = []
    for _ in range(draw(st.integers(0, 8))):
        gpu_type = draw(st.sampled_from(types))
        total = sum(n.gpu_count for n in nodes if n.gpu_type == gpu_type)
        group = draw(st.sampled_from([1, 2]))
        gpus = group * draw(st.integers(1, max(1, total // group)))
        line.append(Want(gpu_type, gpus, group, draw(st.floats(1, 300)) if predicted else None))
    return nodes, free, holders, line


def _free_at(at, gpu_type, nodes, free, holders, line, decisions):
    """The GPUs of ``gpu_type`` free at time ``at`` if every prediction holds: free now or
    released by then, less those the decided starts still hold."""
    out = {n.name: set(free[n.name]) for n in nodes if n.gpu_type == gpu_type}
    for h in holders:
        for node, i in h.gpus:
            if node in out and max(h.ends_at, NOW) <= at:
                out[node].add(i)
    for want, d in zip(line, decisions, strict=True):
        if isinstance(d, Start) and want.gpu_type == gpu_type and (d.ends_at is None or d.ends_at > at):
            for p in d.placements:
                out[p.node] -= set(p.gpus)
    return out


@settings(max_examples=400, deadline=None)
@given(situations())
def test_a_backfilled_run_never_holds_a_gpu_the_head_needs_past_the_heads_reservation(situation):
    nodes, free, holders, line = situation
    decisions = decide(line, nodes, free, holders, NOW)
    for d in decisions:
        if isinstance(d, Start) and d.passed is not None:
            taken = {(p.node, i) for p in d.placements for i in p.gpus}
            assert d.ends_at <= d.passed.at or not taken & d.passed.gpus
    for want, d in zip(line, decisions, strict=True):  # so each head can start at its reservation
        if isinstance(d, Wait) and d.position == 1 and d.reservation is not None:
            at_reservation = _free_at(d.reservation.at, want.gpu_type, nodes, free, holders, line, decisions)
            assert all(i in at_reservation[node] for node, i in d.reservation.gpus)
            assert place(want.gpus, [(n, sorted(at_reservation[n.name])) for n in nodes if n.name in at_reservation], group=want.group)


@settings(max_examples=300, deadline=None)
@given(situations())
def test_every_start_is_on_free_gpus_of_its_type_and_no_two_share_one(situation):
    nodes, free, holders, line = situation
    taken: set[tuple[str, int]] = set()
    types = {n.name: n.gpu_type for n in nodes}
    for want, d in zip(line, decide(line, nodes, free, holders, NOW), strict=True):
        if isinstance(d, Start):
            gpus = [(p.node, i) for p in d.placements for i in p.gpus]
            assert len(gpus) == want.gpus and all(types[node] == want.gpu_type and i in free[node] for node, i in gpus)
            assert not taken & set(gpus)
            taken |= set(gpus)


@settings(max_examples=300, deadline=None)
@given(situations(predicted=False))
def test_runs_without_predictions_are_served_first_come_first_served(situation):
    nodes, free, holders, line = situation
    assert _kinds(decide(line, nodes, free, holders, NOW)) == _kinds(decide(line, nodes, free, holders, NOW, backfill=False))


@settings(max_examples=300, deadline=None)
@given(situations(holders_predicted=False))
def test_a_type_whose_holders_have_no_predictions_is_served_first_come_first_served(situation):
    nodes, free, holders, line = situation
    held_types = {n.gpu_type for h in holders for n in nodes for node, _ in h.gpus if n.name == node}
    backfilled = decide(line, nodes, free, holders, NOW)
    strict = decide(line, nodes, free, holders, NOW, backfill=False)
    for want, b, s in zip(line, _kinds(backfilled), _kinds(strict), strict=True):
        if want.gpu_type in held_types:
            assert b == s


@settings(max_examples=300, deadline=None)
@given(situations())
def test_without_backfill_no_run_starts_behind_a_blocked_run_of_its_type(situation):
    nodes, free, holders, line = situation
    blocked: set[str] = set()
    for want, d in zip(line, decide(line, nodes, free, holders, NOW, backfill=False), strict=True):
        assert not (isinstance(d, Start) and want.gpu_type in blocked)
        if isinstance(d, Wait):
            blocked.add(want.gpu_type)


def test_the_workers_backfill_setting_is_on_or_off_and_anything_else_is_named(monkeypatch):
    from frenzy_prefect.errors import FrenzyError
    from frenzy_prefect.pool.gpu_queue import BACKFILL_ENV, backfill_enabled

    monkeypatch.delenv(BACKFILL_ENV, raising=False)
    assert backfill_enabled()
    monkeypatch.setenv(BACKFILL_ENV, "OFF")
    assert not backfill_enabled()
    monkeypatch.setenv(BACKFILL_ENV, "maybe")
    with pytest.raises(FrenzyError, match=r"^FRENZY_BACKFILL='maybe' on this worker: expected on \(backfill, the default\) or off"):
        backfill_enabled()


def _across(a10: int, t4: int, predicted_s: float | None = 100.0) -> Want:
    return Want("A10+T4", a10 + t4, predicted_s=predicted_s, across=(("A10", a10), ("T4", t4)))


def test_a_run_across_types_takes_gpus_of_each_in_rank_order():
    nodes = [_node("t4", 2, "T4"), _node("a10", 2)]
    (start,) = decide([_across(1, 2)], nodes, {"a10": [0, 1], "t4": [0, 1]}, [], NOW)
    assert isinstance(start, Start) and [(p.node, p.gpus) for p in start.placements] == [("a10", [0]), ("t4", [0, 1])]


def test_a_waiting_run_across_types_is_never_passed_on_its_types_and_blocks_no_other():
    nodes = [_node("a10", 2), _node("t4", 2, "T4"), _node("h100", 1, "H100")]
    holders = [_holder(("t4", 0), ("t4", 1), ends_at=NOW + 100)]
    line = [_across(1, 2), Want("A10", 1, predicted_s=1), Want("T4", 1, predicted_s=1), Want("H100", 1, predicted_s=1)]
    across, a10, t4, h100 = decide(line, nodes, {"a10": [0, 1], "h100": [0]}, holders, NOW)
    assert isinstance(across, Wait) and across.reservation is None  # no backfill behind it on its types
    assert isinstance(a10, Wait) and isinstance(t4, Wait)  # a free A10 stays free for it, however short the run
    assert isinstance(h100, Start)


def test_a_run_across_types_waits_behind_a_single_type_head_unless_it_ends_before_the_reservation():
    nodes = [_node("a10", 2), _node("t4", 2, "T4")]
    holders = [_holder(("a10", 0), ends_at=NOW + 100)]
    free = {"a10": [1], "t4": [0, 1]}
    head, short, long = decide([Want("A10", 2, predicted_s=10), _across(1, 1, 50), _across(1, 1, 500)], nodes, free, holders, NOW)
    assert isinstance(head, Wait) and head.reservation.at == NOW + 100
    assert isinstance(short, Start) and short.passed == head.reservation  # ends at NOW + 50, before the head's turn
    assert isinstance(long, Wait)  # would hold the head's A10 past NOW + 100


def test_a_pinned_run_goes_to_its_node_only_and_waiting_for_it_holds_up_no_one():
    """A node's check (`frenzy cluster check`) is pinned to that node: placed there even where
    another node of its type is free, and while its node is busy it waits without heading the
    line, so a later run of its type starts on the other node."""
    nodes = [_node("a", 2), _node("b", 2)]
    (check,) = decide([Want("A10", 2, nodes=("b",))], nodes, {"a": [0, 1], "b": [0, 1]}, [], NOW)
    assert isinstance(check, Start) and [(p.node, p.gpus) for p in check.placements] == [("b", [0, 1])]
    busy_b = {"a": [0, 1], "b": [0]}
    holders = [_holder(("b", 1), ends_at=None)]
    check, training, later = decide([Want("A10", 2, nodes=("b",)), Want("A10", 2), Want("A10", 1)], nodes, busy_b, holders, NOW)
    assert isinstance(check, Wait) and (check.position, check.free, check.reservation) == (1, 1, None)  # its node's free GPUs
    assert isinstance(training, Start) and [p.node for p in training.placements] == ["a"]
    assert isinstance(later, Start) and [(p.node, p.gpus) for p in later.placements] == [("b", [0])]
