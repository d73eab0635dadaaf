"""Nodes of one process exchanging rollouts through the real protocol, with only the network hop replaced.

For benchmarks and tests that run several nodes in lockstep: what a node publishes is the exact
signed record a DHT store would carry (built, signed and encoded by the same code as
`DHTTransport.publish`), and a reader gets every other node's latest record through the same
`BatchReceiver` (decoded, signature and swarm checked, replays and stale batches refused); the node
then re-generates and re-scores what it draws, as it does for groups that came from the network.
"""

from __future__ import annotations

import time

from node.config import NodeConfig
from node.stats import SwarmStats
from node.rollouts.base import ExternalGroup, RolloutGroup
from node.transport.base import Transport
from node.transport.batches import BatchReceiver, sign_rollout_batch
from protocol import NodeIdentity


class InProcessExchange:
    """The network between in-process nodes: the latest signed rollout record of each node, by node id."""

    def __init__(self) -> None:
        self.latest: dict[str, bytes] = {}


class InProcessTransport(Transport):
    def __init__(
        self,
        exchange: InProcessExchange,
        config: NodeConfig,
        identity: NodeIdentity,
        stats: SwarmStats,
        fingerprint: str,
    ):
        from node.transport.records import RecordWriter  # the DHT transport's signer, so the bytes are the same

        self.exchange = exchange
        self.identity = identity
        self.stats = stats
        self.fingerprint = fingerprint
        self.writer = RecordWriter(identity, config.swarm.swarm_id)
        self.receiver = BatchReceiver(config.swarm, identity.node_id, fingerprint, stats)

    async def publish(self, round_: int, policy_version: int, groups: list[RolloutGroup]) -> None:
        record, keep = sign_rollout_batch(self.writer, self.fingerprint, round_, policy_version, groups)
        self.exchange.latest[self.identity.node_id] = record.data
        self.stats.batches_published += 1
        self.stats.questions_published += keep
        self.stats.bytes_published += len(record.data)

    async def collect(self) -> list[ExternalGroup]:
        return self.receiver.receive(list(self.exchange.latest.items()), time.time())
