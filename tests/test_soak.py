"""The soak (benchmarks/soak/): what its figures read from a node's files, checked on files written here; a short soak
in the lab (three join nodes, one behind a home router, a p2p daemon killed, a node killed, a checkpoint damaged)
in the default suite; and the whole fault list over 8 nodes and a 3-stage pipeline with a spare (`slow`). Every
wait is a hang guard on an event; how long each recovery took is printed (run with -s), not asserted: the targets
are the benchmark's (benchmarks/README.md#soak)."""

from __future__ import annotations

import json

import pytest

from benchmarks.lab import lab_unavailable
from benchmarks.soak import figures
from benchmarks.soak.figures import Downtime
from benchmarks.soak.faults import FAULTS
from benchmarks.soak.plan import CLOCK_JUMP_S, FAULT_KINDS, LIBFAKETIME, SoakPlan
from benchmarks.soak.run import Soak


def test_a_stall_is_a_gap_between_rows_that_no_scheduled_downtime_explains():
    rows = [{"time": t} for t in (0, 1, 2, 30, 31, 100, 101)]
    assert figures.row_gaps(rows, []) == [(0, 1), (1, 1), (2, 28), (30, 1), (31, 69), (100, 1)]
    # the node was down on purpose from 40 to 90: the gap across it is not a stall, the one before it is
    gaps = figures.row_gaps(rows, [Downtime(0, 40, 90)])
    assert max(s for _, s in gaps) == 28 and (31, 69) not in gaps
    # a downtime that never ended covers everything after its start
    assert max(s for _, s in figures.row_gaps(rows, [Downtime(0, 29, None)])) == 1


def test_rows_are_contiguous_only_when_each_round_is_there_once():
    assert figures.contiguous([{"round": r} for r in (1, 2, 3)]) is None
    assert figures.contiguous([{"round": r} for r in (1, 2, 2, 3)]) == "row 3 has round 2, not 3"
    assert figures.contiguous([{"round": r} for r in (1, 3)]) == "row 2 has round 3, not 2"
    assert figures.contiguous([{"round": r} for r in (2, 3)]) == "row 1 has round 2, not 1"  # a fresh start lost 1
    assert figures.contiguous([{"step": s} for s in (7, 8, 9)], "step") is None  # a driver counts from its stages


def test_policy_versions_may_stand_but_never_go_back():
    assert figures.versions_forward([{"round": r, "policy_version": v} for r, v in ((1, 1), (2, 1), (3, 2))]) is None
    back = [{"round": r, "policy_version": v} for r, v in ((1, 4), (2, 5), (3, 3))]
    assert figures.versions_forward(back) == "round 3: policy version 3 after 5"


def test_rss_growth_is_measured_from_the_baseline_after_the_last_start():
    samples = [(t, 100.0 + t) for t in range(0, 1300, 100)]
    assert figures.rss_growth(samples, since=0, baseline_after_s=600) == {
        "baseline_mib": 700.0,
        "end_mib": 1300.0,
        "ratio": round(1300 / 700, 3),
    }
    assert figures.rss_growth(samples, since=1000, baseline_after_s=600) is None  # restarted too late to say


def test_the_metrics_file_reader_skips_a_line_a_kill_cut_short(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert [r["round"] for r in figures.read_rows(tmp_path)] == [1, 2]
    assert figures.read_rows(tmp_path / "absent") == []


def test_a_damaged_checkpoint_is_named_with_why(tmp_path, tiny_config):
    import torch

    from node.device import HOST
    from node.model import ensure_default_model, load_policy
    from node.state import StateStore

    model, tokenizer = load_policy(ensure_default_model(tiny_config(), progress=False), "float32", HOST)
    store = StateStore(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters())
    for round_ in (1, 2):
        store.save(round_, model, tokenizer, optimizer, policy_version=round_, keep=3)
    assert figures.unloadable_checkpoints(tmp_path) == {}
    weights = tmp_path / "checkpoints" / "round-00000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    damaged = figures.unloadable_checkpoints(tmp_path)
    assert list(damaged) == ["round-00000002"] and "policy does not load" in damaged["round-00000002"]


def test_a_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="unknown fault kinds"):
        SoakPlan(faults=("p2pd_kill", "meteor"))
    with pytest.raises(ValueError, match="stage_kill needs"):
        SoakPlan(stages=0)
    with pytest.raises(ValueError, match="pipeline_p2pd_kill needs a pipeline"):
        SoakPlan(stages=0, faults=("pipeline_p2pd_kill",))
    with pytest.raises(ValueError, match="node 0 is the relay"):
        SoakPlan(join_nodes=3, natted=(0,))
    assert set(FAULTS) == set(FAULT_KINDS)  # each kind has its fault
    plan = SoakPlan()
    # each fault kind its own public node of the 8, the NAT'd ones and the relay spared
    targets = {kind: plan.target(kind) for kind in ("p2pd_kill", "node_kill", "disk_full", "checkpoint_damage")}
    assert sorted(targets.values()) == [1, 2, 3, 4] and plan.cut == {1, 2}
    assert (plan.stage_index(0), plan.spare_index(0), plan.driver, plan.hostile, plan.lab_nodes) == (8, 11, 12, 13, 14)


def run_soak(tmp_path, cli_env, plan: SoakPlan) -> dict:
    with Soak(plan, tmp_path, cli_env) as soak:
        result = soak.run()
    print(json.dumps(result, indent=1, default=str))  # for the notebook (pytest -s)
    return result


def check(result: dict, plan: SoakPlan) -> None:
    """What must hold whatever the machine's load: nothing crashed or was lost, every fault was recovered from (in
    the plan's hang guard), every process stopped cleanly; the figures beside them (how fast) are the benchmark's."""
    assert result["crashes"] == 0, result["crash_details"]
    assert result["alive_at_end"]
    kinds = [k for k in plan.faults if not (k == "clock_jump" and not LIBFAKETIME.exists())]
    unrecovered = [e for e in result["events"] if e["recovery_s"] is None and not e["details"].get("skipped")]
    assert not unrecovered, unrecovered
    assert set(result["recovery_s_by_kind"]) == set(kinds)
    assert all(reason is None for reason in result["rows_contiguous"].values()), result["rows_contiguous"]
    assert all(reason is None for reason in result["versions_forward"].values()), result["versions_forward"]
    assert all(not damaged for damaged in result["unloadable_checkpoints"].values()), result["unloadable_checkpoints"]
    assert set(result["exit_codes_on_stop"].values()) == {0}, result["exit_codes_on_stop"]
    assert result["tracebacks_on_stop"] == []
    for readyz in result["readyz"]:  # a dead daemon is said on /readyz, and its return
        assert readyz["not_ready_after_s"] is not None and readyz["ready_again_after_s"] is not None, readyz
    for event in result["events"]:
        if event["kind"] == "checkpoint_damage":
            assert event["details"]["fell_back"], event
        if event["kind"] == "disk_full":
            assert event["details"]["named_no_space"] and event["details"]["free_bytes_while_full"] == 0, event
        if event["kind"] == "clock_jump":  # said, with the figure: a signed time arrives after it was signed
            assert CLOCK_JUMP_S - 1 <= (event["details"]["said_ahead_s"] or 0) <= CLOCK_JUMP_S + 60, event
        if event["kind"] == "relay_restart":
            assert event["details"]["same_address"], event
        if "restart_s" in event["details"]:  # a process started again: where its time went, read from its log
            moments = event["details"]["restart_s"]
            assert None not in moments.values() and moments["resumed"] <= moments["joined"], event
        if event["kind"] == "hostile_peer":
            assert all(count > 0 for count in event["details"]["refused_by_node"].values()), event


lab = pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))


@lab
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_a_short_soak_loses_nothing(tmp_path, cli_env):
    """Three join nodes (node 2 behind a home router), no pipeline: a p2p daemon killed under a live node, a node
    killed and started again, a checkpoint damaged before a restart."""
    plan = SoakPlan(
        join_nodes=3,
        natted=(2,),
        stages=0,
        spares=0,
        faults=("p2pd_kill", "node_kill", "checkpoint_damage"),
        gap_s=2,
        down_s=3,
        recover_timeout_s=300,
        rss_baseline_s=60,
    )
    check(run_soak(tmp_path, cli_env, plan), plan)


@lab
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_every_fault_kind_in_a_swarm_and_a_pipeline(tmp_path, cli_env):
    """8 join nodes (two behind routers), a 3-stage pipeline with a spare and its driver, each fault kind once."""
    plan = SoakPlan(faults=FAULT_KINDS if LIBFAKETIME.exists() else tuple(k for k in FAULT_KINDS if k != "clock_jump"))
    check(run_soak(tmp_path, cli_env, plan), plan)
