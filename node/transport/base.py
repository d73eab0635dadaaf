"""The swarm transport interface the node loop talks to.

The loop publishes its own scored rollout groups each round and asks for up to J external
groups; it never learns how they travel. Isolated mode uses `NullTransport`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from node.rollouts.base import RolloutGroup
from protocol.messages import RolloutCompletion
from protocol.specs import TaskSpec


@dataclass
class ExternalGroup:
    """A peer's question and completions as received: its rewards are not trusted, the node re-scores."""

    spec: TaskSpec
    completions: list[RolloutCompletion]  # text and the sender's token ids / behaviour log-probs
    claimed_rewards: list[float]  # advisory only: compared with our own scores, never trained on
    peer_id: str
    same_model: bool  # sender's model fingerprint equals ours: its token ids and log-probs are comparable
    policy_version: int  # the sender's policy version (its own counter)


class Transport(ABC):
    async def start(self) -> None:
        """Connect to the swarm."""

    async def stop(self) -> None:
        """Leave the swarm and release sockets and processes."""

    @abstractmethod
    async def publish(self, round_: int, policy_version: int, groups: list[RolloutGroup]) -> None:
        """Offer this round's own scored groups to peers."""

    @abstractmethod
    async def collect(self, round_: int) -> list[ExternalGroup]:
        """Peers' groups verified by the protocol and not seen before; none when peers are missing."""

    def check_alive(self) -> None:
        """Raise if one of the transport's background services died."""
