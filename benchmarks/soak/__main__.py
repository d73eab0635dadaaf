"""The soak's command: 8 `join` nodes in their own network namespaces (two behind home routers), a 3-stage pipeline
with a spare and its driver, and every fault kind of benchmarks/soak/run.py in turn, for --cycles rounds of faults or
until --hours have passed. Root (network namespaces, tmpfs, iptables) and libfaketime (Debian: faketime).

    sudo .venv/bin/python -m benchmarks.soak --hours 3 --results benchmarks/results/soak.jsonl
    sudo .venv/bin/python -m benchmarks.soak --cycles 1 --gap-s 30 --fault-s 60     # one of each, accelerated

Prints a line per fault and ends with one JSON line of the figures (appended to --results): crashes, the longest
stall per process (no metrics row for that long, outside its scheduled downtime), recovery per fault kind (lifted to
the next exchange with a peer), rows contiguous, policy versions forward, checkpoints that do not load, RSS growth
from --rss-baseline-s after each start to the end, and /readyz around each p2p daemon kill.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.common import print_result_line
from benchmarks.lab import lab_unavailable, stop_on_first_signal
from benchmarks.soak.plan import FAULT_KINDS, SoakPlan
from benchmarks.soak.run import Soak


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hours", type=float, help="repeat the faults until this long has passed (else --cycles)")
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--faults", nargs="+", choices=FAULT_KINDS, default=list(FAULT_KINDS))
    parser.add_argument("--join-nodes", type=int, default=8)
    parser.add_argument("--natted", type=int, nargs="*", default=[6, 7])
    parser.add_argument("--stages", type=int, default=3, help="0: no pipeline")
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--gap-s", type=float, default=60.0)
    parser.add_argument("--fault-s", type=float, default=60.0)
    parser.add_argument("--down-s", type=float, default=10.0)
    parser.add_argument("--recover-timeout-s", type=float, default=300.0)
    parser.add_argument("--rss-baseline-s", type=float, default=600.0)
    parser.add_argument("--state-root", type=Path, help="keep the processes' state here (default: a temporary one)")
    parser.add_argument("--results", type=Path)
    args = parser.parse_args()
    if why := lab_unavailable():
        print(f"soak: {why}", file=sys.stderr)
        return 2
    plan = SoakPlan(
        join_nodes=args.join_nodes,
        natted=tuple(args.natted),
        stages=args.stages,
        spares=args.spares,
        faults=tuple(args.faults),
        cycles=args.cycles,
        gap_s=args.gap_s,
        fault_s=args.fault_s,
        down_s=args.down_s,
        recover_timeout_s=args.recover_timeout_s,
        rss_baseline_s=args.rss_baseline_s,
    )
    stop_on_first_signal()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        root = args.state_root or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        try:
            with Soak(plan, root, env, log=lambda line: print(line, flush=True)) as soak:
                result = soak.run(hours=args.hours)
        except KeyboardInterrupt:
            print("soak: stopped before its schedule ended; its processes are stopped, no figures", file=sys.stderr)
            return 130
    print_result_line(result, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
