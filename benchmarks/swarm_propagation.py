"""Rollout propagation on loopback: gossipsub push vs DHT polling, join time, bytes per round.

For each swarm size N, N real transports (each with its own p2pd, DHT node and, for the
push channel, a libp2p gossipsub host; all in this process) join node 0. Then node 0
publishes --trials rollout batches of the default config's size (one real round of the
default model: 8 questions x 8 completions) and every other node waits for each one:
- gossipsub: the batch is pushed; receivers drain their topic every millisecond;
- DHT polling: receivers read the round's DHT record back to back (the best case; a node
  really polls once per round, so add half a round time to these figures).
Latency = publish call start -> the receiver holds the decoded, verified batch.
join_s = transport start (p2pd, DHT bootstrap, first heartbeat) -> first other peer seen.
Ends with one JSON line.

    .venv/bin/python benchmarks/swarm_propagation.py --sizes 4 8 --trials 20
    sudo .venv/bin/python benchmarks/swarm_propagation.py --lab --mbit 50 --sizes 4 8 16 --trials 20

--lab runs one node per process, each in its own network namespace of benchmarks/lab/ with
its link shaped to --mbit both ways (and --loss): no shared GIL, real addresses. Processes
share the machine's wall clock, so latency = the publisher's time.time() at the publish call
-> the receiver's time.time() when it holds the decoded, verified batch. A receiver that has
not got a trial's batch 30 s after its publish counts as not delivered (`delivered`).
wire_bytes_per_publish is what the publisher's eth0 sent from one publish to the next
(gossip fan-out, the DHT store, heartbeats). Delay is not emulated (no netem in this kernel):
the links have a veth's RTT, so these are figures for a rate-limited LAN, not for the
internet's tens of ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

from benchmarks.lab import eth0_tx_bytes, wait_file, write_atomic  # noqa: E402
from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402
from node.stats import SwarmStats  # noqa: E402
from node.transport.batches import decode_verified  # noqa: E402
from node.transport.dht import DHTTransport  # noqa: E402
from node.transport.peers import read_peer_stats  # noqa: E402
from node.transport.kv import read_key  # noqa: E402
from node.transport.session import join_swarm  # noqa: E402
from protocol.shards import rollout_key  # noqa: E402
from protocol import MessageKind, NodeIdentity, PeerStats  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fake_heartbeat(identity: NodeIdentity):
    def build() -> PeerStats:
        return PeerStats(
            identity.node_id,
            "bench",
            "0.1.0",
            "1.0",
            "default",
            1,
            0,
            0,
            0.0,
            0.0,
            0,
            0,
            0,
            0,
            0.0,
            0.0,
            time.time(),
            [],
            [],
            0,
            0,
        )

    return build


async def start_transport(config, identity: NodeIdentity, state: Path) -> DHTTransport:
    """A transport over its own swarm session, started; `leave` stops both."""
    transport = DHTTransport(
        await join_swarm(config, identity, state), SwarmStats(), "bench", heartbeat=fake_heartbeat(identity)
    )
    await transport.start()
    return transport


async def leave(transport: DHTTransport) -> None:
    await transport.stop()
    await transport.session.close()


async def start_swarm(size: int, gossip: str, scratch: str) -> tuple[list[DHTTransport], list[float]]:
    transports, join_s = [], []
    for i in range(size):
        peers = [f"swarm.initial_peers={json.dumps(transports[0].session.addresses)}"] if transports else []
        config = load_config(
            REPO / "configs" / "swarm.yaml",
            [
                'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
                f"swarm.gossip={gossip}",
                "swarm.swarm_id=bench",
                "swarm.heartbeat_interval_s=1",
                *peers,
            ],
        )
        identity = NodeIdentity.generate()
        state = Path(scratch) / f"{gossip}-{size}-{i}"
        state.mkdir(parents=True)
        started = time.monotonic()
        transport = await start_transport(config, identity, state)
        if transports:
            while not [
                p for p, _ in await read_peer_stats(transport.session.dht, config) if p.node_id != identity.node_id
            ]:
                await asyncio.sleep(0.01)
            join_s.append(time.monotonic() - started)
        transports.append(transport)
    if gossip == "libp2p":
        for transport in transports:
            await transport.connect_gossip_peers()
        await asyncio.sleep(3.0)  # a few gossipsub heartbeats: the mesh forms
    return transports, join_s


async def wait_gossip(receiver: DHTTransport, publisher_id: str, seq: int) -> float:
    while True:
        for raw in receiver.gossip.drain(receiver.rollouts_topic):
            envelope = decode_verified(
                raw, None, receiver.config.swarm.swarm_id, MessageKind.ROLLOUT_BATCH, time.time()
            )
            if envelope.sender_id == publisher_id and envelope.seq >= seq:
                return time.monotonic()
        await asyncio.sleep(0.001)


async def wait_dht(receiver: DHTTransport, publisher_id: str, seq: int, key: str) -> float:
    while True:
        for subkey, raw in await read_key(receiver.session.dht, key, 10.0):
            if subkey == publisher_id:
                envelope = decode_verified(
                    raw, subkey, receiver.config.swarm.swarm_id, MessageKind.ROLLOUT_BATCH, time.time()
                )
                if envelope.seq >= seq:
                    return time.monotonic()


async def measure(size: int, gossip: str, trials: int, groups, scratch: str) -> tuple[list[float], list[float], int]:
    transports, join_s = await start_swarm(size, gossip, scratch)
    publisher, receivers = transports[0], transports[1:]
    latencies_ms, sizes = [], []
    try:
        for trial in range(trials):
            bytes_before = publisher.stats.bytes_published
            window = int(time.time() // publisher.config.swarm.window_s)
            key = rollout_key(publisher.prefix, window, 1, 0)  # a small swarm's one shard
            started = time.monotonic()
            first_new_seq = publisher.writer._seq + 1  # seqs only grow: anything from here on is this trial's batch
            if gossip == "libp2p":
                waits = [
                    asyncio.create_task(wait_gossip(r, publisher.identity.node_id, first_new_seq)) for r in receivers
                ]
            await publisher.publish(trial, 0, groups)
            if gossip == "dht":
                waits = [
                    asyncio.create_task(wait_dht(r, publisher.identity.node_id, first_new_seq, key)) for r in receivers
                ]
            arrived = await asyncio.wait_for(asyncio.gather(*waits), 30)
            latencies_ms += [(t - started) * 1000 for t in arrived]
            sizes.append(publisher.stats.bytes_published - bytes_before)
            await asyncio.sleep(0.05)
    finally:
        for transport in transports:
            await leave(transport)
    return latencies_ms, join_s, int(statistics.median(sizes))


# one node per process, in the lab --------------------------------------------------------------

DELIVERY_TIMEOUT_S = 30.0


def lab_config(ip: str, gossip: str, initial_peers: list[str]):
    return load_config(
        REPO / "configs" / "swarm.yaml",
        [
            f'swarm.host_maddrs=["/ip4/{ip}/tcp/0"]',
            f"swarm.gossip={gossip}",
            "swarm.swarm_id=bench",
            "swarm.heartbeat_interval_s=1",
            f"swarm.initial_peers={json.dumps(initial_peers)}",
        ],
    )


async def lab_worker(args) -> None:
    scratch = Path(args.scratch)
    peers = json.loads(await asyncio.to_thread(wait_file, scratch / "addrs-0.json")) if args.index else []
    config = lab_config(args.ip, args.gossip, peers)
    identity = NodeIdentity.generate()
    state = scratch / f"state-{args.index}"
    state.mkdir()
    started = time.monotonic()
    transport = await start_transport(config, identity, state)
    try:
        join_s = None
        if args.index == 0:
            write_atomic(scratch / "publisher", identity.node_id)
            write_atomic(scratch / "addrs-0.json", json.dumps(transport.session.addresses))
        else:
            while not [
                p for p, _ in await read_peer_stats(transport.session.dht, config) if p.node_id != identity.node_id
            ]:
                await asyncio.sleep(0.01)
            join_s = time.monotonic() - started
        write_atomic(scratch / f"ready-{args.index}", json.dumps({"join_s": join_s}))
        await asyncio.to_thread(wait_file, scratch / "all-ready")
        if args.gossip == "libp2p":
            await transport.connect_gossip_peers()  # every peer has announced itself by now
            await asyncio.sleep(3.0)  # a few gossipsub heartbeats: the mesh forms
        write_atomic(scratch / f"meshed-{args.index}", "")
        if args.index == 0:
            await lab_publish(transport, scratch, args.trials)
        else:
            await lab_receive(transport, scratch, wait_file(scratch / "publisher"), args.gossip)
    finally:
        await leave(transport)


async def lab_publish(transport: DHTTransport, scratch: Path, trials: int) -> None:
    groups = pickle.loads((scratch / "groups.pkl").read_bytes())
    for trial in range(trials):
        await asyncio.to_thread(wait_file, scratch / f"go-{trial}")
        # seqs only grow: anything from here on is this trial's batch
        first_new_seq = transport.session.writer.last_seq + 1
        bytes_before, wire_before = transport.stats.bytes_published, eth0_tx_bytes()
        started = time.time()
        await transport.publish(trial, 0, groups)
        write_atomic(
            scratch / f"published-{trial}",
            json.dumps(
                {
                    "start": started,
                    "seq": first_new_seq,
                    "wire_before": wire_before,
                    "batch_bytes": transport.stats.bytes_published - bytes_before,
                }
            ),
        )
    await asyncio.to_thread(wait_file, scratch / "stop")
    write_atomic(scratch / "published-end", json.dumps({"wire_before": eth0_tx_bytes()}))


async def lab_receive(transport: DHTTransport, scratch: Path, publisher_id: str, gossip: str) -> None:
    seen: set[int] = set()
    window_s = transport.config.swarm.window_s
    with open(scratch / f"arrivals-{transport.identity.node_id}.jsonl", "a") as out:

        def record(raw: bytes, subkey: str | None) -> None:
            envelope = decode_verified(
                raw, subkey, transport.config.swarm.swarm_id, MessageKind.ROLLOUT_BATCH, time.time()
            )
            if envelope.sender_id == publisher_id and envelope.seq not in seen:
                seen.add(envelope.seq)
                out.write(json.dumps({"seq": envelope.seq, "t": time.time()}) + "\n")
                out.flush()

        while not (scratch / "stop").exists():
            if gossip == "libp2p":
                for raw in transport.gossip.drain(transport.rollouts_topic):
                    record(raw, None)
                await asyncio.sleep(0.001)
            else:  # back-to-back reads of this window's and the last window's record
                window = int(time.time() // window_s)
                for key in (
                    rollout_key(transport.prefix, window - 1, 1, 0),
                    rollout_key(transport.prefix, window, 1, 0),
                ):
                    for subkey, raw in await read_key(transport.session.dht, key, 10.0):
                        if subkey == publisher_id:
                            record(raw, subkey)


def lab_measure(size: int, gossip: str, args, groups_path: Path) -> dict:
    from benchmarks.lab import Lab, Link, start_workers, wait_worker_file

    scratch = Path(tempfile.mkdtemp(prefix=f"propagation-{gossip}-{size}-"))
    (scratch / "groups.pkl").write_bytes(groups_path.read_bytes())
    latencies_ms, wire_bytes, batch_bytes, delivered = [], [], [], 0
    with Lab(size, host_link=False) as lab:
        for index in range(size):
            lab.shape(index, Link(mbit=args.mbit, loss=args.loss))
        start_workers(
            lab,
            lambda index: [
                sys.executable,
                str(Path(__file__).resolve()),
                "--worker",
                "--index",
                str(index),
                "--ip",
                lab.ip(index),
                "--gossip",
                gossip,
                "--scratch",
                str(scratch),
                "--trials",
                str(args.trials),
            ],
            scratch,
        )
        join_s = [json.loads((scratch / f"ready-{index}").read_text())["join_s"] for index in range(1, size)]
        write_atomic(scratch / "all-ready", "")
        for index in range(size):
            wait_worker_file(lab, index, scratch / f"meshed-{index}", "connecting to the gossip mesh")
        published = []
        for trial in range(args.trials):
            write_atomic(scratch / f"go-{trial}", "")
            published.append(
                json.loads(wait_worker_file(lab, 0, scratch / f"published-{trial}", f"publishing trial {trial}"))
            )
            seq, deadline = published[-1]["seq"], time.monotonic() + DELIVERY_TIMEOUT_S
            while time.monotonic() < deadline:  # every receiver holds this trial's batch, or the deadline passed
                if (
                    sum(
                        1
                        for path in scratch.glob("arrivals-*.jsonl")
                        if any(row["seq"] >= seq for row in read_rows(path))
                    )
                    >= size - 1
                ):
                    break
                time.sleep(0.02)
            time.sleep(0.05)
        write_atomic(scratch / "stop", "")
        end = json.loads(wait_worker_file(lab, 0, scratch / "published-end", "stopping"))
        for index in range(size):
            with contextlib.suppress(subprocess.TimeoutExpired):
                lab.processes[index].popen.wait(timeout=60)
    arrivals = [read_rows(path) for path in scratch.glob("arrivals-*.jsonl")]
    for trial, pub in enumerate(published):
        next_seq = published[trial + 1]["seq"] if trial + 1 < len(published) else float("inf")
        for rows in arrivals:
            got = [row["t"] for row in rows if pub["seq"] <= row["seq"] < next_seq]
            if got and got[0] - pub["start"] <= DELIVERY_TIMEOUT_S:
                latencies_ms.append((got[0] - pub["start"]) * 1000)
                delivered += 1
        wire_bytes.append(
            (published[trial + 1] if trial + 1 < len(published) else end)["wire_before"] - pub["wire_before"]
        )
        batch_bytes.append(pub["batch_bytes"])
    return {
        "latencies_ms": latencies_ms,
        "join_s": join_s,
        "delivered": f"{delivered}/{len(published) * (size - 1)}",
        "wire_bytes_per_publish": int(statistics.median(wire_bytes)),
        "batch_bytes": int(statistics.median(batch_bytes)),
        "logs": str(scratch),
    }


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def main_lab(args, groups) -> None:
    from benchmarks.lab import lab_unavailable

    why = lab_unavailable()
    if why:
        raise SystemExit(f"--lab: {why}")
    started = time.monotonic()
    results: dict = {
        "propagation_ms": {},
        "join_s": {},
        "delivered": {},
        "wire_bytes_per_publish": {},
        "bytes_per_round": None,
    }
    with tempfile.TemporaryDirectory() as scratch:
        groups_path = Path(scratch) / "groups.pkl"
        groups_path.write_bytes(pickle.dumps(groups))
        for gossip in ("libp2p", "dht"):
            for size in args.sizes:
                run = lab_measure(size, gossip, args, groups_path)
                label = "gossipsub" if gossip == "libp2p" else "dht_polling"
                latencies = run["latencies_ms"]
                results["propagation_ms"].setdefault(label, {})[str(size)] = (
                    {"median": statistics.median(latencies), "p90": percentile(latencies, 0.9)} if latencies else None
                )
                results["join_s"].setdefault(label, {})[str(size)] = {
                    "median": statistics.median(run["join_s"]),
                    "max": max(run["join_s"]),
                }
                results["delivered"].setdefault(label, {})[str(size)] = run["delivered"]
                results["wire_bytes_per_publish"].setdefault(label, {})[str(size)] = run["wire_bytes_per_publish"]
                results["bytes_per_round"] = run["batch_bytes"]
                median = (
                    f"{statistics.median(latencies):.1f} ms, p90 {percentile(latencies, 0.9):.1f} ms"
                    if latencies
                    else "nothing delivered"
                )
                print(
                    f"lab {label:12s} N={size} @ {args.mbit} Mbit: publish->received median {median}; delivered "
                    f"{run['delivered']}; "
                    f"join median {statistics.median(run['join_s']):.2f}s max {max(run['join_s']):.2f}s; publisher's "
                    f"eth0 sent {run['wire_bytes_per_publish']} bytes per publish "
                    f"(logs {run['logs']})",
                    flush=True,
                )
    print(
        json.dumps(
            {
                "benchmark": "swarm_propagation",
                "lab": True,
                "mbit": args.mbit,
                "rtt_ms": None,
                "loss": args.loss,
                "trials": args.trials,
                **results,
                "minutes": round((time.monotonic() - started) / 60, 2),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument(
        "--lab", action="store_true", help="one node per process, each in its own shaped network namespace (root)"
    )
    parser.add_argument("--mbit", type=float, default=50.0, help="--lab: link rate of every node, each way")
    parser.add_argument(
        "--loss", type=float, default=0.0, help="--lab: packet loss probability of every node, each way"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ip", help=argparse.SUPPRESS)
    parser.add_argument("--gossip", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return asyncio.run(lab_worker(args))

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    results: dict = {"propagation_ms": {}, "join_s": {}, "bytes_per_round": None}
    with tempfile.TemporaryDirectory() as scratch:
        node = Node(load_config(REPO / "configs" / "isolated.yaml", ["eval_every=0"], state_dir=f"{scratch}/model"))
        node.load()
        groups, _, _ = node.local.generate_and_score(node.tasks.batch(0, 8), seed=1)  # one real round of the default
        if args.lab:
            return main_lab(args, groups)
        for gossip in ("libp2p", "dht"):
            for size in args.sizes:
                latencies, join_s, batch_bytes = asyncio.run(measure(size, gossip, args.trials, groups, scratch))
                label = "gossipsub" if gossip == "libp2p" else "dht_polling"
                results["propagation_ms"].setdefault(label, {})[str(size)] = {
                    "median": statistics.median(latencies),
                    "p90": percentile(latencies, 0.9),
                }
                results["join_s"].setdefault(label, {})[str(size)] = {
                    "median": statistics.median(join_s),
                    "max": max(join_s),
                }
                results["bytes_per_round"] = batch_bytes
                print(
                    f"{label:12s} N={size}: publish->received median {statistics.median(latencies):.1f} ms, p90 "
                    f"{percentile(latencies, 0.9):.1f} ms; "
                    f"join median {statistics.median(join_s):.2f}s max {max(join_s):.2f}s; batch {batch_bytes} bytes",
                    flush=True,
                )
    print(
        "bytes published per node per round (8 questions x 8 completions, signed envelope): "
        f"{results['bytes_per_round']}"
    )
    print(json.dumps({"benchmark": "swarm_propagation", "trials": args.trials, **results}))


if __name__ == "__main__":
    main()
