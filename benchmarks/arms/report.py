"""--report: the figures from the runs kept in --results, per setting and arm, and the JSON line."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Collection
from pathlib import Path

from benchmarks.arms.catalog import (
    FOUR_SPECIALTIES,
    NODES,
    OWN_SKILL_TOLERANCE_POINTS,
    REPORTED_SWARM_ARMS,
    SPECIALTIES,
    arm_label,
    base_arm,
    may_be_best,
)
from benchmarks.arms.curves import (
    at_compute,
    first_reach,
    interpolate,
    mean_metric,
    node_metric,
    own_gain_per_node,
    silo_twin_differences,
    spread,
)
from benchmarks.arms.plots import plot, plot_four


def warm_start_mismatches(by_key: dict) -> list[str]:
    """Each (setting, seed) whose arms' runs started from different warm starts (runs without a digest, stored
    before it was recorded, are not checked)."""
    digests: dict[tuple[str, int], dict[str, tuple]] = {}
    for (setting, label), seeds in by_key.items():
        for seed, run in seeds.items():
            if run.get("warm_start_digests"):
                digests.setdefault((setting, seed), {})[label] = tuple(run["warm_start_digests"])
    return [
        f"{setting} seed {seed}: " + "; ".join(f"{label} {','.join(d)}" for label, d in sorted(by_label.items()))
        for (setting, seed), by_label in sorted(digests.items())
        if len(set(by_label.values())) > 1
    ]


def on_axis(run: dict) -> dict:
    """The run as the report reads it: `compute_s` and `budget_s` on the run's own axis (units runs: compute units)."""
    if run.get("axis", "cpu") != "units":
        return run
    view = dict(run)
    view["compute_s"] = run["units"]
    view["curves"] = [[{**p, "compute_s": p["units"]} for p in curve] for curve in run["curves"]]
    return view


def cut_at(run: dict, budget: float) -> dict:
    """A run with a longer budget read as if it had stopped at `budget` (its curves hold points there: --points with
    the budget a multiple of the step): its held-out points up to it, each node's rounds and compute at its last one.
    Its per-round means (sampled reward, groups used, peers' groups re-scored) stay the whole run's."""
    if run["rounds_limit"] is not None or run["budget_s"] <= budget:
        return run
    view = dict(run, budget_s=budget, cut_from_budget=run["budget_s"])
    view["curves"] = [[p for p in curve if p["compute_s"] <= budget * 1.01] for curve in run["curves"]]
    view["rounds"] = [curve[-1]["round"] for curve in view["curves"]]
    view["compute_s"] = [curve[-1]["compute_s"] for curve in view["curves"]]
    return view


def json_lines(paths: list[Path]) -> list[dict]:
    """Every JSON line of the files, in order."""
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]


def report(args) -> None:
    runs = json_lines([args.results, *args.more_results])
    runs.sort(key=lambda run: run.get("finished", 0))  # across files too, the newest run of a key counts
    # one axis at a time: a budget in units and one in CPU seconds are not the same work
    runs = [on_axis(run) for run in runs if run.get("axis", "cpu") == args.axis]
    # one transport at a time (--transport): a run through the DHT must not stand in for its seed's in-process one
    runs = [run for run in runs if run.get("transport", "inprocess") == args.transport]
    # arms are compared at one budget: longer runs are read up to it, shorter ones left out
    if args.report_budget is not None:
        runs = [cut_at(run, args.report_budget) for run in runs]
        runs = [run for run in runs if run["rounds_limit"] is not None or run["budget_s"] == args.report_budget]
        for run in runs:
            if "cut_from_budget" in run:
                label = f"{arm_label(run)} seed {run['seed']}"
                print(f"{label}: a run of {run['cut_from_budget']:g} read up to {args.report_budget:g}")
    # arms whose runs shared the machine's load: CPU seconds per round move with it
    # (benchmarks/notebook/2026-11-26-sharing-cpu-seconds.md)
    named = args.report_arms or []
    if named:
        runs = [run for run in runs if run["arm"] in named or arm_label(run) in named]
    # the newest run of each (setting, arm and its --set overrides, seed) counts; the sparse setting's runs are
    # compared at one horizon (--rounds) at a time: a longer run is another figure, not a newer one
    by_key: dict[tuple[str, str], dict[int, dict]] = {}
    sparse_by_rounds: dict[int, dict[str, dict[int, dict]]] = {}
    for run in runs:
        if run["setting"] == "sparse":
            sparse_by_rounds.setdefault(run["rounds_limit"], {}).setdefault(arm_label(run), {})[run["seed"]] = run
        else:
            by_key.setdefault((run["setting"], arm_label(run)), {})[run["seed"]] = run
    summary: dict = {"benchmark": "sharing", "compute_axis": args.axis, "baseline": args.baseline}
    if mismatches := warm_start_mismatches(by_key):
        print("WARNING: these arms started from different warm starts (built on different machines?), so their")
        print("differences are not the arms' alone:\n  " + "\n  ".join(mismatches))
        summary["warm_start_mismatches"] = mismatches
    if args.baseline != "silo":  # the best single-node recipe plays the silo every arm is measured against
        for setting in {setting for setting, _ in by_key}:
            if (setting, args.baseline) in by_key:
                plain = by_key.pop((setting, "silo"), None)
                if plain:
                    by_key[(setting, "silo_plain")] = plain
                by_key[(setting, "silo")] = by_key.pop((setting, args.baseline))
        print(f"the silo below is {args.baseline!r} (plain SAPO-less silo: 'silo_plain')")
    summary.update(four_specialists(by_key, named))
    four_arms = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "four"}
    if args.plot_four and four_arms:
        plot_four(four_arms, args.plot_four, args.axis, args.baseline)
    costs = json_lines([path for path in args.round_cost_results if path.exists()])
    if ratios := round_cost_against(costs, args.baseline):
        summary["round_cost_ratio_vs_silo"] = ratios
    else:
        print(f"no --round-cost line in {[str(p) for p in args.round_cost_results]} measured against {args.baseline!r}")
    silo_round_s = (
        statistics.fmean(
            c / r
            for run in by_key.get(("specialists", "silo"), {}).values()
            for c, r in zip(run["compute_s"], run["rounds"])
        )
        if ("specialists", "silo") in by_key
        else None
    )

    # specialists: held-out on the weak specialty at equal compute, and the speed-up
    spec_arms = {
        arm: seeds
        for (setting, arm), seeds in by_key.items()
        if setting == "specialists" and seeds[next(iter(seeds))]["rounds_limit"] is None
    }
    if "silo" in spec_arms:
        silo = spec_arms["silo"]
        print(
            f"specialists: weak-specialty held-out (mean of {NODES} nodes) at equal node compute; silo round "
            f"{silo_round_s:.3f} s of compute"
        )
        table = {}
        for arm, seeds in sorted(spec_arms.items()):
            common = sorted(set(seeds) & set(silo))
            if not common:
                continue
            row = {"seeds": common}
            budget = min(seeds[s]["budget_s"] for s in common)
            row["weak_start"] = spread([mean_metric(seeds[s], 0.0, "weak") for s in common])
            row["weak_final"] = spread([mean_metric(seeds[s], budget, "weak") for s in common])
            row["own_final"] = spread([mean_metric(seeds[s], budget, "own") for s in common])
            row["both_final"] = spread([mean_metric(seeds[s], budget, "all") for s in common])
            if all("kl_own_vs_warm" in seeds[s]["curves"][0][-1] for s in common):
                # RL's Razor: how far the node moved from its warm start on what it knew (nats per sequence)
                row["kl_own_vs_warm_final"] = spread(
                    [statistics.fmean(curve[-1]["kl_own_vs_warm"] for curve in seeds[s]["curves"]) for s in common]
                )
            row["both_gain_points_vs_silo"] = spread(
                [100 * (mean_metric(seeds[s], budget, "all") - mean_metric(silo[s], budget, "all")) for s in common]
            )
            row["weak_gain_points_vs_silo"] = spread(
                [100 * (mean_metric(seeds[s], budget, "weak") - mean_metric(silo[s], budget, "weak")) for s in common]
            )
            row["own_gain_points_vs_silo"] = spread(
                [100 * (mean_metric(seeds[s], budget, "own") - mean_metric(silo[s], budget, "own")) for s in common]
            )
            row["own_gain_points_per_node_and_seed"] = own_gain_per_node(seeds, silo, common, budget)
            row["budget_s"] = budget
            swarm_arm = base_arm(arm) in REPORTED_SWARM_ARMS
            if swarm_arm and "silo_imitate" in spec_arms and set(common) <= set(spec_arms["silo_imitate"]):
                # the fair silo of an arm that imitates: the same imitation term on its own right answers only
                control = spec_arms["silo_imitate"]
                row["weak_gain_points_vs_silo_imitate"] = spread(
                    [
                        100 * (mean_metric(seeds[s], budget, "weak") - mean_metric(control[s], budget, "weak"))
                        for s in common
                    ]
                )
            charge = args.network_charge * silo_round_s if swarm_arm else 0.0
            speedups, speedups_net = [], []
            for s in common:
                # S = the compute the silo needs to reach its final held-out / what this arm needs to reach it
                # (the silo's own curve is noisy: it may touch its final level before the end of its budget)
                target = mean_metric(silo[s], budget, "weak")
                silo_reach = first_reach(silo[s], "weak", target) or budget
                reach = first_reach(seeds[s], "weak", target)
                rounds_per_s = statistics.fmean(r / c for r, c in zip(seeds[s]["rounds"], seeds[s]["compute_s"]))
                speedups.append(silo_reach / reach if reach else 0.0)
                speedups_net.append(silo_reach / (reach * (1 + charge * rounds_per_s)) if reach else 0.0)
            row["speedup"] = spread(speedups)
            row["speedup_with_network"] = spread(speedups_net)
            row["sampled_reward_ratio_vs_silo"] = spread(
                [
                    statistics.fmean(seeds[s]["reward_per_round"]) / statistics.fmean(silo[s]["reward_per_round"])
                    for s in common
                ]
            )
            row["groups_used_per_update"] = statistics.fmean(seeds[s]["groups_used_per_update"] for s in common)
            weights = [
                seeds[s]["importance_weight_mean"] for s in common if seeds[s]["importance_weight_mean"] is not None
            ]
            row["importance_weight_mean"] = statistics.fmean(weights) if weights else None
            rescored = [seeds[s]["rescored_per_round"] for s in common if seeds[s]["rescored_per_round"] is not None]
            row["rescored_per_round"] = statistics.fmean(rescored) if rescored else None
            row["rounds_per_node"] = statistics.fmean(r for s in common for r in seeds[s]["rounds"])
            table[arm] = row
            print(
                f"  {arm:13s} seeds {common}: weak {row['weak_start']['mean']:.3f} -> {row['weak_final']['mean']:.3f} "
                f"({row['weak_gain_points_vs_silo']['mean']:+.1f} points vs silo, per seed "
                f"{[round(v, 1) for v in row['weak_gain_points_vs_silo']['per_seed']]}), "
                f"own {row['own_final']['mean']:.3f}, both {row['both_final']['mean']:.3f} "
                f"({row['both_gain_points_vs_silo']['mean']:+.1f} points vs silo), S {row['speedup']['mean']:.2f}x "
                f"({row['speedup_with_network']['mean']:.2f}x with network), "
                f"reward ratio {row['sampled_reward_ratio_vs_silo']['mean']:.3f}, groups/update "
                f"{row['groups_used_per_update']:.2f}, "
                f"rounds {row['rounds_per_node']:.0f}, own vs the same node alone over the last third, points per seed "
                f"{row['own_gain_points_per_node_and_seed']}"
                + (
                    f", importance weight {row['importance_weight_mean']:.3f}"
                    if row["importance_weight_mean"] is not None
                    else ""
                )
                + (
                    f", {row['weak_gain_points_vs_silo_imitate']['mean']:+.1f} points vs silo_imitate"
                    if "weak_gain_points_vs_silo_imitate" in row
                    else ""
                ),
                flush=True,
            )
        summary["specialists"] = table
        # an arm run with --set overrides is a variant (its label says which), never the shipped arm
        swarm_rows = {arm: row for arm, row in table.items() if may_be_best(arm, named)}
        # the best arm among those run on the most seeds: a 2-seed pilot must not outrank a 3-seed result
        swarm_rows = on_most_seeds(swarm_rows, lambda row: row["seeds"])
        if swarm_rows:
            # the swarm must add: the best arm ends highest on both specialties together among the arms that keep the
            # node's own specialty (a gain on both paid for by the own one is not the target met)
            best = best_keeping_own(
                swarm_rows,
                gain=lambda row: row["both_gain_points_vs_silo"]["mean"],
                keeps_own=lambda row: row["own_gain_points_vs_silo"]["mean"] >= -OWN_SKILL_TOLERANCE_POINTS,
            )
            summary["best_arm"] = best
            summary["seeds"] = table[best]["seeds"]
            summary["both_gain_points_per_seed"] = table[best]["both_gain_points_vs_silo"]["per_seed"]
            summary["own_gain_points_per_seed"] = table[best]["own_gain_points_vs_silo"]["per_seed"]
            summary["own_gain_points_per_node_and_seed"] = table[best]["own_gain_points_per_node_and_seed"]
            twins = silo_twin_differences(silo, table[best]["seeds"], table[best]["budget_s"])
            differences = [d for per_seed in twins.values() for d in per_seed]
            summary["own_silo_twin_difference_points_per_seed"] = twins
            # the twins' differences have mean 0 by construction: their root mean square is the spread of a
            # node-against-node difference that no sharing made
            summary["own_silo_twin_rms_points"] = (
                round(math.sqrt(statistics.fmean(d * d for d in differences)), 1) if differences else None
            )
            print(
                f"  the silo's twins (nodes warm-started alike), own specialty over the last third, first less second, "
                f"points per seed: {twins}; root mean square {summary['own_silo_twin_rms_points']}; a node alone "
                f"ends more than 2 points under its twin in {sum(abs(d) > 2 for d in differences)} of "
                f"{2 * len(differences)} ordered comparisons",
                flush=True,
            )
            summary["heldout_gain_weak_points_per_seed"] = table[best]["weak_gain_points_vs_silo"]["per_seed"]
            summary["speedup_per_seed"] = table[best]["speedup"]["per_seed"]
            summary["speedup_with_network_per_seed"] = table[best]["speedup_with_network"]["per_seed"]
        if args.plot:
            plot(spec_arms, args.plot, args.axis, args.baseline)
    # homogeneous: never below the silo
    homo = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "homogeneous"}
    if "silo" in homo:
        summary.update(homogeneous_ratios(homo, summary.get("best_arm"), named))
    pretrained = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "pretrained"}
    if "silo" in pretrained:
        summary.update(pretrained_gains(pretrained))
    # sparse: SAPO's cumulative reward ratio, against the paper's silo and ours, at each horizon run; the summary's
    # per-seed fields keep the horizon with the most seeds of the paper's two arms (then the longest)
    horizons: dict[int, dict[str, list[float]]] = {}
    for rounds, sparse in sorted(sparse_by_rounds.items()):
        for name, silo_arm in (
            ("sapo_ratio_vs_paper_silo_per_seed", "paper_silo"),
            ("sapo_ratio_vs_our_silo_per_seed", "silo"),
        ):
            if "paper_sapo" in sparse and silo_arm in sparse:
                common = sorted(set(sparse["paper_sapo"]) & set(sparse[silo_arm]))
                horizons.setdefault(rounds, {})[name] = [
                    statistics.fmean(sparse["paper_sapo"][s]["cumulative_reward"])
                    / statistics.fmean(sparse[silo_arm][s]["cumulative_reward"])
                    for s in common
                ]
                ratios = [round(r, 3) for r in horizons[rounds][name]]
                print(
                    f"sparse, {rounds} rounds: paper's 4/4 cumulative reward / {silo_arm}, seeds {common}: {ratios}",
                    flush=True,
                )
    if horizons:
        kept = max(horizons, key=lambda r: (len(horizons[r].get("sapo_ratio_vs_paper_silo_per_seed", [])), r or 0))
        summary.update(horizons[kept])
        summary["sparse_rounds"] = kept
        summary["sparse_by_rounds"] = {str(r): ratios for r, ratios in horizons.items()}
    if "silo" in spec_arms and args.axis == "cpu":  # compute units are load-free already
        summary["load_matched"] = load_matched(spec_arms)
    print(json.dumps(summary))


def round_cost_against(lines: list[dict], baseline: str) -> dict | None:
    """The round-cost ratios of the newest --round-cost line measured against `baseline` (an arm, or a variant by its
    full label), keyed by the labels the report prints: a line run with --set swarm.own_replay=4 is a line of
    `silo_imitate[own_replay=4]` and `sapo_balance_gated[own_replay=4]`, not of the arms without replay."""
    for line in reversed(lines):
        ratios = line.get("round_cost_ratio_vs_silo")
        if not ratios:
            continue
        overrides = line.get("overrides") or []
        # lines from before round_cost_baseline was recorded took their ratios against the plain silo
        measured_against = arm_label({"arm": line.get("round_cost_baseline", "silo"), "overrides": overrides})
        if measured_against == baseline:
            return {arm_label({"arm": arm, "overrides": overrides}): ratio for arm, ratio in ratios.items()}
    return None


def best_keeping_own(rows: dict, gain: Callable[[dict], float], keeps_own: Callable[[dict], bool]) -> str | None:
    """The arm with the highest `gain` among those that keep the node's own specialty, or among all of them where none
    does (the report then says so)."""
    keeping = {arm: row for arm, row in rows.items() if keeps_own(row)}
    if rows and not keeping:
        print(f"no arm keeps the own specialty within {OWN_SKILL_TOLERANCE_POINTS} points of the silo's", flush=True)
    candidates = keeping or rows
    return max(candidates, key=lambda arm: gain(candidates[arm]), default=None)


def on_most_seeds(by_arm: dict, seeds_of: Callable[[object], list]) -> dict:
    """The arms run on the most seeds: a pilot on fewer seeds must not outrank a result on more."""
    most = max((len(seeds_of(value)) for value in by_arm.values()), default=0)
    return {arm: value for arm, value in by_arm.items() if len(seeds_of(value)) == most}


def homogeneous_ratios(homo: dict, best_arm: str | None, named: Collection[str] = ()) -> dict:
    """Equal nodes: each arm's mean held-out over its 4 nodes divided by the silo's, per seed, at the smaller budget of
    the two; the summary's per-seed ratios are those of the specialists' best arm, or (a report of equal nodes alone)
    of the swarm arm with the highest mean ratio among those run on the most seeds."""
    ratios = {}
    for arm, seeds in homo.items():
        common = sorted(set(seeds) & set(homo["silo"]))
        ratios[arm] = []
        for s in common:
            budget = min(seeds[s]["budget_s"], homo["silo"][s]["budget_s"])
            ratios[arm].append(mean_metric(seeds[s], budget, "all") / mean_metric(homo["silo"][s], budget, "all"))
        print(
            f"homogeneous: {arm} held-out ratio to silo at equal compute, per seed "
            f"{[round(r, 3) for r in ratios[arm]]}",
            flush=True,
        )
    if best_arm is None:
        swarm_ratios = {arm: r for arm, r in ratios.items() if may_be_best(arm, named) and r}
        swarm_ratios = on_most_seeds(swarm_ratios, lambda per_seed: per_seed)
        best_arm = max(swarm_ratios, key=lambda arm: statistics.fmean(swarm_ratios[arm]), default=None)
    return {
        "homogeneous_arm": best_arm,
        "homogeneous_ratio_per_seed": ratios.get(best_arm) if best_arm else None,
        "homogeneous_ratios": ratios,
    }


def pretrained_gains(arms: dict) -> dict:
    """Equal nodes of a pretrained model: each arm's held-out (mean of its nodes, every task) at the start and at the
    smaller budget of the arm and the silo, per seed, and its gain over the silo there in points."""
    rows = {}
    for arm, seeds in sorted(arms.items()):
        common = sorted(set(seeds) & set(arms["silo"]))
        per_seed = []
        for s in common:
            budget = min(seeds[s]["budget_s"], arms["silo"][s]["budget_s"])
            start, final = mean_metric(seeds[s], 0.0, "all"), mean_metric(seeds[s], budget, "all")
            silo_final = mean_metric(arms["silo"][s], budget, "all")
            per_seed.append(
                {
                    "seed": s,
                    "budget": budget,
                    "start": round(start, 4),
                    "final": round(final, 4),
                    "gain_points": round(100 * (final - start), 1),
                    "vs_silo_points": round(100 * (final - silo_final), 1),
                    "nodes_final": [round(node_metric(seeds[s], i, budget, "all"), 3) for i in range(NODES)],
                }
            )
        rows[arm] = per_seed
        print(f"pretrained: {arm}, held-out (mean of {NODES} nodes) at equal compute, per seed {per_seed}", flush=True)
    return {"pretrained": rows}


def four_specialists(by_key: dict, named: Collection[str] = ()) -> dict:
    """--setting four: each node's mean held-out over the four specialties at the budget, against the silo's node of
    the same index and seed (the same warm start), and the worst specialty of each."""
    four = {arm: seeds for (setting, arm), seeds in by_key.items() if setting == "four"}
    if "silo" not in four:
        return {"four_specialists_gain_points_per_node_and_seed": None}
    silo, out = four["silo"], {}
    for arm, seeds in sorted(four.items()):
        common = sorted(set(seeds) & set(silo))
        if not common:
            continue
        budget = min(seeds[s]["budget_s"] for s in common)

        def final(run: dict, node: int, key: str) -> float:
            return at_compute(run["curves"][node], key, budget)

        gains = [[100 * (final(seeds[s], i, "all") - final(silo[s], i, "all")) for i in range(NODES)] for s in common]
        worst = [[min(final(seeds[s], i, label) for label in FOUR_SPECIALTIES) for i in range(NODES)] for s in common]
        by_specialty = {
            label: statistics.fmean(final(seeds[s], i, label) for s in common for i in range(NODES))
            for label in FOUR_SPECIALTIES
        }
        own = statistics.fmean(final(seeds[s], i, seeds[s]["own"][i]) for s in common for i in range(NODES))
        out[arm] = {
            "seeds": common,
            "mean_final": statistics.fmean(final(seeds[s], i, "all") for s in common for i in range(NODES)),
            "own_final": own,
            "by_specialty_final": by_specialty,
            "gain_points_per_node_and_seed": gains,
            "gain_points_mean": statistics.fmean(g for per_seed in gains for g in per_seed),
            "worst_specialty_per_node_and_seed": worst,
            "own_gain_points_per_node_and_seed": own_gain_per_node(seeds, silo, common, budget),
            "rounds_per_node": statistics.fmean(r for s in common for r in seeds[s]["rounds"]),
        }
        print(
            f"four specialists: {arm:13s} seeds {common}: 4-specialty mean {out[arm]['mean_final']:.3f} "
            f"({out[arm]['gain_points_mean']:+.1f} points vs silo; per seed, per node "
            f"{[[round(g, 1) for g in per_seed] for per_seed in gains]}), own {own:.3f}, by specialty "
            f"{ {label: round(v, 3) for label, v in by_specialty.items()} }, worst per node "
            f"{[[round(w, 3) for w in per_seed] for per_seed in worst]}, own specialty vs the same node alone over "
            f"the budget's last third, points per seed and node {out[arm]['own_gain_points_per_node_and_seed']}",
            flush=True,
        )
    swarm = {arm: row for arm, row in out.items() if may_be_best(arm, named)}
    best = best_keeping_own(
        swarm,
        gain=lambda row: row["gain_points_mean"],
        # every node keeps its own specialty on the mean of its seeds
        keeps_own=lambda row: all(
            statistics.fmean(per_node) >= -OWN_SKILL_TOLERANCE_POINTS
            for per_node in zip(*row["own_gain_points_per_node_and_seed"].values())
        ),
    )
    return {
        "four_specialists": out,
        "four_specialists_best_arm": best,
        "four_specialists_gain_points_per_node_and_seed": out[best]["gain_points_per_node_and_seed"] if best else None,
        "four_specialists_own_gain_points_per_node_and_seed": (
            out[best]["own_gain_points_per_node_and_seed"] if best else None
        ),
    }


def mean_at_round(run: dict, round_: float, which: str) -> float:
    keys = [
        (
            run["weak"][i]
            if which == "weak"
            else next(label for label in SPECIALTIES if label != run["weak"][i])
            if which == "own"
            else "all"
        )
        for i in range(NODES)
    ]
    return statistics.fmean(interpolate(run["curves"][i], keys[i], "round", round_) for i in range(NODES))


def load_matched(spec_arms: dict) -> dict:
    """Each arm against the silo of its seeds when their runs did not share the machine's load (CPU seconds a round
    move with it): the arm's CPU cost a round relative to a silo run that overlapped it in time gives the rounds it
    would have run in the silo's budget at the silo's load; its held-out at that round against the silo's at its end."""

    def span(run):
        return run["finished"] - run["wall_s"], run["finished"]

    def cost(run):
        return statistics.fmean(c / r for c, r in zip(run["compute_s"], run["rounds"]))

    silo, out = spec_arms["silo"], {}
    for arm, seeds in sorted(spec_arms.items()):
        if arm == "silo":
            continue
        for seed, run in sorted(seeds.items()):
            beside = [q for q in silo.values() if span(q)[0] < span(run)[1] and span(run)[0] < span(q)[1]]
            if seed not in silo or not beside:
                continue
            ratio = cost(run) / statistics.fmean(cost(q) for q in beside)
            rounds = statistics.fmean(silo[seed]["rounds"]) / ratio
            row = {"cost_ratio_vs_silo_beside": ratio, "rounds_at_silo_budget": rounds}
            for which in ("weak", "own", "all"):
                row[which] = mean_at_round(run, rounds, which)
                row[f"{which}_gain_points_vs_silo"] = 100 * (
                    row[which] - mean_metric(silo[seed], silo[seed]["budget_s"], which)
                )
            out.setdefault(arm, {})[seed] = row
            print(
                f"load-matched {arm} seed {seed}: a round costs {ratio:.2f}x a silo round beside it, so {rounds:.0f} "
                "rounds in the silo's budget; "
                f"there weak {row['weak']:.3f} ({row['weak_gain_points_vs_silo']:+.1f} points vs silo), own "
                f"{row['own']:.3f} ({row['own_gain_points_vs_silo']:+.1f}), "
                f"both {row['all']:.3f} ({row['all_gain_points_vs_silo']:+.1f})",
                flush=True,
            )
    return out
