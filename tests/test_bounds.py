"""Every per-peer structure stays at its cap while 5,000 throwaway peer ids write to it at full rate."""

from __future__ import annotations

import pytest

from node.stats import MAX_TRACKED_PEERS, LogThrottle, RecordRefusals, SwarmStats
from node.transport.batches import MAX_SENDERS_REMEMBERED, SEEN_PER_SENDER, SeenEnvelopes
from protocol import ProtocolRejection, Refusal

FLOOD = 5000


def fake(i: int) -> str:
    return f"{i:040x}"


def test_swarm_stats_stay_bounded():
    stats = SwarmStats()
    for i in range(FLOOD):
        stats.peer(fake(i)).batches_received += 1
        stats.reject(fake(i), Refusal.BAD_SIGNATURE)
        stats.reject_heartbeat(fake(i), ProtocolRejection(Refusal.SENDER_MISMATCH, "x"))
        stats.records.record(fake(i), "no_subkey", "x")
    assert len(stats.peers) == MAX_TRACKED_PEERS
    assert len(stats.refusals.by_peer()) == MAX_TRACKED_PEERS
    assert len(stats.heartbeat_refusals.by_peer()) == MAX_TRACKED_PEERS
    assert len(stats.records.by_owner) == MAX_TRACKED_PEERS and len(stats.records.log_throttle) == MAX_TRACKED_PEERS
    assert len(stats.heartbeat_log_throttle) == MAX_TRACKED_PEERS
    # Totals stay exact while the per-peer detail is bounded.
    assert stats.refusals.by_reason() == {"bad_signature": FLOOD}
    assert stats.records.by_reason == {"no_subkey": FLOOD}
    assert len(stats.snapshot()["peers"]) <= 2 * MAX_TRACKED_PEERS


def test_a_log_throttle_says_one_line_per_key_and_remembers_only_its_newest_keys():
    throttle = LogThrottle(every_s=3600, cap=2)
    assert throttle.due("peer-a", "bad_signature") and not throttle.due("peer-a", "bad_signature")
    assert throttle.due("peer-a", "too_large")  # another reason is another line
    assert throttle.due("peer-b", "bad_signature") and len(throttle) == 2
    assert throttle.due("peer-a", "bad_signature")  # forgotten: it was the oldest of three keys
    assert all(LogThrottle(every_s=0).due("x") for _ in range(3))


def test_seen_envelopes_stay_bounded():
    seen = SeenEnvelopes()
    for i in range(FLOOD):
        for seq in range(3):
            seen.add(fake(i), seq)
    for seq in range(10 * SEEN_PER_SENDER):
        seen.add(fake(0), seq)
    remembered = seen.remembered()
    assert len(remembered) == MAX_SENDERS_REMEMBERED
    assert max(remembered.values()) == SEEN_PER_SENDER  # fake(0), the last to send, with all of its seqs it may keep


def test_record_refusals_log_at_most_once_a_minute_per_owner_and_reason(caplog):
    refusals = RecordRefusals()
    with caplog.at_level("INFO", logger="node.stats"):
        for _ in range(100):
            refusals.record(fake(1), "no_subkey", "x")
    assert refusals.by_reason["no_subkey"] == 100
    assert sum("refused a DHT record" in r.getMessage() for r in caplog.records) == 1


def test_pipeline_driver_and_server_memories_stay_bounded():
    from node.config import load_config
    from node.pipeline.client import HopFailed
    from node.pipeline.driver import PipelineRouter
    from node.pipeline.stagemap import StageMap
    from protocol import RefusalCounter, StageAnnouncement
    from protocol.pipeline import DEFAULT_PIPELINE_LIMITS
    from protocol.refusals import PipelineRefusal

    router = PipelineRouter(
        dht=None,
        config=load_config(None, ["pipeline.num_stages=2"]),
        model_fingerprint="m",
        stage_fingerprints=["a", "b"],
        limits=DEFAULT_PIPELINE_LIMITS,
    )
    router.map = StageMap(2)
    for i in range(FLOOD):
        server = StageAnnouncement(
            node_id=fake(i),
            p2p_peer_id="p",
            model_fingerprint="m",
            num_stages=2,
            stage=0,
            stage_fingerprint="a",
            layer_start=0,
            layer_end=1,
            parts=["layers"],
            state="serving",
            step=0,
            grad_norm=0.0,
            samples_per_s=0.0,
            recoveries=0,
            replicas=[],
        )
        router.fail(HopFailed(server, "unreachable"))  # one strike each: remembered, not yet avoided
    assert len(router.strikes) <= 4096 and not router.avoid
    server_refusals = RefusalCounter(max_peers=256)  # what a StageServer keeps
    for i in range(FLOOD):
        server_refusals.record(fake(i), PipelineRefusal.BAD_TENSOR)
    assert len(server_refusals.by_peer()) == 256 and server_refusals.by_reason() == {"bad_tensor": FLOOD}


def test_refused_value_memory_stays_bounded(tmp_path):
    from node.config import load_config
    from node.transport.batches import MAX_REFUSED_REMEMBERED
    from node.transport.dht import DHTTransport
    from node.transport.session import SwarmSession
    from protocol import NodeIdentity

    stats = SwarmStats()
    session = SwarmSession(
        load_config(None, ["swarm.transport=dht"]),
        dht=None,
        reachability="direct",
        identity=NodeIdentity.generate(),
        state_dir=tmp_path,
    )
    transport = DHTTransport(session, stats, "f", heartbeat=None)
    for i in range(FLOOD):
        transport.receiver.refuse_once(fake(i), f"value {i}".encode(), ProtocolRejection(Refusal.BAD_SIGNATURE, "x"))
        # re-read: not counted again
        transport.receiver.refuse_once(fake(i), f"value {i}".encode(), ProtocolRejection(Refusal.BAD_SIGNATURE, "x"))
    assert len(transport.receiver.refused) == MAX_REFUSED_REMEMBERED
    assert stats.refusals.by_reason() == {"bad_signature": FLOOD} and len(stats.refusals.by_peer()) == MAX_TRACKED_PEERS


def test_replay_guard_stays_bounded():
    from protocol import MessageKind
    from protocol.envelope import Envelope, ReplayGuard

    guard = ReplayGuard(max_senders=256)
    for i in range(FLOOD):
        guard.check_and_record(
            Envelope(
                version=(1, 0),
                kind=MessageKind.PEER_STATS,
                swarm_id="s",
                sender=i.to_bytes(32, "big"),
                sender_id=fake(i),
                seq=1,
                timestamp=0.0,
                message=None,
            )
        )
    assert len(guard._highest) == 256


def test_gossip_receive_buffer_stays_bounded():
    from node.transport.gossip_libp2p import LibP2PGossip

    gossip = LibP2PGossip(max_buffered=128)  # never started: the buffer is what the trio thread fills
    for i in range(FLOOD):
        gossip._buffer("topic", fake(i).encode())
    assert len(gossip._inbox["topic"]) == 128 and gossip.dropped("topic") == FLOOD - 128
    assert gossip.drain("topic")[-1] == fake(FLOOD - 1).encode()  # the newest are kept
    assert len(gossip._dropped_since_drain) == 0 and list(gossip._inbox) == ["topic"]


@pytest.mark.integration
def test_gossip_peerstore_stays_bounded_under_a_flood_of_advertised_peers():
    """Heartbeats of throwaway ids each advertising a gossip address: every dial fails (nothing listens),
    one call dials at most MAX_DIALS_PER_CONNECT of them, and what the host remembers stays at
    py-libp2p's peerstore cap."""
    import asyncio

    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    from node.transport.gossip_libp2p import MAX_DIALS_PER_CONNECT, LibP2PGossip

    count = 1200
    addresses = [
        f"/ip4/127.0.0.1/tcp/1/p2p/{ID.from_pubkey(create_new_key_pair().public_key).to_base58()}" for _ in range(count)
    ]

    async def flood() -> tuple[int, int, int]:
        gossip = LibP2PGossip()
        await gossip.start()
        try:
            peerstore = gossip._host.get_peerstore()
            assert await gossip.connect(addresses) == 0  # the whole flood in one heartbeat
            after_one_call = len(peerstore.peer_ids())
            for start in range(0, count, MAX_DIALS_PER_CONNECT):
                assert await gossip.connect(addresses[start : start + MAX_DIALS_PER_CONNECT]) == 0
            assert gossip.running
            return after_one_call, len(peerstore.peer_ids()), peerstore.max_peers
        finally:
            await gossip.stop()

    after_one_call, remembered, cap = asyncio.run(flood())
    assert after_one_call <= MAX_DIALS_PER_CONNECT + 1  # + 1: the host itself
    assert remembered <= cap + 1 < count


def test_averaging_round_memories_stay_bounded():
    import msgpack

    from node.averaging.exchange import _KNOWN_REFUSALS, _parse_refusal
    from node.averaging.matchmaking import MAX_GROUP_PARTNERS, MAX_ROUND_PEERS, CallRefusal, Round

    rnd = Round(round_id=1, theta={}, payload=b"", capacity=MAX_GROUP_PARTNERS, deadline=float("inf"))  # all mode
    for i in range(FLOOD):
        rnd.given_up.add(fake(i))
        rnd.failed_calls.bump(fake(i))
        if rnd.refusal_for(fake(i)) is None:  # what an acceptor checks before it takes a caller in
            rnd.engaged.add(fake(i))
    assert len(rnd.given_up) == MAX_ROUND_PEERS and len(rnd.failed_calls) == MAX_ROUND_PEERS
    assert fake(FLOOD - 1) in rnd.given_up and fake(0) not in rnd.given_up  # the oldest are forgotten first
    assert len(rnd.engaged) == 0  # every id was already given up: refused before any weights
    fresh = Round(round_id=1, theta={}, payload=b"", capacity=MAX_GROUP_PARTNERS, deadline=float("inf"))
    for i in range(FLOOD):
        if fresh.refusal_for(fake(i)) is None:
            fresh.engaged.add(fake(i))
    assert len(fresh.engaged) == MAX_GROUP_PARTNERS and fresh.refusal_for(fake(FLOOD + 1)) is CallRefusal.BUSY
    # Partners' refusal reasons become counter keys: only our own vocabulary gets through.
    reasons = {_parse_refusal(msgpack.packb({"reason": f"made up {i}"})) for i in range(FLOOD)}
    reasons |= {_parse_refusal(msgpack.packb({"reason": reason})) for reason in _KNOWN_REFUSALS}
    assert reasons == _KNOWN_REFUSALS | {"unknown"}


def test_a_bounded_dict_forgets_the_least_recently_set_first():
    from protocol.bounded import BoundedDict

    seen: BoundedDict[str, int] = BoundedDict(3)
    for key, value in [("a", 1), ("b", 2), ("c", 3)]:
        seen[key] = value
    seen["a"] = 10  # set again: the newest now
    seen["d"] = 4
    assert list(seen.items()) == [("c", 3), ("a", 10), ("d", 4)]  # "b" went first, then would "c"
    seen.update({"e": 5})
    assert list(seen) == ["a", "d", "e"] and seen.setdefault("f", 6) == 6 and list(seen) == ["d", "e", "f"]
    copied = seen.copy()
    copied["g"] = 7
    assert isinstance(copied, BoundedDict) and len(copied) == 3 and list(seen) == ["d", "e", "f"]
    with pytest.raises(ValueError):
        BoundedDict(0)
