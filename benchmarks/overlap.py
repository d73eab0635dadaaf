"""Generating the next round's rollouts during the update (rollout.max_staleness 1) against the serial round.

Per seed, two nodes of the same config and seed in this process, one after the other (serial first, so that the
generating-ahead node knows the wall time to match): the serial node runs --rounds rounds; the other runs the same
rounds (the same questions and seeds: equal compute units) and then on until its wall time equals the serial node's.
Reported per seed: rounds per wall-clock second of each and their ratio (the target: at least 1.5x), the CPU seconds
a round, and greedy held-out accuracy of each after --rounds rounds (equal compute: at most 1 point below) and of the
generating-ahead node at the serial node's wall time (equal wall clock: ahead on every seed). A round's
`ahead_wait_s` (the wait for rollouts generated during the round before) says which of generation and update was the
longer. Each seed's row is appended to --results as it finishes, so seeds accumulate over sessions.

    .venv/bin/python benchmarks/overlap.py --seeds 3 --rounds 40 --results benchmarks/results/overlap.jsonl
Ends with one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, run_seeds, seeds_parser  # noqa: E402


def node_for(config_path: Path, seed: int, staleness: int, state_dir: Path, settings: list[str]):
    from node.config import load_config
    from node.loop import Node

    overrides = [f"seed={seed}", f"rollout.max_staleness={staleness}", "eval_every=0", "checkpoint_every=1000000"]
    node = Node(load_config(config_path, [*overrides, *settings], state_dir=str(state_dir)))
    node.load(fresh=True, progress=False)
    return node


async def timed_rounds(node, rounds: int | None = None, until_wall_s: float | None = None, spent_s: float = 0.0):
    """Rounds until `rounds` ran or the wall time reached `until_wall_s`: (wall s, CPU s, rows)."""
    rows, wall, cpu = [], time.perf_counter(), time.process_time()
    while (rounds is not None and len(rows) < rounds) or (
        until_wall_s is not None and spent_s + time.perf_counter() - wall < until_wall_s
    ):
        rows.append(await node.run_round())
    return time.perf_counter() - wall, time.process_time() - cpu, rows


def heldout(node) -> float:
    accuracy, _ = node.evaluator.by_dataset()
    return accuracy


def run_seed(args, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        serial = node_for(args.config, seed, 0, Path(scratch) / "serial", args.set)
        s_wall, s_cpu, s_rows = asyncio.run(timed_rounds(serial, args.rounds))
        s_heldout = heldout(serial)
        ahead = node_for(args.config, seed, 1, Path(scratch) / "ahead", args.set)

        async def ahead_run():
            wall, cpu, rows = await timed_rounds(ahead, args.rounds)
            # held-out at equal compute, off the clock; the round generating ahead finishes first (one sampler)
            await ahead.settle_rollouts()
            equal_compute = await asyncio.to_thread(heldout, ahead)
            more_wall, more_cpu, more = await timed_rounds(ahead, until_wall_s=s_wall, spent_s=wall)
            await ahead.settle_rollouts()
            return wall, cpu, rows, equal_compute, more, wall + more_wall

        a_wall, a_cpu, a_rows, a_heldout, a_more, a_total_wall = asyncio.run(ahead_run())
        equal_wall = heldout(ahead)
    waits = [row["ahead_wait_s"] for row in a_rows if row.get("ahead_wait_s") is not None]
    return {
        "benchmark": "overlap",
        "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "config": args.config.name,
        "settings": args.set,
        "seed": seed,
        "rounds": args.rounds,
        "serial_rounds_per_s": args.rounds / s_wall,
        "ahead_rounds_per_s": args.rounds / a_wall,
        "ratio": s_wall / a_wall,
        "serial_cpu_s_per_round": s_cpu / args.rounds,
        "ahead_cpu_s_per_round": a_cpu / args.rounds,
        "ahead_wait_s_median": statistics.median(waits) if waits else None,
        "staleness_mean": statistics.mean(row["staleness_mean"] for row in a_rows),
        "serial_heldout": s_heldout,
        "ahead_heldout_equal_compute": a_heldout,
        "ahead_rounds_equal_wall": args.rounds + len(a_more),
        "ahead_wall_s_equal_wall": a_total_wall,
        "serial_wall_s": s_wall,
        "ahead_heldout_equal_wall": equal_wall,
        "load_average": os.getloadavg(),
    }


def describe(seed: int, row: dict) -> str:
    return (
        f"seed {seed}: {row['serial_rounds_per_s']:.2f} -> {row['ahead_rounds_per_s']:.2f} rounds/s "
        f"({row['ratio']:.2f}x; CPU s a round {row['serial_cpu_s_per_round']:.2f} -> "
        f"{row['ahead_cpu_s_per_round']:.2f}; waited for rollouts {row['ahead_wait_s_median']}); held-out "
        f"{row['serial_heldout']:.3f} serial, {row['ahead_heldout_equal_compute']:.3f} ahead at equal compute, "
        f"{row['ahead_heldout_equal_wall']:.3f} ahead at equal wall clock "
        f"({row['ahead_rounds_equal_wall']} rounds)"
    )


def main() -> None:
    args = seeds_parser(__doc__.split("\n")[0], REPO / "configs" / "isolated.yaml", rounds=40).parse_args()
    rows = run_seeds(args, run_seed, describe)
    print(
        json.dumps(
            {
                "benchmark": "overlap",
                "seeds": len(rows),
                "ratio_median": statistics.median(r["ratio"] for r in rows),
                "ratios": [r["ratio"] for r in rows],
                "heldout_equal_compute_minus_serial": [
                    r["ahead_heldout_equal_compute"] - r["serial_heldout"] for r in rows
                ],
                "heldout_equal_wall_minus_serial": [r["ahead_heldout_equal_wall"] - r["serial_heldout"] for r in rows],
            }
        )
    )


if __name__ == "__main__":
    main()
