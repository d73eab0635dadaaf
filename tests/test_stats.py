import asyncio
import json

from node.stats import MAX_TRACKED_PEERS, MetricsServer, SwarmStats, prometheus_text
from protocol import Refusal


def test_counters_snapshot_and_round_rejections(tmp_path):
    stats = SwarmStats()
    stats.peer("a").batches_received += 2
    stats.peer("a").questions_used += 3
    stats.reject("a", Refusal.BAD_SIGNATURE)
    stats.reject("b", Refusal.REPLAY)
    stats.reject("b", Refusal.REPLAY)
    assert stats.take_round_rejections() == {"bad_signature": 1, "replay": 2}
    assert stats.take_round_rejections() == {}
    totals = stats.totals()
    assert totals["rejected"] == {"bad_signature": 1, "replay": 2} and totals["questions_used"] == 3
    stats.save(tmp_path / "swarm.json")
    saved = json.loads((tmp_path / "swarm.json").read_text())
    assert saved["peers"]["a"]["rejected"] == {"bad_signature": 1}
    assert saved["peers"]["b"]["rejected"] == {"replay": 2} and saved["peers"]["b"]["batches_received"] == 0


def test_tracked_peers_are_bounded():
    stats = SwarmStats()
    for i in range(MAX_TRACKED_PEERS + 50):
        stats.peer(f"p{i}")
        stats.reject(f"p{i}", Refusal.BAD_VALUE)
    assert len(stats.peers) == MAX_TRACKED_PEERS and "p0" not in stats.peers
    assert len(stats.refusals.by_peer()) <= MAX_TRACKED_PEERS
    assert stats.totals()["rejected"] == {"bad_value": MAX_TRACKED_PEERS + 50}


def test_metrics_endpoint_serves_prometheus_text():
    stats = SwarmStats()
    stats.peer('odd"peer').batches_accepted += 1
    stats.reject("x", Refusal.STALE)

    async def scrape():
        server = MetricsServer("127.0.0.1", 0, lambda: prometheus_text({"round": 7}, stats))
        await server.start()
        try:
            replies = []
            for path in (b"/metrics", b"/other"):
                reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n")
                await writer.drain()
                replies.append((await asyncio.wait_for(reader.read(), 10)).decode())
                writer.close()
            return replies
        finally:
            await server.stop()

    metrics, other = asyncio.run(scrape())
    assert metrics.startswith("HTTP/1.1 200 OK")
    assert "swarm_node_round 7.0" in metrics
    assert 'swarm_node_peer_batches_accepted_total{peer="odd\\"peer"} 1' in metrics
    assert 'swarm_node_peer_rejected_total{peer="x",reason="stale"} 1' in metrics
    assert other.startswith("HTTP/1.1 404")


def test_seen_envelopes_are_bounded():
    from node.transport.batches import MAX_SENDERS_REMEMBERED, SEEN_PER_SENDER, SeenEnvelopes

    seen = SeenEnvelopes()
    for seq in range(SEEN_PER_SENDER + 10):
        seen.add("a", seq)
    assert seen.seen("a", SEEN_PER_SENDER + 9) and not seen.seen("a", 0) and seen.oldest("a") == 10
    for i in range(MAX_SENDERS_REMEMBERED + 5):
        seen.add(f"s{i}", 1)
    assert not seen.seen("a", SEEN_PER_SENDER + 9) and seen.seen(f"s{MAX_SENDERS_REMEMBERED + 4}", 1)
