"""SAPO on loopback: 4 nodes sharing rollouts vs training alone, for the paper's mixes.

Four real nodes (each its own p2pd and DHT node on 127.0.0.1, all in this process) start
from the same warm-started default model and train in lockstep for --rounds rounds. Each
round every node generates and publishes 8 questions x their completions, and trains on I
of its own (those with a learning signal first) + J external questions (8 in all, the paper's
batch), so per-node compute, generation and update, is equal across mixes; with J > 0 a node
samples its external questions from what the other three published (one round old at most,
re-scored locally). --generate-local-only is the older setting where a node generated only
its I questions (the rows of benchmarks/notebook/2026-11-25-swarm-vs-isolated.md whose JSON has no
`generated_per_round`).
Cumulative reward = sum over rounds of the mean reward of a node's own completions,
averaged over the 4 nodes (the paper's figure of merit). Because the warm start's reward
level makes up most of it in a short run, the gain above that level (cumulative reward -
rounds x the reward of round 1, before any update) is reported beside it, with the reward
curve per mix. Ends with one JSON line.

    .venv/bin/python benchmarks/swarm_vs_isolated.py --rounds 200
    .venv/bin/python benchmarks/swarm_vs_isolated.py --config configs/mix.yaml --seeds 0 1 2 --mixes 8/0 4/4
    .venv/bin/python benchmarks/swarm_vs_isolated.py --config configs/mix.yaml --mixes 8/0 4/4 \
        --node-set 2:model.default.warmup_steps=300 --node-set 3:model.default.warmup_steps=300   # heterogeneous
    .venv/bin/python benchmarks/swarm_vs_isolated.py --config configs/mix.yaml \
        --mixes 8/0 4/4 4/4@swarm.importance_weighting=false     # a sharing setting side by side

Each seed repeats every mix with other question streams and sampling (node i of seed s has
seed 100 * s + i); ratios are taken per seed, then their mean and spread reported. At the
end of each mix every node is evaluated greedily on the held-out set, per specialty of the
task mix (the mean over nodes is reported).
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

from benchmarks.common import spread  # noqa: E402
from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIXES = {"8/0": (8, 0), "6/2": (6, 2), "4/4": (4, 4), "2/6": (2, 6)}

# SAPO's plain rule, which this benchmark's campaigns (benchmarks/notebook/) were measured with: configs/swarm.yaml now
# also draws by weakness and learns from stronger peers' right answers, which this benchmark does not measure.
SAPO_RULE = ["swarm.external_selection=uniform", "swarm.imitation=none"]


def parse_mix(text: str) -> tuple[int, int, list[str]]:
    """'4/4' or a variant '4/4@KEY=VALUE[@KEY=VALUE...]': (local, external, overrides for every node of that run).

    Variants let one run compare sharing settings side by side, each against the same 8/0."""
    base, *overrides = text.split("@")
    if base not in MIXES or any("=" not in item for item in overrides):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {', '.join(MIXES)}, optionally followed by @KEY=VALUE overrides"
        )
    return (*MIXES[base], overrides)


async def run_mix(
    local: int,
    external: int,
    nodes: int,
    rounds: int,
    scratch: str,
    overrides: list[str],
    config_path: str,
    seed: int = 0,
    node_overrides: dict[int, list[str]] | None = None,
    run_index: int = 0,
    generate_local_only: bool = False,
) -> tuple[list[list[float]], dict[str, float], float, float | None]:
    """(per node, the mean reward of its own completions each round; held-out accuracy per specialty, mean over nodes;
    rollout bytes a node published per round, mean over nodes; the mean importance weight of peers' tokens, or None)."""
    common = [
        *SAPO_RULE,  # first: a variant's or --set's overrides may change it
        *overrides,
        "swarm.transport=dht",
        'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        f"swarm.local_questions={local}",
        f"swarm.external_questions={external}",
        f"swarm.generated_questions={local if generate_local_only else local + external}",
        "swarm.swarm_id=bench",
        "swarm.window_s=30",
        "checkpoint_every=1000000",
        "eval_every=0",
        "torch_threads=2",
    ]
    swarm: list[Node] = []
    try:
        for i in range(nodes):
            peers = [f'swarm.initial_peers={json.dumps(swarm[0].addresses)}'] if swarm else []
            own = (node_overrides or {}).get(i, [])
            node = Node(
                load_config(
                    config_path,
                    [*common, *own, *peers, f"seed={100 * seed + i}", f"name=bench-{i}"],
                    state_dir=f"{scratch}/{seed}/{run_index}-{local}-{external}/{i}",
                )
            )
            node.load(fresh=True)
            await node.start_services()
            swarm.append(node)
        rewards: list[list[float]] = [[] for _ in swarm]
        importance_weights: list[float] = []
        started = time.monotonic()
        for round_ in range(rounds):
            for i, node in enumerate(swarm):
                row = await node.run_round()
                rewards[i].append(row["reward_mean"])
                if "importance_weight_mean" in row:
                    importance_weights.append(row["importance_weight_mean"])
            if (round_ + 1) % 25 == 0:
                mean_last = statistics.fmean(r for per_node in rewards for r in per_node[-25:])
                used = sum(n.stats.totals()["questions_used"] for n in swarm)
                print(
                    f"  seed {seed} {local}/{external} round {round_ + 1}: reward(last 25) {mean_last:.3f}, external "
                    f"questions used {used}, {time.monotonic() - started:.0f}s",
                    flush=True,
                )
        heldout = await asyncio.gather(*(asyncio.to_thread(node.evaluator.by_dataset) for node in swarm))
        labels = sorted({label for _, by_dataset in heldout for label in by_dataset})
        by_specialty = {
            label: statistics.fmean(by_dataset.get(label, 0.0) for _, by_dataset in heldout) for label in labels
        }
        by_specialty["all"] = statistics.fmean(overall for overall, _ in heldout)
        bytes_per_round = statistics.fmean(node.stats.totals()["bytes_published"] for node in swarm) / rounds
        return (
            rewards,
            by_specialty,
            bytes_per_round,
            statistics.fmean(importance_weights) if importance_weights else None,
        )
    finally:
        for node in swarm:
            await node.stop_services()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--mixes",
        nargs="+",
        default=list(MIXES),
        metavar="L/E[@KEY=VALUE...]",
        help=f"local/external mixes ({', '.join(MIXES)}); a variant adds overrides, e.g. "
        "4/4@swarm.importance_weighting=false",
    )
    parser.add_argument("--config", default=str(REPO / "configs" / "swarm.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config overrides for every node")
    parser.add_argument(
        "--generate-local-only",
        action="store_true",
        help="a node generates only its I questions (less compute with J > 0)",
    )
    parser.add_argument(
        "--node-set",
        action="append",
        default=[],
        metavar="I:KEY=VALUE",
        help="a config override for node I only (a heterogeneous swarm), e.g. 2:model.default.warmup_steps=300",
    )
    args = parser.parse_args()
    for name in args.mixes:
        try:
            parse_mix(name)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--mixes {exc}")
    node_overrides: dict[int, list[str]] = {}
    for item in args.node_set:
        index, sep, override = item.partition(":")
        if not sep or not index.isdigit() or int(index) >= args.nodes or "=" not in override:
            parser.error(f"--node-set {item!r}: expected I:KEY=VALUE with 0 <= I < {args.nodes}")
        node_overrides.setdefault(int(index), []).append(override)

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cumulative: dict[str, list[float]] = {name: [] for name in args.mixes}
    final: dict[str, list[float]] = {name: [] for name in args.mixes}
    heldout: dict[str, list[dict[str, float]]] = {name: [] for name in args.mixes}
    per_node: dict[str, list[list[float]]] = {name: [] for name in args.mixes}  # [seed][node] cumulative reward
    published: dict[str, list[float]] = {name: [] for name in args.mixes}  # [seed] rollout bytes per node per round
    weights_seen: dict[str, list[float]] = {
        name: [] for name in args.mixes
    }  # [seed] mean importance weight of peers' tokens
    curves: dict[str, list[list[float]]] = {name: [] for name in args.mixes}  # [seed][round] mean reward over nodes
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for run_index, name in enumerate(args.mixes):
                local, external, variant = parse_mix(name)
                rewards, by_specialty, bytes_per_round, importance_weight = asyncio.run(
                    run_mix(
                        local,
                        external,
                        args.nodes,
                        args.rounds,
                        scratch,
                        [*args.set, *variant],
                        args.config,
                        seed,
                        node_overrides,
                        run_index,
                        args.generate_local_only,
                    )
                )
                per_node[name].append([sum(rewards_of_node) for rewards_of_node in rewards])
                cumulative[name].append(statistics.fmean(per_node[name][-1]))
                final[name].append(
                    statistics.fmean(statistics.fmean(own[-max(1, args.rounds // 10) :]) for own in rewards)
                )
                curves[name].append([statistics.fmean(per_round) for per_round in zip(*rewards)])
                heldout[name].append(by_specialty)
                published[name].append(bytes_per_round)
                if importance_weight is not None:
                    weights_seen[name].append(importance_weight)
                print(
                    f"seed {seed} mix {name}: cumulative reward {cumulative[name][-1]:.2f} (mean over {args.nodes} "
                    f"nodes), last-10% reward {final[name][-1]:.3f}, "
                    f"held-out {' '.join(f'{k} {v:.2f}' for k, v in by_specialty.items())}, "
                    f"{bytes_per_round / 1000:.1f} kB published per node per round"
                    + (
                        f", importance weight of peers' tokens {importance_weight:.3f}"
                        if importance_weight is not None
                        else ""
                    ),
                    flush=True,
                )
    per_seed = (
        {name: [c / base for c, base in zip(values, cumulative["8/0"])] for name, values in cumulative.items()}
        if "8/0" in cumulative
        else {}
    )
    ratios = {name: statistics.fmean(values) for name, values in per_seed.items()}
    if ratios:
        print(
            "ratio to 8/0, mean over seeds [per seed]: "
            + ", ".join(f"{k} {v:.2f}x {[round(r, 2) for r in per_seed[k]]}" for k, v in ratios.items())
            + " (paper: 6/2 1.52x, 4/4 1.94x, 2/6 1.68x)"
        )
    # The warm start's reward level is most of every mix's cumulative reward, which caps the ratio a faster learner can
    # show in a short run. So also the gain above it: cumulative reward - rounds x start, where start = the mean reward
    # of
    # round 1 over all mixes of the seed (round 1's completions come before any update, from the same warm start).
    starts = [statistics.fmean(curves[name][s][0] for name in args.mixes) for s in range(len(args.seeds))]
    gains = {name: [c - args.rounds * start for c, start in zip(values, starts)] for name, values in cumulative.items()}
    gain_per_seed = (
        {
            name: [g / base if base > 0 else None for g, base in zip(values, gains["8/0"])]
            for name, values in gains.items()
        }
        if "8/0" in gains
        else {}
    )
    print(
        "start reward per seed (round 1, before any update): "
        + ", ".join(f"{s:.3f}" for s in starts)
        + "; cumulative gain above it: "
        + ", ".join(
            f"{name} {statistics.fmean(values):.2f} {[round(v, 2) for v in values]}" for name, values in gains.items()
        ),
        flush=True,
    )
    node_ratios = {}
    if "8/0" in per_node:  # who gains and who loses: each node against itself training alone
        node_ratios = {
            name: [
                statistics.fmean(seed_run[i] / base[i] for seed_run, base in zip(runs, per_node["8/0"]))
                for i in range(args.nodes)
            ]
            for name, runs in per_node.items()
        }
        for i in range(args.nodes):
            described = " ".join(node_overrides.get(i, [])) or "as --set"
            print(
                f"node {i} ({described}): "
                + ", ".join(f"{name} {ratio[i]:.2f}x" for name, ratio in node_ratios.items()),
                flush=True,
            )
    heldout_by_specialty = {
        name: {
            label: statistics.fmean(run.get(label, 0.0) for run in runs)
            for label in sorted({k for run in runs for k in run})
        }
        for name, runs in heldout.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "swarm_vs_isolated",
                "config": Path(args.config).name,
                "nodes": args.nodes,
                "rounds": args.rounds,
                "generated_per_round": "I" if args.generate_local_only else "I+J",
                "seeds": args.seeds,
                "cumulative_reward": {name: statistics.fmean(values) for name, values in cumulative.items()},
                "cumulative_reward_spread": {name: spread(values) for name, values in cumulative.items()},
                "final_reward_last_10pct": {name: statistics.fmean(values) for name, values in final.items()},
                "ratio_to_8_0": ratios,
                "ratio_4_4_vs_8_0": ratios.get("4/4"),
                "ratio_4_4_vs_8_0_per_seed": per_seed.get("4/4"),
                "heldout_by_specialty": heldout_by_specialty,
                "node_overrides": {str(i): values for i, values in node_overrides.items()},
                "cumulative_reward_per_node": {
                    name: [statistics.fmean(run[i] for run in runs) for i in range(args.nodes)]
                    for name, runs in per_node.items()
                },
                "ratio_to_8_0_per_node": node_ratios,
                "bytes_published_per_node_round": {
                    name: statistics.fmean(values) for name, values in published.items()
                },
                "importance_weight_mean": {
                    name: statistics.fmean(values) for name, values in weights_seen.items() if values
                },
                "start_reward_per_seed": starts,
                "cumulative_gain_over_start": {name: statistics.fmean(values) for name, values in gains.items()},
                "cumulative_gain_over_start_per_seed": gains,
                "gain_ratio_to_8_0_per_seed": gain_per_seed,
                "reward_curve": {
                    name: [round(statistics.fmean(run[r] for run in runs), 4) for r in range(args.rounds)]
                    for name, runs in curves.items()
                },
                "minutes": (time.monotonic() - started) / 60,
            }
        )
    )


if __name__ == "__main__":
    main()
