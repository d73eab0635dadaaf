"""Time of one weight sync: NoLoCo pairs vs a DiLoCo all-reduce, for growing swarms.

N real peers on 127.0.0.1 (each its own p2pd and DHT node, all in this process) hold
random weights of the default model's size (--floats) and run --rounds sync rounds with
the node's own exchange (node/averaging/pairing.py): pairs (group of 2, a random partner
every round) or all live peers (full mesh). Reported per N: median seconds per sync
(rendezvous included; over peers and rounds) and bytes sent per peer per sync.
Ends with one JSON line.

    .venv/bin/python benchmarks/averaging_sync.py --sizes 2 4 8 --rounds 5
    sudo .venv/bin/python benchmarks/averaging_sync.py --lab --mbit 20 --sizes 2 4 8 16 --rounds 3

--lab runs one process per peer, each in its own network namespace of benchmarks/lab/ with
its link shaped to --mbit both ways (and --loss), and adds hivemind's DecentralizedAverager
(butterfly all-reduce, the engine's reference) on the same tensors and links. Rounds start
together (the parent releases each round once every peer finished the previous one); a
peer's sync time is from its call to its result, rendezvous or matchmaking included (hivemind
starts its all-reduce as soon as the group is full, at the latest --matchmaking-s after the
call). Bytes per peer are what its eth0 sent during the round (from
/proc/net/dev in its namespace: protocol, DHT and retries included). Delay is not emulated
(no netem in this kernel): the links have a veth's RTT. hivemind's peers are first connected
to every other peer (--no-hivemind-preconnect leaves that out): its averager calls peers by
peer id alone, which the daemon cannot route to a peer it is not connected to, and every
round at N > 2 then fails with "routing: not found". Ours dials the addresses peers announce.
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

from node.transport import hivemind_p2p  # noqa: E402 - hivemind's private calls, and its protobuf kept isolated

import torch  # noqa: E402
from hivemind.dht.node import DHTNode  # noqa: E402

from benchmarks.lab import WORKER_WAIT_S as WAIT_S, eth0_tx_bytes, wait_file, write_atomic  # noqa: E402
from node.averaging.pairing import PairAverager  # noqa: E402
from node.files import append_json_line  # noqa: E402
from node.transport.records import RecordWriter  # noqa: E402
from protocol import NodeIdentity  # noqa: E402


async def sync_rounds(
    size: int, group_size: int | None, floats: int, rounds: int, mode: str
) -> tuple[list[float], list[int], int]:
    nodes, averagers = [], []
    try:
        for i in range(size):
            peers = [str(a) for a in await nodes[0].get_visible_maddrs()] if nodes else None
            nodes.append(await DHTNode.create(initial_peers=peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
            averager = PairAverager(
                nodes[-1],
                "bench/avg",
                group_size=group_size,
                mode=mode,
                max_relative_distance=10.0,
                writer=RecordWriter(NodeIdentity.generate(), "bench"),
            )
            await averager.start()
            averagers.append(averager)
        torch.manual_seed(0)
        weights = [{"w": torch.randn(floats)} for _ in averagers]
        seconds, sent, complete = [], [], 0
        for round_id in range(rounds):
            results = await asyncio.gather(
                *(a.average(w, round_id=round_id, timeout=60) for a, w in zip(averagers, weights))
            )
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


# one peer per process, in the lab -------------------------------------------------------------


# Written once every worker has ended its last round: a worker stays in the swarm until then. Two that left as soon
# as they had averaged took their daemons and DHT nodes with them; a slower peer that still saw one of them "free"
# dialed a closed port, and neither slower peer found the other before the round ended (6/8 in a CI run). Peers
# leaving mid-round is not what this benchmark measures.
FINISHED = "finished"


def sleep_until(wall_time: float) -> None:
    time.sleep(max(0.0, wall_time - time.time()))


async def worker_ours(args, scratch: Path, tensor) -> None:
    peers = json.loads(wait_file(scratch / "addrs-0.json")) if args.index else None
    node = await DHTNode.create(initial_peers=peers, host_maddrs=[f"/ip4/{args.ip}/tcp/0"])
    averager = PairAverager(
        node,
        "bench/avg",
        group_size=2 if args.method == "noloco" else None,
        mode=args.mode,
        max_relative_distance=10.0,
        settle_s=args.settle_s,
        writer=RecordWriter(NodeIdentity.generate(), "bench"),
    )
    await averager.start()
    try:
        if args.index == 0:
            write_atomic(scratch / "addrs-0.json", json.dumps([str(a) for a in await node.get_visible_maddrs()]))
        write_atomic(scratch / f"ready-{args.index}", "")
        for round_id in range(args.rounds):
            start = float(await asyncio.to_thread(wait_file, scratch / f"go-{round_id}"))
            await asyncio.sleep(max(0.0, start - time.time()))
            sent_before = eth0_tx_bytes()
            result = await averager.average({"w": tensor}, round_id=round_id, timeout=WAIT_S / 4)
            row = {
                "round": round_id,
                "seconds": result.seconds if result else None,
                "group": result.group_size if result else 1,
                "wire_bytes": eth0_tx_bytes() - sent_before,
                "payload_bytes": result.bytes_sent if result else None,
                "failures_so_far": dict(averager.failures),
            }
            append_json_line(scratch / f"result-{args.index}.jsonl", row)
            write_atomic(scratch / f"done-{round_id}-{args.index}", "")
        await asyncio.to_thread(wait_file, scratch / FINISHED)
    finally:
        await averager.stop()
        await node.shutdown()


async def connect_to_every_peer(dht, scratch: Path, size: int, index: int) -> None:
    """Connect this peer's daemon to every other one (their addrs-<j>.json). hivemind's averager calls
    peers by peer id alone, which p2pd cannot route to a peer it is not connected to (the bug our own
    exchange had before its announcements carried addresses): without this, every N > 2 round in
    the lab fails with "routing: not found"."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    p2p = await dht.replicate_p2p()
    for other in range(size):
        if other != index:
            maddrs = [
                Multiaddr(a) for a in json.loads(await asyncio.to_thread(wait_file, scratch / f"addrs-{other}.json"))
            ]
            await hivemind_p2p.connect(p2p, PeerID.from_base58(maddrs[0]["p2p"]), maddrs)


def worker_hivemind(args, scratch: Path, tensor) -> None:
    from hivemind import DHT
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    # hivemind has no 4-bit codec: int4 and int8 both use its 8-bit uniform quantization
    compression = {"fp32": NoCompression(), "fp16": Float16Compression()}.get(args.mode, Uniform8BitQuantization())
    peers = json.loads(wait_file(scratch / "addrs-0.json")) if args.index else None
    dht = DHT(initial_peers=peers, host_maddrs=[f"/ip4/{args.ip}/tcp/0"], start=True)
    averager = DecentralizedAverager(
        [tensor],
        dht,
        start=True,
        prefix="benchavg",
        target_group_size=args.size,
        min_group_size=args.size,
        min_matchmaking_time=args.matchmaking_s,
        request_timeout=args.matchmaking_s / 2,
        compression=compression,
    )
    try:
        write_atomic(scratch / f"addrs-{args.index}.json", json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        if args.preconnect:
            asyncio.run(connect_to_every_peer(dht, scratch, args.size, args.index))
        write_atomic(scratch / f"ready-{args.index}", "")
        for round_id in range(args.rounds):
            start = float(wait_file(scratch / f"go-{round_id}"))
            sleep_until(start)
            sent_before = eth0_tx_bytes()
            scheduled = start + args.matchmaking_s
            try:
                group = averager.step(scheduled_time=scheduled, timeout=WAIT_S / 4, allow_retries=False)
            except (
                Exception
            ) as exc:  # hivemind raises when matchmaking finds no group: a failed round, not a dead worker
                print(f"round {round_id}: hivemind step failed: {exc!r}", flush=True)
                group = None
            finished = time.time()
            row = {
                "round": round_id,
                "seconds": finished - start if group else None,
                "group": len(group) if group else 1,
                "wire_bytes": eth0_tx_bytes() - sent_before,
                "payload_bytes": None,
            }
            append_json_line(scratch / f"result-{args.index}.jsonl", row)
            write_atomic(scratch / f"done-{round_id}-{args.index}", "")
        wait_file(scratch / FINISHED)
    finally:
        averager.shutdown()
        dht.shutdown()


def worker(args) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("node").setLevel(logging.INFO)  # the exchange's own account of failed calls, in the worker's log
    scratch = Path(args.scratch)
    torch.manual_seed(args.index)
    tensor = torch.randn(args.floats)
    torch.set_num_threads(1)
    if args.method == "hivemind":
        worker_hivemind(args, scratch, tensor)
    else:
        asyncio.run(worker_ours(args, scratch, tensor))


def lab_sizes(args) -> dict:
    from benchmarks.lab import Lab, Link, lab_unavailable, start_workers, wait_worker_file

    why = lab_unavailable()
    if why:
        raise SystemExit(f"--lab: {why}")
    results: dict = {"sync_s": {}, "wire_bytes_per_peer": {}, "payload_bytes_per_peer": {}, "complete": {}}
    for size in args.sizes:
        for method in args.methods:
            scratch = Path(tempfile.mkdtemp(prefix=f"avgsync-{method}-{size}-"))
            with Lab(size, host_link=False) as lab:
                for index in range(size):
                    lab.shape(index, Link(mbit=args.mbit, loss=args.loss))
                start_workers(
                    lab,
                    lambda index: [
                        sys.executable,
                        str(Path(__file__).resolve()),
                        "--worker",
                        "--method",
                        method,
                        "--index",
                        str(index),
                        "--size",
                        str(size),
                        "--ip",
                        lab.ip(index),
                        "--scratch",
                        str(scratch),
                        "--rounds",
                        str(args.rounds),
                        "--floats",
                        str(args.floats),
                        "--mode",
                        args.mode,
                        "--matchmaking-s",
                        str(args.matchmaking_s),
                        "--settle-s",
                        str(args.settle_s),
                        *(["--preconnect"] if args.hivemind_preconnect else []),
                    ],
                    scratch,
                )
                time.sleep(2.0)  # let the DHT settle: every peer has announced itself
                for round_id in range(args.rounds):
                    write_atomic(scratch / f"go-{round_id}", repr(time.time() + 1.0))
                    for index in range(size):
                        wait_worker_file(
                            lab,
                            index,
                            scratch / f"done-{round_id}-{index}",
                            f"finishing {method} round {round_id} (N={size})",
                        )
                write_atomic(scratch / FINISHED, "")
            rows = [
                json.loads(line)
                for index in range(size)
                for line in (scratch / f"result-{index}.jsonl").read_text().splitlines()
            ]
            done = [r for r in rows if r["seconds"] is not None]
            key = str(size)
            results["sync_s"].setdefault(method, {})[key] = (
                statistics.median(r["seconds"] for r in done) if done else None
            )
            results["wire_bytes_per_peer"].setdefault(method, {})[key] = (
                int(statistics.median(r["wire_bytes"] for r in done)) if done else None
            )
            payload = [r["payload_bytes"] for r in done if r["payload_bytes"] is not None]
            results["payload_bytes_per_peer"].setdefault(method, {})[key] = (
                int(statistics.median(payload)) if payload else None
            )
            results["complete"].setdefault(method, {})[key] = f"{len(done)}/{len(rows)}"
            sync = results["sync_s"][method][key]
            print(
                f"lab N={size} {method:9s} @ {args.mbit} Mbit: median sync {sync if sync is None else round(sync, 3)} "
                "s, wire bytes sent per peer "
                f"{results['wire_bytes_per_peer'][method][key]}, {len(done)}/{len(rows)} peer-rounds averaged (logs "
                f"{scratch})",
                flush=True,
            )
    return results


def main_lab(args) -> None:
    started = time.monotonic()
    results = lab_sizes(args)
    largest, smallest = str(max(args.sizes)), str(min(args.sizes))

    def ratio(method: str) -> float | None:
        times = results["sync_s"].get(method, {})
        return times[largest] / times[smallest] if times.get(largest) and times.get(smallest) else None

    for method in args.methods:
        print(
            f"{method}: sync time ratio N={largest} / N={smallest}: {ratio(method)}"
            + (" (target <= 1.2)" if method == "noloco" else "")
        )
    print(
        json.dumps(
            {
                "benchmark": "averaging_sync",
                "lab": True,
                "mbit": args.mbit,
                "rtt_ms": None,
                "loss": args.loss,
                "floats": args.floats,
                "mode": args.mode,
                "rounds": args.rounds,
                "noloco_sync_s": results["sync_s"].get("noloco"),
                "allreduce_sync_s": results["sync_s"].get("allreduce"),
                "hivemind_allreduce_sync_s": results["sync_s"].get("hivemind"),
                "wire_bytes_per_peer": results["wire_bytes_per_peer"],
                "payload_bytes_per_peer": results["payload_bytes_per_peer"],
                "complete": results["complete"],
                "noloco_time_ratio": ratio("noloco"),
                "allreduce_time_ratio": ratio("allreduce"),
                "hivemind_allreduce_time_ratio": ratio("hivemind"),
                "minutes": (time.monotonic() - started) / 60,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--floats", type=int, default=2_900_000, help="parameters averaged (default: the default model's size)"
    )
    parser.add_argument("--mode", default="fp16", choices=["fp32", "fp16", "int8", "int4"])
    parser.add_argument(
        "--lab", action="store_true", help="one process per peer, each in its own shaped network namespace (root)"
    )
    parser.add_argument("--mbit", type=float, default=100.0, help="--lab: link rate of every peer, each way")
    parser.add_argument(
        "--loss", type=float, default=0.0, help="--lab: packet loss probability of every peer, each way"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["noloco", "allreduce", "hivemind"],
        choices=["noloco", "allreduce", "hivemind"],
        help="--lab: what to time",
    )
    parser.add_argument(
        "--matchmaking-s",
        type=float,
        default=8.0,
        help="--lab: hivemind's matchmaking window before the scheduled all-reduce",
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=2.0,
        help="--lab: how long a NoLoCo peer that sees nobody left free waits before it gives up the round (the node's "
        "default: 2)",
    )
    parser.add_argument(
        "--no-hivemind-preconnect",
        dest="hivemind_preconnect",
        action="store_false",
        help="--lab: do not connect every hivemind peer to every other before the rounds (they then fail with "
        "'routing: not found' at N > 2)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--preconnect", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.lab:
        return main_lab(args)
    noloco, allreduce, bytes_noloco, bytes_allreduce = {}, {}, {}, {}
    started = time.monotonic()
    for size in args.sizes:
        for label, group_size, times, volume in (
            ("noloco", 2, noloco, bytes_noloco),
            ("allreduce", None, allreduce, bytes_allreduce),
        ):
            seconds, sent, complete = asyncio.run(sync_rounds(size, group_size, args.floats, args.rounds, args.mode))
            times[str(size)] = statistics.median(seconds) if seconds else None
            volume[str(size)] = int(statistics.median(sent)) if sent else None
            print(
                f"N={size} {label:9s}: median sync {times[str(size)]:.3f}s, bytes sent per peer {volume[str(size)]}, "
                f"{complete}/{size * args.rounds} peer-rounds averaged",
                flush=True,
            )
    largest, smallest = str(max(args.sizes)), str(min(args.sizes))
    ratio = noloco[largest] / noloco[smallest]
    print(
        f"NoLoCo time ratio N={largest} / N={smallest}: {ratio:.2f} (target <= 1.2); all-reduce: "
        f"{allreduce[largest] / allreduce[smallest]:.2f}"
    )
    print(
        json.dumps(
            {
                "benchmark": "averaging_sync",
                "floats": args.floats,
                "mode": args.mode,
                "rounds": args.rounds,
                "noloco_sync_s": noloco,
                "allreduce_sync_s": allreduce,
                "noloco_bytes_per_peer": bytes_noloco,
                "allreduce_bytes_per_peer": bytes_allreduce,
                "noloco_time_ratio": ratio,
                "allreduce_time_ratio": allreduce[largest] / allreduce[smallest],
                "minutes": (time.monotonic() - started) / 60,
            }
        )
    )


if __name__ == "__main__":
    main()
