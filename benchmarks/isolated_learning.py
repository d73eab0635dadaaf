"""Does an isolated node learn? Held-out accuracy before/after a budget, per seed.

From the warm-started default model (built once, shared by all seeds), each seed trains
in isolation for --minutes of wall time, --rounds rounds, or --units compute units (the
load-free axis of benchmarks/sharing.py: each round's counted work at the idle-machine costs
of benchmarks/compute_costs.json); the seed sets the question stream and sampling.
Held-out accuracy is greedy exact-match on the fixed held-out set (200 questions from a
seed that training never draws). Prints a line per evaluation and ends with one JSON line
(appended to --results too, with the --set overrides it ran with).

    .venv/bin/python benchmarks/isolated_learning.py --seeds 0 1 2 --minutes 10
    .venv/bin/python benchmarks/isolated_learning.py --rounds 300 --config configs/mix.yaml   # a fixed number of rounds
    .venv/bin/python benchmarks/isolated_learning.py --units 100 --set swarm.own_replay=4     # at equal compute
    .venv/bin/python benchmarks/isolated_learning.py --config configs/smollm2.yaml --rounds 40 --seeds 1 \
        --state-root runs/smollm2        # run again after a kill: the seed resumes from its last checkpoint

With a task mix of several specialties it also reports held-out accuracy per specialty, and
per specialty how many distinct answers the greedy policy gives against how many are right
(one answer for every question: the policy learned the answers' prior, not the task).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.config import load_config  # noqa: E402
from benchmarks.arms.lockstep import unit_costs  # noqa: E402
from node.compute import RoundWork, UnitCosts  # noqa: E402
from benchmarks.common import print_result_line  # noqa: E402
from node.loop import Node  # noqa: E402
from node.tasks import SpecialtyScore  # noqa: E402


def resident_mib() -> float:
    """This process's resident memory (VmRSS), in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def train_for(
    node: Node,
    seconds: float,
    eval_every_s: float,
    rounds: int | None = None,
    units: float | None = None,
    costs: UnitCosts | None = None,
    eval_every_units: float | None = None,
) -> tuple[list[dict], list[tuple[float, float]], float]:
    """Train for `seconds` of wall time, exactly `rounds` rounds, or until the rounds' work reaches `units` compute
    units at `costs` (with rounds or units, a loaded machine changes times, not results). Held-out accuracy every
    `eval_every_units` units on the units axis, else every `eval_every_s` seconds; returns the rounds' metrics rows,
    the curve as (wall seconds or units, accuracy), and the units spent (0 without `costs`)."""
    if units is not None and (costs is None or not eval_every_units):
        raise ValueError("a budget in compute units needs the unit costs and an evaluation interval in units")
    rows, curve = [], []
    start = time.monotonic()
    spent = 0.0
    next_eval = eval_every_units if units is not None else eval_every_s

    def more() -> bool:
        if units is not None:
            return spent < units
        if rounds is not None:
            return len(rows) < rounds
        return time.monotonic() - start < seconds

    while more():
        rows.append(await node.run_round())
        rows[-1]["rss_mib"] = resident_mib()  # this benchmark's copy of the row: the node's memory after the round
        if costs is not None:
            spent += costs.units(RoundWork.from_dict(rows[-1]["work"]))
        elapsed = time.monotonic() - start
        at = spent if units is not None else elapsed
        if at >= next_eval:
            curve.append((at, node.evaluator.accuracy()))
            print(
                f"  {elapsed:6.0f}s {spent:7.1f} units round {node.round:5d} heldout {curve[-1][1]:.3f} "
                f"reward(last 50) {statistics.fmean(r['reward_mean'] for r in rows[-50:]):.3f}",
                flush=True,
            )
            next_eval += eval_every_units if units is not None else eval_every_s
    return rows, curve, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=None, help="train exactly this many rounds instead of --minutes")
    parser.add_argument(
        "--units", type=float, default=None, help="train until this many compute units instead of --minutes"
    )
    parser.add_argument("--eval-every-units", type=float, default=None, help="--units: default a tenth of the budget")
    parser.add_argument("--costs", type=Path, default=Path(__file__).resolve().parent / "compute_costs.json")
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "isolated.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config overrides, as for swarm-node train")
    parser.add_argument("--eval-every-s", type=float, default=60.0)
    parser.add_argument(
        "--state-root",
        type=Path,
        default=None,
        help="keep each seed's state in DIR/seed<N> (default: a temporary folder); with --rounds, a seed whose state "
        "holds a checkpoint resumes there and trains up to --rounds in all",
    )
    args = parser.parse_args()
    if args.units is not None and args.rounds is not None:
        parser.error("--units and --rounds are two budgets: give one")
    if args.units is not None and args.units <= 0:
        parser.error("--units must be positive")

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    before, after, first_reward, last_reward, rounds, curves, spent_units = [], [], [], [], [], [], []
    by_dataset_before, by_dataset_after = [], []
    distinct_before, distinct_after = [], []
    cpu_seconds, wall_seconds = [], []  # of the training (with its curve's evaluations), this process's CPU time
    memory = []  # the process's resident MiB after the first round, at the end and at most, per seed
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            state = (args.state_root or Path(scratch)) / f"seed{seed}"
            start_record = state / "heldout_before.json"  # the held-out figures of the seed's start, for a resume
            resuming = args.rounds is not None and start_record.exists() and (state / "checkpoints" / "LATEST").exists()
            config = load_config(args.config, [*args.set, f"seed={seed}", "eval_every=0"], state_dir=str(state))
            node = Node(config)
            node.load(fresh=not resuming)
            if resuming:
                start = json.loads(start_record.read_text())
                print(f"seed {seed}: resuming at round {node.round}", flush=True)
            else:
                overall, scores = node.evaluator.report()
                start = {
                    "overall": overall,
                    "by_dataset": {label: score.accuracy for label, score in scores.items()},
                    "distinct": _distinct(scores),
                }
                start_record.write_text(json.dumps(start))
            before.append(start["overall"])
            by_dataset_before.append(start["by_dataset"])
            print(f"seed {seed}: heldout before {before[-1]:.3f} {_fmt(by_dataset_before[-1])}", flush=True)
            distinct_before.append({label: tuple(pair) for label, pair in start["distinct"].items()})
            print(
                f"seed {seed}: distinct greedy answers / distinct right answers before: "
                f"{_fmt_distinct(distinct_before[-1])}",
                flush=True,
            )
            cpu_start, wall_start = time.process_time(), time.monotonic()
            rows, curve, spent = asyncio.run(
                train_for(
                    node,
                    args.minutes * 60,
                    args.eval_every_s,
                    args.rounds - node.round if args.rounds is not None else None,
                    args.units,
                    unit_costs(node, args.costs) if args.units is not None else None,
                    args.eval_every_units or (args.units / 10 if args.units is not None else None),
                )
            )
            memory.append(
                {
                    "after_first_round": rows[0]["rss_mib"],
                    "end": rows[-1]["rss_mib"],
                    "max": max(r["rss_mib"] for r in rows),
                }
            )
            print(f"seed {seed}: resident MiB {json.dumps(memory[-1])}", flush=True)
            cpu_seconds.append(round(time.process_time() - cpu_start, 1))
            wall_seconds.append(round(time.monotonic() - wall_start, 1))
            spent_units.append(spent if args.units is not None else None)
            overall, scores = node.evaluator.report()
            after.append(overall)
            by_dataset_after.append({label: score.accuracy for label, score in scores.items()})
            print(f"seed {seed}: heldout after {_fmt(by_dataset_after[-1])}", flush=True)
            distinct_after.append(_distinct(scores))
            print(
                f"seed {seed}: distinct greedy answers / distinct right answers after: "
                f"{_fmt_distinct(distinct_after[-1])}",
                flush=True,
            )
            rows = node.store.read_metrics()  # every round of the seed, those before a resume too
            tenth = max(1, len(rows) // 10)
            first_reward.append(statistics.fmean(r["reward_mean"] for r in rows[:tenth]))
            last_reward.append(statistics.fmean(r["reward_mean"] for r in rows[-tenth:]))
            rounds.append(len(rows))
            curves.append(curve)
            print(
                f"seed {seed}: heldout {before[-1]:.3f} -> {after[-1]:.3f} ({len(rows)} rounds, {spent:.1f} units); "
                f"reward first 10% "
                f"{first_reward[-1]:.3f}, last 10% {last_reward[-1]:.3f}",
                flush=True,
            )
    gains = [a - b for a, b in zip(after, before)]
    print(
        f"held-out gain (points): {[round(100 * g, 1) for g in gains]}; target >= 10 on every seed: "
        f"{'met' if min(gains) >= 0.10 else 'NOT met'}"
    )
    line = {
        "benchmark": "isolated_learning",
        "config": Path(args.config).name,
        "overrides": args.set,
        "seeds": args.seeds,
        "minutes": args.minutes if args.rounds is None and args.units is None else None,
        "units_budget": args.units,
        "units": spent_units,
        "rounds": rounds,
        "train_cpu_s": cpu_seconds,
        "train_wall_s": wall_seconds,
        "resident_mib": memory,
        "heldout_accuracy_before": before,
        "heldout_accuracy_after": after,
        "heldout_gain_points": [round(100 * g, 1) for g in gains],
        "reward_mean_first_10pct": first_reward,
        "reward_mean_last_10pct": last_reward,
        "heldout_curves": curves,
        "heldout_by_dataset_before": by_dataset_before,
        "heldout_by_dataset_after": by_dataset_after,
        "distinct_greedy_answers_before": distinct_before,  # {specialty: [given, right]}
        "distinct_greedy_answers_after": distinct_after,
    }
    print_result_line(line, args.results)


def _distinct(scores: dict[str, SpecialtyScore]) -> dict[str, tuple[int, int]]:
    """Per specialty: distinct greedy answers given, and distinct right answers (see SpecialtyScore)."""
    return {label: (score.distinct_given, score.distinct_right) for label, score in scores.items()}


def _fmt_distinct(distinct: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{label} {given}/{true}" for label, (given, true) in distinct.items())


def _fmt(by_dataset: dict[str, float]) -> str:
    return (
        "(" + ", ".join(f"{label} {value:.2f}" for label, value in by_dataset.items()) + ")"
        if len(by_dataset) > 1
        else ""
    )


if __name__ == "__main__":
    main()
