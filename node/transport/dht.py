"""The rollout transport over the swarm's hivemind DHT: heartbeats and rollout gossip. (Joining the DHT is
node/transport/joining.py, listing peers node/transport/peers.py, keeping the process joined its session's
membership, node/transport/membership.py.)

Keys, all namespaced by protocol major version and swarm id, sharded (protocol/shards.py):
    swarm-node/v1/<swarm>/peers/<h>                         subkey = node id, value = signed PeerStats
    swarm-node/v1/<swarm>/rollouts/<window>/s<count>/<i>    subkey = node id, value = signed RolloutBatch
where <window> = floor(unix time / window_s). Each round a node publishes its batch under
the current window and reads the last `collect_windows` windows, so nodes of different
speeds overlap and a late joiner finds what was published in the recent past. What a node
reads does not grow with the swarm: `swarm.rollout_shards_read` shards per window, at the
shard count its estimate of the swarm's size gives (one shard, every batch, up to 32 nodes),
and at most `swarm.max_batches_read_per_round` values decoded per round, DHT and gossip
together, drawn at random from those it has not processed yet; the rest are counted as
left unread. Its heartbeat loop reads only as many heartbeat shards as it needs to keep a
few hundred peers in view; it estimates the swarm's size from them, and hands the DHT addresses
they carry to the session's membership (node/transport/membership.py), which keeps the node joined.
Every value is an envelope signed by its sender; a value whose signer is not the node id
it is stored under is refused, and so is anything that fails the protocol's checks: first
by the DHT's record validator (node/transport/records.py), so that no value can poison a
key's other subkeys or replace them, then by the reader. Records expire a fixed lifetime
per kind after they were signed (records.RECORD_TTL_S); readers judge freshness by the
signed timestamp (heartbeat_ttl_s, max_batch_age_s).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from typing import Callable

from node.aio import cancel_and_wait
from node.stats import SwarmStats
from node.rollouts.base import ExternalGroup, RolloutGroup
from node.transport.base import Transport
from node.transport.batches import BatchReceiver, sign_rollout_batch
from node.transport.kv import read_values
from node.transport.peers import read_peer_stats
from protocol import PeerStats, ProtocolRejection, Refusal
from protocol.shards import (
    HEARTBEAT_SHARDS,
    heartbeat_shards_to_read,
    peers_key,
    rollout_key,
    rollout_shard_count,
    rollout_write_levels,
    shard_of,
)

log = logging.getLogger(__name__)


def listen_ip(host_maddrs: list[str]) -> str:
    """The IP of the first /ip4/ listening address (where the gossip host listens too)."""
    for maddr in host_maddrs:
        parts = maddr.split("/")
        if len(parts) > 2 and parts[1] == "ip4":
            return parts[2]
    return "0.0.0.0"


def routable_gossip_addresses(gossip_addresses: list[str], dht_addresses: list[str]) -> list[str]:
    """The gossip host's addresses as peers on other machines can dial them.

    Listening on 0.0.0.0 (the default) makes the host report /ip4/0.0.0.0/..., which only
    works when both ends share a machine; a peer elsewhere must be given the IPs it reaches
    this node's DHT at (its announced or interface addresses, as p2pd reports them),
    routable ones first and loopback last."""
    ips = []
    for maddr in dht_addresses:
        parts = maddr.split("/")
        if (
            len(parts) > 2
            and parts[1] in ("ip4", "ip6")
            and parts[2] not in ("0.0.0.0", "::")
            and (parts[1], parts[2]) not in ips
        ):
            ips.append((parts[1], parts[2]))
    ips.sort(key=lambda ip: ip[1].startswith("127.") or ip[1] == "::1")  # stable: keeps p2pd's order otherwise
    routable = []
    for maddr in gossip_addresses:
        parts = maddr.split("/")
        if len(parts) > 4 and parts[2] in ("0.0.0.0", "::") and ips:
            rest = "/".join(parts[3:])
            routable += [f"/{family}/{ip}/{rest}" for family, ip in ips if family == parts[1]]
        else:
            routable.append(maddr)
    return list(dict.fromkeys(routable))


class DHTTransport(Transport):
    """Rollout gossip and heartbeats over a swarm session (node/transport/session.py) someone else opened and
    closes: this transport signs with the session's writer and reads through its DHT node, never its own. Keeping
    the node joined (rejoining after a partition, addresses, links) is the session's membership; this transport
    hands it the addresses in the heartbeats it reads."""

    def __init__(
        self,
        session,
        stats: SwarmStats,
        fingerprint: str,
        heartbeat: Callable[[], PeerStats],
        on_addresses: Callable[[list[str]], None] | None = None,
    ):
        self.session = session
        self.config = session.config
        self.identity = session.identity
        self.stats = stats
        self.fingerprint = fingerprint
        self.heartbeat = heartbeat
        # told the addresses peers dial us at, at start and whenever they change (the session's membership
        # refreshes them)
        self.on_addresses = on_addresses
        self.prefix = session.prefix
        self.gossip = None
        self.gossip_addresses: list[str] = []
        self.receiver = BatchReceiver(self.config.swarm, self.identity.node_id, fingerprint, stats)
        self._heartbeat_task: asyncio.Task | None = None
        self.swarm_size = 1  # live nodes, this one included, estimated from the heartbeat shards last read
        self._next_heartbeat_shard = 0  # the heartbeat loop reads shards in turn, from here

    # lifecycle -----------------------------------------------------------------------

    @property
    def rollouts_topic(self) -> str:
        return f"{self.prefix}/rollouts"

    async def start(self) -> None:
        if self.on_addresses:
            self.on_addresses(self.session.addresses)
            self.session.address_listeners.append(self.on_addresses)
        if self.config.swarm.gossip == "libp2p":
            await self._start_gossip()
        await self.publish_heartbeat()
        await self.connect_gossip_peers()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def _start_gossip(self) -> None:
        from node.transport.gossip_libp2p import LibP2PGossip

        # A round decodes at most max_batches_read_per_round values: buffering more between rounds only holds memory
        # (the oldest are dropped, and counted, past it).
        self.gossip = LibP2PGossip(
            listen_host=listen_ip(self.config.swarm.host_maddrs),
            listen_port=self.config.swarm.gossip_port,
            max_buffered=2 * self.config.swarm.max_batches_read_per_round,
        )
        listening = await self.gossip.start()
        # Behind NAT nobody can dial the gossip host: it dials out, and gossipsub uses those links both ways.
        self.gossip_addresses = (
            routable_gossip_addresses(listening, self.session.addresses)
            if self.session.reachability == "direct"
            else []
        )
        log.info("gossip listens at %s; advertised to peers as %s", listening, self.gossip_addresses)
        if any(a.split("/")[2:3] in (["0.0.0.0"], ["::"]) for a in self.gossip_addresses):
            log.warning(
                "gossip advertises a wildcard address (%s): peers on other machines cannot dial it; "
                "set swarm.announce_maddrs or listen on a routable IP",
                self.gossip_addresses,
            )
        await self.gossip.subscribe(self.rollouts_topic)

    async def connect_gossip_peers(self) -> None:
        """Read the next heartbeat shards (enough to keep a few hundred peers in view, all of them in a
        small swarm), estimate the swarm's size from them, dial the gossip addresses peers announce
        (new ones only), and hand the DHT addresses of those that can be dialed to the session's membership."""
        read = heartbeat_shards_to_read(self.swarm_size)
        shards = [(self._next_heartbeat_shard + k) % HEARTBEAT_SHARDS for k in range(read)]
        self._next_heartbeat_shard = (self._next_heartbeat_shard + read) % HEARTBEAT_SHARDS
        live = await read_peer_stats(self.session.dht, self.config, self.stats, shards=shards)
        others = {stats.node_id for stats, _ in live} - {self.identity.node_id}
        self.swarm_size = 1 + (round(len(others) * HEARTBEAT_SHARDS / read) if read < HEARTBEAT_SHARDS else len(others))
        self.stats.swarm_size_estimate = self.swarm_size
        peers = [stats for stats, _ in live if stats.node_id != self.identity.node_id]
        for stats in peers:
            if stats.reachability in ("", "direct"):  # one that cannot be dialed keeps its own links to us up
                self.session.membership.remember(stats.addresses)
        addresses = [a for stats in peers for a in stats.gossip_addresses]
        if addresses and self.gossip is not None:
            await self.gossip.connect(addresses)

    async def stop(self) -> None:
        if self.on_addresses in self.session.address_listeners:
            self.session.address_listeners.remove(self.on_addresses)
        if self._heartbeat_task is not None:
            await cancel_and_wait([self._heartbeat_task], "heartbeat loop")
        if self.gossip is not None:
            await self.gossip.stop()
            self.gossip = None

    def check_alive(self) -> None:
        """Raise if a background service died, the session's membership included (the node checks only its
        transport): the node must stop loudly, not limp on."""
        self.session.check_alive()
        task = self._heartbeat_task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise RuntimeError("the heartbeat service died") from task.exception()
        if self.gossip is not None and not self.gossip.running:
            raise RuntimeError("the gossip service died") from self.gossip.failure

    # publishing ----------------------------------------------------------------------

    async def publish_heartbeat(self) -> None:
        stats = dataclasses.replace(
            self.heartbeat(),
            addresses=self.session.addresses,
            gossip_addresses=self.gossip_addresses,
            reachability=self.session.reachability,
        )
        await self.session.store(peers_key(self.prefix, shard_of(self.identity.node_id, HEARTBEAT_SHARDS)), stats)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm.heartbeat_interval_s)
            try:
                await self.publish_heartbeat()
                await self.connect_gossip_peers()
            except Exception as exc:  # a lost store is retried next beat; the loop must not die of it
                log.warning("heartbeat not published: %s", exc)

    def rollout_shards(self) -> tuple[int, list[int]]:
        """(shard count, the shards this round reads): the count from the swarm size estimate, the shards at random."""
        count = rollout_shard_count(self.swarm_size)
        return count, sorted(random.sample(range(count), min(count, self.config.swarm.rollout_shards_read)))

    async def collect(self) -> list[ExternalGroup]:
        swarm = self.config.swarm
        now = time.time()
        window = int(now // swarm.window_s)
        count, shards = self.rollout_shards()
        keys = [
            (rollout_key(self.prefix, window - k, count, shard), shard)
            for k in range(swarm.collect_windows)
            for shard in shards
        ]
        reads = await asyncio.gather(*(read_values(self.session.dht, key, swarm.dht_timeout_s) for key, _ in keys))
        values: list[tuple[object, object]] = []
        for (key, shard), found in zip(keys, reads):
            if found is None:
                self.stats.rollout_reads_failed += 1
                continue
            for subkey, raw in found:
                self.stats.count_read(raw)
                # one identity must not fill other shards
                if isinstance(subkey, str) and shard_of(subkey, count) != shard:
                    self.receiver.refuse_once(
                        subkey[:64],
                        raw,
                        ProtocolRejection(Refusal.WRONG_SHARD, f"stored under shard {shard} of {count}"),
                    )
                    continue
                values.append((subkey, raw))
        if self.gossip is not None:
            pushed = self.gossip.drain(self.rollouts_topic)
            self.stats.gossip_messages_received += len(pushed)
            self.stats.gossip_messages_dropped = self.gossip.dropped(self.rollouts_topic)
            self.stats.gossip_bytes_dropped = self.gossip.dropped_bytes(self.rollouts_topic)
            for raw in pushed:
                self.stats.count_read(raw)
            values += [(None, raw) for raw in pushed]
        return self.receiver.receive(values, now, budget=swarm.max_batches_read_per_round)

    async def publish(self, round_: int, policy_version: int, groups: list[RolloutGroup]) -> None:
        window = int(time.time() // self.config.swarm.window_s)
        record, keep = sign_rollout_batch(self.session.writer, self.fingerprint, round_, policy_version, groups)
        if self.gossip is not None:  # push first: it is the low-latency path, the DHT record is for late readers
            await self.gossip.publish(self.rollouts_topic, record.data)
        levels = rollout_write_levels(rollout_shard_count(self.swarm_size))
        await asyncio.gather(
            *(
                self.session.store(
                    rollout_key(self.prefix, window, level, shard_of(self.identity.node_id, level)), record
                )
                for level in levels
            )
        )
        self.stats.batches_published += 1
        self.stats.questions_published += keep
        self.stats.bytes_published += len(record.data)

    def shed_buffers(self) -> int:
        """Drop what peers' values hold of this process's memory that the node can do without, and return the bytes:
        the gossip messages not yet read (counted as dropped) and the DHT's local cache of the values it read (every
        read asks the network again: `read_values` reads the latest). A `MemoryBudget` shed (node/host_memory.py)."""
        from node.transport.records import clear_dht_cache

        freed = self.gossip.shed() if self.gossip is not None else 0
        if self.session.dht is not None:
            freed += clear_dht_cache(self.session.dht)
        return freed

    async def read_peers(self) -> list[tuple[PeerStats, float]]:
        return await read_peer_stats(self.session.dht, self.config, self.stats)
