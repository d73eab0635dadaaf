"""A hostile peer on 127.0.0.1 stores forged, false, oversize, truncated, replayed and foreign
values where an honest node reads rollouts: each is refused with its reason and counted —
by the DHT's record validator when the value is not a well-formed record of its owner, by
the reader when it is (a lie, a task outside the mix); a batch stored again is not used twice — and the honest
node keeps training on its own scores. What the reader calls a replay is tested in tests/test_transport.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from node.config import load_config
from node.loop import Node
from node.tasks import materialize
from node.transport.joining import key_prefix
from protocol import NodeIdentity, RolloutBatch, RolloutCompletion, RolloutQuestion, TaskSpec, encode_message
from protocol.shards import rollout_key
from tests.helpers.common import REPO
from tests.helpers.swarm import SWARM_OVERRIDES

pytestmark = pytest.mark.integration

SWARM = "test-swarm"


def batch_for(spec: TaskSpec, completions: list[str], claimed: list[float]) -> RolloutBatch:
    sent = [RolloutCompletion(text=text, token_ids=[1], logprobs=None, finish_reason="length") for text in completions]
    return RolloutBatch(
        round=1,
        policy_version=1,
        model_fingerprint="someone-else",
        questions=[RolloutQuestion(spec=spec, completions=sent, claimed_rewards=claimed)],
    )


def test_hostile_values_are_refused_and_counted(model_cache, tmp_path):
    asyncio.run(_hostile_scenario(tmp_path))


async def _hostile_scenario(tmp_path):
    from hivemind.dht.node import DHTNode
    from hivemind.utils import get_dht_time

    # The hostile values go under the window of the test's clock; the node reads that window and the one before, so a
    # window boundary passing on a slow machine between the stores and the node's reads cannot hide them.
    config = load_config(
        REPO / "configs" / "swarm.yaml",
        [*SWARM_OVERRIDES, "swarm.window_s=600", "swarm.collect_windows=2"],
        state_dir=str(tmp_path / "honest"),
    )
    honest = Node(config)
    honest.load()
    await honest.start_services()
    hostile = await DHTNode.create(initial_peers=honest.addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        window = int(time.time() // config.swarm.window_s)
        key = rollout_key(key_prefix(SWARM), window, 1, 0)  # a lone node reads the one shard of a small swarm
        mix = config.tasks.datasets[0]
        spec = TaskSpec(mix.name, mix.config, seed=5, index=3)
        question = materialize(spec)
        wrong = str(int(question.answer) + 1)
        peers = {
            name: NodeIdentity.generate()
            for name in ("forger", "liar", "big", "cut", "foreign", "mismatch", "other_task", "bomb", "replayer")
        }

        def signed(identity, batch, seq, swarm=SWARM):
            return encode_message(batch, identity=identity, swarm_id=swarm, seq=seq, timestamp=time.time())

        async def put(subkey: str, value: bytes) -> None:
            assert await hostile.store(key, value, expiration_time=get_dht_time() + 60, subkey=subkey)

        async def refused_by_the_dht(subkey: str, value: bytes) -> None:
            assert not await hostile.store(key, value, expiration_time=get_dht_time() + 60, subkey=subkey)

        honest_batch = batch_for(spec, [question.answer, wrong], [1.0, 0.0])
        forged = bytearray(signed(peers["forger"], honest_batch, 10))
        forged[-1] ^= 0xFF
        await refused_by_the_dht(peers["forger"].node_id, bytes(forged))
        # a valid signature, but it claims its wrong answers are right: we re-score, never trust
        await put(
            peers["liar"].node_id,
            signed(peers["liar"], batch_for(spec, [wrong, wrong + "0", question.answer], [1.0, 1.0, 0.0]), 10),
        )
        await refused_by_the_dht(
            peers["big"].node_id, b"\x92" + b"\xc6" + (1_500_000).to_bytes(4, "big") + bytes(1_500_000)
        )
        await refused_by_the_dht(peers["cut"].node_id, signed(peers["cut"], honest_batch, 10)[:-25])
        await refused_by_the_dht(
            peers["foreign"].node_id, signed(peers["foreign"], honest_batch, 10, swarm="another-swarm")
        )
        # signed by someone else
        await refused_by_the_dht(peers["mismatch"].node_id, signed(peers["forger"], honest_batch, 11))
        await put(
            peers["other_task"].node_id,
            signed(peers["other_task"], batch_for(TaskSpec("chain_sum", {}, 1, 1), ["1", "2"], [0.0, 1.0]), 10),
        )
        # a CPU/memory bomb
        bomb = TaskSpec(mix.name, {**mix.config, "max_digits": 10**6, "min_digits": 10**6}, seed=1, index=1)
        await put(peers["bomb"].node_id, signed(peers["bomb"], batch_for(bomb, ["1", "2"], [0.0, 1.0]), 10))
        await put(peers["replayer"].node_id, signed(peers["replayer"], honest_batch, 100))

        weights_before = [p.detach().clone() for p in honest.model.parameters()]
        await honest.run_round()
        # the batch it used, signed again (new bytes, the same seq): a repeat, not used twice
        await put(peers["replayer"].node_id, signed(peers["replayer"], honest_batch, 100))
        await honest.run_round()

        # (hivemind retries a refused store, so each value may be refused more than once)
        records = {owner: set(counts) for owner, counts in honest.stats.records.by_owner.items()}
        assert records[peers["forger"].node_id] == {"bad_signature"}
        assert records[peers["big"].node_id] == {"too_large"}
        assert records[peers["cut"].node_id] <= {"not_msgpack", "bad_structure"} and records[peers["cut"].node_id]
        assert records[peers["foreign"].node_id] == {"wrong_swarm"}
        assert records[peers["mismatch"].node_id] == {"sender_mismatch"}
        rejected = honest.stats.refusals.by_peer()
        assert rejected[peers["other_task"].node_id] == {"bad_spec": 1}
        assert rejected[peers["bomb"].node_id] == {"bad_spec": 1}
        replayer = honest.stats.peers[peers["replayer"].node_id]
        assert peers["replayer"].node_id not in rejected and replayer.batches_accepted == 1
        liar = honest.stats.peers[peers["liar"].node_id]
        assert (
            peers["liar"].node_id not in rejected and liar.batches_accepted == 1 and liar.claimed_rewards_disagree == 1
        )
        # what the node trained on was scored here: the liar's group carries our rewards
        rescored, _ = honest.sharing.rescore(_liar_group(peers["liar"], spec, question, wrong))
        assert rescored.rewards[:2] == [0.0, 0.0] and rescored.rewards[2] == 1.0

        rows = honest.store.read_metrics()
        assert [r["round"] for r in rows] == [1, 2]
        assert sum(sum(r["rejected"].values()) for r in rows) == 2  # the other 5 never reached the reader
        assert all(torch.isfinite(p).all() for p in honest.model.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(weights_before, honest.model.parameters()))  # still training
    finally:
        await hostile.shutdown()
        await honest.stop_services()


def _liar_group(identity, spec, question, wrong):
    from node.rollouts.base import ExternalGroup

    batch = batch_for(spec, [wrong, wrong + "0", question.answer], [1.0, 1.0, 0.0])
    [question] = batch.questions
    return ExternalGroup(
        spec=question.spec,
        completions=question.completions,
        claimed_rewards=question.claimed_rewards,
        peer_id=identity.node_id,
        same_model=False,
        policy_version=1,
    )
