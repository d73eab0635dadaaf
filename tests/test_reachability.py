"""Behind NAT or not: the observed-address answer on the wire, the verdict drawn from the answers, and the
daemon a NAT'd node runs to get a relay slot (the slot itself needs public addresses: tests/test_nat.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest

from node.transport.reachability import has_relay_address, start_relay_client, verdict, wait_for_relay_address
from protocol import ProtocolRejection, Refusal
from protocol.reachability import decode_observed, encode_observed

GOLDEN_OBSERVED = "82a17601a86f62736572766564bb2f6970342f3139382e31382e3235302e312f7463702f3336353239"  # version 1


def test_golden_observed_address():
    assert encode_observed("/ip4/198.18.250.1/tcp/36529").hex() == GOLDEN_OBSERVED
    assert decode_observed(bytes.fromhex(GOLDEN_OBSERVED)) == "/ip4/198.18.250.1/tcp/36529"


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"\xc1", Refusal.NOT_MSGPACK),
        (msgpack.packb(["/ip4/1.2.3.4/tcp/1"]), Refusal.BAD_STRUCTURE),
        (msgpack.packb({"v": 1, "observed": "/ip4/1.2.3.4/tcp/1", "extra": 1}), Refusal.BAD_STRUCTURE),
        (msgpack.packb({"v": 2, "observed": "/ip4/1.2.3.4/tcp/1"}), Refusal.UNKNOWN_VERSION),
        (msgpack.packb({"v": 1, "observed": 7}), Refusal.BAD_STRUCTURE),
        (msgpack.packb({"v": 1, "observed": "1.2.3.4:1"}), Refusal.BAD_VALUE),
        (msgpack.packb({"v": 1, "observed": "/" + "x" * 300}), Refusal.STRING_TOO_LONG),
        (msgpack.packb({"v": 1, "observed": "/" + "x" * 600}), Refusal.TOO_LARGE),
    ],
)
def test_malformed_answers_are_refused(data, reason):
    with pytest.raises(ProtocolRejection) as caught:
        decode_observed(data)
    assert caught.value.reason is reason


def test_verdict():
    own = ["/ip4/198.19.0.2/tcp/4001/p2p/Qm", "/ip4/127.0.0.1/tcp/4001/p2p/Qm"]
    assert verdict(own, ["/ip4/198.18.250.1/tcp/5555"]) == "outbound-only"  # rewritten by a NAT
    # one peer saw us as we are
    assert verdict(own, ["/ip4/198.18.250.1/tcp/5555", "/ip4/198.19.0.2/tcp/4001"]) == "direct"
    assert verdict(own, []) == "direct"  # nobody answered (the first node of a swarm): as before the check
    assert verdict(own, ["/p2p-circuit", "junk"]) == "direct"  # answers without an IP say nothing
    assert has_relay_address(["/ip4/198.18.1.1/tcp/1/p2p/QmA/p2p-circuit/p2p/QmB"]) and not has_relay_address(own)


class ScriptedAddresses:
    """A P2P stand-in whose daemon reports no address, then a direct one, then a relay slot too."""

    def __init__(self):
        self.calls = 0

    async def get_visible_maddrs(self, latest: bool = False):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("No multiaddrs found")  # hivemind's way of saying: none yet
        direct = ["/ip4/192.168.0.2/tcp/4001/p2p/QmB"]
        return direct if self.calls < 3 else [*direct, "/ip4/198.20.1.1/tcp/1/p2p/QmA/p2p-circuit/p2p/QmB"]


def test_waiting_for_a_relay_slot_returns_the_circuit_addresses_or_nothing_at_its_bound():
    assert asyncio.run(wait_for_relay_address(ScriptedAddresses(), timeout=30, every_s=0.01)) == [
        "/ip4/198.20.1.1/tcp/1/p2p/QmA/p2p-circuit/p2p/QmB"
    ]

    class NeverRelayed(ScriptedAddresses):
        async def get_visible_maddrs(self, latest: bool = False):
            self.calls += 1
            return ["/ip4/192.168.0.2/tcp/4001/p2p/QmB"]

    never = NeverRelayed()
    assert asyncio.run(wait_for_relay_address(never, timeout=0.05, every_s=0.01)) == [] and never.calls >= 2


def test_a_relay_client_daemon_asks_only_its_static_relays_and_believes_itself_private():
    """The flags hivemind cannot pass reach p2pd's command line, and the DHT node shuts its handed-over daemon down."""
    from node.transport.protobuf_shim import import_hivemind_isolated

    import_hivemind_isolated()
    from hivemind.dht.node import DHTNode

    async def run():
        relay = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            maddrs = [str(a) for a in await relay.get_visible_maddrs()]
            node = await start_relay_client(
                DHTNode,
                {"initial_peers": maddrs, "client_mode": True},
                {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "trusted_relays": maddrs},
            )
            daemon = node.p2p._child
            try:
                argv = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
                assert {b"-relayDiscovery=0", b"-autoRelay=1", b"-forceReachabilityPrivate=1", b"-dhtClient=1"} <= set(
                    argv
                ), argv
                assert any(arg.startswith(b"-trustedRelays=") for arg in argv), argv
            finally:
                await node.shutdown()
            assert daemon.returncode is not None
        finally:
            await relay.shutdown()

    asyncio.run(run())
