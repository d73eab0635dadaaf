"""Per-node cost flat in swarm size: shard keys, the read budget, and a real node next to a crowd of 64 peers on
loopback."""

from __future__ import annotations

import asyncio
import time

import pytest

from node.config import load_config
from node.stats import SwarmStats
from node.transport.batches import BatchReceiver
from protocol import NodeIdentity, Refusal
from protocol.shards import (
    HEARTBEAT_SHARDS,
    MAX_ROLLOUT_SHARDS,
    heartbeat_shards_to_read,
    peers_key,
    rollout_key,
    rollout_shard_count,
    rollout_write_levels,
    shard_of,
)
from tests.helpers.common import REPO
from tests.helpers.swarm import SWARM_OVERRIDES

CROWD = 64
CROWD_OVERRIDES = [
    *SWARM_OVERRIDES,
    "swarm.gossip=dht",
    "swarm.client_mode=true",
    "swarm.reachability=direct",
    "swarm.heartbeat_ttl_s=60",
    "swarm.max_batches_read_per_round=16",
]


# --- shard keys (protocol/shards.py): every node must compute the same ones ---------------------------


def test_shard_keys_are_pinned():
    node_id = "0123456789abcdef0123456789abcdef01234567"
    assert [shard_of(node_id, count) for count in (1, 2, 8, 1024)] == [0, 1, 3, 443]
    assert peers_key("swarm-node/v1/s", 3) == "swarm-node/v1/s/peers/3"
    assert rollout_key("swarm-node/v1/s", 177, 4, 2) == "swarm-node/v1/s/rollouts/177/s4/2"


def test_shards_nest_and_spread():
    ids = [NodeIdentity.generate().node_id for _ in range(512)]
    for node_id in ids:
        assert shard_of(node_id, 8) == shard_of(node_id, 16) % 8  # a writer one level off lands in the related shard
    per_shard = [sum(shard_of(i, 8) == s for i in ids) for s in range(8)]
    assert min(per_shard) > 30 and max(per_shard) < 100  # 64 expected each


def test_small_swarms_and_late_joiners_read_one_shard_with_every_batch():
    assert [rollout_shard_count(n) for n in (1, 2, 4, 32)] == [1, 1, 1, 1]  # as before sharding: one key, every batch
    assert [rollout_shard_count(n) for n in (33, 65, 1025)] == [2, 4, 64]
    assert rollout_shard_count(10**9) == MAX_ROLLOUT_SHARDS  # an inflated estimate only thins what is read
    assert rollout_write_levels(1) == [1, 2] and rollout_write_levels(4) == [2, 4, 8]
    # all heartbeats
    assert heartbeat_shards_to_read(1) == HEARTBEAT_SHARDS and heartbeat_shards_to_read(256) == HEARTBEAT_SHARDS
    assert heartbeat_shards_to_read(1024) == 2 and heartbeat_shards_to_read(100_000) == 1


# --- the round's read budget: a flood is bounded and counted -------------------------------------------


def test_a_flood_is_decoded_up_to_the_budget_and_the_rest_counted():
    from benchmarks.crowd import Crowd
    from node.transport.records import RecordWriter

    config = load_config(REPO / "configs" / "swarm.yaml", CROWD_OVERRIDES)
    crowd = Crowd(config)  # its batches, signed by 120 throwaway identities, as if all were stored under one shard
    flooders = [NodeIdentity.generate() for _ in range(120)]
    values = [
        (identity.node_id, RecordWriter(identity, "test-swarm").sign(crowd.batch(i)).data)
        for i, identity in enumerate(flooders)
    ]
    stats = SwarmStats()
    receiver = BatchReceiver(config.swarm, "f" * 40, "fingerprint", stats)
    first = receiver.receive(values, time.time(), budget=16)
    assert stats.values_decoded == 16 and stats.values_left_unread == 120 - 16
    assert len({g.peer_id for g in first}) == 16
    second = receiver.receive(values, time.time(), budget=16)  # the next round draws among the ones not decoded yet
    assert stats.values_decoded == 32 and not {g.peer_id for g in first} & {g.peer_id for g in second}
    assert stats.refusals.by_reason() == {}


# --- a node next to a crowd of 64 -----------------------------------------------------------------------


@pytest.mark.integration
def test_a_node_next_to_a_crowd_of_64_reads_and_rescores_a_bounded_amount_and_lists_everyone(model_cache, tmp_path):
    from benchmarks.crowd import Crowd, list_peers
    from node.dashboard.sources import read_peer_rows
    from node.loop import Node

    async def scenario():
        crowd = Crowd(load_config(REPO / "configs" / "swarm.yaml", CROWD_OVERRIDES, state_dir=str(tmp_path / "crowd")))
        address = (await crowd.start())[0]
        node = None
        try:
            crowd.grow(CROWD)
            assert await crowd.publish() == (CROWD * 4, 0)  # a heartbeat and a batch at three shard levels each
            node = Node(
                load_config(
                    REPO / "configs" / "swarm.yaml",
                    [*CROWD_OVERRIDES, f'swarm.initial_peers=["{address}"]'],
                    state_dir=str(tmp_path / "node"),
                )
            )
            node.load()
            await node.start_services()
            assert node.stats.swarm_size_estimate == CROWD + 1  # a swarm this small: every heartbeat shard was read
            rows, per_round = [], []
            for _ in range(3):
                await crowd.publish()
                before = node.stats.totals()
                rows.append(await node.run_round())
                after = node.stats.totals()
                per_round.append(
                    {
                        name: after[name] - before[name]
                        for name in ("values_read", "values_decoded", "values_left_unread")
                    }
                )
            count = rollout_shard_count(CROWD + 1)
            # One crowd member stores its batch under every other shard of the window; whichever the node reads holds
            # it.
            window = int(time.time() // node.config.swarm.window_s)
            flooder = NodeIdentity.generate()
            for shard in range(count):
                if shard != shard_of(flooder.node_id, count):
                    assert await crowd.flood(rollout_key(crowd.prefix, window, count, shard), [flooder]) == 1
            for _ in range(12):  # each collect reads one random shard: 12 misses in a row are one chance in 4^12
                await node.transport.collect()
                if node.stats.refusals.by_reason().get(Refusal.WRONG_SHARD.value):
                    break
            listed = await read_peer_rows(node.session.dht, node.config)
            cli_seconds, cli_listed = await list_peers(address, node.config.swarm.swarm_id)
            return rows, per_round, count, listed, cli_listed, node.sharing.rescore_budget, node.stats.totals()
        finally:
            if node is not None:
                await node.stop_services()
            await crowd.stop()

    rows, per_round, count, listed, cli_listed, budget, totals = asyncio.run(scenario())
    assert count == 4
    windows = 2  # swarm.collect_windows
    for round_reads in per_round:
        # one shard of four per window: about 16 writers each, never the whole crowd (an unsharded read was 2 x 64)
        assert 0 < round_reads["values_read"] <= windows * 2 * CROWD // count, per_round
        assert round_reads["values_decoded"] <= 16, per_round  # swarm.max_batches_read_per_round
    assert all(0 < row["external_rescored"] <= budget for row in rows), [row["external_rescored"] for row in rows]
    assert sum(row["external_questions"] for row in rows) > 0  # the crowd's groups are real: the node trains on them
    assert totals["rejected"].get(Refusal.WRONG_SHARD.value, 0) >= 1, totals["rejected"]
    assert totals["rollout_reads_failed"] == 0
    assert len(listed) == CROWD + 1 and cli_listed == CROWD + 1


def test_a_key_flooded_past_its_byte_bound_refuses_new_subkeys_and_stays_readable():
    from hivemind.dht.routing import DHTID

    from node.stats import RecordRefusals
    from node.transport.records import BoundedKeyStorage

    refusals = RecordRefusals()
    storage = BoundedKeyStorage(refusals, max_key_bytes=1000)
    key, far = DHTID.generate(source="k"), time.time() + 60
    assert storage.store_subkey(key, "a" * 40, b"x" * 400, far) and storage.store_subkey(key, "b" * 40, b"x" * 400, far)
    assert not storage.store_subkey(key, "c" * 40, b"x" * 400, far)  # would make 1,200 bytes: refused
    # an owner's newer value in place of its own still fits
    assert storage.store_subkey(key, "a" * 40, b"y" * 500, far + 1)
    assert sorted(subkey for subkey, _ in storage.get(key).value.items()) == ["a" * 40, "b" * 40]
    assert refusals.by_reason == {"key_full": 1}
