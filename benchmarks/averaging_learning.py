"""Learning with weight averaging: none vs NoLoCo (one random peer) vs DiLoCo (all peers).

Four real nodes on 127.0.0.1 (in this process) start from the same warm-started default
model and train in lockstep for --rounds rounds on their own questions only (no rollout
sharing, so averaging is the only interaction; --sharing 4/4 adds SAPO's rollout sharing at
equal compute, as swarm_vs_isolated.py runs it). Every --every-steps updates each node
starts an outer step in the background. Reported per method: mean held-out accuracy of
the 4 nodes (greedy, the config's held-out set) every --eval-every rounds, and per
specialty at the end, mean reward of the last 10% of rounds, bytes sent per node, outer
steps done/skipped, and the spread of the replicas (mean pairwise relative L2 distance of
their weights) at the end. With several --seeds (node i of seed s has seed 100 * s + i)
every method runs once per seed and the final held-out accuracy is given per seed, with
its mean and spread. Ends with one JSON line.

    .venv/bin/python benchmarks/averaging_learning.py --rounds 120 --every-steps 10
    .venv/bin/python benchmarks/averaging_learning.py --config configs/mix.yaml --seeds 0 1 2 --sharing 4/4
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
from node.weights.validation import relative_distance  # noqa: E402
from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402
from benchmarks.common import spread as value_spread  # noqa: E402 - `spread` here is the replicas'
from benchmarks.swarm_vs_isolated import parse_mix  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# SAPO's plain rule, which this benchmark's campaigns (benchmarks/notebook/) were measured with: configs/swarm.yaml now
# also draws by weakness and learns from stronger peers' right answers, which this benchmark does not measure.
SAPO_RULE = ["swarm.external_selection=uniform", "swarm.imitation=none"]


def spread(nodes: list[Node]) -> float:
    weights = [{k: v.detach() for k, v in float_parameters(n.model).items()} for n in nodes]
    return statistics.fmean(relative_distance(a, b) for a, b in itertools.combinations(weights, 2))


async def run_method(method: str, args, scratch: str, seed: int) -> dict:
    local, external, sharing_overrides = parse_mix(args.sharing)
    common = [
        *SAPO_RULE,  # first: --set may change it
        *args.set,
        *sharing_overrides,
        "swarm.transport=dht",
        'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        "swarm.swarm_id=avg-bench",
        f"swarm.local_questions={local}",
        f"swarm.external_questions={external}",
        f"swarm.generated_questions={local + external}",
        "swarm.gossip=dht",
        f"averaging.method={method}",
        f"averaging.every_steps={args.every_steps}",
        "averaging.window_s=5",
        "averaging.timeout_s=10",
        "checkpoint_every=1000000",
        "eval_every=0",
        "torch_threads=2",
    ]
    nodes: list[Node] = []
    try:
        for i in range(args.nodes):
            peers = [f"swarm.initial_peers={json.dumps(nodes[0].addresses)}"] if nodes else []
            node = Node(
                load_config(
                    args.config, [*common, *peers, f"seed={100 * seed + i}"], state_dir=f"{scratch}/{seed}/{method}/{i}"
                )
            )
            node.load(fresh=True)
            await node.start_services()
            nodes.append(node)
        curve, rewards = [], [[] for _ in nodes]
        for round_ in range(1, args.rounds + 1):
            for i, node in enumerate(nodes):
                rewards[i].append((await node.run_round())["reward_mean"])
            if round_ % args.eval_every == 0:
                accuracy = statistics.fmean(
                    await asyncio.gather(*(asyncio.to_thread(n.evaluator.accuracy) for n in nodes))
                )
                curve.append((round_, accuracy))
                print(
                    f"  seed {seed} {method:6s} round {round_}: held-out {accuracy:.3f}, spread {spread(nodes):.4f}",
                    flush=True,
                )
        counters = [n.averaging.counters() for n in nodes] if method != "none" else []
        tenth = max(1, args.rounds // 10)
        heldout = await asyncio.gather(*(asyncio.to_thread(n.evaluator.by_dataset) for n in nodes))
        labels = sorted({label for _, by_dataset in heldout for label in by_dataset})
        return {
            "heldout_curve": curve,
            "heldout_final": statistics.fmean(overall for overall, _ in heldout),
            "heldout_by_specialty": {
                label: statistics.fmean(by_dataset.get(label, 0.0) for _, by_dataset in heldout) for label in labels
            },
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
    parser.add_argument("--config", default=str(REPO / "configs" / "swarm.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config overrides for every node")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--sharing",
        default="8/0",
        metavar="L/E[@KEY=VALUE...]",
        help="SAPO mix every method runs with (8/0: no rollout sharing; 4/4: the paper's), as in swarm_vs_isolated.py",
    )
    args = parser.parse_args()
    try:
        parse_mix(args.sharing)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--sharing {exc}")

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    started = time.monotonic()
    runs: dict[str, list[dict]] = {method: [] for method in args.methods}
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for method in args.methods:
                r = asyncio.run(run_method(method, args, scratch, seed))
                runs[method].append(r)
                by_specialty = " ".join(f"{label} {value:.2f}" for label, value in r["heldout_by_specialty"].items())
                print(
                    f"seed {seed} {method:6s}: held-out {r['heldout_final']:.3f} ({by_specialty}), reward last 10% "
                    f"{r['reward_last_10pct']:.3f}, "
                    f"spread {r['spread_final']:.4f}, bytes sent/node {r['bytes_sent_per_node']:.0f}, "
                    f"outer steps {r['outer_steps_succeeded']} done / {r['outer_steps_skipped']} skipped",
                    flush=True,
                )
    results = {}
    for method, per_seed in runs.items():
        finals = [r["heldout_final"] for r in per_seed]
        results[method] = {
            "heldout_curves": [r["heldout_curve"] for r in per_seed],
            "heldout_final": statistics.fmean(finals),
            "heldout_final_per_seed": finals,
            "heldout_final_spread": value_spread(finals),
            "heldout_by_specialty": {
                label: statistics.fmean(r["heldout_by_specialty"].get(label, 0.0) for r in per_seed)
                for label in per_seed[0]["heldout_by_specialty"]
            },
            "reward_last_10pct": statistics.fmean(r["reward_last_10pct"] for r in per_seed),
            "spread_final": statistics.fmean(r["spread_final"] for r in per_seed),
            "bytes_sent_per_node": statistics.fmean(r["bytes_sent_per_node"] for r in per_seed),
            "outer_steps_succeeded": sum(r["outer_steps_succeeded"] for r in per_seed),
            "outer_steps_skipped": sum(r["outer_steps_skipped"] for r in per_seed),
        }
        r = results[method]
        print(
            f"{method:6s}: held-out {r['heldout_final']:.3f} (per seed {', '.join(f'{v:.3f}' for v in finals)}), "
            f"reward last 10% {r['reward_last_10pct']:.3f}, "
            f"spread {r['spread_final']:.4f}",
            flush=True,
        )
    print(
        json.dumps(
            {
                "benchmark": "averaging_learning",
                "config": Path(args.config).name,
                "sharing": args.sharing,
                "nodes": args.nodes,
                "rounds": args.rounds,
                "every_steps": args.every_steps,
                "seeds": args.seeds,
                "results": results,
                "minutes": (time.monotonic() - started) / 60,
            }
        )
    )


if __name__ == "__main__":
    main()
