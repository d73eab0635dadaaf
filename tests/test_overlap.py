"""rollout.max_staleness 1: the next round's own rollouts are generated while this round's update runs, from the
weights before it, and trained on one policy version behind, corrected by the trainer's truncated importance weight."""

from __future__ import annotations

import asyncio

import pytest

from node.config import ConfigError
from node.loop import Node
from node.transport.null import NullTransport


class Recording(NullTransport):
    """What each round published: the questions it answered, in order."""

    def __init__(self) -> None:
        self.rounds: list[list[tuple]] = []

    async def publish(self, round_, policy_version, groups):
        self.rounds.append([(g.spec.dataset, g.spec.seed, g.spec.index) for g in groups])


def run(node: Node, rounds: int) -> list[dict]:
    async def scenario():
        return [await node.run_round() for _ in range(rounds)]

    return asyncio.run(scenario())


def test_a_node_one_version_ahead_answers_the_same_questions_and_trains_them_one_version_behind(tiny_config, tmp_path):
    rows, published, nodes = {}, {}, {}
    for staleness in (0, 1):
        transport = Recording()
        node = Node(
            tiny_config(
                f"rollout.max_staleness={staleness}",
                "eval_every=0",
                "tasks.format_reward=0.1",  # a reward spread, so that rounds step and versions move
                state_dir=tmp_path / str(staleness),
            ),
            transport=transport,
        )
        node.load()
        rows[staleness], published[staleness], nodes[staleness] = run(node, 4), transport.rounds, node
    assert published[1] == published[0]  # the same draws and seeds, round by round: only the weights differ
    serial, ahead = rows[0], rows[1]
    assert all("staleness_mean" not in row for row in serial)  # off: the serial round, its rows as before
    # round i's rollouts were sampled before round i-1's update: they are behind by the steps that round took (a round
    # whose groups were all uniform steps nothing), and round 1's were generated in it
    versions = [0] + [row["policy_version"] for row in ahead]
    behind = [0] + [versions[i] - versions[i - 1] for i in range(1, len(ahead))]
    assert [row["staleness_max"] for row in ahead] == behind and 1 in behind
    assert [row["staleness_mean"] for row in ahead] == [float(b) for b in behind]
    assert ahead[0]["ahead_wait_s"] is None and all(row["ahead_wait_s"] >= 0 for row in ahead[1:])
    # the sampler's side of it: idle from the end of the rollouts it generated ahead until the round handed it the next
    # questions; round 1 started it from nothing generated ahead, so it says none
    assert ahead[0]["sampler_idle_s"] is None
    assert all(type(row["sampler_idle_s"]) is float and row["sampler_idle_s"] >= 0 for row in ahead[1:])
    assert all("sampler_idle_s" not in row for row in serial)
    # the first round is the serial one, bit for bit; later ones train on rollouts of older weights
    assert ahead[0]["loss"] == serial[0]["loss"] and ahead[0]["reward_mean"] == serial[0]["reward_mean"]
    # a round whose completions were sampled a version behind weighs each token min(c, pi_now / pi_then); a serial
    # node's are on-policy and weigh nothing
    stale = [row for row, b in zip(ahead, behind) if b and row["groups_used"]]
    assert stale and all(row.get("importance_weight_mean") is not None for row in stale)
    assert all("importance_weight_mean" not in row for row in serial)
    assert nodes[1].sampler_model is not nodes[1].model and nodes[0].sampler_model is nodes[0].model


@pytest.mark.parametrize(
    "sets, blocker",
    [
        (["swarm.transport=dht", "swarm.external_questions=2", "swarm.external_gate=stronger_peer"], "external_gate"),
        (["swarm.transport=dht", "swarm.external_questions=2", "swarm.local_draw=balance"], "local_draw balance"),
        (["rollout.backend=vllm"], "rollout.backend vllm"),
    ],
)
def test_generating_ahead_is_refused_where_the_round_must_know_its_peers_first(sets, blocker, tiny_config):
    with pytest.raises(ConfigError, match=f"rollout.max_staleness 1 .*{blocker}"):
        tiny_config("rollout.max_staleness=1", *sets)
