"""A node's one connection to its swarm: its DHT node (and p2p daemon), the writer that signs its
records, its reachability, and the addresses peers dial it at.

Every command that talks to a swarm opens exactly one session and closes it when it leaves:
`join_swarm` for a training node, a stage server and a pipeline driver (they sign records, and keep
their p2p key in the state directory so that their address survives a restart), `watch_swarm` for
the read-only viewers (`peers`, the dashboard). Components are handed the session, or only the part
they use (a DHT node to read from, the writer to sign with), and never start a DHT node or a writer
of their own: one identity, one sequence of record numbers, one place that knows how a node joins.
A joined session also keeps the node joined (node/transport/membership.py: address refresh, the link keeper,
rejoining after a partition), for every role alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from node.aio import retry_with_backoff
from node.config import NodeConfig
from node.transport.joining import create_dht_node, key_prefix, shutdown_dht, start_swarm_dht
from node.transport.membership import Membership
from protocol import Message, NodeIdentity

log = logging.getLogger(__name__)

T = TypeVar("T")

ADDRESSES_FILE = "addresses.txt"  # where peers reach this node, one multiaddr a line: for scripts and `--initial-peers`
DAEMON_SILENT_PROBES = 2  # unanswered probes of the p2p daemon in a row (swarm.daemon_probe_s) that count as it gone
WATCH_INTERVAL_S = 1.0  # how often `watch_joined` looks at the daemon's process and the membership's tasks
REJOIN_FIRST_S = 2.0  # a swarm connection that died is rejoined after this, then twice as long each failed attempt
REJOIN_MAX_S = 60.0


class SwarmSession:
    """What `join_swarm` / `watch_swarm` return. `writer` is None for a viewer: it signs nothing."""

    def __init__(
        self,
        config: NodeConfig,
        dht,
        reachability: str,
        identity: NodeIdentity | None = None,
        state_dir: Path | None = None,
    ) -> None:
        from node.transport.records import RecordWriter

        self.config = config
        self.dht = dht
        self.reachability = (
            reachability  # "direct", "outbound-only" (behind NAT), "relayed" once a relay reserved a slot
        )
        self.identity = identity
        self.state_dir = state_dir
        self.prefix = key_prefix(config.swarm.swarm_id)
        self.writer = RecordWriter(identity, config.swarm.swarm_id) if identity is not None else None
        self.addresses: list[str] = []
        self._silent_probes = 0  # probe_daemon's unanswered probes in a row
        # whether the daemon's own autorelay holds a relay slot (else the membership reserves one: membership.py)
        self.daemon_relayed = False
        self.address_listeners: list[Callable[[list[str]], None]] = []  # told the new addresses when they change
        # what keeps a joined node joined; started by join_swarm (a viewer's session never starts it)
        self.membership = Membership(self)

    @property
    def peer_id(self) -> str:
        """The p2p daemon's id: the /p2p/ part of this node's addresses."""
        return self.dht.peer_id.to_base58()

    async def refresh_addresses(self) -> bool:
        """Ask the daemon where peers reach us (a node behind NAT gains /p2p-circuit addresses once a relay
        reserves it a slot, its daemon's or the membership's, and loses them with the slot), keep them in the state
        directory's addresses file and tell the address listeners; True when they changed."""
        from node.files import write_snapshot
        from node.transport.reachability import has_relay_address

        try:
            addresses = [str(a) for a in await self.dht.get_visible_maddrs(latest=bool(self.addresses))]
        except ValueError:  # hivemind's "no address": a host nobody can dial may have only relay addresses, or none yet
            addresses = []
        if self.reachability != "direct":
            self.daemon_relayed = has_relay_address(addresses)
            if not self.daemon_relayed:
                addresses += self.membership.circuit_addresses()
            if self.reachability == "outbound-only" and has_relay_address(addresses):
                self.reachability = "relayed"
                log.info(
                    "a relay reserved this node a slot: peers can now dial it at %s",
                    [a for a in addresses if "/p2p-circuit" in a],
                )
            elif self.reachability == "relayed" and not has_relay_address(addresses):
                self.reachability = "outbound-only"
                log.warning(
                    "this node lost its relay slot (its relay restarted or dropped it): peers not connected to it "
                    "cannot dial it until the membership reserves a new one"
                )
        if addresses == self.addresses:
            return False
        self.addresses = addresses
        if self.state_dir is not None:
            # skipped while the disk is full: the node stays joined, scripts read the addresses of the last write
            write_snapshot(self.state_dir / ADDRESSES_FILE, "".join(a + "\n" for a in addresses))
        for listener in list(self.address_listeners):
            listener(addresses)
        return True

    async def store(self, key: str, message) -> bool:
        """Store `message` under `key` and this node's subkey: a Message (signed here) or a records.SignedRecord
        (signed by `writer.sign`, e.g. once for several keys); False (and a warning) when the DHT did not take it
        in time."""
        if self.writer is None:
            raise RuntimeError("a viewer's swarm session signs nothing: open it with join_swarm to publish")
        timeout = self.config.swarm.dht_timeout_s
        ok = await self.writer.store(self.dht, key, message, timeout)
        if not ok:
            what = f"{len(message.data)} signed bytes" if not isinstance(message, Message) else type(message).__name__
            log.warning("the DHT did not take our %s under %s within %.0fs", what, key, timeout)
        return ok

    def check_alive(self) -> None:
        """Raise if a service that keeps this node joined died: its p2p daemon (which every DHT read and write goes
        through: without it a node would train on alone, reading and publishing nothing) or its membership."""
        from node.transport.hivemind_p2p import daemon_process

        p2p = getattr(self.dht, "p2p", None)  # None once closed
        process = daemon_process(p2p) if p2p is not None else None
        if process is not None and process.returncode is not None:
            raise RuntimeError(f"the p2p daemon exited (status {process.returncode})")
        self.membership.check_alive()

    async def probe_daemon(self, timeout_s: float) -> str | None:
        """Ask the p2p daemon its own view of its addresses (a round trip to it, and nothing else) within `timeout_s`:
        why it counts as gone once DAEMON_SILENT_PROBES probes in a row went unanswered (a stopped or hung daemon
        neither exits nor answers), else None."""
        try:
            await asyncio.wait_for(self.dht.get_visible_maddrs(latest=True), timeout_s)
            self._silent_probes = 0
            return None
        except Exception:  # noqa: BLE001 - a timeout, or a daemon that answers with an error: unanswered
            self._silent_probes += 1
        if self._silent_probes < DAEMON_SILENT_PROBES:
            return None
        self._silent_probes = 0
        return f"the p2p daemon stopped answering ({DAEMON_SILENT_PROBES} probes of {timeout_s:.0f} s in a row)"

    async def close(self) -> None:
        await self.membership.stop()
        if self.dht is not None:
            await shutdown_dht(self.dht)
            self.dht = None


async def join_swarm(
    config: NodeConfig, identity: NodeIdentity, state_dir: Path, refusals=None, clock_offsets=None
) -> SwarmSession:
    """Join as a node that signs records: its daemon key is kept in `state_dir` (the same /p2p/ id after
    a restart), its reachability measured, its addresses written to `state_dir`/addresses.txt.
    Refused DHT records are counted in `refusals` (a stats.RecordRefusals) and the verified ones' signing times given
    to `clock_offsets` (a stats.ClockOffsets) when given; raises
    joining.SwarmJoinError when no initial peer answers. Its membership runs until the session closes."""
    from node.transport.p2p_key import P2P_KEY_FILE

    dht, reachability = await start_swarm_dht(
        config, state_dir / P2P_KEY_FILE, refusals=refusals, clock_offsets=clock_offsets
    )
    session = SwarmSession(config, dht, reachability, identity, state_dir)
    await session.refresh_addresses()
    await session.membership.start()
    return session


class SessionLost(RuntimeError):
    """A joined session's connection died: its p2p daemon exited or stopped answering, or a membership service died."""


async def watch_joined(session: SwarmSession) -> None:
    """Run until the session's connection dies, then raise SessionLost saying how: its daemon exited or a membership
    service died (looked at every WATCH_INTERVAL_S), or the daemon left its probes (one each swarm.daemon_probe_s)
    unanswered. For a process whose work runs over the session (a stage server, a pipeline
    driver): `node.aio.run_supervised` beside it, and the caller rejoins."""
    probe_s = session.config.swarm.daemon_probe_s
    last_probe = asyncio.get_running_loop().time()
    while True:
        await asyncio.sleep(WATCH_INTERVAL_S)
        try:
            session.check_alive()
        except RuntimeError as exc:
            raise SessionLost(f"{exc}" + (f": {exc.__cause__}" if exc.__cause__ is not None else "")) from exc
        if asyncio.get_running_loop().time() - last_probe < probe_s:
            continue
        last_probe = asyncio.get_running_loop().time()
        if (silent := await session.probe_daemon(probe_s)) is not None:
            raise SessionLost(silent)


async def rejoin(join: Callable[[], Awaitable[T]]) -> tuple[T, int]:
    """`join` (a join_swarm, and whatever the caller runs over the session) until it works, backing off from
    REJOIN_FIRST_S to REJOIN_MAX_S between attempts: what it returned and the attempts it took. A `join` that fails
    closes what it opened."""
    return await retry_with_backoff(join, "rejoin", REJOIN_FIRST_S, REJOIN_MAX_S)


async def watch_swarm(config: NodeConfig, refusals=None) -> SwarmSession:
    """Join as a read-only viewer: a DHT client with a throwaway daemon key, that signs and serves nothing."""
    dht = await create_dht_node(config, client_mode=True, refusals=refusals)
    return SwarmSession(config, dht, reachability="outbound-only")
