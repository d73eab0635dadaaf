import asyncio
import json

from node.stats import MAX_TRACKED_PEERS, ClockReading, MetricsServer, SwarmStats, prometheus_text
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
    assert seen.seen("a", SEEN_PER_SENDER + 9) and not seen.seen("a", 0) and seen.forgotten_up_to("a") == 9
    for i in range(MAX_SENDERS_REMEMBERED + 5):
        seen.add(f"s{i}", 1)
    assert not seen.seen("a", SEEN_PER_SENDER + 9) and seen.seen(f"s{MAX_SENDERS_REMEMBERED + 4}", 1)


def test_a_rounds_metrics_row_hand_computed():
    """Telemetry.round_row: the keys tests, benchmarks and the dashboard read, and those only some nodes write."""
    from node.config import load_config
    from node.rollouts.base import Completion, GenerationWork, RolloutGroup
    from node.telemetry import Telemetry
    from node.trainer import TrainStats
    from protocol import TaskSpec
    from tests.helpers.common import REPO

    def group(completions: int) -> RolloutGroup:
        sampled = [Completion([1], [2], "2", None, "stop", policy_version=0)] * completions
        spec = TaskSpec("basic_arithmetic", {}, 1, 0)
        return RolloutGroup(spec, sampled, [1.0] * completions)

    def row(
        *overrides: str, train: TrainStats, peer_groups: list[RolloutGroup], outer_step=None, records_decoded=0
    ) -> dict:
        stats = SwarmStats()
        stats.reject("p", Refusal.REPLAY)
        stats.values_decoded = records_decoded  # what the transport's receiver decoded since the node started
        telemetry = Telemetry(load_config(REPO / "configs" / "isolated.yaml", list(overrides)), stats)
        made = telemetry.round_row(
            3,
            {"reward_mean": 0.25, "accuracy": 0.5},
            train,
            policy_version=7,
            policy_report={"stage_grad_norms": [1.0]},
            own_groups=[group(4), group(4)],
            peer_groups=peer_groups,
            peers_rescored=3,
            peers_gated=1,
            peer_completions_rescored=6,
            outer_step=outer_step,
            generation_s=1.0,
            scoring_s=2.0,
            sharing_s=3.0,
            update_s=4.0,
            generation_work=GenerationWork(prefill_tokens=100, decode_tokens=40, decode_steps=5),
        )
        assert stats.take_round_rejections() == {}  # taken into the row: the next row counts from here
        assert isinstance(made.pop("time"), float)
        return made

    train = TrainStats(
        0.5,
        1.5,
        0.1,
        0.01,
        groups_used=3,
        groups_dropped=1,
        forward_tokens=10,
        train_tokens=20,
        train_calls=2,
        optimizer_steps=1,
    )
    work = {
        "prefill_tokens": 100,
        "decode_tokens": 40,
        "decode_steps": 5,
        "forward_tokens": 10,
        "train_tokens": 20,
        "train_calls": 2,
        "optimizer_steps": 1,
        "records_decoded": 0,
        "groups_rederived": 0,
    }
    isolated = row(train=train, peer_groups=[])
    assert list(isolated.items()) == [
        ("round", 3),
        ("reward_mean", 0.25),
        ("accuracy", 0.5),
        ("policy_version", 7),
        ("loss", 0.5),
        ("grad_norm", 1.5),
        ("clip_fraction", 0.1),
        ("kl", 0.01),
        ("groups_used", 3),
        ("groups_dropped", 1),
        ("stage_grad_norms", [1.0]),
        ("external_questions", 0),
        ("rejected", {"replay": 1}),
        ("generation_s", 1.0),
        ("scoring_s", 2.0),
        ("update_s", 4.0),
        ("work", {**work, "scored_completions": 8}),  # its own 2 x 4 completions; it re-scores nobody's
    ]
    train.importance_weight_mean, train.imitation_sequences, train.imitation_nll = 0.8, 2, 1.25
    peers = [group(3), group(3)]
    swarm = row(
        "swarm.transport=dht",
        "swarm.external_questions=2",
        train=train,
        peer_groups=peers,
        outer_step={"outcome": "applied"},
        records_decoded=2,
    )
    assert {key: swarm[key] for key in swarm.keys() - isolated.keys()} == {
        "importance_weight_mean": 0.8,
        "imitation_sequences": 2,
        "imitation_nll": 1.25,
        "external_rescored": 3,
        "outer_step": {"outcome": "applied"},
        "sharing_s": 3.0,
    }
    assert swarm["external_questions"] == 2 and swarm["work"]["scored_completions"] == 8 + 6  # its own, and re-scored
    assert (swarm["work"]["records_decoded"], swarm["work"]["groups_rederived"]) == (2, 3)
    assert (isolated["work"]["records_decoded"], isolated["work"]["groups_rederived"]) == (0, 0)


def test_the_heartbeat_and_gauges_carry_the_last_rounds_overlap_and_nothing_where_it_is_off():
    """Telemetry.record_round takes a round's overlap keys (rollout.max_staleness, rollout.over_sample); the heartbeat
    carries them, clipped into the protocol's bounds so that the node's own check never refuses it, and /metrics has a
    gauge for each one set."""
    from node.config import load_config
    from node.telemetry import Telemetry
    from protocol.messages import MAX_AHEAD_WAIT_S, MAX_SAMPLER_IDLE_S, MAX_VERSIONS_BEHIND
    from tests.helpers.common import REPO
    from tests.helpers.messages import IDENTITY, decode, encode

    telemetry = Telemetry(load_config(REPO / "configs" / "isolated.yaml", []), SwarmStats())
    base = {"reward_mean": 0.5, "accuracy": 0.25, "tokens_per_s": 10.0}
    heartbeat = lambda: telemetry.heartbeat(IDENTITY.node_id, 1, 3, 2, [])  # noqa: E731
    overlap = ("staleness_mean", "staleness_max", "carried_in", "carried_out", "ahead_wait_s", "sampler_idle_s")
    telemetry.record_round(base)  # the default config: no overlap keys in the row
    assert [getattr(heartbeat(), name) for name in overlap] == [None] * len(overlap)
    gauges = telemetry.prometheus(3, 2)
    assert "staleness" not in gauges and "carried" not in gauges and "sampler_idle" not in gauges

    first = {"staleness_mean": 0.75, "staleness_max": 1, "ahead_wait_s": None, "sampler_idle_s": None}
    telemetry.record_round({**base, **first})
    sent = decode(encode(heartbeat())).message
    assert (sent.staleness_mean, sent.staleness_max, sent.carried_in, sent.ahead_wait_s) == (0.75, 1, None, None)
    assert sent.sampler_idle_s is None and "sampler_idle" not in telemetry.prometheus(3, 2)
    telemetry.record_round(
        {
            **base,
            "staleness_mean": 1.5,
            "staleness_max": 3,
            "carried_in": 4,
            "carried_out": 6,
            "ahead_wait_s": 0.25,
            "sampler_idle_s": 0.125,
        }
    )
    sent = decode(encode(heartbeat())).message
    assert [getattr(sent, name) for name in overlap] == [1.5, 3, 4, 6, 0.25, 0.125]
    gauges = telemetry.prometheus(3, 2)
    for line in (
        "swarm_node_staleness_mean 1.5",
        "swarm_node_staleness_max 3.0",
        "swarm_node_carried_in 4.0",
        "swarm_node_carried_out 6.0",
        "swarm_node_ahead_wait_s 0.25",
        "swarm_node_sampler_idle_s 0.125",
    ):
        assert line in gauges.splitlines(), line
    assert "# TYPE swarm_node_staleness_mean gauge" in gauges

    telemetry.record_round(
        {**base, "staleness_mean": 5e6, "staleness_max": 5_000_000, "ahead_wait_s": 1e9, "sampler_idle_s": 1e9}
    )
    sent = decode(encode(heartbeat())).message  # past the bounds: clipped, still sent
    assert (sent.staleness_mean, sent.staleness_max) == (float(MAX_VERSIONS_BEHIND), MAX_VERSIONS_BEHIND)
    assert sent.ahead_wait_s == MAX_AHEAD_WAIT_S and sent.sampler_idle_s == MAX_SAMPLER_IDLE_S
    assert sent.carried_in is None
    telemetry.record_round({**base, "sampler_idle_s": -0.5})  # a clock that stepped back: clipped to none idle
    assert decode(encode(heartbeat())).message.sampler_idle_s == 0.0
    telemetry.record_round(base)  # the feature off again (a restart with the default config): nothing stays
    assert [getattr(heartbeat(), name) for name in overlap] == [None] * len(overlap)


def test_the_stats_command_summarizes_the_overlap_only_where_rounds_had_it(tmp_path):
    import argparse
    import contextlib
    import io

    from rich.console import Console

    from node.commands import cmd_stats

    def row(round_: int, **overlap) -> dict:
        return {
            "round": round_,
            "time": float(round_),
            "policy_version": round_,
            "reward_mean": 0.5,
            "accuracy": 0.25,
            "tokens_per_s": 10.0,
            "step_s": 1.0,
            **overlap,
        }

    def stats(rows: list[dict]) -> tuple[dict, str]:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        args = argparse.Namespace(state_dir=str(tmp_path), json=False)
        printed = io.StringIO()
        assert cmd_stats(args, Console(file=printed, width=200)) == 0
        printed_json = io.StringIO()
        with contextlib.redirect_stdout(printed_json):  # --json prints with print()
            assert cmd_stats(argparse.Namespace(state_dir=str(tmp_path), json=True), Console(file=io.StringIO())) == 0
        return json.loads(printed_json.getvalue()), printed.getvalue()

    summary, table = stats([row(1), row(2)])
    assert not {"staleness_mean", "staleness_max", "carried_in_total", "ahead_wait_s_mean"} & summary.keys()
    assert not {"sampler_idle_s_mean", "sampler_idle_s_total"} & summary.keys()
    assert "stale" not in table and "carried" not in table and "ahead_wait" not in table and "idle" not in table

    summary, table = stats(
        [
            # the first round generates its own: nothing waited on, either way
            row(1, staleness_mean=1.0, staleness_max=1, ahead_wait_s=None, sampler_idle_s=None),
            row(
                2,
                staleness_mean=0.5,
                staleness_max=2,
                ahead_wait_s=0.5,
                sampler_idle_s=0.25,
                carried_in=3,
                carried_out=1,
            ),
            row(
                3,
                staleness_mean=0.0,
                staleness_max=0,
                ahead_wait_s=1.5,
                sampler_idle_s=0.75,
                carried_in=1,
                carried_out=0,
            ),
        ]
    )
    assert summary["staleness_mean"] == 0.5 and summary["staleness_max"] == 2
    assert (summary["carried_in_total"], summary["carried_out_total"]) == (4, 1)
    assert (summary["ahead_wait_s_mean"], summary["ahead_wait_s_total"]) == (1.0, 2.0)
    assert (summary["sampler_idle_s_mean"], summary["sampler_idle_s_total"]) == (0.5, 1.0)
    for line in (
        "staleness_mean",
        "staleness_max",
        "carried_in_total",
        "carried_out_total",
        "ahead_wait_s_mean",
        "sampler_idle_s_mean",
        "sampler_idle_s_total",
    ):
        assert line in table, line


def test_a_nodes_clock_offset_is_minus_the_median_of_its_peers_leads_hand_computed():
    """A message arrives after it is signed, so a peer's lead is the largest (signed time - arrival) of its recent
    messages; the node's offset is minus the median over peers, which a minority signing false times cannot move far."""
    from node.stats import ClockOffsets

    monotonic = [0.0]
    clock = ClockOffsets(own_id="me", window_s=40.0, clock=lambda: monotonic[0])
    assert clock.reading() is None
    clock.observe("me", signed_at=1300.0, now=1300.0)  # its own record, read back from the DHT: no peer's clock
    clock.observe("a", signed_at=1000.0, now=1300.0)  # a heartbeat read 300 s "late": this node is ahead
    clock.observe("a", signed_at=990.0, now=1300.0)  # an older record of a's: not its lead
    clock.observe("b", signed_at=995.0, now=1300.0)
    clock.observe("c", signed_at=1001.0, now=1302.0)
    clock.observe("liar", signed_at=1600.0, now=1300.0)  # claims to be 300 s ahead of this node
    assert clock.peer_leads() == {"a": -300.0, "b": -305.0, "c": -301.0, "liar": 300.0}
    # median of (-305, -301, -300, 300) = (-301 - 300) / 2
    assert clock.reading() == ClockReading(offset_s=300.5, peers=4)
    monotonic[0] = 25.0  # a's clock heard again in a new half of the window: the earlier half still counts
    clock.observe("a", signed_at=1330.0, now=1330.0)
    assert clock.peer_leads()["a"] == 0.0 and clock.peer_leads()["b"] == -305.0
    monotonic[0] = 45.0  # b, c and the liar not heard for a whole window: forgotten; a's newer half stays
    assert clock.peer_leads() == {"a": 0.0}
    monotonic[0] = 80.0
    assert clock.reading() is None


def test_what_a_node_is_told_of_its_clock_names_the_direction_the_figure_and_the_fix():
    from node.stats import CLOCK_WARN_S, clock_advice

    assert clock_advice(None, 120, 300) is None
    assert clock_advice(ClockReading(CLOCK_WARN_S - 1, 3), 120, 300) is None
    ahead = clock_advice(ClockReading(300.4, 3), 120, 300)
    assert ahead.startswith("this node's clock looks 300 s ahead of the swarm's (the median of 3 peers' signed times)")
    assert "swarm.max_batch_age_s=120 s" in ahead and "its peers refuse whatever it signs" in ahead
    assert ahead.endswith("set the system clock right (timedatectl set-ntp true)")
    behind = clock_advice(ClockReading(-45.0, 1), 120, 300)
    assert behind.startswith("this node's clock looks 45 s behind the swarm's (its one peer's signed times)")
    assert "it refuses whatever its peers sign" in behind


def test_a_refused_batch_signed_in_the_future_still_tells_the_clock_and_the_gauges_say_it():
    """A peer whose clock is ahead past the skew bound has every batch refused as stale; its signed time is what tells
    this node (or that peer) which clock is off."""
    import time

    from node.transport.batches import BatchReceiver
    from protocol import NodeIdentity, RolloutBatch, encode_message
    from node.config import load_config
    from tests.helpers.common import REPO

    config = load_config(REPO / "configs" / "isolated.yaml", ["swarm.transport=dht"])
    stats = SwarmStats()
    assert "swarm_node_clock_offset_seconds" not in prometheus_text({}, stats)  # not measured: no figure at all
    receiver = BatchReceiver(config.swarm, "f" * 40, "fingerprint", stats)
    peer = NodeIdentity.generate()
    batch = RolloutBatch(round=1, policy_version=1, model_fingerprint="fingerprint", questions=[])
    now = time.time()
    ahead = encode_message(batch, identity=peer, swarm_id=config.swarm.swarm_id, seq=1, timestamp=now + 400.0)
    assert receiver.receive([(peer.node_id, ahead)], now) == []
    assert stats.refusals.by_peer() == {peer.node_id: {"stale": 1}}
    assert stats.clock.peer_leads() == {peer.node_id: 400.0}
    assert stats.totals()["clock_offset_s"] == -400.0 and stats.totals()["clock_peers"] == 1
    text = prometheus_text({}, stats)
    assert "swarm_node_clock_offset_seconds -400.0" in text and "swarm_node_clock_peers 1" in text
    assert f'swarm_node_peer_clock_lead_seconds{{peer="{peer.node_id}"}} 400.0' in text
    assert stats.snapshot()["clock_leads"] == {peer.node_id: 400.0}
