"""What a node behind NAT sends through its relay: two NAT'd nodes and their public bootstrap node, in the lab.

    sudo .venv/bin/python benchmarks/relay_traffic.py --minutes 4

Topology (benchmarks/lab/): node 0 is public, starts the swarm and is the others' only bootstrap
peer, hence their circuit relay; node 1 sits behind router 0 and node 2 behind router 1 (two
home routers: MASQUERADE out, only replies in). All three run `swarm-node join` on
configs/swarm.yaml (the default model) with NoLoCo averaging in pairs every `--every-steps`
updates, so each NAT'd node's round traffic is DHT records, gossip, and now and then a weight
exchange, with node 0 or with the other NAT'd node, which neither can dial.

Counted by iptables rules that only count (no target):
  - in node 0's namespace, bytes to and from each router's WAN address: everything the relay
    node carries for each NAT'd node (its own DHT and gossip traffic with it, and the relayed
    circuits between the two NAT'd nodes, which cross it twice: in from one router, out to the other);
  - in each NAT'd node's namespace, bytes to and from node 0 and to and from the other router's
    WAN address: a direct link between the two NATs (hole punching, DCUtR) shows up there only.
And from the nodes' own metrics: rounds, and each weight exchange's partner and payload bytes.
The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.lab import Lab, lab_unavailable, node_summary, start_swarm  # noqa: E402

NAT = {1: 0, 2: 1}  # node -> router


def count_rules(lab: Lab, index: int, peers: dict[str, str]) -> None:
    """Counting-only iptables rules in node `index`'s namespace, one per direction and peer address."""
    for ip in peers.values():
        for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
            subprocess.run(
                ["ip", "netns", "exec", lab.ns(index), "iptables", "-I", chain, "1", flag, ip],
                check=True,
                capture_output=True,
            )


def counted(lab: Lab, index: int, peers: dict[str, str]) -> dict[str, dict[str, int]]:
    """Bytes node `index` received from ("in") and sent to ("out") each named peer address since the rules were set."""
    by_ip: dict[tuple[str, str], int] = {}
    for chain in ("INPUT", "OUTPUT"):
        listing = subprocess.run(
            ["ip", "netns", "exec", lab.ns(index), "iptables", "-L", chain, "-v", "-x", "-n"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        for line in listing.splitlines()[2:]:
            fields = line.split()
            if len(fields) >= 8 and fields[0].isdigit():  # pkts bytes [target] prot opt in out source destination
                source, destination = fields[-2], fields[-1]
                ip = source if chain == "INPUT" else destination
                by_ip[(chain, ip)] = by_ip.get((chain, ip), 0) + int(fields[1])
    return {
        name: {"in": by_ip.get(("INPUT", ip), 0), "out": by_ip.get(("OUTPUT", ip), 0)} for name, ip in peers.items()
    }


def peer_id(state_dir: Path) -> str:
    return (state_dir / "addresses.txt").read_text().split()[0].rsplit("/p2p/", 1)[-1]


def exchanges(state_dir: Path, names: dict[str, str]) -> list[dict]:
    """This node's weight exchanges that averaged: partner (by node name) and payload bytes."""
    rows = (
        [json.loads(line) for line in (state_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
        if (state_dir / "metrics.jsonl").exists()
        else []
    )
    found = []
    for row in rows:
        step = row.get("outer_step")
        if isinstance(step, dict) and step.get("outcome") == "averaged":
            for partner in step.get("partners", []):
                found.append(
                    {
                        "round": row.get("round"),
                        "partner": names.get(partner, partner),
                        "bytes_sent": step.get("bytes_sent", 0),
                        "bytes_received": step.get("bytes_received", 0),
                    }
                )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--minutes", type=float, default=4.0, help="how long the three nodes train once all have joined"
    )
    parser.add_argument(
        "--every-steps", type=int, default=4, help="NoLoCo's H: a weight exchange every this many updates"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides for every node"
    )
    parser.add_argument("--state-root", type=Path, default=None)
    args = parser.parse_args()
    why = lab_unavailable()
    if why:
        print(f"relay_traffic: {why}")
        return 1
    root = args.state_root or Path(tempfile.mkdtemp(prefix="relay-traffic-"))
    # timeout_s <= averaging.window_s (30): longer exchanges phase-lock pairs a window apart (tests/test_nat.py)
    sets = [
        "swarm.swarm_id=relay-traffic",
        "torch_threads=1",
        "eval_every=0",
        "averaging.method=noloco",
        f"averaging.every_steps={args.every_steps}",
        "averaging.timeout_s=30",
        *args.set,
    ]
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with Lab(3, host_link=False, nat=NAT) as lab:
        wan = {f"router{r}": lab.wan_ip(r) for r in sorted(set(NAT.values()))}
        count_rules(lab, 0, wan)
        for index, router in NAT.items():
            other = next(r for i, r in NAT.items() if i != index)
            count_rules(lab, index, {"node0": lab.ip(0), "other_nat": lab.wan_ip(other)})
        start_swarm(lab, root, sets)
        deadline = time.monotonic() + 1800
        # all three train: the clock starts
        while not all((root / f"n{i}" / "metrics.jsonl").exists() for i in range(3)):
            if time.monotonic() > deadline or not all(lab.alive(i) for i in range(3)):
                raise RuntimeError(f"a node did not start training; see {root}")
            time.sleep(2)
        rounds_before = {i: node_summary(root / f"n{i}")["rounds"] for i in range(3)}
        at_relay_before = counted(lab, 0, wan)
        at_nat_before = {
            i: counted(lab, i, {"node0": lab.ip(0), "other_nat": lab.wan_ip(next(r for j, r in NAT.items() if j != i))})
            for i in NAT
        }
        started = time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            if not all(lab.alive(i) for i in range(3)):
                raise RuntimeError(f"a node exited; see {root}")
            time.sleep(2)
        at_relay = counted(lab, 0, wan)
        at_nat = {
            i: counted(lab, i, {"node0": lab.ip(0), "other_nat": lab.wan_ip(next(r for j, r in NAT.items() if j != i))})
            for i in NAT
        }
        rounds = {i: node_summary(root / f"n{i}")["rounds"] - rounds_before[i] for i in range(3)}
        relayed_addresses = {
            i: [a for a in (root / f"n{i}" / "addresses.txt").read_text().split() if "/p2p-circuit/" in a] for i in NAT
        }
    names = {peer_id(root / f"n{i}"): f"node{i}" for i in range(3)}
    nodes = {}
    for index, router in NAT.items():
        relay_side = {k: at_relay[f"router{router}"][k] - at_relay_before[f"router{router}"][k] for k in ("in", "out")}
        own_side = {
            peer: {k: at_nat[index][peer][k] - at_nat_before[index][peer][k] for k in ("in", "out")}
            for peer in ("node0", "other_nat")
        }
        swaps = exchanges(root / f"n{index}", names)
        with_nat = [s for s in swaps if s["partner"] == f"node{next(i for i in NAT if i != index)}"]
        nodes[f"node{index}"] = {
            "rounds": rounds[index],
            "relayed_addresses": relayed_addresses[index],
            "bytes_at_relay_node": relay_side,
            "bytes_at_relay_node_per_round": round(sum(relay_side.values()) / max(1, rounds[index])),
            "bytes_direct_to_other_nat": own_side["other_nat"],
            "bytes_with_node0": own_side["node0"],
            "exchanges_total": len(swaps),
            "exchanges_with_other_nat": len(with_nat),
            "exchange_payload_bytes_with_other_nat": sum(s["bytes_sent"] + s["bytes_received"] for s in with_nat),
        }
        # With no direct byte between the NATs, every exchange with the other NAT'd node crossed the relay: its payload
        # is the relayed traffic (the rest at the relay node is this node's own DHT, gossip and exchanges with node 0).
        relayed = (
            nodes[f"node{index}"]["exchange_payload_bytes_with_other_nat"]
            if not sum(own_side["other_nat"].values())
            else 0
        )
        nodes[f"node{index}"]["relayed_payload_bytes_per_round"] = round(relayed / max(1, rounds[index]))
    hole_punched = any(sum(n["bytes_direct_to_other_nat"].values()) > 0 for n in nodes.values())
    for name, figures in nodes.items():
        print(
            f"{name} (behind NAT): {figures['rounds']} rounds in {args.minutes:g} min; at the relay node: "
            f"{figures['bytes_at_relay_node']['in']:,} B in, {figures['bytes_at_relay_node']['out']:,} B out "
            f"({figures['bytes_at_relay_node_per_round']:,} B per round); direct to the other NAT: "
            f"{sum(figures['bytes_direct_to_other_nat'].values()):,} B; "
            f"weight exchanges {figures['exchanges_total']} ({figures['exchanges_with_other_nat']} with the other "
            "NAT'd node, "
            f"{figures['exchange_payload_bytes_with_other_nat']:,} B payload; relayed "
            f"{figures['relayed_payload_bytes_per_round']:,} B per round)"
        )
    print(
        "hole punching between the two NATs: "
        f"{'yes (direct bytes counted)' if hole_punched else 'no (no byte passed directly)'}"
    )
    print(
        json.dumps(
            {
                "benchmark": "relay_traffic",
                "minutes": args.minutes,
                "every_steps": args.every_steps,
                "sets": sets,
                "node0_rounds": rounds[0],
                "hole_punched": hole_punched,
                "nat_nodes": nodes,
                "state_root": str(root),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
