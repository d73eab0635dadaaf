"""Does an isolated node learn? Held-out accuracy before/after a time budget, per seed.

From the warm-started default model (built once, shared by all seeds), each seed trains
in isolation for --minutes of wall time; the seed sets the question stream and sampling.
Held-out accuracy is greedy exact-match on the fixed held-out set (200 questions from a
seed that training never draws). Prints a line per evaluation and ends with one JSON line.

    .venv/bin/python benchmarks/isolated_learning.py --seeds 0 1 2 --minutes 10
    .venv/bin/python benchmarks/isolated_learning.py --rounds 300 --config configs/mix.yaml   # a fixed number of rounds

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
from node.loop import Node  # noqa: E402
from node.tasks import SpecialtyScore  # noqa: E402


async def train_for(
    node: Node, seconds: float, eval_every_s: float, rounds: int | None = None
) -> tuple[list[dict], list[tuple[float, float]]]:
    """Train for `seconds` of wall time, or exactly `rounds` rounds when given (a loaded machine then changes times,
    not results)."""
    rows, curve = [], []
    start = time.monotonic()
    next_eval = eval_every_s
    while (len(rows) < rounds) if rounds is not None else (time.monotonic() - start < seconds):
        rows.append(await node.run_round())
        elapsed = time.monotonic() - start
        if elapsed >= next_eval:
            curve.append((elapsed, node.evaluator.accuracy()))
            print(
                f"  {elapsed:6.0f}s round {node.round:5d} heldout {curve[-1][1]:.3f} reward(last 50) "
                f"{statistics.fmean(r['reward_mean'] for r in rows[-50:]):.3f}",
                flush=True,
            )
            next_eval += eval_every_s
    return rows, curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=None, help="train exactly this many rounds instead of --minutes")
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "isolated.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config overrides, as for swarm-node train")
    parser.add_argument("--eval-every-s", type=float, default=60.0)
    args = parser.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    before, after, first_reward, last_reward, rounds, curves = [], [], [], [], [], []
    by_dataset_before, by_dataset_after = [], []
    distinct_before, distinct_after = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            config = load_config(
                args.config, [*args.set, f"seed={seed}", "eval_every=0"], state_dir=f"{scratch}/seed{seed}"
            )
            node = Node(config)
            node.load(fresh=True)
            overall, scores = node.evaluator.report()
            before.append(overall)
            by_dataset_before.append({label: score.accuracy for label, score in scores.items()})
            print(f"seed {seed}: heldout before {before[-1]:.3f} {_fmt(by_dataset_before[-1])}", flush=True)
            distinct_before.append(_distinct(scores))
            print(
                f"seed {seed}: distinct greedy answers / distinct right answers before: "
                f"{_fmt_distinct(distinct_before[-1])}",
                flush=True,
            )
            rows, curve = asyncio.run(train_for(node, args.minutes * 60, args.eval_every_s, args.rounds))
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
            tenth = max(1, len(rows) // 10)
            first_reward.append(statistics.fmean(r["reward_mean"] for r in rows[:tenth]))
            last_reward.append(statistics.fmean(r["reward_mean"] for r in rows[-tenth:]))
            rounds.append(len(rows))
            curves.append(curve)
            print(
                f"seed {seed}: heldout {before[-1]:.3f} -> {after[-1]:.3f} ({len(rows)} rounds); reward first 10% "
                f"{first_reward[-1]:.3f}, last 10% {last_reward[-1]:.3f}",
                flush=True,
            )
    gains = [a - b for a, b in zip(after, before)]
    print(
        f"held-out gain (points): {[round(100 * g, 1) for g in gains]}; target >= 10 on every seed: "
        f"{'met' if min(gains) >= 0.10 else 'NOT met'}"
    )
    print(
        json.dumps(
            {
                "benchmark": "isolated_learning",
                "seeds": args.seeds,
                "minutes": args.minutes if args.rounds is None else None,
                "rounds": rounds,
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
        )
    )


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
