"""How peers can reach this node: directly, through a circuit relay, or only over connections it opens.

Measured at join, because a home node cannot know it is behind NAT from its own interfaces (in
the lab and at home alike its address looks like any other). It asks up to
OBSERVED_ASKED of its bootstrap peers where its connection comes from (protocol/reachability.py):
one answer naming an IP of its own says nothing rewrote its packets ("direct"); answers that
all name another IP say a NAT did ("outbound-only"). No answer (a node that starts a swarm,
or old peers) means "direct", as before this check existed. `swarm.reachability` overrides it,
and `swarm.announce_maddrs` implies "direct" (the user forwarded a port and said where).

Why not p2pd's own AutoNAT: the daemon does run it, but its verdict is not exposed on its
control socket, and it needs several peers able to dial back before it says anything (in the
lab with two public peers it showed no verdict within 20 s). Its circuit relay client
(autorelay) is asked for: an outbound-only node's daemon is started with the bootstrap peers as
trusted relays, and once a reservation shows in its addresses (/p2p-circuit) it reports
"relayed". Measured: autorelay waits a fixed 3 minutes before its first attempt and got no
reservation within 5 (benchmarks/RESULTS.md, "Behind NAT"), so today a NAT'd node stays
"outbound-only". What an outbound-only node does differently is in `create_dht_node`
(DHT client mode: nobody puts it in a routing table it cannot answer from) and in the
transport (it announces no gossip address, peers do not try to re-dial it): everything
else reaches it over the connections it opened itself, which libp2p streams use in either
direction.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging

from node.transport.framing import read_frame, write_frame
from protocol import ProtocolRejection
from protocol.reachability import MAX_OBSERVED_BYTES, OBSERVED_ADDRESS_HANDLER, decode_observed, encode_observed

log = logging.getLogger(__name__)

OBSERVED_ASKED = 3  # bootstrap peers asked: one liar cannot make a reachable node hide, nor more than 3 cost a join


class ObservedFrame(enum.IntEnum):
    OBSERVED = 1  # server -> asker: protocol.reachability's map


async def serve_observed_address(p2p) -> None:
    """Answer every asker with the address its stream's connection comes from (its daemon's, authenticated)."""

    async def handle(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await write_frame(writer, ObservedFrame.OBSERVED, encode_observed(str(info.addr)[:256]))
        except (ConnectionError, asyncio.IncompleteReadError) as exc:  # the asker left: nothing to do
            log.debug("observed-address answer not delivered: %r", exc)
        finally:
            writer.close()

    await p2p.add_binary_stream_handler(OBSERVED_ADDRESS_HANDLER, handle)


async def ask_observed(p2p, peer_id: str, timeout: float) -> str | None:
    """Where `peer_id` sees our connection come from; None when it did not say in time (or said nonsense)."""
    from hivemind.p2p import PeerID

    try:
        _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), OBSERVED_ADDRESS_HANDLER), timeout)
    except Exception as exc:  # unreachable, or a peer without the handler: it just does not count
        log.debug("no observed address from %s: %r", peer_id, exc)
        return None
    try:
        _, body = await asyncio.wait_for(read_frame(reader, ObservedFrame, lambda _: MAX_OBSERVED_BYTES), timeout)
        return decode_observed(body)
    except (ProtocolRejection, Exception) as exc:  # noqa: BLE001 - any failure of one answer costs only that answer
        log.warning("observed-address answer from %s refused: %r", peer_id, exc)
        return None
    finally:
        writer.close()


def ip_of(maddr: str) -> str | None:
    parts = str(maddr).split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
        try:
            return str(ipaddress.ip_address(parts[2]))
        except ValueError:
            return None
    return None


def verdict(own_maddrs: list[str], observed: list[str]) -> str:
    """'direct' when a peer saw one of our own IPs (or nobody answered), 'outbound-only' when all saw another one."""
    own = {ip_of(a) for a in own_maddrs} - {None}
    seen = [ip_of(a) for a in observed if ip_of(a) is not None]
    if not seen or any(ip in own for ip in seen):
        return "direct"
    return "outbound-only"


async def measure_reachability(p2p, bootstrap_peer_ids: list[str], timeout: float) -> tuple[str, list[str]]:
    """This node's reachability (see the module docstring) and the addresses its peers observed."""
    own = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
    asked = list(dict.fromkeys(bootstrap_peer_ids))[:OBSERVED_ASKED]
    answers = await asyncio.gather(*(ask_observed(p2p, peer, timeout) for peer in asked))
    observed = [a for a in answers if a]
    return verdict(own, observed), observed


def has_relay_address(maddrs: list[str]) -> bool:
    return any("/p2p-circuit" in str(a) for a in maddrs)


MAX_HELD_LINKS = 32  # DHT peers an outbound-only node keeps a connection to: bounded whatever the swarm's size


async def hold_links(dht, every_s: float, limit: int = MAX_HELD_LINKS) -> None:
    """Keep an outbound-only node callable: connect, every `every_s`, to the DHT peers nearest to it.

    Nobody can dial it, but a libp2p stream can be opened in either direction over a connection
    it made: a driver calling its stage server, a NoLoCo partner, a peer's DHT request. So it looks
    up its own neighbourhood (which refreshes its routing table with peers that joined since) and
    dials the ones it is not connected to. In a swarm larger than `limit` servers, a caller outside
    its neighbourhood needs the relay (its /p2p-circuit addresses) instead."""
    from hivemind.p2p import P2PDaemonError

    while True:
        try:
            found = await asyncio.wait_for(dht.find_nearest_nodes([dht.node_id], k_nearest=limit, exclude_self=True), every_s)
            nearest = set(found.get(dht.node_id, {}).values()) | set(list(dht.protocol.routing_table.peer_id_to_uid)[:limit])
            connected = {peer.peer_id for peer in await dht.p2p.list_peers()}
            wanted = [peer for peer in nearest if peer not in connected]
            log.debug("holding links: %d nearest DHT peers, %d to dial", len(nearest), len(wanted))
            for peer in wanted:
                try:
                    await asyncio.wait_for(dht.p2p._client.connect(peer, []), every_s)
                except (P2PDaemonError, asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - gone peers are normal; retried next pass
                    log.debug("could not hold a link to %s: %r", peer, exc)
        except asyncio.TimeoutError:
            log.debug("neighbourhood lookup took over %.0fs", every_s)
        await asyncio.sleep(every_s)
