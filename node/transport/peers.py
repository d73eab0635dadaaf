"""Listing the swarm's peers: their verified heartbeats (signed `PeerStats`) read from the DHT.

Heartbeats live under `<prefix>/peers/<h>`, one key per shard (protocol/shards.py); listing the whole swarm
(`swarm-node peers`, the dashboard) reads every shard, a node's own heartbeat loop (node/transport/dht.py) only as
many as it needs. A heartbeat counts as live for `swarm.heartbeat_ttl_s` after it was signed.
"""

from __future__ import annotations

import asyncio
import time

from node.config import NodeConfig
from node.stats import SwarmStats
from node.transport.joining import key_prefix
from node.transport.kv import MAX_VALUES_PER_KEY
from protocol import MessageKind, PeerStats, ProtocolRejection
from protocol.shards import HEARTBEAT_SHARDS, peers_key


async def read_peer_stats(
    dht,
    config: NodeConfig,
    stats: SwarmStats | None = None,
    shards: list[int] | None = None,
    limit: int | None = MAX_VALUES_PER_KEY,
) -> list[tuple[PeerStats, float]]:
    """Live peers' verified heartbeats with their signing time, from the given heartbeat shards (None: all of
    them, the whole swarm), at most `limit` per shard (None: all); refused ones are counted in `stats` when given."""
    from node.transport.records import read_records

    def refused(peer: str, rejection: ProtocolRejection) -> None:
        if stats is not None:
            stats.reject_heartbeat(peer, rejection)

    now = time.time()
    prefix = key_prefix(config.swarm.swarm_id)
    shards = list(range(HEARTBEAT_SHARDS)) if shards is None else shards
    reads = await asyncio.gather(
        *(
            read_records(
                dht,
                peers_key(prefix, shard),
                config.swarm.swarm_id,
                MessageKind.PEER_STATS,
                config.swarm.dht_timeout_s,
                limit,
                refused,
                once=stats.heartbeats_refused_once if stats is not None else None,
            )
            for shard in shards
        )
    )
    return [
        (e.message, e.timestamp)
        for envelopes in reads
        for e in envelopes
        if now - e.timestamp <= config.swarm.heartbeat_ttl_s
    ]
