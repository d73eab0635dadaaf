"""The round display a person watching `train` or `join` sees: the overlap's figures appear only in rounds that have
them, in the live table and in the line printed per round off a terminal."""

from __future__ import annotations

import io

from rich.console import Console

from node.display import RoundDisplay

ROW = {"round": 3, "reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 120.0, "step_s": 1.5, "policy_version": 3}


def printed(row: dict, terminal: bool, restarts: dict[str, int] | None = None, clock_warn_s: float | None = 30) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=160, color_system=None)
    display = RoundDisplay(
        console,
        first_round=0,
        target_round=10,
        title="node",
        restarts=lambda: restarts or {},
        clock_warn_s=clock_warn_s,
    )
    with display:
        display.update(row)
    return out.getvalue()


def test_a_serial_round_shows_no_overlap_figures():
    for terminal in (False, True):
        text = printed(ROW, terminal)
        assert "policy" in text and "stale" not in text and "carried" not in text and "waited" not in text
        assert "idle" not in text


def test_the_overlap_figures_show_where_a_round_has_them():
    row = {
        **ROW,
        "staleness_mean": 0.34,
        "staleness_max": 2,
        "carried_in": 5,
        "carried_out": 3,
        "ahead_wait_s": 1.25,
        "sampler_idle_s": 0.5,
    }
    line = printed(row, terminal=False)
    assert "policy=3 stale=0.3/2 carried=5/3 waited=1.2s idle=0.5s eta=" in line, line
    table = printed(row, terminal=True)
    for header, value in (("stale", "0.3/2"), ("carried", "5/3"), ("waited", "1.2s"), ("idle", "0.5s")):
        assert header in table and value in table, table


def test_the_first_round_generating_ahead_has_waited_on_nothing_either_way():
    first = {**ROW, "staleness_mean": 0.0, "staleness_max": 0, "ahead_wait_s": None, "sampler_idle_s": None}
    line = printed(first, terminal=False)
    assert "policy=3 stale=0.0/0 eta=" in line, line


def test_what_the_node_restarted_shows_once_it_has_happened():
    assert "rejoins" not in printed(ROW, False, {"rejoins": 0, "stalls": 0})
    line = printed(ROW, False, {"rejoins": 2, "stalls": 0})
    assert "rejoins=2" in line and "stalls" not in line
    table = printed(ROW, True, {"rejoins": 1, "stalls": 3})
    # the last render: the one with the round in it (the first, before any round, has no cells to add)
    header = [text for text in table.splitlines() if "round" in text and "policy" in text][-1]
    assert "rejoins" in header and "stalls" in header


def test_a_clock_off_the_swarms_shows_from_its_bound_on():
    assert "clock" not in printed({**ROW, "clock_offset_s": 29.9}, False)
    assert "clock" not in printed({**ROW, "clock_offset_s": 300.0}, False, clock_warn_s=None)
    assert "policy=3 clock=+300s eta=" in printed({**ROW, "clock_offset_s": 300.2}, False)
    assert "clock=-45s" in printed({**ROW, "clock_offset_s": -45.0}, False)
    table = printed({**ROW, "clock_offset_s": 300.0}, True)
    assert "clock" in table and "+300s" in table, table
