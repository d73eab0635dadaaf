"""A node's own rollouts: answer its questions with the rollout backend, score them here, choose I to train on."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass

from node.config import NodeConfig
from node.rollouts.base import RolloutBackend, RolloutGroup, is_uniform
from node.tasks import Question, TaskSource, score_group


@dataclass
class RoundTimings:
    generation_s: float = 0.0
    scoring_s: float = 0.0
    update_s: float = 0.0


def apportion(total: int, weights: dict[str, float]) -> dict[str, int]:
    """`total` split in proportion to the weights, rounded by largest remainder (ties: in key order)."""
    mass = sum(weights.values())
    if total <= 0 or mass <= 0:
        return {label: 0 for label in weights}
    exact = {label: total * w / mass for label, w in weights.items()}
    counts = {label: int(share) for label, share in exact.items()}
    by_remainder = sorted(weights, key=lambda label: -(exact[label] - counts[label]))
    for label in by_remainder[: total - sum(counts.values())]:
        counts[label] += 1
    return counts


def balanced_counts(own: int, batch: int, mix: dict[str, float], supplied: dict[str, int]) -> dict[str, int]:
    """How many of its `own` questions a node draws in each specialty (swarm.local_draw 'balance'), so that with the
    peers' groups `supplied` its round's `batch` groups hold each specialty in its share of the mix (MT-GRPO's
    ratio-preserving batch): its own draws fill what peers did not bring, in proportion to what is missing, and
    follow the mix when nothing is (peers brought too much of some specialty, or all of it)."""
    missing = {label: max(0.0, share * batch - supplied.get(label, 0)) for label, share in mix.items()}
    return apportion(own, missing if sum(missing.values()) > 0 else mix)


class LocalRollouts:
    def __init__(self, config: NodeConfig, tasks: TaskSource, backend: RolloutBackend):
        self.config = config
        self.tasks = tasks
        self.backend = backend

    def draw(
        self, first_draw: int, count: int, balance_with: list[RolloutGroup] | None = None, batch_groups: int = 0
    ) -> list[Question]:
        """This round's own questions, `count` of the node's stream from `first_draw` on (the round's plan says how
        many: node/sharing.py RoundPlan): from the task mix, or, given the peers' groups chosen first
        (swarm.local_draw 'balance'), as many of each specialty as make the round's `batch_groups` groups hold the
        mix's shares (balanced_counts)."""
        if balance_with is None:
            return self.tasks.batch(first_draw=first_draw, count=count)
        counts = balanced_counts(
            count, batch_groups, self.tasks.mix_weights, Counter(self.tasks.label(g.spec) for g in balance_with)
        )
        return self.tasks.batch_by_label(first_draw=first_draw, counts=counts)

    def score_group(self, question: Question, completions, source: str) -> tuple[RolloutGroup, int]:
        """The group with its locally computed rewards, and how many of its completions are correct."""
        tasks = self.config.tasks
        return score_group(question, completions, source, tasks.format_reward, tasks.answer_extraction)

    def generate_and_score(
        self, questions: list[Question], seed: int
    ) -> tuple[list[RolloutGroup], dict[str, float], RoundTimings]:
        """One group per question, scored; the round's summary (rewards, accuracy, tokens, per specialty); the time
        spent."""
        timings = RoundTimings()
        start = time.perf_counter()
        prompts = [self.tasks.prompt(q) for q in questions]
        completions = self.backend.generate(prompts, self.config.rollout.completions_per_question, seed=seed)
        timings.generation_s = time.perf_counter() - start
        start = time.perf_counter()
        groups, correct, total, tokens = [], 0, 0, 0
        by_label: dict[str, list[float]] = {}  # label -> [reward sum, correct, completions]
        for question, group_completions in zip(questions, completions):
            group, group_correct = self.score_group(question, group_completions, source="local")
            groups.append(group)
            tally = by_label.setdefault(self.tasks.label(question.spec), [0.0, 0, 0])
            tally[0] += sum(group.rewards)
            tally[1] += group_correct
            tally[2] += len(group_completions)
            correct += group_correct
            total += len(group_completions)
            tokens += sum(len(c.completion_ids) for c in group_completions)
        timings.scoring_s = time.perf_counter() - start
        rewards = [r for g in groups for r in g.rewards]
        lengths = sorted(len(c.completion_ids) for g in groups for c in g.completions)
        summary = {
            "reward_mean": sum(rewards) / len(rewards),
            "accuracy": correct / total,
            "tokens": tokens,
            "tokens_per_s": tokens / max(timings.generation_s, 1e-9),
            "completion_len_mean": tokens / total,
            # the tail a round waits for: its longest completion, and the share cut at rollout.max_new_tokens
            "completion_len_p90": lengths[min(len(lengths) - 1, int(0.9 * len(lengths)))],
            "completion_len_max": lengths[-1],
            "completions_cut": sum(c.finish_reason == "length" for g in groups for c in g.completions) / total,
            "reward_by_dataset": {label: reward / n for label, (reward, _, n) in sorted(by_label.items())},
            "accuracy_by_dataset": {label: right / n for label, (_, right, n) in sorted(by_label.items())},
        }
        return groups, summary, timings

    def choose(self, groups: list[RolloutGroup], seed: int, count: int) -> list[RolloutGroup]:
        """`count` of the node's own groups to train on (I, more for peers' groups the gate turned away): those with a
        learning signal first (the trainer would drop the uniform ones), at random within each kind."""
        if len(groups) <= count:
            return groups
        rng = random.Random(seed)
        with_signal = [g for g in groups if not is_uniform(g.rewards)]
        uniform = [g for g in groups if is_uniform(g.rewards)]
        rng.shuffle(with_signal)
        rng.shuffle(uniform)
        return (with_signal + uniform)[:count]
