"""A node finds peers again that fell out of its DHT routing table.

hivemind drops a peer from the routing table after failed calls and only looks up peers its
table leads to; after a partition each side has forgotten the other, and without the rejoin pass
the two halves never meet again (found by tests/test_lab_faults.py, where a real partition is cut
and healed between network namespaces). Here three real DHT nodes on 127.0.0.1 forget each other
the way a partition leaves them, and the pass must bring them back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from node.config import load_config
from node.stats import SwarmStats
from node.transport.dht import DHTTransport, dht_addresses_by_peer
from protocol import NodeIdentity
from tests.helpers.messages import stats_message


def transport(tmp_path, name: str, initial_peers: list[str]) -> DHTTransport:
    config = load_config(None, ["swarm.gossip=dht", "swarm.host_maddrs=[\"/ip4/127.0.0.1/tcp/0\"]"])
    config = config.model_copy(update={"swarm": config.swarm.model_copy(update={"initial_peers": initial_peers, "swarm_id": "rejoin-test"})})
    identity = NodeIdentity.generate()
    state = tmp_path / name
    state.mkdir()
    holder: list[DHTTransport] = []
    node = DHTTransport(config, identity, SwarmStats(), state, "f",
                        heartbeat=lambda: dataclasses.replace(stats_message(identity, time.time()), addresses=holder[0].addresses))
    holder.append(node)
    return node


def forget(node: DHTTransport, other: DHTTransport) -> None:
    table = node.dht.protocol.routing_table
    node_id = table.get(peer_id=other.dht.peer_id)
    if node_id is not None:
        del table[node_id]


def test_dht_addresses_by_peer_skips_what_it_cannot_dial():
    good = "/ip4/10.0.0.1/tcp/4000/p2p/12D3KooWHVpdP9fpGTpE8P7vbEVjZCir9ZeA5MPcqSBqPMDj5DQ9"
    assert dht_addresses_by_peer([good, "/ip4/10.0.0.1/tcp/4000", "garbage", good.replace("10.0.0.1", "10.0.0.2")]) == {
        "12D3KooWHVpdP9fpGTpE8P7vbEVjZCir9ZeA5MPcqSBqPMDj5DQ9": [good, good.replace("10.0.0.1", "10.0.0.2")]}


def test_peers_dropped_from_the_routing_table_are_found_again(tmp_path):
    async def scenario() -> None:
        a = transport(tmp_path, "a", [])
        await a.start()
        b = c = None
        try:
            b = transport(tmp_path, "b", a.addresses)
            await b.start()
            c = transport(tmp_path, "c", a.addresses)
            await c.start()
            for node in (a, b, c):
                await node.publish_heartbeat()
            for node in (a, b, c):
                await node._connect_gossip_peers()  # reads the heartbeats: remembers the others' DHT addresses
            assert c.dht.peer_id.to_base58() in b._dht_peers_seen
            # The partition {a, b} | {c}: each side forgets the other.
            for left in (a, b):
                forget(left, c)
                forget(c, left)
            assert all(c.dht.peer_id not in n.dht.protocol.routing_table for n in (a, b))
            assert a.dht.peer_id not in c.dht.protocol.routing_table and b.dht.peer_id not in c.dht.protocol.routing_table

            assert await c.rejoin_lost_peers() >= 2  # a (its bootstrap peer) and b (seen in a heartbeat)
            assert a.dht.peer_id in c.dht.protocol.routing_table and b.dht.peer_id in c.dht.protocol.routing_table
            # c's pings put it back into their tables too (hivemind adds a pinging server node)
            assert c.dht.peer_id in a.dht.protocol.routing_table and c.dht.peer_id in b.dht.protocol.routing_table
            assert c.dht_peers_rejoined >= 2
            assert await c.rejoin_lost_peers() == 0  # nobody is lost any more: nothing to do
        finally:
            for node in (c, b, a):
                if node is not None:
                    await node.stop()

    asyncio.run(scenario())
