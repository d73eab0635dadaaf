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
lab with two public peers it showed no verdict within 20 s). So the verdict is handed to the
daemon instead (`force_reachability`): a node that joins as a DHT server is told it is public,
which starts its circuit relay service at once (go-libp2p runs that service only on a host it
believes public, and AutoNAT may not have said so yet when the first NAT'd peer asks); an
outbound-only node is told it is private and asks its bootstrap peers, and only them, for a
relay slot (`start_relay_client`). Once a slot is reserved its addresses include
/p2p-circuit ones, and it reports "relayed": peers that have no connection to it dial it
through the relay (their daemons find those addresses by asking the DHT peers it is
connected to), and libp2p's hole punching (DCUtR) then moves the link to a direct one where
the caller can be dialed. What an outbound-only node does besides is in `create_dht_node`
(DHT client mode: nobody puts it in a routing table it cannot answer from), in the
transport (it announces no gossip address, peers do not try to re-dial it) and in its session's
membership (node/transport/membership.py: it keeps links open to its DHT neighbourhood,
`hold_links`, picks up a relay slot reserved after the join, and reserves one itself with
`reserve_relay_slot` while its daemon holds none, as after its relay restarted): streams run either way over
connections it opened itself.

What it took, measured in benchmarks/lab/ (2026-11-25, hivemind 1.1.12's p2pd, go-libp2p
0.32): with the daemon's defaults (relay discovery on) autorelay waits a fixed 3-minute boot
delay until it has 4 candidates, and never acts on a host whose AutoNAT has not said
"private"; with discovery off (`-relayDiscovery=0`, a flag hivemind does not expose, hence
`RELAY_CLIENT_FLAGS`), the bootstrap peers as static relays and reachability forced private,
the reservation came within a second of the daemon's start.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging

from node.transport import hivemind_p2p
from node.transport.framing import read_frame, write_frame
from protocol import ProtocolRejection, Refusal
from protocol.reachability import MAX_OBSERVED_BYTES, OBSERVED_ADDRESS_HANDLER, decode_observed, encode_observed
from protocol.relay import (
    HOP_PROTOCOL,
    MAX_HOP_MESSAGE_BYTES,
    MAX_VARINT_BYTES,
    HopStatus,
    decode_hop_status,
    decode_uvarint,
    encode_reserve,
)

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


OBSERVED_ATTEMPTS = 3  # streams asked of one peer whose answer stream broke before the answer


async def ask_observed(p2p, peer_id: str, timeout: float) -> str | None:
    """Where `peer_id` sees our connection come from; None when it did not say in time (or said nonsense).

    A stream that opened and then ended before the answer is asked again, up to OBSERVED_ATTEMPTS streams: p2pd
    streams break now and then, and a node whose only bootstrap peer's answer was lost that way would conclude that
    nobody rewrote its packets ("direct") behind a NAT (seen in a clean-clone test suite: tests/test_nat.py). A peer
    that cannot be reached or has no handler is not asked again: that costs a join its timeout each time."""
    from hivemind.p2p import PeerID

    for attempt in range(1, OBSERVED_ATTEMPTS + 1):
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), OBSERVED_ADDRESS_HANDLER), timeout
            )
        except Exception as exc:  # unreachable, or a peer without the handler: it just does not count
            log.debug("no observed address from %s: %r", peer_id, exc)
            return None
        try:
            _, body = await asyncio.wait_for(read_frame(reader, ObservedFrame, lambda _: MAX_OBSERVED_BYTES), timeout)
            return decode_observed(body)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:  # the stream broke: ask on a new one
            log.info("observed-address stream from %s broke (attempt %d): %r", peer_id, attempt, exc)
        except (ProtocolRejection, Exception) as exc:  # noqa: BLE001 - any failure of one answer costs only that answer
            log.warning("observed-address answer from %s refused: %r", peer_id, exc)
            return None
        finally:
            writer.close()
    log.warning("observed-address answer from %s lost: %d streams broke before it", peer_id, OBSERVED_ATTEMPTS)
    return None


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


RELAY_CLIENT_FLAGS = {
    "relayDiscovery": False
}  # static relays only: with discovery on, autorelay waits 3 minutes for 4 candidates
# how long a join waits for its relay slot (under a second on an idle machine); later ones are picked up by heartbeats
RELAY_WAIT_S = 30.0


async def start_relay_client(dht_node_class, dht_options: dict, p2p_options: dict):
    """A DHT node whose daemon asks `p2p_options["trusted_relays"]` (and no one else) for a relay slot.

    hivemind's `P2P.create` does not pass `-relayDiscovery`: the daemon is started with RELAY_CLIENT_FLAGS added to
    its command line (node/transport/hivemind_p2p.py), and the DHT node is handed that daemon (and shuts it down with
    itself, as with one it started)."""
    return await hivemind_p2p.start_dht_node(
        dht_node_class,
        dht_options,
        dict(p2p_options, dht_mode="client", use_auto_relay=True, force_reachability="private"),
        RELAY_CLIENT_FLAGS,
    )


async def wait_for_relay_address(p2p, timeout: float, every_s: float = 0.5) -> list[str]:
    """This node's /p2p-circuit addresses once a relay reserved it a slot ([] if none within `timeout`).

    Reading them with `latest=True` also refreshes hivemind's cached addresses, which the stage
    server and the averaging announce later."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            maddrs = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
        # no address at all yet: a host on neither a private nor a public IP shows only relay addresses
        except ValueError:
            maddrs = []
        relayed = [a for a in maddrs if "/p2p-circuit" in a]
        if relayed or loop.time() >= deadline:
            return relayed
        await asyncio.sleep(every_s)


async def reserve_relay_slot(p2p, relay_peer_id: str, timeout: float) -> HopStatus:
    """Ask relay `relay_peer_id` (which our daemon must be connected to: nobody can dial us, and the slot lasts as long
    as that connection) for a circuit relay slot ourselves, over a stream our daemon opens (protocol/relay.py says why
    the daemon's own autorelay does not do it). Returns the relay's answer; raises when it gave none in time, or a
    malformed one (ProtocolRejection)."""
    from hivemind.p2p import PeerID

    _, reader, writer = await asyncio.wait_for(
        hivemind_p2p.open_protocol_stream(p2p, PeerID.from_base58(relay_peer_id), HOP_PROTOCOL), timeout
    )
    try:
        writer.write(encode_reserve())
        await writer.drain()

        async def answer() -> bytes:
            prefix = b""
            while not prefix or prefix[-1] & 0x80:
                if len(prefix) == MAX_VARINT_BYTES:
                    break  # decode_uvarint refuses it
                prefix += await reader.readexactly(1)
            length, _ = decode_uvarint(prefix, 0)
            if length > MAX_HOP_MESSAGE_BYTES:  # bounded before the body is read
                raise ProtocolRejection(
                    Refusal.TOO_LARGE, f"relay answer of {length} bytes, over {MAX_HOP_MESSAGE_BYTES}"
                )
            return await reader.readexactly(length)

        return decode_hop_status(await asyncio.wait_for(answer(), timeout))
    finally:
        writer.close()


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
            found = await asyncio.wait_for(
                dht.find_nearest_nodes([dht.node_id], k_nearest=limit, exclude_self=True), every_s
            )
            nearest = set(found.get(dht.node_id, {}).values()) | set(
                list(dht.protocol.routing_table.peer_id_to_uid)[:limit]
            )
            connected = {peer.peer_id for peer in await dht.p2p.list_peers()}
            wanted = [peer for peer in nearest if peer not in connected]
            log.debug("holding links: %d nearest DHT peers, %d to dial", len(nearest), len(wanted))
            for peer in wanted:
                try:
                    await asyncio.wait_for(hivemind_p2p.connect(dht.p2p, peer, []), every_s)
                except (P2PDaemonError, asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - gone peers are normal; retried next pass
                    log.debug("could not hold a link to %s: %r", peer, exc)
        except asyncio.TimeoutError:
            log.debug("neighbourhood lookup took over %.0fs", every_s)
        await asyncio.sleep(every_s)
