"""Sharing that pays: does a swarm teach a node what it lacks, for the compute the node spends?

Workload (configs/specialists.yaml): the default one-task arithmetic (1-digit, 2 terms) split
into two specialties by operator, `add` and `subtract`. Settings:
  specialists  nodes 0-1 warm-started on `add` only, nodes 2-3 on `subtract` only; every node
               then trains on both. A node's *weak* specialty is the one it was not warm-started on.
  homogeneous  every node warm-started on both (the same warm start): sharing must not hurt.
  sparse       every node barely warm-started (rewards a few percent), binary reward: SAPO's
               regime, to compare its 4/4 against the paper's silo (zero-advantage groups kept)
               and against ours (dropped).
  pretrained   a real pretrained model (configs/smollm2_swarm.yaml: SmolLM2-135M-Instruct on its
               two-task mix), no warm start: four equal nodes from the same weights, measured on
               --heldout-per-specialty questions of each task (50: the 100 of tasks.heldout_size).
Arms (same seeds and warm starts; --arms picks, ARMS below lists them): `silo` generates and trains
on 8 own questions a round; `sapo` generates 4 and trains on 4 own + 4 peers' (SAPO's 4/4, peers'
groups drawn uniformly among those with a reward spread); `sapo_balance` draws peers' groups by weakness, adds the
imitation term (trainer.imitation_coef 4) over stronger peers' right answers and the node's own (swarm.imitation),
and draws its own questions after peers' groups (swarm.local_draw balance); `silo_imitate` is its fair silo, the same
term over its own right answers only (configs/isolated.yaml); `sapo_balance_gated` is the shipped sharing
(configs/specialists.yaml); `sapo_balance_noloco` / `silo_imitate_noloco` add NoLoCo's averaging; `paper_silo` /
`paper_sapo` keep zero-advantage groups in the batch as the paper's baseline did. Arms of mechanisms that lost and
left the product, and variants that did no better than the shipped arms, are gone (RETIRED_ARMS); their stored
runs are still read by --report.

The real path, only the network hop replaced: the 4 nodes live in this process and run in
lockstep, one round each in turn; what a node publishes is the signed record a DHT store would
carry and peers read it through the same receiver (node/transport/inprocess.py), then draw,
re-generate and re-score it as from the network (node/sharing.py).

Axis: each node's own compute, CPU seconds of this process while that node's round runs
(generation, scoring, re-scoring of peers' groups, update; torch on 1 thread; the held-out
evaluation is not counted). A node stops at --budget seconds; held-out accuracy (greedy, 200
fixed questions per specialty from a seed training never draws) is measured at --points equal
steps of its compute. The network is charged apart: --network-charge x a silo round's mean
compute per swarm round (0.081: the lab's measured overhead of a swarm round over an isolated
one, publish + collect + re-score, benchmarks/notebook/2026-11-23-lab.md).

Every (setting, arm, seed) run appends one JSON line to --results as it finishes, so seeds
accumulate over several invocations (also several processes at once); `--report` reads the file,
prints the figures and the plot (--plot), and ends with one JSON line.

    .venv/bin/python benchmarks/sharing.py --gate                                  # warm-start gate
    .venv/bin/python benchmarks/sharing.py --setting specialists --arms silo_imitate sapo_balance_gated --seeds 0 1 2
    .venv/bin/python benchmarks/sharing.py --report --plot benchmarks/sharing.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

# run as a script, Python puts benchmarks/ on the path, not the repository: benchmarks.* is imported from there
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.arms.catalog import (  # noqa: E402
    ARMS,
    CONFIG,
    HELDOUT_PER_SPECIALTY,
    arm_or_variant,
    parse_warmup_steps,
    single_node_arm,
)
from benchmarks.arms.lockstep import gate, round_cost, run_arm  # noqa: E402
from benchmarks.arms.report import report  # noqa: E402
from benchmarks.common import REPO  # noqa: E402
from node.files import append_json_line  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting", choices=["specialists", "four", "homogeneous", "sparse", "pretrained"], default="specialists"
    )
    parser.add_argument(
        "--heldout-per-specialty",
        type=int,
        default=None,
        help=f"greedy held-out questions of each task ({HELDOUT_PER_SPECIALTY}; --setting pretrained: 50)",
    )
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["silo_imitate", "sapo_balance_gated"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--budget", type=float, default=300.0, help="compute per node, on --axis (units: idle-machine CPU seconds)"
    )
    parser.add_argument(
        "--axis",
        choices=["units", "cpu"],
        default="units",
        help="the budget's axis: compute units (node/compute.py; load-free) or this process's CPU seconds; with "
        "--report: the runs of this axis",
    )
    parser.add_argument("--costs", type=Path, default=REPO / "benchmarks" / "compute_costs.json")
    parser.add_argument("--points", type=int, default=6, help="held-out evaluations along the budget")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="run this many rounds per node instead of a compute budget (the sparse setting's SAPO ratio)",
    )
    parser.add_argument(
        "--warmup-steps",
        nargs="+",
        default=["260"],
        metavar="[LABEL=]STEPS",
        help="warm-start steps: one number, or per specialist and 'both'",
    )
    parser.add_argument("--sparse-warmup-steps", type=int, default=60)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--set", action="append", default=[], help="a config override for every node of every arm")
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "sharing.jsonl")
    parser.add_argument("--more-results", type=Path, nargs="*", default=[], help="--report: read these files too")
    parser.add_argument(
        "--network-charge",
        type=float,
        default=0.081,
        help="network cost of a swarm round, as a fraction of a silo round",
    )
    parser.add_argument(
        "--transport",
        choices=["inprocess", "dht"],
        default="inprocess",
        help="dht: the nodes talk through real p2p daemons on 127.0.0.1; with --report: the runs of this transport",
    )
    parser.add_argument("--gate", action="store_true", help="only print the warm-start gate")
    parser.add_argument(
        "--round-cost",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="only measure what a round of each of --arms costs (ROUNDS rounds per node, arms interleaved)",
    )
    parser.add_argument("--round-cost-warmup", type=int, default=5)
    parser.add_argument(
        "--round-cost-results",
        type=Path,
        nargs="+",
        default=[REPO / "benchmarks" / "results" / "sharing_round_cost.jsonl"],
        help="--round-cost appends its JSON line to the first file; --report quotes the newest line of them all "
        "measured against --baseline",
    )
    parser.add_argument(
        "--baseline",
        default="silo",
        type=single_node_arm,
        help="--report: the single-node arm (or variant, 'silo_imitate[own_replay=4]') every arm is measured against "
        "(the best single-node recipe)",
    )
    parser.add_argument("--report", action="store_true", help="only summarize --results")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--plot-four", type=Path, default=None, help="--report: the four-specialist plot")
    parser.add_argument(
        "--report-arms",
        nargs="+",
        type=arm_or_variant,
        help="--report: only these arms (the silo among them); an arm's variant named by its full label, "
        "'sapo_balance_gated[own_replay=4]', is kept alone and may be the summary's best arm",
    )
    parser.add_argument(
        "--report-budget",
        type=float,
        default=None,
        help="--report: only runs of this --budget (they must share one axis)",
    )
    args = parser.parse_args()
    if args.heldout_per_specialty is None:
        args.heldout_per_specialty = 50 if args.setting == "pretrained" else HELDOUT_PER_SPECIALTY
    try:
        args.warmup_steps = parse_warmup_steps(args.warmup_steps)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(str(exc))
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.report:
        report(args)
        return
    if args.gate:
        gate(args)
        return
    if args.round_cost:
        result = asyncio.run(round_cost(args))
        append_json_line(args.round_cost_results[0], result)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for arm in args.arms:
                result = asyncio.run(run_arm(args.setting, arm, seed, args, scratch))
                append_json_line(args.results, result)
                finals = [curve[-1] for curve in result["curves"]]
                print(
                    f"{args.setting} {arm} seed {seed}: rounds {result['rounds']}, final held-out "
                    + ", ".join(
                        f"node {i} {' '.join(f'{k} {v:.2f}' for k, v in f.items() if k not in ('compute_s', 'round'))}"
                        for i, f in enumerate(finals)
                    )
                    + f", {result['wall_s']:.0f} s wall",
                    flush=True,
                )


if __name__ == "__main__":
    main()
