"""Averaging peers for tests: real in-process DHT nodes on 127.0.0.1 (one p2pd each), PairAveragers on them,
and weights to exchange."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import torch

from node.averaging.pairing import PairAverager
from node.transport.joining import shutdown_dht

PREFIX = "swarm-node/v1/test-swarm/avg/aaaaaaaaaaaaaaaa"
OTHER_PREFIX = "swarm-node/v1/test-swarm/avg/bbbbbbbbbbbbbbbb"
FAST = dict(poll_interval=0.1, settle_s=0.5, gather_s=1.0, dht_timeout=3.0)


def ordered_identities(directory, count: int) -> list[str]:
    """`count` p2p identity files, sorted by the peer id they give: the first one is the caller of a pair."""
    from hivemind.p2p import P2P, PeerID

    paths = [str(directory / f"identity-{i}.key") for i in range(count)]
    for path in paths:
        P2P.generate_identity(path)
    return sorted(paths, key=lambda path: PeerID.from_identity(open(path, "rb").read()).to_base58())


@asynccontextmanager
async def swarm(count: int, identities: list[str] | None = None):
    """`count` DHT nodes: the first on 127.0.0.1:0, the others joined to its real addresses."""
    from hivemind.dht.node import DHTNode

    def options(i: int) -> dict:
        return dict(identity_path=identities[i], check_if_identity_free=False) if identities else {}

    nodes = []
    try:
        nodes.append(await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], **options(0)))
        addresses = [str(a) for a in await nodes[0].get_visible_maddrs()]
        nodes += await asyncio.gather(
            *(
                DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addresses, **options(i))
                for i in range(1, count)
            )
        )
        yield nodes
    finally:
        await asyncio.gather(*(shutdown_dht(node, timeout=10) for node in nodes))


class GainsARelayAddress:
    """A DHT node whose daemon, once `relay` is set, also reports a /p2p-circuit address (a relay that reserved it a
    slot after the start, or came back after a restart); everything else is the node's own."""

    def __init__(self, node) -> None:
        self.node = node
        self.relay: list[str] = []

    def __getattr__(self, name):
        return getattr(self.node, name)

    async def get_visible_maddrs(self, latest: bool = False):
        from multiaddr import Multiaddr

        return [*await self.node.get_visible_maddrs(latest=latest), *(Multiaddr(a) for a in self.relay)]


def make_writer():
    """A fresh node identity signing averaging announcements for the test swarm."""
    from node.transport.records import RecordWriter
    from protocol import NodeIdentity

    return RecordWriter(NodeIdentity.generate(), "test-swarm")


def writer_losing_done_announcements():
    """A writer whose "done" announcements never reach the DHT (a store that timed out on a loaded machine),
    while its "free" ones do: its peer stays "free" in everyone's view after its round ended."""
    from node.transport.records import RecordWriter
    from protocol import AveragingReady, NodeIdentity

    class LosesDone(RecordWriter):
        async def store(self, dht, key, message, timeout):
            if isinstance(message, AveragingReady) and message.state == "done":
                return False
            return await super().store(dht, key, message, timeout)

    return LosesDone(NodeIdentity.generate(), "test-swarm")


def writer_slow_to_announce_done(delay_s: float):
    """A writer whose "done" announcements reach the DHT `delay_s` late (a slow store on a loaded machine)."""
    from node.transport.records import RecordWriter
    from protocol import AveragingReady, NodeIdentity

    class SlowDone(RecordWriter):
        async def store(self, dht, key, message, timeout):
            if isinstance(message, AveragingReady) and message.state == "done":
                await asyncio.sleep(delay_s)
            return await super().store(dht, key, message, timeout)

    return SlowDone(NodeIdentity.generate(), "test-swarm")


@asynccontextmanager
async def averagers(nodes, prefixes=None, cls=PairAverager, writers=None, **kwargs):
    """A started averager on each DHT node (`writers[i]`, when given and not None, signs node i's announcements)."""
    started = []
    try:
        for i, (node, prefix) in enumerate(zip(nodes, prefixes or [PREFIX] * len(nodes))):
            writer = (writers[i] if writers and i < len(writers) else None) or make_writer()
            averager = cls(node, prefix, **{**FAST, "writer": writer, **kwargs})
            await averager.start()
            started.append(averager)
        yield started
    finally:
        await asyncio.gather(*(a.stop(timeout=5) for a in started))


def weights(seed: int, rows: int = 16, cols: int = 8) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.Generator().manual_seed(1234)  # shared init: peers stay close, as after regular averaging
    return {
        "w": torch.randn(rows, cols, generator=base) + 0.05 * torch.randn(rows, cols, generator=generator),
        "b": torch.randn(cols, generator=base) + 0.05 * torch.randn(cols, generator=generator),
    }


def snapshot(named):
    return {k: v.clone() for k, v in named.items()}


def assert_untouched(named, before):
    for name in before:
        assert torch.equal(named[name], before[name]), f"{name} was modified"
