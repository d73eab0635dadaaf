"""The sharing benchmark (benchmarks/sharing.py): its arms, whatever the config files ship; its report's guard against
comparing runs that started from different warm starts (each row's `warm_start_digests`, and the report's warning), and
the equal nodes' ratios."""

from __future__ import annotations

import argparse

import pytest
import torch
import yaml

from benchmarks.arms.catalog import (
    ARMS,
    CONFIG,
    FOUR_CONFIG,
    FOUR_SPECIALTIES as FOUR,
    arm_or_variant,
    may_be_best,
    node_overrides,
    single_node_arm,
)
from benchmarks.arms.curves import own_gain_per_node, silo_twin_differences
from benchmarks.arms.lockstep import weights_digest
from benchmarks.arms.report import four_specialists, homogeneous_ratios, round_cost_against, warm_start_mismatches


@pytest.mark.parametrize(("setting", "path"), [("specialists", CONFIG), ("four", FOUR_CONFIG)])
def test_an_arm_means_the_same_whatever_the_config_file_ships(setting, path, tmp_path):
    """Stored runs of an arm compare with today's only if what a config file ships for users (the gate, replay,
    imitation) cannot leak into the arm: each arm's swarm and trainer settings resolve the same on the shipped file as
    on that file without its swarm and trainer sections (the code's defaults)."""
    from node.config import load_config

    shipped = yaml.safe_load(path.read_text())
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({k: v for k, v in shipped.items() if k not in ("swarm", "trainer")}))
    args = argparse.Namespace(warmup_steps={"add": 1, "subtract": 1, "both": 1}, sparse_warmup_steps=1, set=[])
    for arm in ARMS:
        overrides = node_overrides(setting, arm, 0, 1, args)
        on_file, on_defaults = load_config(path, overrides), load_config(bare, overrides)
        assert on_file.swarm == on_defaults.swarm, arm
        assert on_file.trainer == on_defaults.trainer, arm


def test_the_digest_sees_one_changed_bit_and_nothing_else():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    same = torch.nn.Linear(4, 3)
    same.load_state_dict(model.state_dict())
    assert weights_digest(model) == weights_digest(same)
    with torch.no_grad():
        bits = same.weight.view(torch.int32)
        bits[1, 2] ^= 1  # the last bit of one float
    assert weights_digest(model) != weights_digest(same)
    assert len(weights_digest(model)) == 12


def test_arms_of_one_seed_from_different_warm_starts_are_named():
    def run(*digests):
        return {"warm_start_digests": list(digests)}

    by_key = {
        ("specialists", "silo"): {0: run("a", "b"), 1: run("c", "d"), 2: {}},
        ("specialists", "sapo_balance"): {0: run("a", "b"), 1: run("c", "e"), 2: run("x", "y")},
        ("homogeneous", "silo"): {1: run("c", "d")},
    }
    # seed 0 agrees; seed 2's silo row has no digest (stored before they were recorded); the homogeneous setting is
    # another comparison
    assert warm_start_mismatches(by_key) == ["specialists seed 1: sapo_balance c,e; silo c,d"]


def test_equal_nodes_ratios_per_seed_at_the_budget_both_arms_reached():
    def run(final: float, budget: float = 200.0) -> dict:
        curve = [{"compute_s": 0.0, "all": 0.7}, {"compute_s": budget, "all": final}]
        return {"budget_s": budget, "weak": [None] * 4, "curves": [curve] * 4}

    homo = {
        "silo": {0: run(0.9), 1: run(0.8)},
        "sapo_balance": {0: run(0.9 * 0.99), 1: run(0.8 * 0.97)},
        "sapo_balance_gated": {0: run(0.9), 1: run(0.8 * 1.01)},
        "sapo_own": {0: run(0.95)},  # one seed: not comparable with the two-seed arms
        "silo_imitate_peers": {0: run(0.9), 1: run(0.75, budget=100.0)},  # stopped at 100: compared there
    }
    out = homogeneous_ratios(homo, best_arm=None)
    assert out["homogeneous_ratios"]["sapo_balance"] == pytest.approx([0.99, 0.97])
    # at 100 units the silo is halfway: 0.7 + (0.8 - 0.7) / 2
    assert out["homogeneous_ratios"]["silo_imitate_peers"] == pytest.approx([1.0, 0.75 / 0.75])
    # a report of equal nodes alone names its best swarm arm on the most seeds (the silo is none)
    assert out["homogeneous_arm"] == "sapo_balance_gated"
    assert out["homogeneous_ratio_per_seed"] == pytest.approx([1.0, 1.01])
    # beside specialists, the specialists' best arm is the one reported
    assert homogeneous_ratios(homo, best_arm="sapo_balance")["homogeneous_ratio_per_seed"] == pytest.approx(
        [0.99, 0.97]
    )


def run(add_accuracy: list[float], subtract_accuracy: list[float], weak=("subtract", "subtract", "add", "add")) -> dict:
    """Curves that climb linearly from 0 at 0 units to the given held-out at 100; by default nodes 0-1 know addition,
    2-3 subtraction."""
    curves = [
        [{"compute_s": 0.0, "add": 0.0, "subtract": 0.0}, {"compute_s": 100.0, "add": a, "subtract": b}]
        for a, b in zip(add_accuracy, subtract_accuracy)
    ]
    return {"budget_s": 100.0, "weak": list(weak), "curves": curves}


def test_each_node_own_specialty_is_compared_with_the_same_node_alone():
    silo = {3: run([0.90, 0.94, 0.1, 0.1], [0.1, 0.1, 0.96, 0.90])}
    swarm = {3: run([0.97, 0.80, 0.9, 0.9], [0.9, 0.9, 0.98, 0.90])}
    # own: add for nodes 0-1, subtract for 2-3 (the weak specialty, 0.1 -> 0.9, does not enter), averaged over the
    # budget's last third: these curves climb linearly from 0, so the mean is their value at 5/6 of the budget
    assert own_gain_per_node(swarm, silo, [3], 100.0) == {3: [5.8, -11.7, 1.7, 0.0]}
    assert own_gain_per_node(swarm, silo, [3], 50.0) == {3: [2.9, -5.8, 0.8, 0.0]}


def test_the_silo_twins_are_the_nodes_warm_started_alike_compared_as_a_node_with_itself_alone():
    silo = {
        3: run([0.90, 0.84, 0.1, 0.1], [0.1, 0.1, 0.96, 0.90]),
        # three nodes know subtraction here: three pairs among them, none with the addition specialist
        4: run([0.1, 0.6, 0.1, 0.1], [0.9, 0.1, 0.6, 0.3], weak=("add", "subtract", "add", "add")),
    }
    # each curve's mean over the last third is its value at 5/6 of the budget: (0.90 - 0.84) * 5/6 = 0.05
    assert silo_twin_differences(silo, [3, 4], 100.0) == {3: [5.0, 5.0], 4: [25.0, 50.0, 25.0]}


def four_run(own_final: list[float], others_final: float) -> dict:
    """Four specialists, node i knowing FOUR[i]: its curve climbs linearly from 0 at 0 units to `own_final[i]` on it
    and to `others_final` on the other three at 90 units."""
    curves = []
    for i, own in enumerate(own_final):
        end = {label: (own if label == FOUR[i] else others_final) for label in FOUR}
        end["all"] = sum(end.values()) / 4
        curves.append([{"compute_s": 0.0, **{k: 0.0 for k in end}}, {"compute_s": 90.0, **end}])
    return {"budget_s": 90.0, "weak": [None] * 4, "own": list(FOUR), "curves": curves, "rounds": [10] * 4}


def test_four_specialists_compare_each_node_with_itself_alone_on_all_four_and_on_its_own():
    by_key = {
        ("four", "silo"): {0: four_run([0.6, 0.9, 0.3, 0.6], others_final=0.0)},
        ("four", "sapo_balance_gated"): {0: four_run([0.6, 0.6, 0.6, 0.9], others_final=0.4)},
    }
    out = four_specialists(by_key)
    gated = out["four_specialists"]["sapo_balance_gated"]
    # all four at 90 units: silo (own)/4, gated (own + 3 x 0.4)/4
    assert gated["gain_points_per_node_and_seed"] == [pytest.approx([30.0, 22.5, 37.5, 37.5])]
    assert gated["worst_specialty_per_node_and_seed"] == [pytest.approx([0.4] * 4)]
    # own specialty over the budget's last third (the mean of a line is its value at 5/6 of 90 units): the subtraction
    # node's 0.6 against its 0.9 alone is -25 points, however high its mean of four
    assert out["four_specialists_own_gain_points_per_node_and_seed"] == {0: [0.0, -25.0, 25.0, 25.0]}
    assert out["four_specialists_best_arm"] == "sapo_balance_gated"


def test_a_variant_named_by_its_full_label_may_be_the_best_arm_and_a_pilot_beside_it_may_not():
    """Replay ships as an arm run with --set swarm.own_replay=4: the report must be able to name it (and a silo with
    replay as the baseline), while other --set pilots stored in the same files stay out of the summary."""
    shipped = "sapo_balance_gated[own_replay=4]"
    assert arm_or_variant(shipped) == shipped
    assert single_node_arm("silo_imitate[own_replay=4]") == "silo_imitate[own_replay=4]"
    for bad in ("sapo_balance_gated[own_replay]", "no_such_arm[own_replay=4]", "sapo_balance_gated[a=1]]"):
        with pytest.raises(argparse.ArgumentTypeError):
            arm_or_variant(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="node alone"):
        single_node_arm("sapo_balance_gated")
    # a retired arm's stored runs are still reported, and it still counts as taking peers' groups or not
    assert arm_or_variant("sapo_cap") == "sapo_cap" and "sapo_cap" not in ARMS
    assert single_node_arm("silo_distill") == "silo_distill"
    with pytest.raises(argparse.ArgumentTypeError, match="node alone"):
        single_node_arm("sapo_balance_positive")
    assert may_be_best("sapo_balance_ramp", [])
    assert may_be_best("sapo_balance_gated", [])
    assert not may_be_best(shipped, ["sapo_balance_gated"])
    assert may_be_best(shipped, [shipped])
    assert not may_be_best("silo_imitate[own_replay=4]", ["silo_imitate[own_replay=4]"])

    def flat(level: float) -> dict:
        curves = [[{"compute_s": x, "all": level, **dict.fromkeys(FOUR, level)} for x in (0.0, 90.0)] for _ in range(4)]
        return {"budget_s": 90.0, "weak": [None] * 4, "own": list(FOUR), "curves": curves, "rounds": [10] * 4}

    by_key = {
        ("four", "silo"): {0: flat(0.2)},
        ("four", "sapo_balance_gated"): {0: flat(0.4)},
        ("four", shipped): {0: flat(0.5)},
        ("four", "sapo_balance_gated[kl_beta=0.04]"): {0: flat(0.9)},  # a pilot: never the summary's arm
    }
    assert four_specialists(by_key)["four_specialists_best_arm"] == "sapo_balance_gated"
    named = ["silo", "sapo_balance_gated", shipped]
    assert four_specialists(by_key, named)["four_specialists_best_arm"] == shipped
    homo = {"silo": {0: flat(0.5)}, shipped: {0: flat(0.55)}, "sapo_balance_gated[kl_beta=0.04]": {0: flat(0.9)}}
    assert homogeneous_ratios(homo, None, named)["homogeneous_arm"] == shipped
    assert homogeneous_ratios(homo, None)["homogeneous_arm"] is None


def test_the_best_arm_keeps_every_node_own_specialty_before_it_adds_the_most():
    """A higher mean of four paid for by one node's own specialty is not the target met: the summary names the arm
    that keeps every node's own skill (within 2 points of itself alone) and adds less, and the highest only where no
    arm keeps it."""
    silo = four_run([0.6, 0.6, 0.6, 0.6], others_final=0.0)
    # own over the last third is the value at 5/6 of the budget: 0.57 against 0.6 is -2.5 points, 0.58 is -1.7
    trading = four_run([0.9, 0.57, 0.9, 0.9], others_final=0.5)  # +42.9 points on the mean of four, -2.5 on node 1
    keeping = four_run([0.6, 0.58, 0.6, 0.6], others_final=0.3)  # +22.4 points, -1.7 on node 1
    by_key = {("four", "silo"): {0: silo}, ("four", "sapo_balance"): {0: trading}}
    assert four_specialists(by_key)["four_specialists_best_arm"] == "sapo_balance"  # the only arm: named, though
    by_key[("four", "sapo_balance_gated")] = {0: keeping}
    out = four_specialists(by_key)
    assert (
        out["four_specialists"]["sapo_balance"]["gain_points_mean"]
        > out["four_specialists"]["sapo_balance_gated"]["gain_points_mean"]
    )
    assert out["four_specialists_best_arm"] == "sapo_balance_gated"
    assert out["four_specialists_own_gain_points_per_node_and_seed"] == {0: [0.0, -1.7, 0.0, 0.0]}


def test_the_round_cost_quoted_is_the_newest_measured_against_the_reports_baseline():
    """The round cost of arms that replay sits beside lines of arms that do not: the report quotes the line measured
    against its own baseline, keyed by the labels it prints, and nothing where no line was."""
    lines = [
        {"round_cost_ratio_vs_silo": {"silo": {"units": 1.0}, "sapo_balance": {"units": 1.11}}},  # before the field
        {"round_cost_baseline": "silo_imitate", "round_cost_ratio_vs_silo": {"sapo_balance": {"units": 1.04}}},
        {"round_cost_baseline": "silo_imitate", "round_cost_ratio_vs_silo": {"sapo_balance": {"units": 1.02}}},
        {
            "round_cost_baseline": "silo_imitate",
            "overrides": ["swarm.own_replay=4"],
            "round_cost_ratio_vs_silo": {"silo_imitate": {"units": 1.0}, "sapo_balance_gated": {"units": 1.03}},
        },
        {"round_cost_baseline": "silo_imitate", "overrides": [], "round_cost_ratio_vs_silo": {"x": {"units": 0.9}}},
        {"round_cost_baseline": "silo_imitate", "overrides": ["swarm.own_replay=4"]},  # no silo arm ran: no ratios
    ]
    assert round_cost_against(lines, "silo") == {"silo": {"units": 1.0}, "sapo_balance": {"units": 1.11}}
    assert round_cost_against(lines, "silo_imitate") == {"x": {"units": 0.9}}
    assert round_cost_against(lines[:3], "silo_imitate") == {"sapo_balance": {"units": 1.02}}
    assert round_cost_against(lines, "silo_imitate[own_replay=4]") == {
        "silo_imitate[own_replay=4]": {"units": 1.0},
        "sapo_balance_gated[own_replay=4]": {"units": 1.03},
    }
    assert round_cost_against(lines, "silo_imitate[own_replay=8]") is None
