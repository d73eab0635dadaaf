"""The transport of an isolated node: publishes nowhere, receives nothing."""

from __future__ import annotations

from node.rollouts.base import ExternalGroup, RolloutGroup
from node.transport.base import Transport


class NullTransport(Transport):
    async def publish(self, round_: int, policy_version: int, groups: list[RolloutGroup]) -> None:
        return None

    async def collect(self) -> list[ExternalGroup]:
        return []
