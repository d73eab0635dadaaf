"""The figures from the rows of --results (report) and their tables (print_report)."""

from __future__ import annotations

import math
import statistics

from benchmarks.common import REPO, print_result_line
from benchmarks.recovery.runs import STAGES, seeded_shape_overrides
from node.config import load_config
from node.model import build_char_tokenizer, build_default_model
from node.pipeline.recovery import tensor_bytes
from node.pipeline.stages import checkfree_plus_extra_parts, part_tensors, split_model


def same_rate(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def runs_of(rows: list[dict], strategy: str, rate: float | None = None) -> list[dict]:
    """The rows of `strategy` (at `rate`, where one is given)."""
    return [r for r in rows if r["strategy"] == strategy and (rate is None or same_rate(r["rate"], rate))]


def stage_kind(stages: list[int]) -> str:
    """`end` for a failure that lost the first or the last stage (the embedding or the head with its layers), else
    `middle`: the two cost random re-initialisation very differently."""
    return "end" if any(stage in (0, STAGES - 1) for stage in stages) else "middle"


def mean_and_range(values: list[float]) -> dict | None:
    """Over the seeds that have a value: its mean, min and max, and how many they are (None where none has one)."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def report(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """The figures of issue #37 from the rows of --results: per strategy and rate, the mean over seeds (with min, max
    and how many seeds reached the target) of steps and wall seconds to the target; checkpoint-restart's wall seconds
    over CheckFree's per rate (of the means, and per seed); recovery seconds by how the stage came back; what a
    checkpoint cost."""

    # the rates asked for only (and the failure-free runs): recoveries, spikes and checkpoint costs are read per report
    rows = [r for r in rows if r["strategy"] == "none" or any(same_rate(r["rate"], rate) for rate in rates)]

    def rows_of(strategy: str, rate: float | None = None) -> list[dict]:
        return runs_of(rows, strategy, rate)

    steps: dict[str, dict] = {"none": {"0.00": mean_and_range([r["steps_to_target"] for r in rows_of("none")])}}
    wall: dict[str, dict] = {"none": {"0.00": mean_and_range([r["wall_s_to_target"] for r in rows_of("none")])}}
    failures: dict[str, dict] = {}
    end_failures: dict[str, dict] = {}
    for strategy in strategies:
        steps[strategy], wall[strategy], failures[strategy], end_failures[strategy] = {}, {}, {}, {}
        for rate in rates:
            runs = sorted(rows_of(strategy, rate), key=lambda r: r["seed"])
            steps[strategy][f"{rate:.2f}"] = mean_and_range([r["steps_to_target"] for r in runs])
            wall[strategy][f"{rate:.2f}"] = mean_and_range([r["wall_s_to_target"] for r in runs])
            failures[strategy][f"{rate:.2f}"] = [r["failures"] for r in runs]
            end_failures[strategy][f"{rate:.2f}"] = [
                sum(stage_kind(f["stages"]) == "end" for f in r["recoveries"]) for r in runs
            ]
    speedup, speedup_by_seed, steps_ratio = {}, {}, {}
    for rate in rates:
        name = f"{rate:.2f}"
        pairs = checkfree_checkpoint_pairs(rows, rate)
        speedup_by_seed[name] = {
            str(ours["seed"]): theirs["wall_s_to_target"] / ours["wall_s_to_target"] for ours, theirs in pairs
        }
        speedup[name] = paired_ratio_of_means(pairs, "wall_s_to_target")
        steps_ratio[name] = paired_ratio_of_means(pairs, "steps_to_target")
    by_method: dict[str, list[float]] = {}
    to_serving: dict[str, list[float]] = {}
    for row in rows:
        for recovery in row.get("recoveries", []):
            for method in recovery["methods"]:
                by_method.setdefault(method, []).append(recovery["seconds"])
                if "to_serving_s" in recovery:
                    to_serving.setdefault(method, []).append(recovery["to_serving_s"])
    baselines = [r for r in rows_of("none") if r.get("target") is not None]
    # validation loss at the step where the failure-free runs took their target: a measure that does not jump by a
    # whole evaluation interval when a curve on its plateau misses the target by a hair
    target_steps = [next((p["step"] for p in r["curve"] if p["val_loss"] <= r["target"]), None) for r in baselines]
    target_step = max((s for s in target_steps if s is not None), default=None)

    def val_at(run: dict) -> float | None:
        # the last evaluation at that step (a rollback evaluates a step again), else the run stopped before it
        return next((p["val_loss"] for p in reversed(run.get("curve", [])) if p["step"] == target_step), None)

    val_loss_at = {
        strategy: {f"{rate:.2f}": mean_and_range([val_at(r) for r in rows_of(strategy, rate)]) for rate in rates}
        for strategy in strategies
    }
    equal_wall, equal_wall_s, equal_wall_ranks, not_evaluated = val_loss_at_equal_wall_clock(rows, rates, strategies)
    checkpoints = rows_of("checkpoint")
    saves = [s for r in checkpoints for s in r["checkpoint_saves_s"]]
    loads = [s for r in checkpoints for s in r["checkpoint_loads_s"]]
    wall_means = {f"{rate:.2f}": common_seed_means(rows, rate, strategies) for rate in rates}
    wall_means_missed_counted = {
        f"{rate:.2f}": common_seed_means(rows, rate, strategies, missed_at_last_evaluation=True) for rate in rates
    }
    return {
        "benchmark": "stage_recovery",
        "parameters": next((r.get("parameters") for r in rows if r.get("parameters")), None),
        "key": next((r["key"] for r in rows if r["strategy"] != "none"), rows[0]["key"] if rows else None),
        "steps_by_strategy_and_rate": steps,
        "wall_s_by_strategy_and_rate": wall,
        "wallclock_speedup_vs_checkpoint_by_rate": speedup,
        "wallclock_speedup_vs_checkpoint_by_rate_and_seed": speedup_by_seed,
        "steps_ratio_checkpoint_vs_checkfree_by_rate": steps_ratio,
        "ordering_by_wall_s": {name: sorted(means, key=means.get) for name, means in wall_means.items()},
        # over every seed, a run that missed the target at its last evaluation: its mean a lower bound
        "wall_s_missed_counted_by_rate": wall_means_missed_counted,
        "ordering_by_wall_s_missed_counted": {
            name: sorted(means, key=means.get) for name, means in wall_means_missed_counted.items()
        },
        "val_loss_at_step": target_step,
        "val_loss_at_step_by_strategy_and_rate": val_loss_at,
        # each seed's runs compared at the wall clock where the first of them reached the target
        "val_loss_at_equal_wall_s_by_strategy_and_rate": equal_wall,
        "equal_wall_s_by_rate_and_seed": equal_wall_s,
        "mean_rank_at_equal_wall_s_by_rate": equal_wall_ranks,
        "ordering_by_rank_at_equal_wall_s": {name: sorted(r, key=r.get) for name, r in equal_wall_ranks.items()},
        "not_evaluated_by_equal_wall_s": not_evaluated,
        "failures_by_strategy_and_rate": failures,
        # of those, the failures that lost the first or the last stage (by seed, as above)
        "end_stage_failures_by_strategy_and_rate": end_failures,
        "recovery_s_by_method": {m: mean_and_range(v) for m, v in sorted(by_method.items())},
        # the part of a recovery before the first step: the replacement's start and weight transfer (rows since
        # 2026-11-28)
        "to_serving_s_by_method": {m: mean_and_range(v) for m, v in sorted(to_serving.items())},
        # training loss of the first step after a failure less that of the step before it
        "loss_spike_by_strategy": {
            s: mean_and_range([x for r in rows_of(s) for x in r.get("loss_spike", [])]) for s in strategies
        },
        "loss_spike_by_strategy_and_stage_kind": {
            s: {
                kind: mean_and_range(
                    [
                        spike
                        for r in rows_of(s)
                        for f, spike in zip(r["recoveries"], r.get("loss_spike", []))
                        if stage_kind(f["stages"]) == kind
                    ]
                )
                for kind in ("end", "middle")
            }
            for s in strategies
        },
        "checkpoint_save_s": mean_and_range(saves),
        "checkpoint_load_s": mean_and_range(loads),
        "checkpoint_bytes": max((r["checkpoint_bytes"] for r in checkpoints), default=0),
        # what a rollback threw away, and the share of checkpoint-restart's wall clock its saves and loads took
        "checkpoint_replayed_steps": mean_and_range([f["replayed"] for r in checkpoints for f in r["recoveries"]]),
        "checkpoint_io_share": mean_and_range(
            [r["checkpoint_io_s"] / r["wall_s_to_target"] for r in checkpoints if r["wall_s_to_target"]]
        ),
        "checkpoint_every_by_rate": {
            f"{rate:.2f}": sorted({r["checkpoint_every"] for r in rows_of("checkpoint", rate)}) for rate in rates
        },
        # uploads in the background (empty otherwise): how long a checkpoint took to become the restore point, what
        # saves waited for the uploads before them, and the failures that cut uploads still going
        "checkpoint_upload_s": mean_and_range([s for r in checkpoints for s in r.get("checkpoint_uploads_s", [])]),
        "checkpoint_upload_wait_s": mean_and_range(
            [s for r in checkpoints for s in r.get("checkpoint_upload_waits_s", [])]
        ),
        "checkpoint_failures_that_cut_uploads": [
            sum(bool(f.get("uploads_cut")) for f in r["recoveries"]) for r in checkpoints
        ],
        "missed_target": sorted(
            f"{r['strategy']}@{r['rate']:.2f} seed {r['seed']}" for r in rows if r["steps_to_target"] is None
        ),
        # a step without a failure in it (each run's median): what uploads in the background cost the steps beside them
        "normal_step_s_by_strategy_and_rate": {
            strategy: {
                f"{rate:.2f}": mean_and_range([r.get("normal_step_s") for r in rows_of(strategy, rate)])
                for rate in rates
            }
            for strategy in strategies
        },
        **wall_s_split(rows, rates, strategies),
        **uplink_traffic(rows, rates, strategies),
        **neighbour_fetch_over_links(rows, rates, strategies),
    }


def uplink_traffic(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """Per-host uplinks (rows with `uplink_mb_by_host`): what a stage's host sent over its uplink per step executed,
    validation included (the mean over the four stage hosts; over seeds: spread), and the driver's."""
    shaped = [r for r in rows if r.get("uplink_mb_by_host")]
    if not shaped:
        return {}

    def per_step(row: dict, hosts: list[str]) -> float | None:
        executed = row["curve"][-1]["executed"] if row.get("curve") else 0
        sent = [row["uplink_mb_by_host"].get(host) for host in hosts]
        return statistics.mean(sent) / executed if executed and None not in sent else None

    stage_hosts = [f"stage-{index}" for index in range(STAGES)]
    by_strategy = {"none": {"0.00": runs_of(shaped, "none")}} | {
        strategy: {f"{rate:.2f}": runs_of(shaped, strategy, rate) for rate in rates} for strategy in strategies
    }
    return {
        "uplink_mb_per_step_stage_host_by_strategy_and_rate": {
            strategy: {rate: mean_and_range([per_step(r, stage_hosts) for r in runs]) for rate, runs in by_rate.items()}
            for strategy, by_rate in by_strategy.items()
        },
        "uplink_mb_per_step_driver_by_strategy_and_rate": {
            strategy: {rate: mean_and_range([per_step(r, ["driver"]) for r in runs]) for rate, runs in by_rate.items()}
            for strategy, by_rate in by_strategy.items()
        },
    }


WALL_PARTS = ("steps", "replayed_steps", "recoveries", "saves", "rest")  # replayed_steps: a part of steps


def wall_s_split(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """Where each run's wall seconds to the target went (spread over seeds, per strategy and rate): its steps executed
    at its own normal (median) step, and of those the steps a rollback replayed; its recoveries (each the time to a
    serving stage and what the next step took beyond a normal one); its checkpoint saves (what they blocked); and the
    rest (steps slower or faster than the run's median as the load moved, the first step's warm-up). A baseline is
    second or third by what it pays on every step (uploads beside the steps, a slower median) or per failure (a
    recovery, replayed steps, or the extra steps a loss spike costs, which show as more steps executed). Also the
    order by steps executed alone: the paper's account, where saves, loads and recoveries cost nothing. Both over the
    seeds where every strategy reached the target (and, for the split, recorded its normal step), as the order by wall
    seconds is."""

    def timed(run: dict) -> bool:
        return bool(run["wall_s_to_target"]) and run.get("normal_step_s") is not None

    split: dict[str, dict] = {s: {} for s in strategies}
    ordering = {}
    for rate in rates:
        steps_means = common_seed_means(rows, rate, strategies, "steps_to_target")
        ordering[f"{rate:.2f}"] = sorted(steps_means, key=steps_means.get)
        common = set.intersection(*({r["seed"] for r in runs_of(rows, s, rate) if timed(r)} for s in strategies))
        for strategy in strategies:
            parts: dict[str, list[float]] = {name: [] for name in WALL_PARTS}
            for run in runs_of(rows, strategy, rate):
                if run["seed"] not in common or not timed(run):
                    continue
                steps = run["steps_to_target"] * run["normal_step_s"]
                replayed = sum(f.get("replayed", 0) for f in run["recoveries"]) * run["normal_step_s"]
                recoveries = sum(f["seconds"] for f in run["recoveries"])
                saves = sum(run.get("checkpoint_saves_s", []))
                for name, value in (
                    ("steps", steps),
                    ("replayed_steps", replayed),
                    ("recoveries", recoveries),
                    ("saves", saves),
                    ("rest", run["wall_s_to_target"] - steps - recoveries - saves),
                ):
                    parts[name].append(value)
            split[strategy][f"{rate:.2f}"] = {name: mean_and_range(values) for name, values in parts.items()}
    return {"wall_s_split_by_strategy_and_rate": split, "ordering_by_steps": ordering}


def common_seed_means(
    rows: list[dict],
    rate: float,
    strategies: list[str],
    key: str = "wall_s_to_target",
    added_s: dict[tuple[str, int], float] | None = None,
    missed_at_last_evaluation: bool = False,
) -> dict[str, float]:
    """Each strategy's mean `key` (wall seconds or steps to the target) at `rate`, over the seeds where every strategy
    reached the target (so that each mean is of the same seeds); `added_s` {(strategy, seed): s} is added to those
    runs first. With `missed_at_last_evaluation`, over every seed that each strategy ran: a run that missed the target
    counts what it had spent at its last evaluation (`executed` for steps), which is less than it would have needed,
    so its strategy's mean is a lower bound (leaving such a run out favours it: it was the slowest of its seed)."""
    added_s = added_s or {}
    spent = {"wall_s_to_target": "wall_s", "steps_to_target": "executed"}[key]

    def value(run: dict) -> float | None:
        if run[key]:
            return run[key]
        if missed_at_last_evaluation and run.get("curve"):
            return run["curve"][-1][spent]
        return None

    reached = {
        s: {
            r["seed"]: value(r) + added_s.get((s, r["seed"]), 0.0)
            for r in runs_of(rows, s, rate)
            if value(r) is not None
        }
        for s in strategies
    }
    common = set.intersection(*(set(v) for v in reached.values())) if reached else set()
    return {s: statistics.fmean(reached[s][seed] for seed in common) for s in strategies} if common else {}


def neighbour_fetch_over_links(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """Where each stage's host has a link of its own (--checkpoint-uplinks per-stage), a CheckFree(+) rebuild reads
    its neighbours' weights across hosts too, but this benchmark's stages talk over loopback. So the report also
    charges each CheckFree(+) recovery its bytes at the rate the same key's checkpoint-restart replacements got for
    their downloads, and gives the ratios and the order with that charge (random re-initialisation reads nothing;
    checkpoint-restart's downloads are in its runs already). The downloads set the model: a replacement's link
    carries the rate each way, so a rebuild's bytes from both neighbours come in through it one after the other, in
    their sum / the rate; a download includes every stage's read from disk after it, so the rate is a little under
    the link's and CheckFree a little over-charged. Empty in every other setting: with one shared link the stages sit
    behind it together, and reach each other as fast as the loopback here."""
    key = next((r["key"] for r in rows if r["strategy"] != "none"), None)
    if not key or key.get("checkpoint_uplinks") != "per-stage":
        return {}
    downloads = [
        (r["checkpoint_bytes"] / STAGES, f["load_s"])
        for r in rows
        if r["strategy"] == "checkpoint"
        for f in r["recoveries"]
        if f.get("load_s")
    ]
    if not downloads:
        return {}
    mb_per_s = sum(size for size, _ in downloads) / sum(seconds for _, seconds in downloads) / 1e6
    from_model = None  # rows from before recoveries recorded their bytes: the same count, from the key's model
    charged: dict[tuple[int, float], float] = {}
    fetched: dict[str, list[int]] = {}
    for row in rows:
        if row["strategy"] != "checkfree":
            continue
        seconds = 0.0
        for recovery in row["recoveries"]:
            counts = recovery.get("fetched_bytes") or [None] * len(recovery["stages"])
            for stage, method, count in zip(recovery["stages"], recovery["methods"], counts):
                if method not in ("checkfree", "checkfree_plus"):
                    continue
                if count is None:
                    from_model = from_model or rebuild_bytes(tuple(key["shape"]))
                    count = from_model[stage]
                fetched.setdefault(method, []).append(count)
                seconds += count / 1e6 / mb_per_s
        charged[(row["seed"], row["rate"])] = seconds
    speedup, ordering = {}, {}
    for rate in rates:
        added = {("checkfree", seed): s for (seed, r), s in charged.items() if same_rate(r, rate)}
        means = common_seed_means(rows, rate, strategies, added_s=added)
        ordering[f"{rate:.2f}"] = sorted(means, key=means.get)
        pairs = checkfree_checkpoint_pairs(rows, rate)
        if pairs:
            ours = statistics.fmean(o["wall_s_to_target"] + added[("checkfree", o["seed"])] for o, _ in pairs)
            speedup[f"{rate:.2f}"] = statistics.fmean(t["wall_s_to_target"] for _, t in pairs) / ours
    return {
        "neighbour_fetch_mb_by_method": {m: mean_and_range([b / 1e6 for b in v]) for m, v in sorted(fetched.items())},
        "checkpoint_download_mb_per_s": mb_per_s,
        "neighbour_fetch_charged_s_by_rate_and_seed": {
            f"{rate:.2f}": {str(seed): s for (seed, r), s in sorted(charged.items()) if same_rate(r, rate)}
            for rate in rates
        },
        "wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged": speedup,
        "ordering_by_wall_s_neighbour_fetch_charged": ordering,
    }


def rebuild_bytes(shape: tuple[int, int, int, int]) -> dict[int, int]:
    """By stage: the bytes a CheckFree(+) rebuild of it reads (node/pipeline/recovery.py: an intermediate stage both
    neighbours' layers, an end stage its neighbour's layers and that neighbour's copy of its embedding or head), from
    a model of `shape`: the same count a recovery records, for rows written before recoveries recorded it."""
    config = load_config(
        REPO / "configs" / "pipeline.yaml", [*seeded_shape_overrides(shape, 0), f"pipeline.num_stages={STAGES}"]
    )
    tokenizer = build_char_tokenizer()
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    extra = checkfree_plus_extra_parts(STAGES)
    stages = split_model(model, STAGES, extra)

    def read_from(neighbour: int) -> int:
        parts = ["layers"] + [p.value for p in extra.get(neighbour, ())]
        return tensor_bytes(part_tensors(stages[neighbour], parts))

    rebuilt = {0: read_from(1), STAGES - 1: read_from(STAGES - 2)}  # CheckFree+
    for index in range(1, STAGES - 1):  # CheckFree: the layers of both neighbours
        rebuilt[index] = sum(tensor_bytes(part_tensors(stages[n], ["layers"])) for n in (index - 1, index + 1))
    return rebuilt


def checkfree_checkpoint_pairs(rows: list[dict], rate: float) -> list[tuple[dict, dict]]:
    """(CheckFree's run, checkpoint-restart's run) of each seed at `rate` where both reached the target: the ratios of
    the means are taken over these, since a seed one of them has no row for must not enter one mean and not the
    other."""
    checkpoints = runs_of(rows, "checkpoint", rate)
    pairs = []
    for ours in runs_of(rows, "checkfree", rate):
        theirs = next((r for r in checkpoints if r["seed"] == ours["seed"]), None)
        if theirs and ours["wall_s_to_target"] and theirs["wall_s_to_target"]:
            pairs.append((ours, theirs))
    return pairs


def paired_ratio_of_means(pairs: list[tuple[dict, dict]], key: str) -> float | None:
    """The mean of `key` over the second rows of `pairs` over its mean over the first (None without pairs)."""
    if not pairs:
        return None
    return statistics.fmean(theirs[key] for _, theirs in pairs) / statistics.fmean(ours[key] for ours, _ in pairs)


def val_loss_at_equal_wall_clock(
    rows: list[dict], rates: list[float], strategies: list[str]
) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict], list[str]]:
    """Each seed's strategies at one wall clock: the earliest at which one of them reached the target (the runs stop
    there, so it is the latest time every run has a curve for), and each run's last validation loss by then. Time to
    a target on a plateau turns on which curve crosses a line a thousandth away before its next failure; the loss at
    the winner's time says how far behind the others were. Returns, per strategy and rate, the spread over seeds of
    that loss, per rate and seed the wall clock used, per rate each strategy's rank among the seed's runs averaged
    over seeds (1 = lowest loss; a run with no evaluation by then, e.g. one still writing its first checkpoint, ranks
    last and is named in `not_evaluated`)."""
    losses: dict[str, dict] = {s: {} for s in strategies}
    used: dict[str, dict] = {}
    ranks: dict[str, dict] = {}
    not_evaluated: list[str] = []
    for rate in rates:
        name = f"{rate:.2f}"
        runs = [r for r in rows if r["strategy"] in strategies and same_rate(r["rate"], rate)]
        by_seed: dict[int, list[dict]] = {}
        for run in runs:
            by_seed.setdefault(run["seed"], []).append(run)
        per_strategy: dict[str, list[float]] = {s: [] for s in strategies}
        rank_lists: dict[str, list[float]] = {s: [] for s in strategies}
        used[name] = {}
        for seed, seed_runs in sorted(by_seed.items()):
            reached = [r["wall_s_to_target"] for r in seed_runs if r["wall_s_to_target"] is not None]
            # every strategy of the seed must be there to be compared; a run that missed the target ran to its end
            if not reached or {r["strategy"] for r in seed_runs} != set(strategies):
                continue
            wall = min(reached)
            used[name][str(seed)] = wall
            at_wall = {}
            for run in seed_runs:
                before = [p["val_loss"] for p in run["curve"] if p["wall_s"] <= wall + 1e-9]
                if before:
                    at_wall[run["strategy"]] = before[-1]
                    per_strategy[run["strategy"]].append(before[-1])
                else:
                    not_evaluated.append(f"{run['strategy']}@{name} seed {seed}")
            order = sorted(strategies, key=lambda s: at_wall.get(s, math.inf))
            for strategy in strategies:
                rank_lists[strategy].append(order.index(strategy) + 1.0)
        for strategy in strategies:
            losses[strategy][name] = mean_and_range(per_strategy[strategy])
        ranks[name] = {s: statistics.fmean(v) for s, v in rank_lists.items() if v}
    return losses, used, ranks, sorted(not_evaluated)


def print_report(summary: dict) -> None:
    def cell(value: dict | None, digits: int) -> str:
        if value is None:
            return "-"
        return f"{value['mean']:.{digits}f} [{value['min']:.{digits}f}-{value['max']:.{digits}f}] n={value['n']}"

    print("\nstrategy @ rate          steps to target (mean [min-max] n)   wall s to target (mean [min-max] n)")
    for strategy, by_rate in summary["steps_by_strategy_and_rate"].items():
        for rate, value in by_rate.items():
            wall = summary["wall_s_by_strategy_and_rate"][strategy][rate]
            print(f"{strategy + '@' + rate:24s} {cell(value, 1):36s} {cell(wall, 1)}")
    print(f"checkpoint-restart wall s / CheckFree's, by rate: {summary['wallclock_speedup_vs_checkpoint_by_rate']}")
    print(
        f"order by wall s {summary['ordering_by_wall_s']}; over every seed, a run that missed the target counted at "
        f"its last evaluation (a lower bound): {summary['wall_s_missed_counted_by_rate']}, order "
        f"{summary['ordering_by_wall_s_missed_counted']}"
    )
    print(
        "validation loss at each seed's first time to target: "
        f"{summary['val_loss_at_equal_wall_s_by_strategy_and_rate']}"
        f" (mean rank {summary['mean_rank_at_equal_wall_s_by_rate']}; no evaluation yet: "
        f"{summary['not_evaluated_by_equal_wall_s']})"
    )
    print(f"recovery s by method: {summary['recovery_s_by_method']}")
    print(f"of which to a serving replacement, s: {summary['to_serving_s_by_method']}")
    print(f"loss spike after a failure: {summary['loss_spike_by_strategy']}")
    print(
        "by the stages it lost (end: the first or the last): "
        f"{summary['loss_spike_by_strategy_and_stage_kind']}; end-stage failures by seed "
        f"{summary['end_stage_failures_by_strategy_and_rate']}"
    )
    print(f"checkpoint save s {summary['checkpoint_save_s']}, load s {summary['checkpoint_load_s']}")
    print(
        f"checkpoint every {summary['checkpoint_every_by_rate']} steps; steps replayed per failure "
        f"{summary['checkpoint_replayed_steps']}; share of wall s in checkpoint I/O {summary['checkpoint_io_share']}"
    )
    if summary.get("wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged"):
        print(
            "CheckFree's neighbour fetches charged at the checkpoint downloads' "
            f"{summary['checkpoint_download_mb_per_s']:.2f} MB/s: MB by method "
            f"{summary['neighbour_fetch_mb_by_method']}"
            f", s by seed {summary['neighbour_fetch_charged_s_by_rate_and_seed']}; checkpoint-restart wall s / "
            f"CheckFree's with them {summary['wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged']}, "
            f"order by wall s {summary['ordering_by_wall_s_neighbour_fetch_charged']}"
        )
    if summary["checkpoint_upload_s"]:
        print(
            f"uploads in the background: s to a restore point {summary['checkpoint_upload_s']}, saves' wait for the "
            f"last uploads {summary['checkpoint_upload_wait_s']}, failures that cut uploads per run "
            f"{summary['checkpoint_failures_that_cut_uploads']}"
        )
    print(f"a step without a failure in it, s: {summary['normal_step_s_by_strategy_and_rate']}")
    print("where the wall s to the target went (means over seeds):")
    for strategy, by_rate in summary["wall_s_split_by_strategy_and_rate"].items():
        for rate, parts in by_rate.items():
            cells = ", ".join(f"{name} {part['mean']:.1f}" for name, part in parts.items() if part)
            print(f"  {strategy + '@' + rate:24s} {cells}")
    print(f"order by steps executed (saves, loads, recoveries free: the paper's count) {summary['ordering_by_steps']}")
    if summary.get("uplink_mb_per_step_stage_host_by_strategy_and_rate"):
        print(
            "sent over its uplink per step executed, MB: a stage's host "
            f"{summary['uplink_mb_per_step_stage_host_by_strategy_and_rate']}, the driver "
            f"{summary['uplink_mb_per_step_driver_by_strategy_and_rate']}"
        )
    print_result_line(summary)
