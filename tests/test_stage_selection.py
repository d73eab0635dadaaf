"""Stage selection as pure functions of a stage map (node/pipeline/selection.py): which announcements count as live,
which stage a newcomer or a spare takes, and when a serving replica moves — without flapping."""

from __future__ import annotations

import asyncio

from node.pipeline.selection import (
    Move,
    choose_stage,
    fresh_window_s,
    holes,
    live_view,
    lost_report,
    movers,
    plan_move,
    spare_assignment,
    stages_to_report,
    update_empty_since,
)
from node.pipeline.stagemap import StageMap, latest_losses, wait_for_lost_report
from protocol import StageAnnouncement, StageLost

NOW = 1_700_000_000.0
FRESH = fresh_window_s(announce_interval_s=2.0, announce_ttl_s=8.0)


def server(name: str, stage: int, state: str = "serving", rate: float = 10.0) -> StageAnnouncement:
    node_id = name * 40 if len(name) == 1 else name.ljust(40, "0")
    return StageAnnouncement(
        node_id=node_id,
        p2p_peer_id="peer-" + name,
        model_fingerprint="m",
        num_stages=4,
        stage=stage,
        stage_fingerprint=f"fp{stage}",
        layer_start=stage,
        layer_end=stage + 1,
        parts=["layers"],
        state=state,
        step=10,
        grad_norm=0.5,
        samples_per_s=rate,
        recoveries=0,
        replicas=[],
    )


def stage_map(*servers: tuple[StageAnnouncement, float], lost: dict[int, float] | None = None) -> StageMap:
    """A map of (announcement, seconds since it was signed) pairs, and lost reports by stage (seconds ago)."""
    return StageMap.from_announcements(
        4,
        [s for s, _ in servers],
        {s.node_id: NOW - age for s, age in servers},
        {i: NOW - age for i, age in (lost or {}).items()},
    )


def test_fresh_window_is_a_few_announce_intervals_within_the_ttl():
    assert fresh_window_s(2.0, 8.0) == 5.0
    assert fresh_window_s(2.0, 3.0) == 3.0


def test_a_silent_server_is_not_counted_although_its_announcement_is_within_the_ttl():
    view = live_view(
        stage_map((server("a", 0), 0.5), (server("b", 1), 0.5), (server("c", 2), 7.0), (server("d", 3), 0.5)),
        NOW,
        FRESH,
    )
    assert [s.stage for group in view.servers.values() for s in group] == [0, 1, 3]
    assert holes(view) == [2]
    assert choose_stage(view) == (2, "auto: no live server")


def test_a_lost_report_beats_a_fresh_announcement_until_the_stage_announces_again():
    # stage 2's server announced 1 s ago, a driver found it dead 0.5 s ago: not counted
    dead = stage_map(
        (server("a", 0), 0.5), (server("b", 1), 0.5), (server("c", 2), 1.0), (server("d", 3), 0.5), lost={2: 0.5}
    )
    view = live_view(dead, NOW, FRESH)
    assert holes(view) == [2] and 2 in view.lost
    assert choose_stage(view) == (2, "auto: lost (a driver reported it)")
    # a server of stage 2 announced after the report: the report no longer stands
    back = stage_map(
        (server("a", 0), 0.5), (server("b", 1), 0.5), (server("e", 2), 0.1), (server("d", 3), 0.5), lost={2: 0.5}
    )
    view = live_view(back, NOW, FRESH)
    assert holes(view) == [] and view.lost == {}


def test_a_lost_stage_is_chosen_before_one_that_only_went_silent_and_before_any_served_one():
    view = live_view(
        stage_map(
            (server("a", 0), 0.5), (server("b", 1), 9.0), (server("c", 2), 1.0), (server("d", 3), 0.5), lost={2: 0.5}
        ),
        NOW,
        FRESH,
    )
    assert holes(view) == [2, 1]
    assert choose_stage(view)[0] == 2


def test_a_report_superseded_by_a_slow_server_does_not_come_back_for_a_newcomer():
    # stage 2 was reported 7 s ago and its new server announced after that, 6 s ago: not fresh, but not lost either;
    # stage 1's server went silent. Both are holes to a newcomer; neither is ranked as reported lost.
    view = live_view(
        stage_map(
            (server("a", 0), 0.5), (server("b", 1), 9.0), (server("c", 2), 6.0), (server("d", 3), 0.5), lost={2: 7.0}
        ),
        NOW,
        FRESH,
    )
    assert view.lost == {} and holes(view) == [1, 2]
    assert choose_stage(view) == (1, "auto: no live server")


def test_a_driver_does_not_report_a_stage_whose_server_announced_after_failing_it():
    slow, dead, loading = server("c", 2), server("e", 0), server("f", 3, state="loading")
    seen = stage_map((dead, 3.0), (server("b", 1), 0.5), (slow, 0.2), (loading, 0.5))
    failed_at = {slow.node_id: NOW - 1.0, dead.node_id: NOW - 2.0}  # both timed out; only the slow one spoke since
    assert stages_to_report(seen, [0, 2, 3], failed_at) == [0]
    # a stage with no announcement left at all is reported
    assert stages_to_report(stage_map((server("b", 1), 0.5)), [0, 2], {}) == [0, 2]
    # a server that failed after its last announcement is not taken for alive
    assert stages_to_report(seen, [2], {slow.node_id: NOW - 0.1}) == [2]


def test_a_loading_server_fills_a_hole_for_the_next_chooser():
    view = live_view(
        stage_map((server("a", 0), 0.5), (server("b", 1, state="loading"), 0.5), (server("d", 3), 0.5)), NOW, FRESH
    )
    assert holes(view) == [2]


def test_without_holes_the_least_served_stage_is_chosen():
    view = live_view(
        stage_map(
            (server("a", 0), 0),
            (server("b", 1), 0),
            (server("x", 1), 0),
            (server("c", 2, rate=5.0), 0),
            (server("d", 3), 0),
        ),
        NOW,
        FRESH,
    )
    assert choose_stage(view) == (2, "auto: least served")


def test_spares_share_the_holes_by_node_id():
    base = [
        (server("a", 0), 0.5),
        (server("d", 3), 0.5),
        (server("s", -1, state="spare"), 0.5),
        (server("t", -1, state="spare"), 0.5),
    ]
    view = live_view(stage_map(*base), NOW, FRESH)
    assert holes(view) == [1, 2]
    assert spare_assignment(view, "s" * 40) == 1 and spare_assignment(view, "t" * 40) == 2
    assert spare_assignment(live_view(stage_map(*base[:1], *base[2:]), NOW, FRESH), "t" * 40) == 2
    # no server at all: not started yet
    assert spare_assignment(live_view(stage_map(*base[2:]), NOW, FRESH), "s" * 40) is None


def test_empty_since_remembers_when_a_hole_opened_and_forgets_a_filled_one():
    view = live_view(stage_map((server("a", 0), 0), (server("d", 3), 0)), NOW, FRESH)
    assert update_empty_since({}, view, NOW) == {1: NOW, 2: NOW}
    assert update_empty_since({1: NOW - 5, 3: NOW - 9}, view, NOW) == {1: NOW - 5, 2: NOW}


def two_of_stage_1(**rates) -> list[StageAnnouncement]:
    return [
        server("a", 0, rate=rates.get("a", 10.0)),
        server("b", 1, rate=rates.get("b", 10.0)),
        server("x", 1, rate=rates.get("x", 10.0)),
        server("c", 2, rate=rates.get("c", 10.0)),
        server("d", 3, rate=rates.get("d", 10.0)),
    ]


def test_a_replica_moves_to_a_stage_empty_past_the_grace_period():
    servers = [s for s in two_of_stage_1() if s.stage != 2]
    view = live_view(stage_map(*[(s, 0.2) for s in servers]), NOW, FRESH)
    b, x = servers[1], servers[2]
    assert [s.node_id for s in movers(view, b)] == [x.node_id]  # "b..." keeps stage 1, "x..." is free to go
    assert plan_move(view, x, {2: NOW - 3}, NOW, grace_s=6.0, balance_quality=0.75) is None  # a newcomer may still come
    move = plan_move(view, x, {2: NOW - 7}, NOW, grace_s=6.0, balance_quality=0.75)
    assert move == Move(2, "stage 2 had no live server for 7.0s")
    assert plan_move(view, b, {2: NOW - 7}, NOW, grace_s=6.0, balance_quality=0.75) is None  # the keeper stays
    lone = servers[0]
    # the only server of stage 0 never leaves it
    assert plan_move(view, lone, {2: NOW - 7}, NOW, grace_s=6.0, balance_quality=0.75) is None


def test_a_replica_does_not_leave_a_stage_whose_other_server_may_be_dead():
    # stage 1's other server last announced 7 s ago: within the 8 s TTL, so the TTL view still lists it (a driver's
    # later report replaced the one that named it), but not re-signed within the fresh window
    lone, stale, me = server("a", 0), server("b", 1), server("x", 1)
    view = live_view(stage_map((lone, 0.2), (stale, 7.0), (me, 0.2), (server("d", 3), 0.2)), NOW, 8.0)
    assert [s.node_id for s in movers(view, stale)] == [me.node_id]
    assert plan_move(view, me, {2: NOW - 7}, NOW, 6.0, 0.75, fresh_s=FRESH) is None
    # once it re-signs, "x" may go
    view = live_view(stage_map((lone, 0.2), (stale, 0.5), (me, 0.2), (server("d", 3), 0.2)), NOW, 8.0)
    assert plan_move(view, me, {2: NOW - 7}, NOW, 6.0, 0.75, fresh_s=FRESH) == Move(
        2, "stage 2 had no live server for 7.0s"
    )


def test_a_replica_moves_for_throughput_only_when_the_bottleneck_rises_enough():
    balanced = live_view(stage_map(*[(s, 0.2) for s in two_of_stage_1()]), NOW, FRESH)
    assert all(plan_move(balanced, s, {}, NOW, 6.0, 0.75) is None for s in two_of_stage_1())
    slow = two_of_stage_1(c=4.0)  # stage 2 is the bottleneck: x moving there lifts it from 4 to 10 (x2.5)
    view = live_view(stage_map(*[(s, 0.2) for s in slow]), NOW, FRESH)
    assert plan_move(view, slow[2], {}, NOW, 6.0, 0.75) == Move(2, "throughput: the bottleneck rises x2.50")
    assert [plan_move(view, s, {}, NOW, 6.0, 0.75) for s in slow if s is not slow[2]] == [
        None
    ] * 4  # one server moves, not two
    slightly = two_of_stage_1(c=9.0)  # x1.11 is within balance_quality's margin: nobody moves
    view = live_view(stage_map(*[(s, 0.2) for s in slightly]), NOW, FRESH)
    assert all(plan_move(view, s, {}, NOW, 6.0, 0.75) is None for s in slightly)
    unmeasured = two_of_stage_1(c=0.0)  # a server that has not served yet gives no basis for a throughput move
    assert all(
        plan_move(live_view(stage_map(*[(s, 0.2) for s in unmeasured]), NOW, FRESH), s, {}, NOW, 6.0, 0.75) is None
        for s in unmeasured
    )


def test_no_flapping_after_a_move_nobody_moves_back():
    """Apply every move the rules make, each as its server would, until none is made: it ends, and no server
    returns to a stage it left."""
    rates = {"a": 10.0, "b": 12.0, "x": 11.0, "y": 9.0, "c": 3.0, "d": 10.0}
    placement = {"a": 0, "b": 1, "x": 1, "y": 1, "c": 2, "d": 3}
    left: dict[str, set[int]] = {name: set() for name in placement}
    for _ in range(10):
        servers = [server(name, stage, rate=rates[name]) for name, stage in placement.items()]
        view = live_view(stage_map(*[(s, 0.2) for s in servers]), NOW, FRESH)
        moves = {s.node_id[0]: move for s in servers if (move := plan_move(view, s, {}, NOW, 6.0, 0.75)) is not None}
        if not moves:
            break
        assert len(moves) == 1  # every server computes the same single move from the same map
        ((name, move),) = moves.items()
        assert move.stage not in left[name]
        left[name].add(placement[name])
        placement[name] = move.stage
    else:
        raise AssertionError(f"still moving after 10 rounds: {placement}")
    assert sorted(placement.values()) == [0, 1, 1, 2, 2, 3]  # stage 2 got the help it needed, and kept it


def test_two_servers_of_a_stage_never_both_leave_it_for_holes():
    servers = [server("a", 0), server("b", 1), server("x", 1)]  # stages 2 and 3 are both empty
    view = live_view(stage_map(*[(s, 0.2) for s in servers]), NOW, FRESH)
    since = {2: NOW - 10, 3: NOW - 10}
    moves = [plan_move(view, s, since, NOW, 6.0, 0.75) for s in servers]
    assert moves == [None, None, Move(2, "stage 2 had no live server for 10.0s")]


def test_a_driver_keeps_a_rebuilt_stage_in_its_report_with_its_old_time_until_the_dead_announcements_age_out():
    # stage 2 found lost at NOW - 4 (earlier in this wait); now stage 0 is lost too, and 2 was rebuilt
    report = lost_report({2: NOW - 4}, [0], dated={2}, now=NOW, hold_s=8.0)
    assert report == {2: NOW - 4, 0: NOW}  # 2 is still named, not re-dated: its new server is not hidden
    assert lost_report(report, [0], dated={2, 0}, now=NOW + 5, hold_s=8.0) == {0: NOW}  # 2 aged out, 0 kept its time
    # found lost again in a later wait (served in between): dated anew
    assert lost_report({2: NOW - 4}, [2], dated=set(), now=NOW, hold_s=8.0) == {2: NOW}


def test_readers_take_each_stage_from_when_it_was_found_lost():
    dead, rebuilt = server("c", 2), server("e", 2)
    report = StageLost(
        node_id="d" * 40, model_fingerprint="m", num_stages=4, stages=[0, 2], lost_at=[NOW - 0.5, NOW - 4.0]
    )
    lost = latest_losses([(report, NOW - 0.5)], "m", 4)
    assert lost == {0: NOW - 0.5, 2: NOW - 4.0}
    view = live_view(
        stage_map((dead, 6.0), (rebuilt, 3.0), (server("b", 1), 0.2), lost={i: NOW - t for i, t in lost.items()}),
        NOW,
        8.0,
    )
    # the killed server of stage 2 stays hidden, the one that rebuilt it after the loss counts
    assert [s.node_id for s in view.servers[2]] == [rebuilt.node_id] and 2 not in view.lost
    assert holes(view) == [0, 3]


def test_a_spare_wakes_on_a_new_lost_report_and_not_on_one_it_has_read():
    known = {2: NOW - 4}
    answers = [{2: NOW - 4}, {2: NOW - 4}, {2: NOW - 4, 1: NOW}]  # the report it read with the map, again, then stage 1
    reads = []

    async def read_losses():
        reads.append(None)
        return answers[min(len(reads), len(answers)) - 1]

    # woken by the third read, long before the whole map's next read (60 s here) would have shown it
    assert asyncio.run(wait_for_lost_report(read_losses, known, timeout_s=60, poll_s=0.01))
    assert len(reads) == 3
    # a stage reported again with the same time is old news: the wait runs out
    answers[:], reads[:] = [{2: NOW - 4}], []
    assert not asyncio.run(wait_for_lost_report(read_losses, known, timeout_s=0.05, poll_s=0.01))
    assert reads
