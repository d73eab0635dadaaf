"""Behind NAT or not: the observed-address answer on the wire, and the verdict drawn from the answers."""

from __future__ import annotations

import msgpack
import pytest

from node.transport.reachability import has_relay_address, verdict
from protocol import ProtocolRejection, Refusal
from protocol.reachability import decode_observed, encode_observed

GOLDEN_OBSERVED = "82a17601a86f62736572766564bb2f6970342f3139382e31382e3235302e312f7463702f3336353239"  # version 1


def test_golden_observed_address():
    assert encode_observed("/ip4/198.18.250.1/tcp/36529").hex() == GOLDEN_OBSERVED
    assert decode_observed(bytes.fromhex(GOLDEN_OBSERVED)) == "/ip4/198.18.250.1/tcp/36529"


@pytest.mark.parametrize("data, reason", [
    (b"\xc1", Refusal.NOT_MSGPACK),
    (msgpack.packb(["/ip4/1.2.3.4/tcp/1"]), Refusal.BAD_STRUCTURE),
    (msgpack.packb({"v": 1, "observed": "/ip4/1.2.3.4/tcp/1", "extra": 1}), Refusal.BAD_STRUCTURE),
    (msgpack.packb({"v": 2, "observed": "/ip4/1.2.3.4/tcp/1"}), Refusal.UNKNOWN_VERSION),
    (msgpack.packb({"v": 1, "observed": 7}), Refusal.BAD_STRUCTURE),
    (msgpack.packb({"v": 1, "observed": "1.2.3.4:1"}), Refusal.BAD_VALUE),
    (msgpack.packb({"v": 1, "observed": "/" + "x" * 300}), Refusal.STRING_TOO_LONG),
    (msgpack.packb({"v": 1, "observed": "/" + "x" * 600}), Refusal.TOO_LARGE),
])
def test_malformed_answers_are_refused(data, reason):
    with pytest.raises(ProtocolRejection) as caught:
        decode_observed(data)
    assert caught.value.reason is reason


def test_verdict():
    own = ["/ip4/198.19.0.2/tcp/4001/p2p/Qm", "/ip4/127.0.0.1/tcp/4001/p2p/Qm"]
    assert verdict(own, ["/ip4/198.18.250.1/tcp/5555"]) == "outbound-only"  # rewritten by a NAT
    assert verdict(own, ["/ip4/198.18.250.1/tcp/5555", "/ip4/198.19.0.2/tcp/4001"]) == "direct"  # one peer saw us as we are
    assert verdict(own, []) == "direct"  # nobody answered (the first node of a swarm): as before the check
    assert verdict(own, ["/p2p-circuit", "junk"]) == "direct"  # answers without an IP say nothing
    assert has_relay_address(["/ip4/198.18.1.1/tcp/1/p2p/QmA/p2p-circuit/p2p/QmB"]) and not has_relay_address(own)
