"""Partial rollouts (rollout.over_sample, APRIL) against the same node without them, on a long-tail workload.

Per seed, three nodes of the same config and seed in this process, side by side: the node without partial rollouts
(over_sample 0), and two with them (--over-sample), keeping a resumed completion's older tokens with their behaviour
log-probs ('keep') or masking them out of the policy-gradient term ('mask'). They run in turns, a round each, so that
the machine's load falls on all three alike; each runs --rounds rounds, and each partial arm then runs on until its
rounds' compute units reach those of the node without them (equal compute units), where greedy held-out accuracy is
taken. Reported per seed and arm: rollout throughput (completions of complete groups per second of generation), the
throughput ratio to the node without partial rollouts (the target: at least 1.2), held-out at equal compute units, the
completions' tail (per round: mean, p90 and max tokens, their medians over the rounds), the staleness of the resumed
completions (policy versions their oldest token is behind the policy they train) and the share of completions carried
in from an earlier round. Each seed's row is appended to --results as it finishes.

    .venv/bin/python benchmarks/partial_rollouts.py --seeds 3 --rounds 60 --set torch_threads=1 \\
        --results benchmarks/results/partial_rollouts.jsonl
Ends with one JSON line.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.arms.lockstep import unit_costs  # noqa: E402
from benchmarks.common import REPO, print_result_line, run_seeds, seeds_parser, spread  # noqa: E402
from node.compute import RoundWork  # noqa: E402
from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402

ARMS = {"without": [], "keep": ["rollout.partial_prefix=keep"], "mask": ["rollout.partial_prefix=mask"]}


def node_for(args, arm: str, seed: int, state_dir: Path) -> Node:
    over_sample = 0 if arm == "without" else args.over_sample
    overrides = [f"seed={seed}", f"rollout.over_sample={over_sample}", "eval_every=0", "checkpoint_every=1000000"]
    node = Node(load_config(args.config, [*overrides, *ARMS[arm], *args.set], state_dir=str(state_dir)))
    node.load(fresh=True, progress=False)
    return node


def arm_summary(rows: list[dict], heldout: float, units: float) -> dict:
    finished = sum(row["work"]["scored_completions"] for row in rows)
    generation_s = sum(row["generation_s"] for row in rows)
    summary = {
        "rounds": len(rows),
        "completions_per_generation_s": finished / generation_s,
        "generation_s": generation_s,
        "units": units,
        "heldout_equal_units": heldout,
        "completion_len_mean": statistics.median(row["completion_len_mean"] for row in rows),
        "completion_len_p90": statistics.median(row["completion_len_p90"] for row in rows),
        "completion_len_max": statistics.median(row["completion_len_max"] for row in rows),
        "decode_steps_per_round": statistics.fmean(row["work"]["decode_steps"] for row in rows),
        "prefill_tokens_per_round": statistics.fmean(row["work"]["prefill_tokens"] for row in rows),
        "accuracy_mean": statistics.fmean(row["accuracy"] for row in rows),
    }
    if "carried_in" in rows[0]:
        summary["carried_share"] = sum(row["carried_in"] for row in rows) / finished
        summary["staleness_mean"] = statistics.fmean(row["staleness_mean"] for row in rows)
        summary["staleness_max"] = max(row["staleness_max"] for row in rows)
    return summary


def run_seed(args, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        nodes = {arm: node_for(args, arm, seed, Path(scratch) / arm) for arm in ARMS}
        costs = unit_costs(nodes["without"], args.costs)
        rows = {arm: [] for arm in ARMS}
        units = dict.fromkeys(ARMS, 0.0)

        async def one_round(arm: str) -> None:
            rows[arm].append(await nodes[arm].run_round())
            units[arm] += costs.units(RoundWork.from_dict(rows[arm][-1]["work"]))

        async def turns() -> None:
            for _ in range(args.rounds):
                for arm in ARMS:
                    await one_round(arm)
            # held-out where each partial arm has spent what the node without them did
            for arm in ("keep", "mask"):
                while units[arm] < units["without"]:
                    await one_round(arm)

        asyncio.run(turns())
        arms = {arm: arm_summary(rows[arm], nodes[arm].evaluator.accuracy(), units[arm]) for arm in ARMS}
        for node in nodes.values():
            node.backend.close()
    base = arms["without"]["completions_per_generation_s"]
    return {
        "benchmark": "partial_rollouts",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "config": args.config.name,
        "settings": args.set,
        "over_sample": args.over_sample,
        "seed": seed,
        "arms": arms,
        "throughput_ratio_keep": arms["keep"]["completions_per_generation_s"] / base,
        "throughput_ratio_mask": arms["mask"]["completions_per_generation_s"] / base,
        "heldout_keep_minus_without": arms["keep"]["heldout_equal_units"] - arms["without"]["heldout_equal_units"],
        "heldout_mask_minus_without": arms["mask"]["heldout_equal_units"] - arms["without"]["heldout_equal_units"],
        "load_average": os.getloadavg(),
    }


def describe(seed: int, row: dict) -> str:
    arms = row["arms"]
    return (
        f"seed {seed}: completions/generation-s {arms['without']['completions_per_generation_s']:.1f} without, "
        f"{arms['keep']['completions_per_generation_s']:.1f} keep ({row['throughput_ratio_keep']:.2f}x), "
        f"{arms['mask']['completions_per_generation_s']:.1f} mask ({row['throughput_ratio_mask']:.2f}x); "
        f"held-out at equal units {arms['without']['heldout_equal_units']:.3f} / "
        f"{arms['keep']['heldout_equal_units']:.3f} / {arms['mask']['heldout_equal_units']:.3f}; "
        f"tail mean/p90/max {arms['without']['completion_len_mean']:.1f}/"
        f"{arms['without']['completion_len_p90']}/{arms['without']['completion_len_max']} tokens; "
        f"carried {arms['keep']['carried_share']:.2f}, staleness {arms['keep']['staleness_mean']:.2f} "
        f"(max {arms['keep']['staleness_max']})"
    )


def main() -> None:
    parser = seeds_parser(__doc__.split("\n")[0], REPO / "configs" / "long_tail.yaml", rounds=60)
    parser.add_argument("--over-sample", type=float, default=0.5)
    parser.add_argument("--costs", type=Path, default=REPO / "benchmarks" / "compute_costs.json")
    args = parser.parse_args()
    seeds = run_seeds(args, run_seed, describe)
    print_result_line(
        {
            "benchmark": "partial_rollouts",
            "seeds": len(seeds),
            "over_sample": args.over_sample,
            "throughput_ratio_keep": spread([r["throughput_ratio_keep"] for r in seeds]),
            "throughput_ratio_mask": spread([r["throughput_ratio_mask"] for r in seeds]),
            "heldout_keep_minus_without": [r["heldout_keep_minus_without"] for r in seeds],
            "heldout_mask_minus_without": [r["heldout_mask_minus_without"] for r in seeds],
        }
    )


if __name__ == "__main__":
    main()
