"""The swarm lab's command: N real `swarm-node join` processes, each in its own network namespace, on shaped links,
with churn and partitions on a schedule (benchmarks/lab/network.py says how the lab is built).

    sudo .venv/bin/python -m benchmarks.lab --nodes 8 --mbit 50 --loss 0.01
    sudo .venv/bin/python -m benchmarks.lab --nodes 8 --mbit 50 --slow-fraction 0.5 --slow-mbit 20 --minutes 10
    sudo .venv/bin/python -m benchmarks.lab --nodes 8 --churn-every 30 --partition-at 120 --partition-for 60
    sudo .venv/bin/python -m benchmarks.lab --nodes 8 --mbit 20 --isolated 8 --minutes 8   # what the swarm costs in
    rounds/min

Ends with one JSON line (per node: rounds, peer questions used, gossip messages, restarts).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lab.network import Lab, Link, cleanup_stale, lab_unavailable, stop_on_first_signal
from benchmarks.lab.swarm import isolated_argv, node_summary, start_swarm


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.lab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument(
        "--mbit", type=float, default=None, help="every node's link rate, both directions (default: unshaped)"
    )
    parser.add_argument("--up-mbit", type=float, default=None, help="upload rate (overrides --mbit)")
    parser.add_argument("--down-mbit", type=float, default=None, help="download rate (overrides --mbit)")
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss per direction, e.g. 0.01")
    parser.add_argument(
        "--slow-fraction", type=float, default=0.0, help="this fraction of the nodes (the last ones) gets --slow-mbit"
    )
    parser.add_argument("--slow-mbit", type=float, default=20.0)
    parser.add_argument(
        "--minutes", type=float, default=0.0, help="run this long, then stop and report (0: until Ctrl-C)"
    )
    parser.add_argument(
        "--churn-every", type=float, default=0.0, help="kill -9 a random non-bootstrap node every this many seconds"
    )
    parser.add_argument(
        "--churn-down", type=float, default=5.0, help="seconds a churned node stays dead before its restart"
    )
    parser.add_argument(
        "--partition-at",
        type=float,
        default=None,
        help="seconds after the start to cut the upper half of the nodes off",
    )
    parser.add_argument("--partition-for", type=float, default=60.0)
    parser.add_argument(
        "--state-root", type=Path, default=None, help="where node state goes (default: a new temporary directory)"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every node"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the churn schedule")
    parser.add_argument(
        "--isolated",
        type=int,
        default=0,
        metavar="K",
        help="also run K nodes with `train` (no network) beside the swarm, in namespaces of their own: the throughput "
        "baseline under the same machine load",
    )
    parser.add_argument("--cleanup", action="store_true", help="only remove what killed labs left behind, then exit")
    args = parser.parse_args()

    if args.cleanup:
        removed = cleanup_stale() if lab_unavailable() is None else []
        print(f"removed {len(removed)} stale lab(s): {', '.join(removed) or '-'}")
        return 0
    why = lab_unavailable()
    if why:
        print(f"lab: {why}; running the nodes on 127.0.0.1 without shaping or faults")
    lab = Lab(args.nodes + args.isolated, loopback=why is not None)
    root = args.state_root or Path(tempfile.mkdtemp(prefix="swarm-lab-"))
    stop_on_first_signal()
    rng = random.Random(args.seed)
    events: list[dict] = []
    started = time.monotonic()
    try:
        lab.up()
        slow_from = args.nodes - round(args.nodes * args.slow_fraction)
        for index in range(args.nodes + args.isolated):
            fast = Link(mbit=args.mbit, up_mbit=args.up_mbit, down_mbit=args.down_mbit, loss=args.loss)
            link = fast if index < slow_from else Link(mbit=args.slow_mbit, loss=args.loss)
            lab.shape(index, link)
            print(
                f"node {index}: {lab.ip(index)} in {'127.0.0.1' if lab.loopback else lab.ns(index)}, {link.describe()}",
                flush=True,
            )
        for index in range(args.nodes, args.nodes + args.isolated):
            lab.run(index, isolated_argv(lab, index, root / f"n{index}", args.set), root / f"n{index}.out")
        bootstrap = start_swarm(lab, root, args.set, swarm_nodes=args.nodes)
        swarm_id = next((s.split("=", 1)[1] for s in args.set if s.startswith("swarm.swarm_id=")), None)
        print(
            f"swarm started; watch it from this host with:\n  .venv/bin/swarm-node peers --initial-peers {bootstrap}"
            + (f" --swarm-id {swarm_id}" if swarm_id else "")
            + (
                f"\n{args.isolated} isolated node(s) train beside it (nodes "
                f"{args.nodes}-{args.nodes + args.isolated - 1}, no network)"
                if args.isolated
                else ""
            ),
            flush=True,
        )
        next_churn = args.churn_every or None
        restart_at: dict[int, float] = {}
        partition_end = None
        while not args.minutes or time.monotonic() - started < args.minutes * 60:
            now = time.monotonic() - started
            if next_churn is not None and now >= next_churn and args.nodes > 1:  # churn hits swarm nodes only
                victim = rng.randrange(1, args.nodes)
                if lab.alive(victim):
                    lab.kill(victim)
                    restart_at[victim] = now + args.churn_down
                    events.append({"t": round(now, 1), "event": "kill -9", "node": victim})
                    print(f"{now:6.0f}s: killed node {victim} (kill -9)", flush=True)
                next_churn += args.churn_every
            for victim, when in list(restart_at.items()):
                if now >= when:
                    lab.restart(victim)
                    del restart_at[victim]
                    events.append({"t": round(now, 1), "event": "restart", "node": victim})
                    print(f"{now:6.0f}s: restarted node {victim} (resumes its state)", flush=True)
            if (
                args.partition_at is not None
                and partition_end is None
                and now >= args.partition_at
                and not lab.loopback
            ):
                cut = set(range(args.nodes // 2, args.nodes))
                lab.partition(cut)
                partition_end = now + args.partition_for
                events.append({"t": round(now, 1), "event": "partition", "nodes": sorted(cut)})
                print(
                    f"{now:6.0f}s: partitioned nodes {sorted(cut)} from the others for {args.partition_for:.0f}s",
                    flush=True,
                )
            if partition_end is not None and lab.partitioned and now >= partition_end:
                lab.heal()
                events.append({"t": round(now, 1), "event": "heal"})
                print(f"{now:6.0f}s: healed the partition", flush=True)
            for index in range(args.nodes + args.isolated):
                if index not in restart_at and not lab.alive(index):
                    print(
                        f"{now:6.0f}s: node {index} exited on its own ({lab.processes[index].popen.returncode}); see "
                        f"{lab.processes[index].log}",
                        flush=True,
                    )
                    restart_at[index] = float("inf")  # reported once, not restarted
            time.sleep(1.0)
    except KeyboardInterrupt:
        print("stopping the lab", flush=True)
    finally:
        lab.down()
    nodes = {
        index: {
            **node_summary(root / f"n{index}"),
            "restarts": lab.processes[index].restarts if index in lab.processes else 0,
            "link": lab.links.get(index, Link()).describe(),
            "isolated": index >= args.nodes,
        }
        for index in range(args.nodes + args.isolated)
    }
    for index, summary in nodes.items():
        print(f"node {index}: {summary}")

    def mean_rate(isolated: bool) -> float | None:
        rates = [
            n["rounds_per_min"] for n in nodes.values() if n["isolated"] == isolated and n["rounds_per_min"] is not None
        ]
        return sum(rates) / len(rates) if rates else None

    def mean_phases(isolated: bool) -> dict[str, float] | None:
        # the nodes mean_rate counts: one slow first round (held-out evaluation included) must not stand for a node's
        # steady rounds
        phases = [
            n["seconds_by_phase"]
            for n in nodes.values()
            if n["isolated"] == isolated and n["seconds_by_phase"] and n["rounds_per_min"] is not None
        ]
        return {k: sum(p[k] for p in phases) / len(phases) for k in phases[0]} if phases else None

    swarm_rate, isolated_rate = mean_rate(False), mean_rate(True)
    swarm_phases, isolated_phases = mean_phases(False), mean_phases(True)
    if swarm_rate and isolated_rate:
        print(
            f"rounds per minute: swarm nodes {swarm_rate:.1f}, isolated nodes {isolated_rate:.1f} (swarm/isolated "
            f"{swarm_rate / isolated_rate:.3f})"
        )
    for label, phases in (("swarm", swarm_phases), ("isolated", isolated_phases)):
        if phases:
            print(
                f"seconds per round, {label} nodes: "
                + ", ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in phases.items())
            )
    print(
        json.dumps(
            {
                "benchmark": "lab",
                "lab": not lab.loopback,
                "nodes": args.nodes,
                "isolated_nodes": args.isolated,
                "mbit": args.mbit,
                "loss": args.loss,
                "rtt_ms": None,
                "rounds_per_min": {"swarm": swarm_rate, "isolated": isolated_rate},
                "seconds_by_phase": {"swarm": swarm_phases, "isolated": isolated_phases},
                "swarm_vs_isolated_throughput": swarm_rate / isolated_rate if swarm_rate and isolated_rate else None,
                "minutes": round((time.monotonic() - started) / 60, 2),
                "events": events,
                "per_node": nodes,
                "state_root": str(root),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
