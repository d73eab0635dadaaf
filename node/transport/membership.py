"""What keeps a joined process in its swarm, whatever its role: a training node, a stage server, a pipeline driver.

`join_swarm` starts one `Membership` with the session and `SwarmSession.close` stops it, so every role that
joins gets the same four services (before, they ran in the rollout transport's heartbeat loop, and a stage
server or a driver, which open no rollout transport, went without them):

- Address refresh. A node peers cannot dial directly asks its daemon, every heartbeat interval, where peers
  reach it: a relay slot reserved after the join shows up as /p2p-circuit addresses (the session then reports
  "relayed"); they are written to addresses.txt and told to the session's address listeners.
- Keeping that node's relay slot. Its daemon's autorelay reserves one at the join, but when the relay restarts it
  does not ask that relay again for an hour (protocol/relay.py says why): while the daemon holds no slot, the
  membership reserves one itself on each bootstrap peer it is connected to, on the first beat it can (a slot
  lost) and again every `rejoin_interval_s` (the relay drops a slot with the connection, and a refresh costs one
  small stream); the session then announces `<relay>/p2p-circuit/p2p/<us>` for it (`circuit_addresses`). A node
  that lost every slot reports "outbound-only" again until it has one.
- The link keeper of such a node (`reachability.hold_links`): connections to its DHT neighbourhood, over which
  peers' streams reach a node nobody can dial.
- Rejoining after a partition. hivemind only looks up peers its routing table leads to: after a partition each
  side has dropped the other from its table, and when the link heals nothing would bring them back together
  (found in the lab, tests/test_lab_faults.py). Every `rejoin_interval_s` the membership pings the bootstrap
  peers and the peers it has seen in signed records that fell out of the routing table, at most
  REJOIN_PEERS_PER_PASS a pass; one that answers is back in the table, and looking up our own neighbourhood
  through it brings back the rest of its side.

Where it learns peers' addresses: from the signed records a role reads anyway, so that it costs no extra reads
where there are some. The rollout transport hands it the DHT addresses in the heartbeats it reads (`remember`);
a stage server and a driver, which publish and read no heartbeats, register the stage announcements as a source
(`add_source`, read before each rejoin pass). It keeps only peers it can dial: none behind a relay (a relayed node
is a DHT client, which answers no ping and keeps its own links to us up), at most MAX_DHT_PEERS_REMEMBERED, the
least recently seen forgotten first.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable

from node.aio import cancel_and_wait
from node.transport import hivemind_p2p
from node.transport.joining import dht_addresses_by_peer
from node.transport.reachability import hold_links, reserve_relay_slot
from protocol.bounded import BoundedDict

log = logging.getLogger(__name__)

MAX_DHT_PEERS_REMEMBERED = 256  # DHT addresses from peers' signed records, kept to find them again after a partition
REJOIN_PEERS_PER_PASS = 16  # lost peers re-contacted per rejoin pass: bounds the work whatever the records claim
MAX_RELAY_SLOTS = 4  # bootstrap peers a NAT'd node reserves a relay slot on itself: bounded however many it was given

# Where a membership learns peers' addresses besides what it is handed: the addresses each peer published in a
# record (multiaddrs ending in /p2p/<PeerID>), one list per peer
AddressSource = Callable[[], Awaitable[Iterable[list[str]]]]


class Membership:
    """The services of the module docstring, for one session (node/transport/session.py), which starts and stops
    them."""

    def __init__(self, session) -> None:
        self.session = session
        self.config = session.config
        # PeerID -> maddrs, least recently seen first
        self.known: BoundedDict[str, list[str]] = BoundedDict(MAX_DHT_PEERS_REMEMBERED)
        self.sources: list[AddressSource] = []
        self.peers_rejoined = 0  # lost DHT peers that answered a rejoin pass, since the start
        # relay PeerID -> (when the slot expires, Unix s; the relay's maddrs): slots reserved here, not by the daemon
        self.relay_slots: dict[str, tuple[int, list[str]]] = {}
        self.slots_reserved = 0  # relay slots this membership obtained where it held none, since the start
        self._refusals_said: set[tuple[str, int]] = set()  # (relay, status) refusals already logged as warnings
        self._task: asyncio.Task | None = None
        self._links: asyncio.Task | None = None
        self._last_rejoin = time.monotonic()

    # what it knows ---------------------------------------------------------------------------

    def remember(self, addresses: list[str]) -> None:
        """Keep the DHT addresses one peer published in a verified record, unless it sits behind a relay (a DHT
        client, not dialed back: see the module docstring)."""
        if any("/p2p-circuit" in a for a in addresses):
            return
        for peer_id, maddrs in dht_addresses_by_peer(addresses).items():
            self.known[peer_id] = maddrs

    def add_source(self, source: AddressSource) -> None:
        """Read `source` before each rejoin pass and remember what it returns."""
        self.sources.append(source)

    # life cycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.session.reachability != "direct":
            self._links = asyncio.create_task(
                hold_links(self.session.dht, self.config.swarm.heartbeat_interval_s), name="hold-links"
            )
        self._last_rejoin = time.monotonic()
        self._task = asyncio.create_task(self._run(), name="membership")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._links) if t is not None]
        if tasks:
            await cancel_and_wait(tasks, "membership")
        self._task = self._links = None

    @property
    def tasks(self) -> list[asyncio.Task]:
        """Its running services (for a caller that stops its process when one of them dies)."""
        return [t for t in (self._task, self._links) if t is not None]

    def check_alive(self) -> None:
        """Raise if one of its services died: the process must stop loudly, not drift out of the swarm."""
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise RuntimeError(f"the swarm membership's {task.get_name()} service died") from task.exception()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.swarm.heartbeat_interval_s)
            rejoin_due = time.monotonic() - self._last_rejoin >= self.config.swarm.rejoin_interval_s
            if rejoin_due:
                self._last_rejoin = time.monotonic()
                await self.read_sources()
                try:
                    await self.rejoin_lost_peers()
                except Exception as exc:  # retried next pass
                    log.warning("rejoining lost DHT peers failed: %r", exc)
            if self.session.reachability == "direct":
                continue
            # a slot lost is sought at once, one held refreshed every pass, and none while the daemon holds its own
            if not self.session.daemon_relayed and (rejoin_due or self.session.reachability == "outbound-only"):
                try:
                    await self.keep_relay_slots()
                except Exception as exc:  # retried next beat
                    log.warning("relay slots not renewed: %r", exc)
            try:
                await self.session.refresh_addresses()
            except Exception as exc:  # retried next beat; the loop must not die of it
                log.warning("this node's addresses not refreshed: %r", exc)

    def circuit_addresses(self) -> list[str]:
        """Where peers dial this node through the slots this membership holds (none expired)."""
        now = time.time()
        return [
            f"{maddr}/p2p-circuit/p2p/{self.session.peer_id}"
            for expire, maddrs in self.relay_slots.values()
            if expire > now
            for maddr in maddrs
        ]

    async def keep_relay_slots(self) -> int:
        """Reserve (or renew) a relay slot on each bootstrap peer this node is connected to, at most MAX_RELAY_SLOTS;
        forget the slots of relays it is no longer connected to (the relay dropped them with the connection).
        Returns how many it holds."""
        relays = dht_addresses_by_peer(self.config.swarm.initial_peers)
        relays.pop(self.session.peer_id, None)
        relays = dict(list(relays.items())[:MAX_RELAY_SLOTS])
        if not relays:
            return 0
        dht = self.session.dht
        connected = {peer.peer_id.to_base58() for peer in await dht.p2p.list_peers()}
        for relay in set(self.relay_slots) - set(relays):
            del self.relay_slots[relay]

        async def reserve(relay: str, maddrs: list[str]) -> None:
            if relay not in connected:
                self.relay_slots.pop(relay, None)
                return
            try:
                answer = await reserve_relay_slot(dht.p2p, relay, self.config.swarm.dht_timeout_s)
            except Exception as exc:  # gone since, or not a relay: asked again next pass
                log.debug("no relay slot from %s: %r", relay, exc)
                self.relay_slots.pop(relay, None)
                return
            if not answer.ok:  # said once per relay and reason: it is asked again every beat while no slot is held
                log_refusal = log.debug if (relay, answer.status) in self._refusals_said else log.warning
                self._refusals_said.add((relay, answer.status))
                log_refusal("bootstrap peer %s refused this node a relay slot: %s", relay, answer.status_name)
                self.relay_slots.pop(relay, None)
                return
            if relay not in self.relay_slots:
                self.slots_reserved += 1
                log.info(
                    "relay %s reserved this node a slot (its daemon held none) until %s; each relayed connection "
                    "limited to %s s and %s bytes",
                    relay,
                    time.strftime("%H:%M:%S", time.gmtime(answer.expire)),
                    answer.limit_s,
                    answer.limit_bytes,
                )
            self.relay_slots[relay] = (answer.expire, maddrs)

        await asyncio.gather(*(reserve(relay, maddrs) for relay, maddrs in relays.items()))
        return len(self.relay_slots)

    async def read_sources(self) -> None:
        """Remember what every registered source returns (a failed read is retried next pass)."""
        for source in self.sources:
            try:
                for addresses in await asyncio.wait_for(source(), self.config.swarm.dht_timeout_s):
                    self.remember(addresses)
            except Exception as exc:  # cut off, or a slow DHT: the addresses already known still serve
                log.warning("peers' addresses not read (%r): the rejoin pass uses those it knows", exc)

    async def rejoin_lost_peers(self) -> int:
        """Ping the bootstrap peers and the peers remembered that fell out of the DHT routing table.

        Returns how many came back (their neighbourhood is then looked up again)."""
        from hivemind.p2p import PeerID
        from multiaddr import Multiaddr

        dht = self.session.dht
        candidates = dht_addresses_by_peer(self.config.swarm.initial_peers)
        candidates.update(self.known)
        candidates.pop(dht.peer_id.to_base58(), None)
        lost = [
            (PeerID.from_base58(p), maddrs)
            for p, maddrs in candidates.items()
            if PeerID.from_base58(p) not in dht.protocol.routing_table
        ]
        if len(lost) > REJOIN_PEERS_PER_PASS:
            lost = random.sample(lost, REJOIN_PEERS_PER_PASS)
        timeout = self.config.swarm.dht_timeout_s

        async def reach(peer_id, maddrs: list[str]) -> bool:
            try:
                await asyncio.wait_for(hivemind_p2p.connect(dht.p2p, peer_id, [Multiaddr(a) for a in maddrs]), timeout)
            except Exception as exc:  # unreachable (still cut off, or gone): normal, the ping below says so
                log.debug("DHT peer %s not reachable at %s: %r", peer_id, maddrs, exc)
                return False
            return await asyncio.wait_for(dht.protocol.call_ping(peer_id), timeout) is not None

        results = await asyncio.gather(*(reach(peer_id, maddrs) for peer_id, maddrs in lost), return_exceptions=True)
        back = sum(result is True for result in results)
        if back:
            self.peers_rejoined += back
            log.info(
                "%d DHT peer(s) that had dropped out of the routing table answered again; looking up the neighbourhood",
                back,
            )
            await asyncio.wait_for(dht.find_nearest_nodes([dht.node_id]), timeout)
        return back
