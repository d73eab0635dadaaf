"""The gossip interface: best-effort push of signed envelopes."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Gossip(ABC):
    """Best-effort push of signed envelopes to the swarm."""

    @abstractmethod
    async def start(self) -> list[str]:
        """Start listening; return own multiaddrs (with /p2p/<peer id>)."""

    @abstractmethod
    async def connect(self, addresses: list[str]) -> int:
        """Dial peers' gossip multiaddrs not yet connected; return how many new connections succeeded.

        Never raises for unreachable peers (logs at info).
        """

    @abstractmethod
    async def publish(self, topic: str, data: bytes) -> None:
        """Push data to the topic; raises ValueError if len(data) > max_message_bytes."""

    @abstractmethod
    def drain(self, topic: str) -> list[bytes]:
        """Every message received on topic since the last drain (not our own), oldest first."""

    @abstractmethod
    async def subscribe(self, topic: str) -> None:
        """Start receiving messages on topic."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop and release everything start() acquired."""

    @abstractmethod
    def peer_count(self) -> int:
        """Number of peers currently connected."""
