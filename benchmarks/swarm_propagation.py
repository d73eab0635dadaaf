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

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402
from node.stats import SwarmStats  # noqa: E402
from node.transport.dht import DHTTransport, decode_verified, read_key, read_peer_stats  # noqa: E402
from protocol import MessageKind, NodeIdentity, PeerStats  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fake_heartbeat(identity: NodeIdentity):
    def build() -> PeerStats:
        return PeerStats(identity.node_id, "bench", "0.1.0", "1.0", "default", 1, 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0, 0.0, time.time(), [], [], 0, 0)

    return build


async def start_swarm(size: int, gossip: str, scratch: str) -> tuple[list[DHTTransport], list[float]]:
    transports, join_s = [], []
    for i in range(size):
        peers = [f"swarm.initial_peers={json.dumps(transports[0].addresses)}"] if transports else []
        config = load_config(REPO / "configs" / "swarm.yaml", ['swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]', f"swarm.gossip={gossip}", "swarm.swarm_id=bench", "swarm.heartbeat_interval_s=1", *peers])
        identity = NodeIdentity.generate()
        state = Path(scratch) / f"{gossip}-{size}-{i}"
        state.mkdir(parents=True)
        transport = DHTTransport(config, identity, SwarmStats(), state, "bench", heartbeat=fake_heartbeat(identity))
        started = time.monotonic()
        await transport.start()
        if transports:
            while not [p for p, _ in await read_peer_stats(transport.dht, config) if p.node_id != identity.node_id]:
                await asyncio.sleep(0.01)
            join_s.append(time.monotonic() - started)
        transports.append(transport)
    if gossip == "libp2p":
        for transport in transports:
            await transport._connect_gossip_peers()
        await asyncio.sleep(3.0)  # a few gossipsub heartbeats: the mesh forms
    return transports, join_s


async def wait_gossip(receiver: DHTTransport, publisher_id: str, seq: int) -> float:
    while True:
        for raw in receiver.gossip.drain(receiver.rollouts_topic):
            envelope = decode_verified(raw, None, receiver.config.swarm.swarm_id, MessageKind.ROLLOUT_BATCH, time.time())
            if envelope.sender_id == publisher_id and envelope.seq >= seq:
                return time.monotonic()
        await asyncio.sleep(0.001)


async def wait_dht(receiver: DHTTransport, publisher_id: str, seq: int, key: str) -> float:
    while True:
        for subkey, raw in await read_key(receiver.dht, key, 10.0):
            if subkey == publisher_id:
                envelope = decode_verified(raw, subkey, receiver.config.swarm.swarm_id, MessageKind.ROLLOUT_BATCH, time.time())
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
            key = f"{publisher.prefix}/rollouts/{window}"
            started = time.monotonic()
            first_new_seq = publisher._seq + 1  # seqs only grow: anything from here on is this trial's batch
            if gossip == "libp2p":
                waits = [asyncio.create_task(wait_gossip(r, publisher.identity.node_id, first_new_seq)) for r in receivers]
            await publisher.publish(trial, 0, groups)
            if gossip == "dht":
                waits = [asyncio.create_task(wait_dht(r, publisher.identity.node_id, first_new_seq, key)) for r in receivers]
            arrived = await asyncio.wait_for(asyncio.gather(*waits), 30)
            latencies_ms += [(t - started) * 1000 for t in arrived]
            sizes.append(publisher.stats.bytes_published - bytes_before)
            await asyncio.sleep(0.05)
    finally:
        for transport in transports:
            await transport.stop()
    return latencies_ms, join_s, int(statistics.median(sizes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    results: dict = {"propagation_ms": {}, "join_s": {}, "bytes_per_round": None}
    with tempfile.TemporaryDirectory() as scratch:
        node = Node(load_config(REPO / "configs" / "isolated.yaml", ["eval_every=0"], state_dir=f"{scratch}/model"))
        node.load()
        groups, _, _ = node._generate_and_score(node.tasks.batch(0, 8), 1)  # one real round of the default
        for gossip in ("libp2p", "dht"):
            for size in args.sizes:
                latencies, join_s, batch_bytes = asyncio.run(measure(size, gossip, args.trials, groups, scratch))
                label = "gossipsub" if gossip == "libp2p" else "dht_polling"
                results["propagation_ms"].setdefault(label, {})[str(size)] = {"median": statistics.median(latencies), "p90": percentile(latencies, 0.9)}
                results["join_s"].setdefault(label, {})[str(size)] = {"median": statistics.median(join_s), "max": max(join_s)}
                results["bytes_per_round"] = batch_bytes
                print(f"{label:12s} N={size}: publish->received median {statistics.median(latencies):.1f} ms, p90 {percentile(latencies, 0.9):.1f} ms; "
                      f"join median {statistics.median(join_s):.2f}s max {max(join_s):.2f}s; batch {batch_bytes} bytes", flush=True)
    print(f"bytes published per node per round (8 questions x 8 completions, signed envelope): {results['bytes_per_round']}")
    print(json.dumps({"benchmark": "swarm_propagation", "trials": args.trials, **results}))


if __name__ == "__main__":
    main()
