"""The swarm transport interface the node loop talks to.

The loop publishes its own scored rollout groups each round and asks for up to J external
groups; it never learns how they travel. `build_transport` (node/transport/__init__.py) builds the one
`swarm.transport` names: `NullTransport` in isolation, `DHTTransport` in a swarm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from node.rollouts.base import ExternalGroup, RolloutGroup


class Transport(ABC):
    async def start(self) -> None:
        """Connect to the swarm."""

    async def stop(self) -> None:
        """Leave the swarm and release sockets and processes."""

    @abstractmethod
    async def publish(self, round_: int, policy_version: int, groups: list[RolloutGroup]) -> None:
        """Offer this round's own scored groups to peers."""

    @abstractmethod
    async def collect(self) -> list[ExternalGroup]:
        """Peers' groups verified by the protocol and not seen before; none when peers are missing."""

    def check_alive(self) -> None:
        """Raise if one of the transport's background services died."""

    def shed_buffers(self) -> int:
        """Drop what peers' values hold of this process's memory that the node can do without, and return the bytes
        dropped (the process is over its budget: node/host_memory.py, `MemoryBudget`); nothing by default."""
        return 0
