"""SAPO on loopback: 4 nodes sharing rollouts vs training alone, for the paper's mixes.

Four real nodes (each its own p2pd and DHT node on 127.0.0.1, all in this process) start
from the same warm-started default model and train in lockstep for --rounds rounds. Each
round every node trains on I local + J external questions (8 in all, the paper's batch),
so per-node update compute is equal across mixes; with J > 0 a node samples its external
questions from what the other three published (one round old at most, re-scored locally).
Cumulative reward = sum over rounds of the mean reward of a node's own completions,
averaged over the 4 nodes (the paper's figure of merit). Ends with one JSON line.

    .venv/bin/python benchmarks/swarm_vs_isolated.py --rounds 200
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

REPO = Path(__file__).resolve().parents[1]
MIXES = {"8/0": (8, 0), "6/2": (6, 2), "4/4": (4, 4), "2/6": (2, 6)}


async def run_mix(local: int, external: int, nodes: int, rounds: int, scratch: str, overrides: list[str]) -> list[list[float]]:
    common = [
        *overrides,
        "swarm.transport=dht",
        'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        f"swarm.local_questions={local}",
        f"swarm.external_questions={external}",
        "swarm.swarm_id=bench",
        "swarm.window_s=30",
        "checkpoint_every=1000000",
        "eval_every=0",
        "torch_threads=2",
    ]
    swarm: list[Node] = []
    try:
        for i in range(nodes):
            peers = [f'swarm.initial_peers={json.dumps(swarm[0].transport.addresses)}'] if swarm else []
            node = Node(load_config(REPO / "configs" / "swarm.yaml", [*common, *peers, f"seed={i}", f"name=bench-{i}"], state_dir=f"{scratch}/{local}-{external}/{i}"))
            node.load(fresh=True)
            await node.transport.start()
            swarm.append(node)
        rewards: list[list[float]] = [[] for _ in swarm]
        started = time.monotonic()
        for round_ in range(rounds):
            for i, node in enumerate(swarm):
                row = await node.run_round()
                rewards[i].append(row["reward_mean"])
            if (round_ + 1) % 25 == 0:
                mean_last = statistics.fmean(r for per_node in rewards for r in per_node[-25:])
                used = sum(n.stats.totals()["questions_used"] for n in swarm)
                print(f"  {local}/{external} round {round_ + 1}: reward(last 25) {mean_last:.3f}, external questions used {used}, {time.monotonic() - started:.0f}s", flush=True)
        return rewards
    finally:
        for node in swarm:
            await node.transport.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--set", action="append", default=[], help="config overrides for every node")
    args = parser.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cumulative, final = {}, {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.mixes:
            local, external = MIXES[name]
            rewards = asyncio.run(run_mix(local, external, args.nodes, args.rounds, scratch, args.set))
            cumulative[name] = statistics.fmean(sum(per_node) for per_node in rewards)
            final[name] = statistics.fmean(statistics.fmean(per_node[-max(1, args.rounds // 10):]) for per_node in rewards)
            print(f"mix {name}: cumulative reward {cumulative[name]:.2f} (mean over {args.nodes} nodes), last-10% reward {final[name]:.3f}", flush=True)
    ratios = {name: value / cumulative["8/0"] for name, value in cumulative.items()} if "8/0" in cumulative else {}
    if ratios:
        print("ratio to 8/0: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + " (paper: 6/2 1.52x, 4/4 1.94x, 2/6 1.68x)")
    print(json.dumps({
        "benchmark": "swarm_vs_isolated",
        "nodes": args.nodes,
        "rounds": args.rounds,
        "cumulative_reward": cumulative,
        "final_reward_last_10pct": final,
        "ratio_to_8_0": ratios,
        "ratio_4_4_vs_8_0": ratios.get("4/4"),
        "minutes": (time.monotonic() - started) / 60,
    }))


if __name__ == "__main__":
    main()
