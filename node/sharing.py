"""Peers' rollouts: which of them a node trains on, and how much each one counts.

Each round a node has received peers' groups (question spec + completions + the sender's claimed
rewards, verified by the protocol but not trusted). SAPO trains on J of them. This component:

1. checks each received spec against the node's own task mix (a dictionary look-up, so refusing a
   flood costs nothing): an arbitrary config could make a generator burn CPU or memory;
2. chooses, then re-scores: candidates are the groups whose *claimed* rewards have a spread (a
   group without one teaches nothing, and SAPO's pool drops it); they are drawn in an order
   (`swarm.external_selection`: uniform, SAPO's rule, or weighted by this node's weakness in the
   specialty) and only the drawn ones are re-generated from their spec and re-scored here, until J
   pass with a real learning signal or `swarm.max_rescored_per_round` re-scores are spent. A group
   that lied about its rewards is scored by us anyway and replaced if it carries no signal, so a
   round's work is bounded by J, whatever the number of peers;
3. keeps each peer's pass rate per specialty: a moving average of its groups' pass rates as re-scored here (never
   its claims), P_peer, beside this node's own accuracy moving average there, P_this (a specialty it has never
   answered counts as CAPABILITY_PRIOR);
4. with `swarm.imitation: own_and_stronger_peers`, marks a peer group's right answers as demonstrations for the
   trainer's imitation term (trainer.imitation_coef), weighted by the share of the peer's pass rate this
   node lacks in the specialty, (P_peer - P_this) / P_peer (imitation_weight): the policy-gradient term
   weighs a peer's answer by how likely this policy finds it, so the answers a node most lacks are the ones it
   learns least from there;
5. with `swarm.external_gate: stronger_peer`, keeps a re-scored group only where its peer is measurably stronger in the
   specialty (that peer's moving pass rate, re-scored here, at least `swarm.external_gate_margin` above this node's
   accuracy moving average); the round answers one more question of its own for each group turned away, so equal
   nodes train as a node alone would and a node takes peers' groups only where they know what it lacks.

What a round does with its own groups and peers' follows from the swarm config alone: `RoundPlan` decides it once
(when to collect, the quotas, what to publish, the trainer's `TrainingBatch`) and `Node.run_round` follows it.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

from node.config import NodeConfig, SwarmConfig
from node.rollouts.base import Completion, Demonstration, ExternalGroup, RolloutGroup, TrainingBatch, is_uniform
from node.stats import SwarmStats
from node.tasks import TaskError, TaskSource, materialize, score_group
from protocol import Refusal, TaskSpec
from protocol.bounded import BoundedDict

WEAKNESS_FLOOR = 0.05  # 'weakness' selection: a specialty the node has mastered is still drawn now and then
RESCORES_PER_QUESTION = 2  # default re-scoring budget per external question: the drawn one and one replacement
CAPABILITY_PRIOR = 0.5  # P_this of a specialty this node has not answered yet: an even chance
PEER_RATE_WEIGHT = 0.2  # of a group's pass rate in its peer's moving average (about the last 5 groups)
MAX_PEER_RATES = 4096  # (peer, specialty) averages remembered: throwaway identities cannot grow them without bound


@dataclass(frozen=True)
class PeerChoice:
    """The peers' groups a round chose, each with the weight of its right answers as demonstrations (0: none), and
    what choosing them cost: groups re-scored, their completions graded here, groups the gate turned away."""

    groups: list[RolloutGroup] = field(default_factory=list)
    imitation_weights: list[float] = field(default_factory=list)
    rescored: int = 0
    rescored_completions: int = 0
    gated: int = 0


@dataclass(frozen=True)
class RoundPlan:
    """What a round does with its own groups and peers', decided once from the swarm config: when it collects peers'
    groups, how many questions of its own it draws and trains on, what it publishes, and the batch the trainer takes.

    `Node.run_round` follows it; nothing of it is set on the rollout types or read back from a component."""

    collect: Literal["never", "before_drawing", "after_publishing"]
    """never without J; with swarm.local_draw 'balance' before the node draws its own questions (they fill the
    specialties peers left short), and with swarm.external_gate (the node answers one more of its own for each peer's
    group it turns away); otherwise after it has published its own (SAPO's order)."""
    generated: int  # questions of its own a round answers (I, or swarm.generated_questions)
    trained: int  # I: of those, the ones it trains on
    external: int  # J
    gated: bool  # swarm.external_gate: a group turned away is replaced by a question of its own
    balance_draw: bool  # swarm.local_draw 'balance'
    publish_all: bool  # swarm.publish 'all', else only groups with a reward spread
    imitation: Literal["none", "own", "own_and_stronger_peers"]
    """swarm.imitation as it applies: learning from stronger peers needs their groups, so a node that takes none
    (external_questions 0, as every isolated node) imitates its own right answers only: `configs/swarm.yaml` trained
    alone is the best single-node recipe, the same as `configs/isolated.yaml`."""
    replayed: int  # own earlier right answers replayed a round (swarm.own_replay, where an imitation term trains them)

    @classmethod
    def of(cls, swarm: SwarmConfig) -> RoundPlan:
        if swarm.external_questions == 0:
            collect = "never"
        elif swarm.local_draw == "balance" or swarm.external_gate != "none":
            collect = "before_drawing"
        else:
            collect = "after_publishing"
        imitation = swarm.imitation
        if imitation == "own_and_stronger_peers" and swarm.external_questions == 0:
            imitation = "own"
        return cls(
            collect=collect,
            generated=swarm.generated_questions or swarm.local_questions,
            trained=swarm.local_questions,
            external=swarm.external_questions,
            gated=swarm.external_gate != "none",
            balance_draw=swarm.local_draw == "balance",
            publish_all=swarm.publish == "all",
            imitation=imitation,
            replayed=swarm.own_replay if imitation != "none" else 0,
        )

    def own_quota(self, peers_taken: int | None = None) -> tuple[int, int]:
        """(questions of its own the node draws and answers, and trains on) in a round: I (or generated_questions)
        and, with the gate, one more for each of the round's J it did not take (`peers_taken`: how many it took;
        None, not known yet: as if all)."""
        deferred = 0
        if self.gated and peers_taken is not None:
            deferred = max(0, self.external - peers_taken)
        return self.generated + deferred, self.trained + deferred

    @property
    def draw_stride(self) -> int:
        """Questions of the node's stream each round may draw: the most any round draws (with the gate, one that took
        no peer's group), so that the rounds' draws never overlap."""
        return self.generated + (self.external if self.gated else 0)

    @property
    def batch_groups(self) -> int:
        """I + J: the groups a round trains on, whose shares of the mix a balanced draw keeps."""
        return self.trained + self.external

    def to_publish(self, own: list[RolloutGroup]) -> list[RolloutGroup]:
        """The node's own groups it offers peers: all, or those whose rewards differ (a receiver re-scores and drops
        the others)."""
        return own if self.publish_all else [g for g in own if not is_uniform(g.rewards)]

    def training_batch(
        self, own: list[RolloutGroup], peers: PeerChoice, replayed: list[Demonstration] = ()
    ) -> TrainingBatch:
        """The trainer's batch: the node's own groups and the peers' it chose in the policy-gradient term (SAPO's way);
        as demonstrations, with any imitation in effect, the node's own right answers at weight 1 (a group all right
        included: they anchor what it knows), the peers' at the weights they were chosen with, and the replayed ones."""
        demonstrations = []
        if self.imitation != "none":
            demonstrations += [Demonstration(1.0, answer) for group in own for answer in group.right_answers()]
        for group, weight in zip(peers.groups, peers.imitation_weights):
            if weight > 0:
                demonstrations += [Demonstration(weight, answer) for answer in group.right_answers()]
        return TrainingBatch(own + peers.groups, demonstrations + list(replayed))


OWN_REPLAY_CAPACITY = 512  # swarm.own_replay: the node's latest distinct right answers it draws replays from


class OwnAnswerReplay:
    """swarm.own_replay: the node's own right answers of earlier rounds, replayed as demonstrations (weight 1).

    Between four specialists peers' right answers as demonstrations take a specialist's own skill away within its first
    100 units (benchmarks/notebook/2026-11-28-sharing-compute-units.md, "The subtraction specialist's early fall");
    replaying what the node got right
    before keeps those answers in the imitation term beside its peers' (rehearsal). Draws come before the round's own
    answers are added, so a round never replays itself. The answers and the draw's generator are saved with each
    checkpoint (state_dict), so a restarted node replays what it knew before the restart."""

    def __init__(self, per_round: int, seed: int, capacity: int = OWN_REPLAY_CAPACITY) -> None:
        self.per_round = per_round
        self.answers: deque[tuple[TaskSpec, Completion]] = deque(maxlen=capacity)
        self.rng = random.Random(seed)

    def state_dict(self) -> dict:
        """Plain lists, dicts and numbers (a checkpoint stores it as it stores the round)."""
        version, internal, gauss = self.rng.getstate()
        return {
            "answers": [[asdict(spec), asdict(answer)] for spec, answer in self.answers],
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict) -> None:
        """What state_dict saved; the newest `capacity` answers are kept if it saved more."""
        self.answers.clear()
        self.answers.extend((TaskSpec(**spec), Completion(**answer)) for spec, answer in state["answers"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))

    def draw(self) -> list[Demonstration]:
        """Up to `per_round` earlier right answers, each a demonstration of weight 1."""
        picks = self.rng.sample(list(self.answers), min(self.per_round, len(self.answers)))
        return [Demonstration(1.0, answer) for _, answer in picks if answer.completion_ids]

    def add(self, own: list[RolloutGroup]) -> None:
        """The distinct right answers of this round's own groups."""
        self.answers.extend((group.spec, answer) for group in own for answer in group.right_answers())


def weighted_sample(items: list, weights: list[float], count: int, rng: random.Random) -> list:
    """`count` distinct items, each draw proportional to the weights of those left (Efraimidis-Spirakis keys)."""
    keyed = sorted(((rng.random() ** (1.0 / w), i) for i, w in enumerate(weights)), reverse=True)
    return [items[i] for _, i in keyed[:count]]


def imitation_weight(this_node: float | None, peer: float) -> float:
    """The share of the peer's pass rate in a specialty that this node lacks: (P_peer - P_this) / P_peer, at least 0.

    A peer right 6 times in 8 where this node is right once in 10 gives 0.87: its right answers are
    nearly full demonstrations; a peer no better than this node gives 0, so nodes that know the same
    things imitate nothing of each other."""
    learner = CAPABILITY_PRIOR if this_node is None else this_node
    return (peer - learner) / peer if peer > learner else 0.0


class PeerRollouts:
    """Receives, checks, chooses and re-scores peers' groups for one node (see the module docstring)."""

    def __init__(
        self,
        config: NodeConfig,
        tasks: TaskSource,
        tokenizer,
        stats: SwarmStats,
        own_accuracy: Mapping[str, float],
        on_refusal: Callable[[ExternalGroup, Refusal, str], None] | None = None,
    ):
        self.config = config
        self.tasks = tasks
        self.tokenizer = tokenizer
        self.stats = stats
        self.own_accuracy = own_accuracy  # the node's per-specialty accuracy moving average (it updates it in place)
        self.mix = {(d.name, TaskSpec(d.name, d.config).config_key) for d in config.tasks.datasets}
        self.peer_rates: BoundedDict[tuple[str, str], float] = BoundedDict(MAX_PEER_RATES)
        self.imitate_stronger = RoundPlan.of(config.swarm).imitation == "own_and_stronger_peers"
        # counts each refused group
        self.on_refusal = on_refusal or (lambda item, reason, detail: stats.reject(item.peer_id, reason))

    @property
    def rescore_budget(self) -> int:
        swarm = self.config.swarm
        return swarm.max_rescored_per_round or RESCORES_PER_QUESTION * swarm.external_questions

    def choose(self, received: list[ExternalGroup], seed: int) -> PeerChoice:
        """Up to J peer groups to train on this round, re-scored here, with their imitation weights, and what choosing
        them cost (re-scores, completions graded here: part of a round's work, node/compute.py; groups gated)."""
        limit = self.config.swarm.external_questions
        candidates = []
        for item in received:
            if (item.spec.dataset, item.spec.config_key) not in self.mix:
                self.on_refusal(
                    item,
                    Refusal.BAD_SPEC,
                    f"dataset {item.spec.dataset!r} with this config is not in this node's task mix",
                )
            elif not is_uniform(item.claimed_rewards):
                candidates.append(item)
        rng = random.Random(seed)
        weights = [self.selection_weight(item.spec) for item in candidates]
        order = (
            weighted_sample(candidates, weights, len(candidates), rng)
            if self.config.swarm.external_selection == "weakness"
            else rng.sample(candidates, len(candidates))
        )
        chosen: list[RolloutGroup] = []
        weights: list[float] = []
        rescored_groups = rescored_completions = gated = 0
        for item in order:
            if len(chosen) >= limit or rescored_groups == self.rescore_budget:
                break
            rescored_groups += 1
            rescored = self.rescore(item)
            if rescored is None:
                continue
            rescored_completions += len(rescored[0].completions)
            group, correct = rescored
            if is_uniform(group.rewards):
                continue  # it claimed a spread it does not have: scored here, found empty, replaced
            weight = self._weigh_by_capability(group, correct / len(group.rewards))
            if not self.passes_gate(group.source, self.tasks.label(group.spec)):
                gated += 1
                continue
            self.stats.peer(group.source).questions_used += 1
            chosen.append(group)
            weights.append(weight)
        return PeerChoice(chosen, weights, rescored_groups, rescored_completions, gated)

    def passes_gate(self, peer: str, label: str) -> bool:
        """swarm.external_gate 'stronger_peer': whether the peer's moving pass rate in the specialty (its groups
        re-scored here, this one included) is at least the margin above this node's accuracy moving average there."""
        swarm = self.config.swarm
        if swarm.external_gate == "none":
            return True
        own = self.own_accuracy.get(label, CAPABILITY_PRIOR)
        return self.peer_rates[(peer, label)] >= own + swarm.external_gate_margin - 1e-9

    def selection_weight(self, spec: TaskSpec) -> float:
        """'weakness' selection: how often this node's own answers in the spec's specialty are wrong (unknown: as if
        always)."""
        accuracy = self.own_accuracy.get(self.tasks.label(spec))
        return max(WEAKNESS_FLOOR, 1.0 - accuracy) if accuracy is not None else 1.0

    def rescore(self, item: ExternalGroup) -> tuple[RolloutGroup, int] | None:
        """Re-derive the peer's question from its spec, re-tokenize its completions and score them here:
        the group and how many of its completions are right (None: refused, and counted).

        The sender's answers and rewards are never used; its token ids and behaviour log-probs only
        when it runs the same model and they match our own tokenization exactly."""
        try:
            question = materialize(item.spec)
        except TaskError as exc:
            self.on_refusal(item, Refusal.UNSCORABLE, str(exc))
            return None
        eos_id = self.tokenizer.eos_token_id
        prompt_ids = self.tokenizer.encode(self.tasks.prompt(question), add_special_tokens=False)
        completions = []
        for sent in item.completions:
            ids = self.tokenizer.encode(sent.text, add_special_tokens=False) + (
                [eos_id] if sent.finish_reason == "stop" else []
            )
            usable = self.config.swarm.importance_weighting and item.same_model and ids == list(sent.token_ids)
            completions.append(
                Completion(
                    prompt_ids,
                    ids,
                    sent.text,
                    list(sent.logprobs) if usable and sent.logprobs is not None else None,
                    sent.finish_reason,
                    policy_version=-1,
                )
            )
        longest = max(len(c.completion_ids) for c in completions)
        if longest > self.config.swarm.max_external_tokens:
            self.on_refusal(
                item, Refusal.BAD_VALUE, f"a completion of {longest} tokens exceeds swarm.max_external_tokens"
            )
            return None
        tasks = self.config.tasks
        group, correct = score_group(question, completions, item.peer_id, tasks.format_reward, tasks.answer_extraction)
        if any(abs(a - b) > 1e-6 for a, b in zip(group.rewards, item.claimed_rewards)):
            self.stats.peer(item.peer_id).claimed_rewards_disagree += 1
        return group, correct

    def _weigh_by_capability(self, group: RolloutGroup, pass_rate: float) -> float:
        """The group's pass rate into its peer's moving average in the specialty, and the group's imitation weight:
        with swarm.imitation own_and_stronger_peers, from that average and this node's accuracy there, else 0."""
        label = self.tasks.label(group.spec)
        key = (group.source, label)
        previous = self.peer_rates.get(key)
        peer_rate = pass_rate if previous is None else (1 - PEER_RATE_WEIGHT) * previous + PEER_RATE_WEIGHT * pass_rate
        self.peer_rates[key] = peer_rate
        return imitation_weight(self.own_accuracy.get(label), peer_rate) if self.imitate_stronger else 0.0
