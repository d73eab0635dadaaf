"""Learning with weight averaging: none vs NoLoCo (one random peer) vs DiLoCo (all peers).

Four real nodes on 127.0.0.1 (in this process) start from the same warm-started default
model and train in lockstep for --rounds rounds on their own questions only (no rollout
sharing, so averaging is the only interaction). Every --every-steps updates each node
starts an outer step in the background. Reported per method: mean held-out accuracy of
the 4 nodes (greedy, 200 fixed questions) every --eval-every rounds, mean reward of the
last 10% of rounds, bytes sent per node, outer steps done/skipped, and the spread of the
replicas (mean pairwise relative L2 distance of their weights) at the end.
Ends with one JSON line.

    .venv/bin/python benchmarks/averaging_learning.py --rounds 120 --every-steps 10
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

from node.averaging.outer import float_parameters  # noqa: E402
from node.averaging.validation import relative_distance  # noqa: E402
from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def spread(nodes: list[Node]) -> float:
    weights = [{k: v.detach() for k, v in float_parameters(n.model).items()} for n in nodes]
    return statistics.fmean(relative_distance(a, b) for a, b in itertools.combinations(weights, 2))


async def run_method(method: str, args, scratch: str) -> dict:
    common = [
        "swarm.transport=dht", 'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', "swarm.swarm_id=avg-bench",
        "swarm.local_questions=8", "swarm.external_questions=0", "swarm.gossip=dht",
        f"averaging.method={method}", f"averaging.every_steps={args.every_steps}", "averaging.window_s=5", "averaging.timeout_s=10",
        "checkpoint_every=1000000", "eval_every=0", "torch_threads=2",
    ]
    nodes: list[Node] = []
    try:
        for i in range(args.nodes):
            peers = [f"swarm.initial_peers={json.dumps(nodes[0].transport.addresses)}"] if nodes else []
            node = Node(load_config(REPO / "configs" / "swarm.yaml", [*common, *peers, f"seed={i}"], state_dir=f"{scratch}/{method}/{i}"))
            node.load(fresh=True)
            await node.start_services()
            nodes.append(node)
        curve, rewards = [], [[] for _ in nodes]
        for round_ in range(1, args.rounds + 1):
            for i, node in enumerate(nodes):
                rewards[i].append((await node.run_round())["reward_mean"])
            if round_ % args.eval_every == 0:
                accuracy = statistics.fmean(await asyncio.gather(*(asyncio.to_thread(n.evaluate_heldout) for n in nodes)))
                curve.append((round_, accuracy))
                print(f"  {method:6s} round {round_}: held-out {accuracy:.3f}, spread {spread(nodes):.4f}", flush=True)
        counters = [n.averaging.counters() for n in nodes] if method != "none" else []
        tenth = max(1, args.rounds // 10)
        return {
            "heldout_curve": curve,
            "heldout_final": curve[-1][1] if curve else None,
            "reward_last_10pct": statistics.fmean(statistics.fmean(r[-tenth:]) for r in rewards),
            "spread_final": spread(nodes),
            "bytes_sent_per_node": statistics.fmean(c["bytes_sent"] for c in counters) if counters else 0,
            "outer_steps_succeeded": sum(c["succeeded"] for c in counters),
            "outer_steps_skipped": sum(c["skipped"] for c in counters),
        }
    finally:
        for node in nodes:
            await node.stop_services()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--every-steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--methods", nargs="+", default=["none", "noloco", "diloco"])
    args = parser.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.monotonic()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for method in args.methods:
            results[method] = asyncio.run(run_method(method, args, scratch))
            r = results[method]
            print(f"{method:6s}: held-out {r['heldout_final']:.3f}, reward last 10% {r['reward_last_10pct']:.3f}, spread {r['spread_final']:.4f}, "
                  f"bytes sent/node {r['bytes_sent_per_node']:.0f}, outer steps {r['outer_steps_succeeded']} done / {r['outer_steps_skipped']} skipped", flush=True)
    print(json.dumps({"benchmark": "averaging_learning", "nodes": args.nodes, "rounds": args.rounds, "every_steps": args.every_steps, "results": results, "minutes": (time.monotonic() - started) / 60}))


if __name__ == "__main__":
    main()
