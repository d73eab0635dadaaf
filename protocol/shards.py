"""Where a node's records live in the DHT: sharded keys, so a node's reads do not grow with the swarm.

Every node must compute the same key for the same record, so the layout is protocol (minor 6).
`<prefix>` is `swarm-node/v<major>/<swarm id>`.

    <prefix>/peers/<h>                          heartbeats: h = shard_of(node id, HEARTBEAT_SHARDS)
    <prefix>/rollouts/<window>/s<count>/<i>     batches:    i = shard_of(node id, count)

Heartbeats use a fixed number of shards: listing the swarm (`swarm-node peers`) reads them all,
each key holding a 1/HEARTBEAT_SHARDS share (128 heartbeats of ~1 KB at 1,024 nodes, far below
p2pd's 4 MiB message), and a node's own heartbeat loop reads only as many as it needs to keep
about HEARTBEATS_READ_PER_BEAT of them in view (all of them while the swarm is that small).

Rollout batches use `count` shards per window, a power of two chosen from the swarm size the
writer estimates from heartbeats: one shard (today's single key) up to PEERS_PER_ROLLOUT_SHARD
nodes, so a small swarm and a late joiner still read every batch; beyond it, enough shards that
each holds about that many. A reader reads a bounded number of shards at its own `count`.
Two nodes may estimate the size differently near a power of two, so a writer stores its batch
at its own count and at the counts one level below and above (`rollout_write_levels`): readers
whose estimate is off by a factor of two still find it. Shards nest (i at count c is i mod c/2
at c/2), so the three copies land in related keys; each key still holds about
PEERS_PER_ROLLOUT_SHARD writers of each level.

A record stored under a shard its signer does not belong to is refused by the reader
(`Refusal.WRONG_SHARD`): one identity cannot fill other shards. Identities can be ground to one
shard, so a node's DHT storage holds at most 3 MiB per key (node/transport/records.py, a reply
must fit p2pd's 4 MiB message) and a reader decodes at most a budget of values per round
(node/transport/dht.py).
"""

from __future__ import annotations

import hashlib

HEARTBEAT_SHARDS = 8  # fixed: every node writes and lists the same keys, whatever its estimate of the swarm's size
HEARTBEATS_READ_PER_BEAT = 256  # a node's own heartbeat loop reads enough shards to see about this many peers
PEERS_PER_ROLLOUT_SHARD = 32  # writers per rollout shard the count aims at (about 230 KB of 7 KB batches per key)
MAX_ROLLOUT_SHARDS = 1024  # 32k nodes at PEERS_PER_ROLLOUT_SHARD; a larger estimate (a lie or a flood) is clipped here


def shard_of(node_id: str, count: int) -> int:
    """The shard a node id belongs to among `count` (a power of two): the first 8 bytes of its SHA-256, modulo count.

    Hashing spreads ids that are themselves hashes of keys evenly, and nests: shard_of(id, c) == shard_of(id, 2c) %
    c."""
    if count < 1:
        raise ValueError(f"shard count must be at least 1, got {count}")
    return int.from_bytes(hashlib.sha256(node_id.encode()).digest()[:8], "big") % count


def rollout_shard_count(swarm_size: int) -> int:
    """Shards per window for a swarm of about `swarm_size` nodes: the smallest power of two that keeps
    each shard near PEERS_PER_ROLLOUT_SHARD writers, 1 for a swarm of up to that many, at most MAX_ROLLOUT_SHARDS."""
    count = 1
    while count * PEERS_PER_ROLLOUT_SHARD < swarm_size and count < MAX_ROLLOUT_SHARDS:
        count *= 2
    return count


def rollout_write_levels(count: int) -> list[int]:
    """The shard counts a writer whose estimate gives `count` stores its batch under: its own, and one level below and
    above."""
    return sorted({max(1, count // 2), count, min(MAX_ROLLOUT_SHARDS, count * 2)})


def heartbeat_shards_to_read(swarm_size: int) -> int:
    """How many heartbeat shards a node reads per beat to keep about HEARTBEATS_READ_PER_BEAT peers in view (all of
    them in a small swarm)."""
    per_shard = max(1, swarm_size) / HEARTBEAT_SHARDS
    return max(1, min(HEARTBEAT_SHARDS, -(-HEARTBEATS_READ_PER_BEAT // max(1, int(per_shard)))))


def peers_key(prefix: str, shard: int) -> str:
    return f"{prefix}/peers/{shard}"


def rollout_key(prefix: str, window: int, count: int, shard: int) -> str:
    return f"{prefix}/rollouts/{window}/s{count}/{shard}"
