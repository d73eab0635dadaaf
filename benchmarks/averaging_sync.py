"""Time of one weight sync: NoLoCo pairs vs a DiLoCo all-reduce, for growing swarms.

N real peers on 127.0.0.1 (each its own p2pd and DHT node, all in this process) hold
random weights of the default model's size (--floats) and run --rounds sync rounds with
the node's own exchange (node/averaging/pairing.py): pairs (group of 2, a random partner
every round) or all live peers (full mesh). Reported per N: median seconds per sync
(rendezvous included; over peers and rounds) and bytes sent per peer per sync.
Ends with one JSON line.

    .venv/bin/python benchmarks/averaging_sync.py --sizes 2 4 8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

import torch  # noqa: E402
from hivemind.dht.node import DHTNode  # noqa: E402

from node.averaging.pairing import PairAverager  # noqa: E402
from node.transport.records import RecordWriter  # noqa: E402
from protocol import NodeIdentity  # noqa: E402


async def sync_rounds(size: int, group_size: int | None, floats: int, rounds: int, mode: str) -> tuple[list[float], list[int], int]:
    nodes, averagers = [], []
    try:
        for i in range(size):
            peers = [str(a) for a in await nodes[0].get_visible_maddrs()] if nodes else None
            nodes.append(await DHTNode.create(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            averager = PairAverager(nodes[-1], "bench/avg", group_size=group_size, mode=mode, max_relative_distance=10.0, writer=RecordWriter(NodeIdentity.generate(), "bench"))
            await averager.start()
            averagers.append(averager)
        torch.manual_seed(0)
        weights = [{"w": torch.randn(floats)} for _ in averagers]
        seconds, sent, complete = [], [], 0
        for round_id in range(rounds):
            results = await asyncio.gather(*(a.average(w, round_id=round_id, timeout=60) for a, w in zip(averagers, weights)))
            for result in results:
                if result is not None:
                    seconds.append(result.seconds)
                    sent.append(result.bytes_sent)
            complete += sum(r is not None for r in results)
        return seconds, sent, complete
    finally:
        for averager in averagers:
            await averager.stop()
        for node in nodes:
            await node.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--floats", type=int, default=2_900_000, help="parameters averaged (default: the default model's size)")
    parser.add_argument("--mode", default="fp16", choices=["fp32", "fp16", "int8", "int4"])
    args = parser.parse_args()
    noloco, allreduce, bytes_noloco, bytes_allreduce = {}, {}, {}, {}
    started = time.monotonic()
    for size in args.sizes:
        for label, group_size, times, volume in (("noloco", 2, noloco, bytes_noloco), ("allreduce", None, allreduce, bytes_allreduce)):
            seconds, sent, complete = asyncio.run(sync_rounds(size, group_size, args.floats, args.rounds, args.mode))
            times[str(size)] = statistics.median(seconds) if seconds else None
            volume[str(size)] = int(statistics.median(sent)) if sent else None
            print(f"N={size} {label:9s}: median sync {times[str(size)]:.3f}s, bytes sent per peer {volume[str(size)]}, {complete}/{size * args.rounds} peer-rounds averaged", flush=True)
    largest, smallest = str(max(args.sizes)), str(min(args.sizes))
    ratio = noloco[largest] / noloco[smallest]
    print(f"NoLoCo time ratio N={largest} / N={smallest}: {ratio:.2f} (target <= 1.2); all-reduce: {allreduce[largest] / allreduce[smallest]:.2f}")
    print(json.dumps({
        "benchmark": "averaging_sync", "floats": args.floats, "mode": args.mode, "rounds": args.rounds,
        "noloco_sync_s": noloco, "allreduce_sync_s": allreduce,
        "noloco_bytes_per_peer": bytes_noloco, "allreduce_bytes_per_peer": bytes_allreduce,
        "noloco_time_ratio": ratio, "allreduce_time_ratio": allreduce[largest] / allreduce[smallest],
        "minutes": (time.monotonic() - started) / 60,
    }))


if __name__ == "__main__":
    main()
