"""What keeps a joined process in its swarm, whatever its role: a training node, a stage server, a pipeline driver.

`join_swarm` starts one `Membership` with the session and `SwarmSession.close` stops it, so every role that
joins gets the same three services (before, they ran in the rollout transport's heartbeat loop, and a stage
server or a driver, which open no rollout transport, went without them):

- Address refresh. A node peers cannot dial directly asks its daemon, every heartbeat interval, where peers
  reach it: a relay slot reserved after the join shows up as /p2p-circuit addresses (the session then reports
  "relayed"); they are written to addresses.txt and told to the session's address listeners.
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
from node.transport.joining import dht_addresses_by_peer
from node.transport.reachability import hold_links
from protocol.bounded import BoundedDict

log = logging.getLogger(__name__)

MAX_DHT_PEERS_REMEMBERED = 256  # DHT addresses from peers' signed records, kept to find them again after a partition
REJOIN_PEERS_PER_PASS = 16  # lost peers re-contacted per rejoin pass: bounds the work whatever the records claim

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
            if self.session.reachability != "direct":
                try:
                    await self.session.refresh_addresses()
                except Exception as exc:  # retried next beat; the loop must not die of it
                    log.warning("this node's addresses not refreshed: %r", exc)
            if time.monotonic() - self._last_rejoin >= self.config.swarm.rejoin_interval_s:
                self._last_rejoin = time.monotonic()
                await self.read_sources()
                try:
                    await self.rejoin_lost_peers()
                except Exception as exc:  # retried next pass
                    log.warning("rejoining lost DHT peers failed: %r", exc)

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
                await asyncio.wait_for(dht.p2p._client.connect(peer_id, [Multiaddr(a) for a in maddrs]), timeout)
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
