"""Partial rollouts (rollout.over_sample; APRIL in slime's words): a round samples groups for more questions than it
trains, stops decoding once enough groups have every completion ended, and carries the completions it stopped to the
next round, which resumes them first, where they stopped, under its newer policy.

Why: a round's sampling waits for its longest completion, and on a workload whose answers vary in length most rows
of the batch have ended long before it. Stopping at the quota lets the round end with the bulk; the tail goes on in
the next round's batch instead of holding this one.

What is carried: each group the round did not complete (its question, its ended completions, and its stopped ones with
their tokens, behaviour log-probs and the policy version of each token), in a FIFO resumed oldest first. It is bounded
by construction: a round samples ceil(wanted * (1 + over_sample)) groups, carried ones first, and completes at least
`wanted` of them (or every one, if that is all there is), so at most ceil(wanted * (1 + over_sample)) - wanted wait.
The buffer lives in memory only: a restart loses it (the stopped completions are dropped, their questions go
unanswered; nothing else changes).

A group leaves only complete, so peers are only ever sent complete groups, and a completion leaves with the policy
version of its oldest token (the version the wire and the staleness metrics know). The tokens an older policy sampled
keep their behaviour log-probs (rollout.partial_prefix 'keep': the trainer's truncated importance weight corrects each
token as it does a peer's), or are left out of the policy-gradient term ('mask'), as context of the rest.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from node.rollouts.base import Completion, PartialCompletion, RolloutBackend
from node.tasks import Question


@dataclass
class CarriedGroup:
    """A question's group that a round stopped before every completion had ended."""

    question: Question
    slots: list[Completion | PartialCompletion]
    """Its G completions in sampling order: those ended, and those to resume."""


@dataclass
class PartialRound:
    """What a round of partial rollouts sampled: its complete groups, and how many completions moved between rounds."""

    groups: list[tuple[Question, list[Completion]]] = field(default_factory=list)
    carried_in: int = 0
    """Completions resumed this round (started by an earlier one)."""
    carried_out: int = 0
    """Completions stopped this round with tokens, to be resumed by the next."""


def masked_older_prefix(completion: Completion) -> Completion:
    """The completion with its tokens an older policy sampled than its last token's marked out of the policy-gradient
    term (rollout.partial_prefix 'mask')."""
    if not completion.token_versions:
        return completion
    newest = completion.token_versions[-1]
    return replace(completion, masked_prefix=sum(version < newest for version in completion.token_versions))


class PartialRollouts:
    """The round's groups sampled with over-provisioning, and the groups it stopped, carried to the next round."""

    def __init__(
        self,
        backend: RolloutBackend,
        encode: Callable[[str], list[int]],
        prompt: Callable[[Question], str],
        completions_per_question: int,
        over_sample: float,
        partial_prefix: Literal["keep", "mask"],
    ):
        if not backend.resumable:
            raise ValueError(
                f"rollout.over_sample needs a backend that resumes completions, not {type(backend).__name__}"
            )
        self.backend = backend
        self.encode = encode
        self.prompt = prompt
        self.completions_per_question = completions_per_question
        self.over_sample = over_sample
        self.partial_prefix = partial_prefix
        self.carried: deque[CarriedGroup] = deque()

    def groups_sampled(self, wanted: int) -> int:
        """Groups a round that trains on `wanted` samples: the carried ones and fresh ones."""
        return math.ceil(wanted * (1 + self.over_sample) - 1e-9)

    def fresh_needed(self, wanted: int) -> int:
        """New questions the round draws beside the carried groups."""
        return max(0, self.groups_sampled(wanted) - len(self.carried))

    def sample(self, fresh: list[Question], wanted: int, seed: int) -> PartialRound:
        """The carried groups resumed and the fresh questions' groups sampled, together, until `wanted` of them are
        complete; the others are carried (resumed next round before any new question)."""
        in_flight = list(self.carried)
        self.carried.clear()
        for question in fresh:
            prompt_ids = self.encode(self.prompt(question))
            in_flight.append(
                CarriedGroup(
                    question, [PartialCompletion(list(prompt_ids)) for _ in range(self.completions_per_question)]
                )
            )
        rows, group_of, where = [], [], []
        result = PartialRound()
        for g, group in enumerate(in_flight):
            for k, slot in enumerate(group.slots):
                if isinstance(slot, PartialCompletion):
                    rows.append(slot)
                    group_of.append(g)
                    where.append((g, k))
                    result.carried_in += bool(slot.completion_ids)
        sampled = self.backend.sample_until(rows, group_of, min(wanted, len(in_flight)), seed)
        for (g, k), row in zip(where, sampled):
            in_flight[g].slots[k] = row
        for group in in_flight:
            if all(isinstance(slot, Completion) for slot in group.slots):
                completions = group.slots
                if self.partial_prefix == "mask":
                    completions = [masked_older_prefix(c) for c in completions]
                result.groups.append((group.question, completions))
            else:
                self.carried.append(group)
                result.carried_out += sum(
                    isinstance(slot, PartialCompletion) and bool(slot.completion_ids) for slot in group.slots
                )
        return result


class SampledCompletions(RolloutBackend):
    """A partial round's complete groups handed to the node's scoring (LocalRollouts.generate_and_score) as a backend
    would hand them: the round's sampling has already happened, so this only returns them, in the order asked."""

    def __init__(self, groups: list[list[Completion]]):
        self.groups = groups

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> list[list[Completion]]:
        if len(prompts) != len(self.groups) or any(len(group) != n for group in self.groups):
            raise ValueError(f"asked for {len(prompts)} groups of {n}; the round completed {len(self.groups)}")
        return self.groups

    def sync_weights(self, model, policy_version: int) -> None:
        raise NotImplementedError("a partial round's completions are sampled already: there is nothing to sample with")
