"""Every per-peer structure stays at its cap while 5,000 throwaway peer ids write to it at full rate."""

from __future__ import annotations

import re

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


def test_gossip_receive_buffer_stays_bounded_in_bytes_and_counts_what_it_drops():
    import random

    from node.transport.gossip_libp2p import LibP2PGossip

    cap = 1 << 20
    gossip = LibP2PGossip(max_buffered=FLOOD, max_buffered_bytes=cap)  # the count never binds: only the bytes
    rng = random.Random(0)
    sent = [rng.randbytes(rng.randrange(1, 64 << 10)) for _ in range(FLOOD)]  # a peer chooses every message's size
    for data in sent:
        gossip._buffer("topic", data)
        assert gossip.buffered_bytes() <= cap
    kept = gossip.drain("topic")
    assert kept == sent[-len(kept) :] and sum(map(len, kept)) > cap - (64 << 10)  # the newest, as many as fit
    assert gossip.dropped("topic") == FLOOD - len(kept)
    assert gossip.dropped_bytes("topic") == sum(map(len, sent)) - sum(map(len, kept))
    assert gossip.buffered_bytes() == 0
    oversized = LibP2PGossip(max_buffered_bytes=10)
    oversized._buffer("topic", b"x" * 11)  # one message beyond the bound alone is not kept either
    assert oversized.drain("topic") == [] and oversized.dropped_bytes("topic") == 11


def test_a_shed_empties_the_gossip_buffer_and_the_dht_cache_and_counts_it(tmp_path):
    from types import SimpleNamespace

    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils.timed_storage import get_dht_time

    from node.config import load_config
    from node.transport.dht import DHTTransport
    from node.transport.gossip_libp2p import LibP2PGossip
    from node.transport.null import NullTransport
    from node.transport.session import SwarmSession
    from protocol import NodeIdentity

    cache = DHTLocalStorage()
    cache.store(DHTID.generate(source="plain"), b"v" * 1000, get_dht_time() + 60)
    cache.store_subkey(DHTID.generate(source="dictionary"), "subkey", b"w" * 500, get_dht_time() + 60)
    stats = SwarmStats()
    session = SwarmSession(
        load_config(None, ["swarm.transport=dht"]),
        dht=SimpleNamespace(protocol=SimpleNamespace(cache=cache)),  # a DHT node's cache, and nothing else of it
        reachability="direct",
        identity=NodeIdentity.generate(),
        state_dir=tmp_path,
    )
    transport = DHTTransport(session, stats, "f", heartbeat=None)
    transport.gossip = LibP2PGossip()  # never started: the buffer is what the trio thread fills
    for i in range(10):
        transport.gossip._buffer(transport.rollouts_topic, b"m" * 100)
    assert transport.shed_buffers() == 10 * 100 + 1000 + 500
    assert transport.gossip.buffered_bytes() == 0 and list(cache.items()) == []
    assert transport.gossip.dropped(transport.rollouts_topic) == 10
    assert transport.gossip.drain(transport.rollouts_topic) == [] and transport.shed_buffers() == 0
    assert NullTransport().shed_buffers() == 0  # a transport that holds nothing of peers' sheds nothing


def test_a_memory_budget_sheds_peers_buffers_says_so_in_one_line_and_metrics_count_it(caplog):
    from node.host_memory import MemoryBudget
    from node.stats import prometheus_text
    from node.transport.gossip_libp2p import LibP2PGossip

    gossip = LibP2PGossip(max_buffered=FLOOD)
    for i in range(FLOOD):
        gossip._buffer("topic", fake(i).encode())
    resident = iter([100 << 20, 300 << 20, 250 << 20, 300 << 20, 300 << 20])  # MiB read before and after each shed
    trims = []
    calls = []
    budget = MemoryBudget(
        200 << 20,
        {"gossip": lambda: calls.append("gossip") or gossip.shed(), "cache": lambda: calls.append("cache") or 0},
        resident=lambda: next(resident),
        hand_back=lambda: trims.append(1),
    )
    stats = SwarmStats()
    with caplog.at_level("WARNING", logger="node.host_memory"):
        assert budget.check() is None and calls == []  # under the budget: nothing read but the resident size
        report = budget.check()
        assert report is not None and report.shed == {"gossip": FLOOD * 40}  # what shed nothing is not reported
        assert (report.rss_before, report.rss_after) == (300 << 20, 250 << 20) and trims == [1]
        stats.count_shed(report)
        assert budget.check() is None and budget.check() is None  # over, with nothing left of peers' to shed
    lines = [r.getMessage() for r in caplog.records]
    assert (
        lines[0] == ("resident memory 300 MiB was over the budget of 200 MiB: shed gossip 0.2 MiB; now 250 MiB")
        and len(lines) == 2
    )  # and the "nothing to shed" line once, not at every check
    assert calls == ["gossip", "cache"] * 3 and gossip.dropped("topic") == FLOOD and trims == [1]
    assert budget.times_shed == 1 and budget.bytes_shed == FLOOD * 40 and budget.times_over_with_nothing_to_shed == 2
    metrics = prometheus_text({}, stats)
    assert (
        "swarm_node_memory_sheds_total 1" in metrics and f"swarm_node_memory_bytes_shed_total {FLOOD * 40}" in metrics
    )
    assert "swarm_node_gossip_bytes_dropped_total 0" in metrics


def test_a_memory_budget_reads_the_process_resident_memory():
    from node.host_memory import MemoryBudget, resident_bytes

    assert 10 << 20 < resident_bytes() < 64 << 30
    held = [bytearray(8 << 20)]
    report = MemoryBudget(1, {"held": lambda: len(held.pop()) if held else 0}).check()  # every process is over 1 byte
    assert report is not None and report.shed == {"held": 8 << 20} and report.rss_before > 0 and report.rss_after > 0


def test_dht_storage_and_cache_stay_bounded_in_bytes_across_keys():
    """Throwaway identities storing under ever new keys: each key is small, all of them together are refused past the
    bound, and what expired makes room again at the next count."""
    import time

    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DictionaryDHTValue

    from node.transport.records import STORAGE_RECOUNT_S, BoundedKeyStorage, value_bytes

    refusals = RecordRefusals()
    clock = [0.0]
    storage = BoundedKeyStorage(refusals, max_key_bytes=1000, max_bytes=10_000, clock=lambda: clock[0])
    soon = time.time() + 5  # far past the stores below on a loaded machine: none expires before it is counted
    stored = sum(storage.store_subkey(DHTID.generate(source=f"k{i}"), fake(i), b"x" * 400, soon) for i in range(FLOOD))
    assert stored == 25 and storage.held_bytes == storage.count_held_bytes() == 10_000
    assert refusals.by_reason == {"storage_full": FLOOD - 25} and len(refusals.by_owner) == MAX_TRACKED_PEERS
    time.sleep(max(0.0, soon - time.time()) + 0.1)  # every record expired: hivemind drops them at its next read
    assert not storage.store_subkey(DHTID.generate(source="late"), "l" * 40, b"y" * 400, time.time() + 60)  # not yet
    clock[0] += STORAGE_RECOUNT_S  # the next count finds them gone
    assert storage.store_subkey(DHTID.generate(source="late"), "l" * 40, b"y" * 400, time.time() + 60)
    assert storage.held_bytes == 400
    # The cache holds whole values found (a dictionary's, or plain ones): bounded the same way.
    cache = BoundedKeyStorage(RecordRefusals(), max_bytes=5000)
    found = DictionaryDHTValue()
    found.store("s" * 40, b"z" * 3000, time.time() + 60)
    assert cache.store(DHTID.generate(source="found"), found, time.time() + 60) and cache.held_bytes == 3000
    assert sum(cache.store(DHTID.generate(source=f"p{i}"), b"p" * 400, time.time() + 60) for i in range(100)) == 5
    assert cache.count_held_bytes() == value_bytes(found) + 5 * 400 <= 5000
    cache.clear()
    assert cache.held_bytes == 0 and cache.store(DHTID.generate(source="again"), b"p" * 400, time.time() + 60)


def test_a_node_over_its_memory_budget_sheds_its_transports_buffers_each_round(tiny_config, caplog):
    """The budget is wired into the round: a node over swarm.rss_budget_mb (1 MiB: every process is over it) asks its
    transport to drop what peers filled, once a round, and counts it."""
    import asyncio

    from node.loop import Node
    from node.transport.null import NullTransport

    class Holding(NullTransport):
        """Holds 4 MiB of peers' messages until asked to drop them."""

        held = 4 << 20

        def shed_buffers(self) -> int:
            dropped, self.held = self.held, 0
            return dropped

    node = Node(tiny_config("swarm.rss_budget_mb=1"), transport=Holding())
    node.load()
    with caplog.at_level("WARNING", logger="node.host_memory"):
        asyncio.run(node.run_round())
        asyncio.run(node.run_round())
    assert node.stats.memory_sheds == 1 and node.stats.memory_bytes_shed == 4 << 20
    said = [r.getMessage() for r in caplog.records]
    shed_line = r"resident memory \d+ MiB was over the budget of 1 MiB: shed peers' buffers 4\.0 MiB; now \d+ MiB"
    assert re.fullmatch(shed_line, said[0]), said[0]
    assert "no peers' buffer holds anything to shed" in said[1]  # the second round: nothing of peers' left
