"""The swarm transport interface the node loop talks to.

The loop publishes its own scored rollout groups each round and asks for up to J external
groups; it never learns how they travel. Isolated mode uses `NullTransport`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from node.rollouts.base import Completion
from node.trainer import RolloutGroup
from protocol.specs import TaskSpec


@dataclass
class ExternalGroup:
    """A peer's question and completions as received: its rewards are not trusted, the node re-scores."""

    spec: TaskSpec
    completions: list[Completion]
    peer_id: str


class Transport(ABC):
    async def start(self) -> None:
        """Connect to the swarm."""

    async def stop(self) -> None:
        """Leave the swarm and release sockets and processes."""

    @abstractmethod
    async def publish(self, round_: int, policy_version: int, groups: list[RolloutGroup]) -> None:
        """Offer this round's own scored groups to peers."""

    @abstractmethod
    async def collect(self, round_: int, count: int) -> list[ExternalGroup]:
        """Up to `count` peers' groups for this round; fewer (or none) when peers are missing."""

    def counters(self) -> dict[str, int]:
        """Transport counters for metrics (received, rejected by reason, ...)."""
        return {}
