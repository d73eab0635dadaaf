"""Peers' rollouts (node/sharing.py): chosen on their claims, re-scored here, bounded work, weighed by capability."""

from __future__ import annotations

import functools
import json
import random

import pytest

from node.config import SwarmConfig, TasksConfig
from node.loop import Node
from node.rollouts.base import Completion, Demonstration, RolloutGroup
from node.sharing import (
    OwnAnswerReplay,
    CAPABILITY_PRIOR,
    PeerChoice,
    RoundPlan,
    imitation_weight,
    weighted_sample,
)
from node.rollouts.base import ExternalGroup
from node.tasks import TaskSource, materialize
from protocol import NodeIdentity, RolloutCompletion, TaskSpec
from tests.helpers.inprocess import in_process_nodes
from tests.helpers.tasks import ARITHMETIC, MIX


@pytest.fixture
def swarm_node(tiny_config):
    """A loaded node of the three-specialty mix that would take J = 4 peer groups a round (never started: no
    network)."""

    def make(*extra: str) -> Node:
        node = Node(
            tiny_config(
                f"tasks.datasets={json.dumps(MIX)}", "swarm.transport=dht", "swarm.external_questions=4", *extra
            )
        )
        node.load()
        return node

    return make


@functools.cache
def specs_of(label: str) -> list[TaskSpec]:
    source = TaskSource(TasksConfig(datasets=MIX), seed=9)
    return [spec for spec in map(source.spec, range(1000)) if source.label(spec) == label]


def spec_of(label: str, index: int) -> TaskSpec:
    return specs_of(label)[index]


def peer_group(spec: TaskSpec, right: int, wrong: int, peer: str, claimed: list[float] | None = None) -> ExternalGroup:
    """A peer's group with `right` right and `wrong` wrong answers; it claims `claimed` (default: the truth)."""
    answer = materialize(spec).answer
    texts = [answer] * right + [
        str(int(answer) + 1)
    ] * wrong  # an off-by-one answer scores 0 (a longer one may earn partial credit)
    completions = [RolloutCompletion(text=text, token_ids=[1], logprobs=None, finish_reason="stop") for text in texts]
    return ExternalGroup(
        spec=spec,
        completions=completions,
        claimed_rewards=claimed or [1.0] * right + [0.0] * wrong,
        peer_id=peer,
        same_model=False,
        policy_version=1,
    )


def right_and_wrong(spec: TaskSpec) -> list[Completion]:
    """A node's own two answers to `spec`: the right one and a wrong one (rewards 1 and 0)."""
    answer = materialize(spec).answer
    return [Completion([1], [2], text, None, "stop", policy_version=0) for text in (answer, "nope")]


def own_group(label: str, index: int, rewards: list[float]) -> RolloutGroup:
    """A node's own group of `spec_of(label, index)` with these rewards (the completions' content does not matter)."""
    completions = [Completion([1], [2 + k], str(k), None, "stop", policy_version=0) for k in range(len(rewards))]
    return RolloutGroup(spec_of(label, index), completions, rewards, correct=[r == 1.0 for r in rewards])


# a round's sharing decisions (Node.run_round asks node/sharing.py) ------------------------------------------------


def plan(**swarm) -> RoundPlan:
    return RoundPlan.of(SwarmConfig(**swarm))


def test_when_a_round_collects_peers_groups():
    assert plan(external_questions=0).collect == "never"
    assert plan(external_questions=0, local_draw="balance").collect == "never"  # nothing to fill
    assert plan(external_questions=2).collect == "after_publishing"  # SAPO's order
    assert plan(external_questions=2, local_draw="balance").collect == "before_drawing"


def test_groups_to_publish_all_or_those_with_a_signal():
    groups = [own_group("add", 0, [1.0, 0.0]), own_group("add", 1, [0.0, 0.0]), own_group("add", 2, [1.0, 1.0])]
    assert plan(publish="all").to_publish(groups) == groups
    assert plan(publish="with_signal").to_publish(groups) == groups[:1]
    assert plan(publish="with_signal").to_publish(groups[1:]) == []  # nothing worth a record


@pytest.mark.parametrize(
    "imitation, external_questions, own_weight",
    [
        ("none", 2, 0.0),
        ("own", 2, 1.0),
        ("own_and_stronger_peers", 2, 1.0),
        ("own_and_stronger_peers", 0, 1.0),  # in effect 'own' without peers: still its own answers
    ],
)
def test_own_right_answers_are_demonstrations_whenever_imitation_is_in_effect(
    imitation, external_questions, own_weight
):
    own = [own_group("add", 0, [1.0, 1.0]), own_group("add", 1, [1.0, 0.0])]  # one all right: an anchor all the same
    peers = PeerChoice([own_group("subtract", 0, [1.0, 0.0])], [0.4])  # its weight was set when it was chosen
    replayed = [Demonstration(1.0, own[1].completions[1])]
    batch = plan(imitation=imitation, external_questions=external_questions).training_batch(own, peers, replayed)
    own_answers = [own[0].completions[0], own[0].completions[1], own[1].completions[0]]  # each right one, distinct
    expected = [Demonstration(own_weight, answer) for answer in own_answers] if own_weight else []
    assert batch.demonstrations == [*expected, Demonstration(0.4, peers.groups[0].completions[0]), *replayed]
    assert batch.groups == own + peers.groups


def test_peers_groups_join_the_nodes_own_in_the_policy_term():
    own, peers = [own_group("add", 0, [1.0, 0.0])], [own_group("subtract", 0, [1.0, 0.0])]
    assert plan(external_questions=1).training_batch(own, PeerChoice(peers, [0.0])).groups == own + peers
    assert plan().training_batch(own, PeerChoice()).groups == own  # an isolated node: its own groups alone
    # a peer group no stronger than this node: in the policy term, none of its answers a demonstration
    weightless = plan(external_questions=1).training_batch([], PeerChoice(peers, [0.0]))
    assert weightless.demonstrations == []


def test_rescoring_work_per_round_does_not_grow_with_the_number_of_peers(swarm_node):
    node = swarm_node()
    rescored = {}
    for peers in (3, 12):
        received = [
            peer_group(spec_of("add", 4 * p + q), right=1 + q % 3, wrong=2, peer=f"peer{p}")
            for p in range(peers)
            for q in range(4)
        ]
        chosen = node.sharing.choose(received, seed=peers)
        assert len(chosen.groups) == 4 and all(g.source.startswith("peer") for g in chosen.groups)
        rescored[peers] = chosen.rescored
    assert rescored == {3: 4, 12: 4}  # every drawn group was honest: exactly J re-scored, with 12 received or 48


def test_groups_that_lie_about_their_spread_are_rescored_replaced_and_bounded(swarm_node):
    node = swarm_node()
    liars = [
        peer_group(spec_of("add", i), right=0, wrong=3, peer=f"liar{i}", claimed=[1.0, 0.0, 0.0]) for i in range(40)
    ]
    honest = [peer_group(spec_of("add", 100 + i), right=1, wrong=2, peer=f"honest{i}") for i in range(2)]
    chosen = node.sharing.choose(liars + honest, seed=1)
    assert chosen.rescored == 8  # 2 x J re-scores at most, whatever the liars send
    assert all(g.source.startswith("honest") for g in chosen.groups)  # a liar's group has no signal once scored here
    assert chosen.rescored_completions == 8 * 3  # each re-scored group's completions, graded here
    assert sum(
        counters.claimed_rewards_disagree for peer, counters in node.stats.peers.items() if peer.startswith("liar")
    ) == 8 - len(chosen.groups)
    uniform_claims = [
        peer_group(spec_of("add", 200 + i), right=1, wrong=2, peer="modest", claimed=[0.0, 0.0, 0.0]) for i in range(3)
    ]
    # never drawn, never scored
    assert node.sharing.choose(uniform_claims, seed=2) == PeerChoice()  # nothing chosen, nothing re-scored


def test_a_peer_is_judged_by_its_rescored_pass_rate_not_its_claims(swarm_node):
    node = swarm_node("swarm.imitation=own_and_stronger_peers", "trainer.imitation_coef=1.0")
    node.telemetry.accuracy_by_dataset.update({"add": 0.05})
    # claims 7 right of 8; really 1 right of 8: its pass rate is 0.125, so its weight is (0.125 - 0.05) / 0.125
    liar = peer_group(spec_of("add", 0), right=1, wrong=7, peer="boaster", claimed=[1.0] * 7 + [0.0])
    chosen = node.sharing.choose([liar], seed=0)
    [group], [weight] = chosen.groups, chosen.imitation_weights
    assert group.rewards == [1.0] + [0.0] * 7
    assert node.sharing.peer_rates[("boaster", "add")] == pytest.approx(0.125)
    assert weight == pytest.approx(0.6)


def test_imitation_weight_hand_computed():
    # the share of the peer's pass rate this node lacks
    assert imitation_weight(0.1, 0.75) == pytest.approx(0.65 / 0.75)
    # a peer no better: nothing to imitate
    assert imitation_weight(0.5, 0.5) == 0.0 and imitation_weight(0.9, 0.3) == 0.0
    # never answered: the stated prior
    assert imitation_weight(None, 0.8) == pytest.approx((0.8 - CAPABILITY_PRIOR) / 0.8)
    assert imitation_weight(0.0, 0.0) == 0.0


def test_stronger_peers_right_answers_become_demonstrations_per_specialty(swarm_node):
    node = swarm_node("swarm.imitation=own_and_stronger_peers", "trainer.imitation_coef=1.0")
    node.telemetry.accuracy_by_dataset.update({"add": 0.9, "subtract": 0.1})
    received = [
        peer_group(spec_of("add", 0), right=6, wrong=2, peer="expert"),
        peer_group(spec_of("subtract", 0), right=6, wrong=2, peer="expert"),
    ]
    chosen = node.sharing.choose(received, seed=0)
    weight = {node.tasks.label(g.spec): w for g, w in zip(chosen.groups, chosen.imitation_weights)}
    group = {node.tasks.label(g.spec): g for g in chosen.groups}
    # this node knows add better
    assert weight["add"] == 0.0 and weight["subtract"] == pytest.approx((0.75 - 0.1) / 0.75)
    assert group["subtract"].correct == [True] * 6 + [False] * 2  # the verdicts of our scorer, not the peer's claims
    batch = node.plan.training_batch([], chosen)
    # six copies of the same right answer: one demonstration; none of the add group's
    assert batch.demonstrations == [Demonstration(weight["subtract"], group["subtract"].completions[0])]
    off = swarm_node()
    off.telemetry.accuracy_by_dataset.update({"subtract": 0.1})
    assert off.sharing.choose(received, seed=0).imitation_weights == [0.0, 0.0]


def test_imitation_needs_its_weight_and_keeps_to_own_answers_without_peers(tiny_config):
    from node.config import ConfigError

    with pytest.raises(ConfigError, match="imitation_coef"):
        tiny_config(
            "swarm.transport=dht",
            "swarm.external_questions=4",
            "swarm.imitation=own_and_stronger_peers",
            "trainer.imitation_coef=0",
        )
    alone = tiny_config("swarm.imitation=own_and_stronger_peers", "trainer.imitation_coef=1.0")  # isolated: no peers
    assert RoundPlan.of(alone.swarm).imitation == "own"  # its own right answers: the best single-node recipe


def test_a_peers_pass_rate_is_a_moving_average_of_its_groups(swarm_node):
    node = swarm_node("swarm.imitation=own_and_stronger_peers", "trainer.imitation_coef=1.0")
    node.telemetry.accuracy_by_dataset.update({"add": 0.1})
    node.sharing.choose([peer_group(spec_of("add", 0), right=4, wrong=4, peer="p")], seed=0)
    [weight] = node.sharing.choose(
        [peer_group(spec_of("add", 1), right=1, wrong=7, peer="p")], seed=0
    ).imitation_weights
    # one unlucky group moves it a fifth, and the group is weighed by the average, not by its own pass rate
    assert node.sharing.peer_rates[("p", "add")] == pytest.approx(0.8 * 0.5 + 0.2 * 0.125)
    assert weight == pytest.approx((0.425 - 0.1) / 0.425)


def test_specs_outside_the_mix_are_refused_without_being_scored(swarm_node):
    node = swarm_node()
    foreign = peer_group(spec_of("add", 0), right=1, wrong=1, peer="stranger")
    foreign.spec = TaskSpec("gcd", {}, 1, 1)
    bomb = peer_group(spec_of("add", 1), right=1, wrong=1, peer="bomber")
    bomb.spec = TaskSpec("basic_arithmetic", {**ARITHMETIC, "max_digits": 10**6, "min_digits": 10**6}, 1, 1)
    assert node.sharing.choose([foreign, bomb], seed=0) == PeerChoice()  # refused before anything is re-scored
    assert node.stats.refusals.by_peer() == {"stranger": {"bad_spec": 1}, "bomber": {"bad_spec": 1}}


def test_weakness_selection_prefers_the_specialties_the_node_gets_wrong(swarm_node):
    node = swarm_node("swarm.external_questions=1", "swarm.external_selection=weakness")
    # masters addition, never subtracts right; chain_sum unknown
    node.telemetry.accuracy_by_dataset.update({"add": 0.95, "subtract": 0.0})
    specs = {label: spec_of(label, 0) for label in ("add", "subtract", "chain_sum")}
    assert {label: node.sharing.selection_weight(spec) for label, spec in specs.items()} == {
        "add": pytest.approx(0.05),
        "subtract": 1.0,
        "chain_sum": 1.0,
    }
    received = [peer_group(spec, right=1, wrong=1, peer=NodeIdentity.generate().node_id) for spec in specs.values()]
    picks = {label: 0 for label in specs}
    for round_ in range(300):
        for group in node.sharing.choose(received, seed=round_).groups:
            picks[node.tasks.label(group.spec)] += 1
    assert picks["add"] < picks["subtract"] / 5 and picks["add"] < picks["chain_sum"] / 5, picks
    # SAPO's rule stays the default until measured better
    assert swarm_node().config.swarm.external_selection == "uniform"
    rng = random.Random(0)
    # distinct items, all of them when asked
    assert sorted(weighted_sample([1, 2, 3], [1.0, 1.0, 1.0], 3, rng)) == [
        1,
        2,
        3,
    ]
    assert weighted_sample([1, 2, 3], [1.0, 1.0, 1.0], 0, rng) == []


def test_the_in_process_exchange_runs_the_real_protocol(tiny_config, tmp_path):
    """What the sharing benchmark relies on: signed bytes out, verified and re-scored groups in, forgeries refused."""
    import asyncio

    common = [f"tasks.datasets={json.dumps(MIX)}", "swarm.transport=dht", "swarm.external_questions=4"]
    a, b = in_process_nodes(tiny_config, tmp_path, {"a": common, "b": common})
    exchange = a.transport.exchange
    spec = spec_of("add", 0)
    answer = materialize(spec).answer
    completions = right_and_wrong(spec)
    asyncio.run(a.transport.publish(1, 0, [RolloutGroup(spec, completions, [1.0, 0.0])]))
    [received] = asyncio.run(b.transport.collect())
    assert received.peer_id == a.identity.node_id and received.spec == spec and received.claimed_rewards == [1.0, 0.0]
    [group] = b.sharing.choose([received], seed=0).groups
    assert group.rewards == [1.0, 0.0] and group.completions[0].text == answer
    assert asyncio.run(b.transport.collect()) == []  # the same record read again is not news
    genuine = exchange.latest[a.identity.node_id]
    asyncio.run(a.transport.publish(2, 1, [RolloutGroup(spec, completions, [1.0, 0.0])]))
    forged = bytearray(exchange.latest[a.identity.node_id])
    forged[-1] ^= 0xFF
    exchange.latest[a.identity.node_id] = bytes(forged)
    assert asyncio.run(b.transport.collect()) == []
    exchange.latest[a.identity.node_id] = genuine  # an old batch, genuinely signed, offered again: already used
    assert asyncio.run(b.transport.collect()) == []
    assert b.stats.refusals.by_peer() == {a.identity.node_id[:64]: {"bad_signature": 1}}


def test_a_peers_group_enters_the_policy_term_and_its_right_answer_is_a_demonstration(tiny_config, tmp_path):
    """A peer's group with a reward spread enters the policy term; where the peer is stronger its right answer is a
    demonstration too."""
    import asyncio

    from node.rollouts.base import Completion, RolloutGroup
    from node.transport.inprocess import InProcessExchange, InProcessTransport
    from tests.helpers.rollouts import ScriptedBackend

    exchange = InProcessExchange()
    all_wrong = ScriptedBackend.factory(lambda backend, prompts, call: [[backend.wrong(p)] * 4 for p in prompts])
    learner = Node(
        tiny_config(
            f"tasks.datasets={json.dumps(MIX)}",
            "swarm.transport=dht",
            "swarm.external_questions=4",
            "swarm.imitation=own_and_stronger_peers",
            "trainer.imitation_coef=1.0",
            "eval_every=0",
            state_dir=tmp_path / "learner",
        ),
        rollout_backend=all_wrong,
    )
    peer = Node(
        tiny_config(
            f"tasks.datasets={json.dumps(MIX)}",
            "swarm.transport=dht",
            "swarm.external_questions=4",
            state_dir=tmp_path / "peer",
        )
    )
    for node in (learner, peer):
        node.load()
        node.transport = InProcessTransport(exchange, node.config, node.identity, node.stats, node.fingerprint)
    learner.backend.remember(
        {
            learner.tasks.prompt(q): q.answer
            for q in learner.tasks.batch(first_draw=0, count=learner.config.swarm.local_questions)
        }
    )
    learner.telemetry.accuracy_by_dataset["subtract"] = 0.1
    spec = spec_of("subtract", 0)
    completions = [
        Completion([1], [2], text, None, "stop", policy_version=0) for text in (materialize(spec).answer, "nope")
    ]
    asyncio.run(peer.transport.publish(1, 0, [RolloutGroup(spec, completions, [1.0, 0.0])]))
    row = asyncio.run(learner.run_round())
    # the peer's right answer, weight (0.5 - 0.1) / 0.5
    assert row["external_questions"] == 1 and row["imitation_sequences"] == 1
    # the learner's own groups are all wrong: dropped; the peer's is the policy term's one group
    assert row["groups_used"] == 1
    assert row["policy_version"] == 1


def test_apportion_and_balanced_counts_hand_computed():
    from node.local_rollouts import apportion, balanced_counts

    # 4 over weights 1:1:1 -> 1.33 each: floors 1, 1, 1; the one left goes to the first of the tied remainders
    assert apportion(4, {"a": 1.0, "b": 1.0, "c": 1.0}) == {"a": 2, "b": 1, "c": 1}
    assert apportion(5, {"a": 0.7, "b": 0.3}) == {"a": 4, "b": 1}  # 3.5 / 1.5: both remainders 0.5, first wins
    assert apportion(0, {"a": 1.0}) == {"a": 0}
    mix = {"add": 0.5, "subtract": 0.5}
    # a batch of 8 holds 4 of each; peers brought 3 subtract and 1 add: the node's 4 fill 3 add and 1 subtract
    assert balanced_counts(4, 8, mix, {"subtract": 3, "add": 1}) == {"add": 3, "subtract": 1}
    # peers brought 4 subtract: all 4 own questions are additions
    assert balanced_counts(4, 8, mix, {"subtract": 4}) == {"add": 4, "subtract": 0}
    # nothing from peers: 4 of each missing, so 2 and 2
    assert balanced_counts(4, 8, mix, {}) == {"add": 2, "subtract": 2}
    # three specialties, 2 subtract from peers: missing 2.67 / 0.67 / 2.67 of 6 -> 1.78 / 0.44 / 1.78 -> 2 / 0 / 2
    three = {"add": 1 / 3, "subtract": 1 / 3, "chain_sum": 1 / 3}
    assert balanced_counts(4, 8, three, {"subtract": 2}) == {"add": 2, "subtract": 0, "chain_sum": 2}
    # peers brought more than the batch holds of what they bring, nothing is missing elsewhere: the mix decides
    assert balanced_counts(2, 2, mix, {"add": 5, "subtract": 5}) == {"add": 1, "subtract": 1}


def test_questions_drawn_by_specialty_are_that_specialtys_and_reproducible():
    from node.tasks import TaskError

    source = TaskSource(TasksConfig(datasets=MIX), seed=9)
    questions = source.batch_by_label(first_draw=40, counts={"add": 2, "chain_sum": 1})
    assert [source.label(q.spec) for q in questions] == ["add", "add", "chain_sum"]
    assert [q.spec.index for q in questions] == [40, 41, 40]
    again = TaskSource(TasksConfig(datasets=MIX), seed=9).batch_by_label(40, {"add": 2, "chain_sum": 1})
    assert [q.text for q in again] == [q.text for q in questions]
    with pytest.raises(TaskError, match="multiply"):
        source.batch_by_label(0, {"multiply": 1})
    assert source.mix_weights == pytest.approx({"add": 1 / 3, "subtract": 1 / 3, "chain_sum": 1 / 3})


def test_a_round_draws_its_own_questions_from_the_mix_or_to_fill_what_peers_left_short():
    from node.config import load_config
    from node.local_rollouts import LocalRollouts
    from tests.helpers.common import REPO

    config = load_config(
        REPO / "configs" / "isolated.yaml",
        [
            f"tasks.datasets={json.dumps(MIX)}",
            "swarm.transport=dht",
            "swarm.local_questions=4",
            "swarm.external_questions=4",
        ],
    )
    tasks = TaskSource(config.tasks, seed=9)
    local = LocalRollouts(config, tasks, backend=None)  # drawing samples nothing
    drawn = lambda questions: [(tasks.label(q.spec), q.spec.index) for q in questions]  # noqa: E731
    # the next 4 draws of the stream each round, the mix's specialties as they come
    assert [q.spec for q in local.draw(8, 4)] == [tasks.spec(draw) for draw in range(8, 12)]
    # peers brought 2 subtract of a round's I + J = 8: of 8/3 per specialty 2/3 subtract and 8/3 add and chain_sum are
    # missing, and 4 split in that proportion is 2 add, 0 subtract, 2 chain_sum (draws 4, 5 of each specialty's stream)
    peers = [own_group("subtract", 0, [1.0, 0.0]), own_group("subtract", 1, [1.0, 0.0])]
    assert drawn(local.draw(4, 4, balance_with=peers, batch_groups=8)) == [
        ("add", 4),
        ("add", 5),
        ("chain_sum", 4),
        ("chain_sum", 5),
    ]
    # balancing with no peers' group: 8/3 missing in each, 4 split 2 / 1 / 1 (largest remainder, first of the ties)
    assert drawn(local.draw(0, 4, balance_with=[], batch_groups=8)) == [
        ("add", 0),
        ("add", 1),
        ("subtract", 0),
        ("chain_sum", 0),
    ]


@pytest.mark.parametrize("draw", ["mix", "balance"])
def test_a_balancing_node_answers_the_specialties_its_peers_did_not_bring(tiny_config, tmp_path, draw):
    """swarm.local_draw 'balance': the peers' groups are chosen first, and the node's own questions fill the
    specialties they left short (hand-computed above: 2 subtract from peers -> 2 add, 0 subtract, 2 chain_sum)."""
    import asyncio

    from node.rollouts.base import Completion, RolloutGroup
    from node.transport.inprocess import InProcessExchange, InProcessTransport
    from tests.helpers.rollouts import ScriptedBackend

    exchange = InProcessExchange()
    asked: list[list[str]] = []

    def all_wrong(backend, prompts, call):
        asked.append(prompts)
        return [[backend.wrong(p)] * 4 for p in prompts]

    learner = Node(
        tiny_config(
            f"tasks.datasets={json.dumps(MIX)}",
            "swarm.transport=dht",
            "swarm.local_questions=4",
            "swarm.external_questions=4",
            f"swarm.local_draw={draw}",
            "eval_every=0",
            state_dir=tmp_path / "learner",
        ),
        rollout_backend=ScriptedBackend.factory(all_wrong),
    )
    peer = Node(tiny_config(f"tasks.datasets={json.dumps(MIX)}", "swarm.transport=dht", state_dir=tmp_path / "peer"))
    for node in (learner, peer):
        node.load()
        node.transport = InProcessTransport(exchange, node.config, node.identity, node.stats, node.fingerprint)
    by_mix = learner.tasks.batch(first_draw=0, count=4)
    balanced = learner.tasks.batch_by_label(first_draw=0, counts={"add": 2, "chain_sum": 2})
    learner.backend.remember({learner.tasks.prompt(q): q.answer for q in [*by_mix, *balanced]})
    groups = []
    for index in range(2):
        spec = spec_of("subtract", index)
        texts = (materialize(spec).answer, "nope")
        groups.append(
            RolloutGroup(spec, [Completion([1], [2], t, None, "stop", policy_version=0) for t in texts], [1, 0])
        )
    asyncio.run(peer.transport.publish(1, 0, groups))
    row = asyncio.run(learner.run_round())
    expected = balanced if draw == "balance" else by_mix
    assert asked[0] == [learner.tasks.prompt(q) for q in expected]
    assert row["external_questions"] == 2
    # the round's work: 4 own questions x 4 completions scored, and each peer group's 2 re-scored here
    assert row["work"]["scored_completions"] == 4 * 4 + 2 * 2
    assert row["work"]["train_tokens"] > 0 and row["work"]["optimizer_steps"] == 1


# a node of the three-specialty mix answering 4 own questions and taking 4 peers' groups a round
FOUR_AND_FOUR = [
    f"tasks.datasets={json.dumps(MIX)}",
    "swarm.transport=dht",
    "swarm.local_questions=4",
    "swarm.external_questions=4",
]


def add_group_with_a_spread(index: int) -> RolloutGroup:
    """A peer's group on the index-th add question: one right answer and one wrong."""
    spec = spec_of("add", index)
    return RolloutGroup(spec, right_and_wrong(spec), [1.0, 0.0])


def own_questions_answered(row: dict, per_question: int) -> int:
    """Questions of its own a node answered in a round, from the round's work (each peer group re-scored has 2
    answers)."""
    return (row["work"]["scored_completions"] - 2 * row["external_rescored"]) // per_question


# swarm.external_gate: peers' groups only where the peer is stronger, the node's own questions in place of the rest ---


def test_the_gate_keeps_a_peers_group_only_where_that_peer_is_the_margin_stronger(swarm_node):
    node = swarm_node("swarm.external_gate=stronger_peer")
    node.telemetry.accuracy_by_dataset.update({"add": 0.9, "subtract": 0.1})
    received = [
        peer_group(spec_of("add", 0), right=6, wrong=2, peer="expert"),  # 0.75 < 0.9 + 0.1: this node knows add
        peer_group(spec_of("subtract", 0), right=6, wrong=2, peer="expert"),  # 0.75 >= 0.1 + 0.1
    ]
    chosen = node.sharing.choose(received, seed=0)
    assert [node.tasks.label(g.spec) for g in chosen.groups] == ["subtract"]
    assert chosen.gated == 1 and chosen.rescored == 2
    assert node.stats.peer("expert").questions_used == 1  # only what it took counts as used
    # an equal peer: right 6 times in 8 where this node is right 0.7 of the time; 0.75 is under 0.7 + 0.1 ...
    node.telemetry.accuracy_by_dataset.update({"subtract": 0.7})
    equal = [peer_group(spec_of("subtract", 1), right=6, wrong=2, peer="equal")]
    assert node.sharing.choose(equal, seed=0).gated == 1 and node.sharing.choose(equal, seed=0).groups == []
    # ... and over 0.7 + 0.05; a specialty the node never answered counts as an even chance (0.5 + 0.1 <= 0.75)
    looser = swarm_node("swarm.external_gate=stronger_peer", "swarm.external_gate_margin=0.05")
    looser.telemetry.accuracy_by_dataset.update({"subtract": 0.7})
    assert len(looser.sharing.choose(equal, seed=0).groups) == 1
    assert len(swarm_node("swarm.external_gate=stronger_peer").sharing.choose(equal, seed=0).groups) == 1
    # SAPO's rule (no gate) keeps every group with a spread
    plain = swarm_node()
    plain.telemetry.accuracy_by_dataset.update({"add": 0.9, "subtract": 0.7})
    everything = plain.sharing.choose(received + equal, seed=0)
    assert len(everything.groups) == 3 and everything.gated == 0


# swarm.own_replay: the node's own earlier right answers, replayed as demonstrations ---------------------------------


def test_own_replay_keeps_each_groups_distinct_right_answers_and_replays_them_as_demonstrations(tiny_config):
    def answer(ids: list[int]) -> Completion:
        return Completion([7, 8], ids, "", None, "stop", policy_version=0)

    spec = spec_of("add", 0)
    replay = OwnAnswerReplay(per_round=2, seed=0, capacity=3)
    assert replay.draw() == []  # nothing learned yet
    right_twice = RolloutGroup(
        spec,
        [answer([1]), answer([1]), answer([2]), answer([])],
        [1.0, 1.0, 0.0, 1.0],
        correct=[True, True, False, True],
    )
    unscored = RolloutGroup(spec, [answer([3])], [1.0])  # no verdicts: nothing to replay
    replay.add([right_twice, unscored])
    # [1] twice is one answer; [2] is wrong; an empty completion teaches nothing
    assert [list(c.completion_ids) for _, c in replay.answers] == [[1]]
    (drawn,) = replay.draw()
    assert drawn.weight == 1.0 and list(drawn.completion.completion_ids) == [1]
    # the newest `capacity` answers are kept; a round draws `per_round` of them, distinct
    replay.add([RolloutGroup(spec, [answer([k])], [1.0], correct=[True]) for k in (4, 5, 6)])
    assert [list(c.completion_ids) for _, c in replay.answers] == [[4], [5], [6]]
    drawn = replay.draw()
    assert len(drawn) == 2 and len({tuple(d.completion.completion_ids) for d in drawn}) == 2
    # replay trains through the imitation term: without one (swarm.imitation none) a node replays nothing
    assert RoundPlan.of(tiny_config().swarm).replayed == 4  # the isolated default replays
    assert RoundPlan.of(tiny_config("swarm.own_replay=4", "swarm.imitation=none").swarm).replayed == 0


def test_a_gated_round_answers_one_more_of_its_own_for_each_peers_group_it_turned_away(tiny_config):
    gated = plan(local_questions=4, external_questions=4, external_gate="stronger_peer")
    assert [gated.own_quota(taken) for taken in (None, 4, 1, 0)] == [(4, 4), (4, 4), (7, 7), (8, 8)]
    assert gated.draw_stride == 8  # a round that took none draws 8: the rounds' draws never overlap
    assert gated.collect == "before_drawing"  # it must know what it took before it draws
    wider = plan(local_questions=4, external_questions=4, generated_questions=6, external_gate="stronger_peer")
    assert wider.own_quota(2) == (8, 6) and wider.draw_stride == 10
    # without the gate what a round took does not change its own share; the stream's stride is what a round draws
    unhurried = plan(local_questions=4, external_questions=4)
    assert unhurried.own_quota(0) == (4, 4) and unhurried.draw_stride == 4
    generating = plan(local_questions=4, external_questions=4, generated_questions=6)
    assert generating.own_quota(0) == (6, 4) and generating.own_quota() == (6, 4) and generating.draw_stride == 6
    # a node that takes no peers' groups (J = 0, the shipped config trained alone) is a silo whatever the gate says
    alone = RoundPlan.of(tiny_config("swarm.external_gate=stronger_peer").swarm)
    assert alone.collect == "never" and alone.own_quota(0) == (2, 2) and alone.draw_stride == 2


def test_a_gated_nodes_rounds_take_a_stronger_peers_groups_and_answer_its_own_in_place_of_an_equals(
    tiny_config, tmp_path
):
    """Node b gates; a publishes 4 add groups right once in 2 (0.5) each round. Where b is right 0.95 of the time at
    add, it takes none and answers 8 of its own; where it is right 0.1 of the time, it takes the 4 and answers 4."""
    import asyncio

    gated = [*FOUR_AND_FOUR, "swarm.external_gate=stronger_peer", "eval_every=0"]
    a, b = in_process_nodes(tiny_config, tmp_path, {"a": FOUR_AND_FOUR, "b": gated})
    per_question = b.config.rollout.completions_per_question

    async def rounds():
        rows = []
        for round_, add_accuracy in enumerate((0.95, 0.1)):
            b.telemetry.accuracy_by_dataset["add"] = add_accuracy
            b.sharing.peer_rates.clear()  # each round judges a's groups afresh
            await a.transport.publish(round_ + 1, 0, [add_group_with_a_spread(4 * round_ + k) for k in range(4)])
            rows.append(await b.run_round())
        return rows

    rows = asyncio.run(rounds())
    assert [row["external_questions"] for row in rows] == [0, 4]
    assert [row["external_gated"] for row in rows] == [4, 0]
    assert [own_questions_answered(row, per_question) for row in rows] == [8, 4]
