"""Every per-peer structure stays at its cap while 5,000 throwaway peer ids write to it at full rate."""

from __future__ import annotations

from node.stats import MAX_TRACKED_PEERS, RecordRefusals, SwarmStats
from node.transport.dht import MAX_SENDERS_REMEMBERED, SEEN_PER_SENDER, _SeenEnvelopes
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
    assert len(stats.records.by_owner) == MAX_TRACKED_PEERS and len(stats.records._logged) <= MAX_TRACKED_PEERS
    assert len(stats._heartbeat_logged) <= MAX_TRACKED_PEERS
    # Totals stay exact while the per-peer detail is bounded.
    assert stats.refusals.by_reason() == {"bad_signature": FLOOD}
    assert stats.records.by_reason == {"no_subkey": FLOOD}
    assert len(stats.snapshot()["peers"]) <= 2 * MAX_TRACKED_PEERS


def test_seen_envelopes_stay_bounded():
    seen = _SeenEnvelopes()
    for i in range(FLOOD):
        for seq in range(3):
            seen.add(fake(i), seq)
    for seq in range(10 * SEEN_PER_SENDER):
        seen.add(fake(0), seq)
    assert len(seen._by_sender) == MAX_SENDERS_REMEMBERED
    assert all(len(seqs) <= SEEN_PER_SENDER for seqs in seen._by_sender.values())


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

    router = PipelineRouter(dht=None, config=load_config(None, ["pipeline.num_stages=2"]), model_fingerprint="m", stage_fingerprints=["a", "b"], limits=DEFAULT_PIPELINE_LIMITS)
    router.map = StageMap(2)
    for i in range(FLOOD):
        server = StageAnnouncement(node_id=fake(i), p2p_peer_id="p", model_fingerprint="m", num_stages=2, stage=0, stage_fingerprint="a", layer_start=0,
                                   layer_end=1, parts=["layers"], state="serving", step=0, grad_norm=0.0, samples_per_s=0.0, recoveries=0, replicas=[])
        router.fail(HopFailed(server, "unreachable"))  # one strike each: remembered, not yet avoided
    assert len(router.strikes) <= 4096 and not router.avoid
    server_refusals = RefusalCounter(max_peers=256)  # what a StageServer keeps
    for i in range(FLOOD):
        server_refusals.record(fake(i), PipelineRefusal.BAD_TENSOR)
    assert len(server_refusals.by_peer()) == 256 and server_refusals.by_reason() == {"bad_tensor": FLOOD}
