"""A node finds peers again that fell out of its DHT routing table.

hivemind drops a peer from the routing table after failed calls and only looks up peers its
table leads to; after a partition each side has forgotten the other, and without the rejoin pass
the two halves never meet again (found by tests/test_lab_faults.py, where a real partition is cut
and healed between network namespaces). Here three real DHT nodes on 127.0.0.1 forget each other
the way a partition leaves them, and the pass must bring them back.
"""

from __future__ import annotations

import asyncio
import time

from node.config import load_config
from node.stats import SwarmStats
from node.transport.dht import DHTTransport, dht_addresses_by_peer
from node.transport.session import join_swarm
from protocol import NodeIdentity
from tests.helpers.messages import stats_message


async def started(tmp_path, name: str, initial_peers: list[str]) -> DHTTransport:
    """A node's transport over its own swarm session, started (stop both with `leave`)."""
    config = load_config(None, ["swarm.gossip=dht", "swarm.host_maddrs=[\"/ip4/127.0.0.1/tcp/0\"]"])
    config = config.model_copy(
        update={"swarm": config.swarm.model_copy(update={"initial_peers": initial_peers, "swarm_id": "rejoin-test"})}
    )
    identity = NodeIdentity.generate()
    state = tmp_path / name
    state.mkdir()
    session = await join_swarm(config, identity, state)
    node = DHTTransport(session, SwarmStats(), "f", heartbeat=lambda: stats_message(identity, time.time()))
    await node.start()
    return node


async def leave(node: DHTTransport) -> None:
    await node.stop()
    await node.session.close()


def forget(node: DHTTransport, other: DHTTransport) -> None:
    table = node.session.dht.protocol.routing_table
    node_id = table.get(peer_id=other.session.dht.peer_id)
    if node_id is not None:
        del table[node_id]


def test_dht_addresses_by_peer_skips_what_it_cannot_dial():
    good = "/ip4/10.0.0.1/tcp/4000/p2p/12D3KooWHVpdP9fpGTpE8P7vbEVjZCir9ZeA5MPcqSBqPMDj5DQ9"
    assert dht_addresses_by_peer([good, "/ip4/10.0.0.1/tcp/4000", "garbage", good.replace("10.0.0.1", "10.0.0.2")]) == {
        "12D3KooWHVpdP9fpGTpE8P7vbEVjZCir9ZeA5MPcqSBqPMDj5DQ9": [good, good.replace("10.0.0.1", "10.0.0.2")]
    }


def test_peers_dropped_from_the_routing_table_are_found_again(tmp_path):
    async def scenario() -> None:
        a = await started(tmp_path, "a", [])
        b = c = None
        try:
            b = await started(tmp_path, "b", a.session.addresses)
            c = await started(tmp_path, "c", a.session.addresses)
            for node in (a, b, c):
                await node.publish_heartbeat()
            for node in (a, b, c):
                await node.connect_gossip_peers()  # reads the heartbeats: remembers the others' DHT addresses
            assert c.session.dht.peer_id.to_base58() in b._dht_peers_seen
            # The partition {a, b} | {c}: each side forgets the other.
            for left in (a, b):
                forget(left, c)
                forget(c, left)
            assert all(c.session.dht.peer_id not in n.session.dht.protocol.routing_table for n in (a, b))
            assert (
                a.session.dht.peer_id not in c.session.dht.protocol.routing_table
                and b.session.dht.peer_id not in c.session.dht.protocol.routing_table
            )

            assert await c.rejoin_lost_peers() >= 2  # a (its bootstrap peer) and b (seen in a heartbeat)
            assert (
                a.session.dht.peer_id in c.session.dht.protocol.routing_table
                and b.session.dht.peer_id in c.session.dht.protocol.routing_table
            )
            # c's pings put it back into their tables too (hivemind adds a pinging server node)
            assert (
                c.session.dht.peer_id in a.session.dht.protocol.routing_table
                and c.session.dht.peer_id in b.session.dht.protocol.routing_table
            )
            assert c.dht_peers_rejoined >= 2
            assert await c.rejoin_lost_peers() == 0  # nobody is lost any more: nothing to do
        finally:
            for node in (c, b, a):
                if node is not None:
                    await leave(node)

    asyncio.run(scenario())
