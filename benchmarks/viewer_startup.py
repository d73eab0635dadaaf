"""How fast `swarm-node stats` answers: CPU and wall seconds of `swarm-node stats --state-dir D --json` over a
synthetic state directory (--rows metrics rows shaped like a node's, and a swarm.json), run --repeats times, beside
the bare interpreter's start (`python -c pass`) as the floor nothing can go under.

Each run is its own process (`python -m node.cli`, what the `swarm-node` entry point runs); its CPU seconds (user +
system) are read with resource.getrusage(RUSAGE_CHILDREN), so they count the command alone, not this script. The load
average is printed with the figures: on a machine shared with other work, wall seconds grow with the load and CPU
seconds much less. Ends with one JSON line.

    .venv/bin/python benchmarks/viewer_startup.py --rows 1000 --repeats 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from node.stats import SwarmStats

REPO = Path(__file__).resolve().parents[1]


def write_state_dir(state_dir: Path, rows: int) -> None:
    """`rows` rounds of a node that trains on two specialties and evaluates every 10 rounds, and its swarm
    counters."""
    with open(state_dir / "metrics.jsonl", "w") as metrics:
        for r in range(1, rows + 1):
            row = {
                "round": r,
                "time": 1_700_000_000.0 + 12.0 * r,
                "policy_version": r,
                "loss": 0.1,
                "grad_norm": 1.0,
                "clip_fraction": 0.0,
                "kl": 0.01,
                "groups_used": 8,
                "groups_dropped": 0,
                "external_questions": 4,
                "rejected": {},
                "generation_s": 8.0,
                "scoring_s": 0.5,
                "update_s": 3.0,
                "step_s": 12.0,
                "reward_mean": r / rows,
                "accuracy": r / rows,
                "tokens_per_s": 250.0,
                "reward_by_dataset": {"arithmetic": r / rows, "letters": r / rows / 2},
            }
            if r % 10 == 0:
                row |= {"heldout_accuracy": r / rows, "heldout_by_dataset": {"arithmetic": r / rows, "letters": 0.1}}
            metrics.write(json.dumps(row) + "\n")
    stats = SwarmStats()
    for peer in range(8):
        stats.peer(f"{peer:016x}").batches_received += rows
    stats.save(state_dir / "swarm.json")


def measure(command: list[str]) -> tuple[float, float, str]:
    """CPU seconds (user + system) and wall seconds of one run of `command`, and what it printed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu_s, wall_s, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1000, help="metrics rows in the synthetic state directory")
    parser.add_argument("--repeats", type=int, default=10, help="runs of each command")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="viewer-startup-") as scratch:
        state_dir = Path(scratch)
        write_state_dir(state_dir, args.rows)
        stats_command = [sys.executable, "-m", "node.cli", "stats", "--state-dir", str(state_dir), "--json"]
        summary = json.loads(measure(stats_command)[2])  # once unmeasured: the check, and the file cache warm
        assert summary["rounds"] == args.rows and summary["swarm"]["peers"], summary
        load_before = os.getloadavg()
        stats_runs = [measure(stats_command)[:2] for _ in range(args.repeats)]
        floor_runs = [measure([sys.executable, "-c", "pass"])[:2] for _ in range(args.repeats)]
        load_after = os.getloadavg()

    figures = {}
    for name, runs in (("stats", stats_runs), ("python_startup", floor_runs)):
        cpu, wall = [run[0] for run in runs], [run[1] for run in runs]
        figures[name] = {
            "cpu_s_median": statistics.median(cpu),
            "cpu_s_max": max(cpu),
            "wall_s_median": statistics.median(wall),
            "wall_s_max": max(wall),
        }
        print(
            f"{name}: CPU s median {statistics.median(cpu):.3f} (max {max(cpu):.3f}), "
            f"wall s median {statistics.median(wall):.3f} (max {max(wall):.3f}) over {len(runs)} runs"
        )
    print(
        f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; "
        f"after {', '.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs"
    )
    print(
        json.dumps(
            {
                "benchmark": "viewer_startup",
                "command": "swarm-node stats --state-dir D --json",
                "metrics_rows": args.rows,
                "repeats": args.repeats,
                **figures,
                "load_average_before": load_before,
                "load_average_after": load_after,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
