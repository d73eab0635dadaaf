from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from node.config import NodeConfig
from node.stats import SwarmStats
from node.transport.base import Transport
from protocol import PeerStats

if TYPE_CHECKING:
    from node.transport.session import SwarmSession


def needs_session(config: NodeConfig) -> bool:
    """Whether the transport `swarm.transport` names runs over a swarm session the node opens first (join_swarm)."""
    return config.swarm.transport == "dht"


def build_transport(
    config: NodeConfig,
    session: SwarmSession | None,
    stats: SwarmStats,
    fingerprint: str,
    heartbeat: Callable[[], PeerStats],
    on_addresses: Callable[[list[str]], None] | None = None,
) -> Transport:
    """The rollout transport `swarm.transport` names: 'none', the null one of an isolated node; 'dht', rollouts and
    heartbeats over the node's open swarm session (the other arguments are its: what counts, the model fingerprint
    peers compare, the heartbeat's content, who is told the node's addresses)."""
    if config.swarm.transport == "none":
        from node.transport.null import NullTransport

        return NullTransport()
    if session is None:
        raise ValueError(f"swarm.transport {config.swarm.transport!r} needs the node's open swarm session")
    from node.transport.dht import DHTTransport

    return DHTTransport(session, stats, fingerprint, heartbeat=heartbeat, on_addresses=on_addresses)


__all__ = ["Transport", "build_transport", "needs_session"]
