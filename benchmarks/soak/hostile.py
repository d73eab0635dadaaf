"""The soak's hostile peer: a bare hivemind DHT node that joins the swarm and, for --seconds, stores malformed and
oversized values where honest nodes read rollouts and heartbeats (forged signatures, values cut short, another
swarm's records, not msgpack at all, 1.5 MB blobs, a valid record of a task outside the mix). What each honest node
refused is in its swarm.json; this process writes what it tried to --out when it ends.

    python -m benchmarks.soak.hostile --initial-peers MADDR --swarm-id soak --host IP --seconds 60 --out FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from protocol import NodeIdentity, RolloutBatch, RolloutCompletion, RolloutQuestion, TaskSpec, encode_message
from protocol.shards import HEARTBEAT_SHARDS, peers_key, rollout_key

OVERSIZED = 1_500_000


def junk_values(swarm_id: str, identities: list[NodeIdentity]) -> list[tuple[str, NodeIdentity, bytes]]:
    """(kind, owner, value): each a value a validator must refuse, or a reader must, with its reason."""
    forger, cutter, foreigner, blob, other = identities
    batch = RolloutBatch(
        round=1,
        policy_version=1,
        model_fingerprint="hostile",
        questions=[
            RolloutQuestion(
                spec=TaskSpec("chain_sum", {}, seed=1, index=1),  # outside any shipped mix
                completions=[RolloutCompletion(text="7", token_ids=[1], logprobs=None, finish_reason="length")],
                claimed_rewards=[1.0],
            )
        ],
    )

    def signed(identity: NodeIdentity, swarm: str = swarm_id) -> bytes:
        return encode_message(batch, identity=identity, swarm_id=swarm, seq=int(time.time()), timestamp=time.time())

    forged = bytearray(signed(forger))
    forged[-1] ^= 0xFF
    return [
        ("forged_signature", forger, bytes(forged)),
        ("cut_short", cutter, signed(cutter)[:-25]),
        ("another_swarm", foreigner, signed(foreigner, "another-swarm")),
        ("not_msgpack", blob, b"\xc1\xff not a record"),
        ("oversized", blob, b"\x92\xc6" + OVERSIZED.to_bytes(4, "big") + bytes(OVERSIZED)),
        ("task_outside_the_mix", other, signed(other)),
    ]


async def attack(args) -> dict:
    from hivemind.dht.node import DHTNode
    from hivemind.utils import get_dht_time

    from node.transport.joining import key_prefix

    node = await DHTNode.create(initial_peers=args.initial_peers, host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    args.out.with_suffix(".started").touch()  # joined: the attack begins now
    prefix = key_prefix(args.swarm_id)
    identities = [NodeIdentity.generate() for _ in range(5)]
    tried: dict[str, int] = {}
    stored: dict[str, int] = {}
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            window = int(time.time() // args.window_s)
            keys = [rollout_key(prefix, window, count, 0) for count in (1, 2, 4)]
            keys += [peers_key(prefix, shard) for shard in range(HEARTBEAT_SHARDS)]
            for kind, owner, value in junk_values(args.swarm_id, identities):
                for key in keys:
                    tried[kind] = tried.get(kind, 0) + 1
                    try:
                        ok = await asyncio.wait_for(
                            node.store(key, value, expiration_time=get_dht_time() + 60, subkey=owner.node_id), 10
                        )
                    except (asyncio.TimeoutError, OSError, ValueError):
                        ok = False
                    stored[kind] = stored.get(kind, 0) + bool(ok)
            await asyncio.sleep(1.0)
    finally:
        await node.shutdown()
    return {"tried": tried, "stored_by_some_peer": stored}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak.hostile", description=__doc__)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--swarm-id", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (the namespace's own)")
    parser.add_argument("--window-s", type=float, default=2.0, help="the swarm's swarm.window_s")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    summary = asyncio.run(attack(args))
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
