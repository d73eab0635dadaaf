"""The rollout backend interface (prompts in, sampled completions with behaviour log-probs out) and the rollout data
types: a node's own groups, a peer's groups as received, and what a round trains on."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from protocol.messages import RolloutCompletion
from protocol.specs import TaskSpec

# the data types below are torch-free: transports and record validators take them without a model library
if TYPE_CHECKING:
    import torch


def is_uniform(rewards: list[float]) -> bool:
    """Whether a group's rewards are all equal: no learning signal (GRPO's advantages are all zero)."""
    return max(rewards) - min(rewards) < 1e-9


@dataclass
class Completion:
    """One sampled completion, exactly as the trainer will score it."""

    prompt_ids: list[int]
    completion_ids: list[int]  # ends with the eos id when finish_reason == "stop"
    text: str  # decoded completion, eos excluded
    logprobs: list[float] | None  # behaviour log-probs, one per completion id, at the sampling temperature
    finish_reason: Literal["stop", "length"]
    policy_version: int  # version of the policy that sampled it; of its oldest token, for a resumed completion
    token_versions: list[int] | None = None
    """Per completion id, the version of the policy that sampled it, for a completion resumed over rounds
    (rollout.over_sample); None: every token policy_version's."""
    masked_prefix: int = 0
    """Leading completion ids the policy-gradient term leaves out (rollout.partial_prefix 'mask': those an older
    policy sampled before the completion was resumed); they stay the context of the rest."""


@dataclass
class PartialCompletion:
    """A completion to sample from its prompt (no tokens yet), or one a round stopped before it ended
    (rollout.over_sample), resumed where it stopped: its tokens so far with their behaviour log-probs and the policy
    version of each."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)


@dataclass
class RolloutGroup:
    """One question and the completions sampled for it, with locally computed rewards."""

    spec: TaskSpec
    completions: list[Completion]
    rewards: list[float]
    source: str = "local"  # "local" or the id of the peer that generated it
    correct: list[bool] | None = None
    """Per completion, whether its answer is right (the scorer's verdict, not the reward, which may hold a format
    bonus)."""

    def right_answers(self) -> list[Completion]:
        """The group's distinct right answers (the same tokens twice teach nothing twice); none without verdicts."""
        if self.correct is None:
            return []
        seen, out = set(), []
        for completion, right in zip(self.completions, self.correct):
            key = tuple(completion.completion_ids)
            if right and completion.completion_ids and key not in seen:
                seen.add(key)
                out.append(completion)
        return out


@dataclass(frozen=True)
class Demonstration:
    """A right answer the trainer's imitation term learns (trainer.imitation_coef), and how much it counts there."""

    weight: float
    completion: Completion


@dataclass(frozen=True)
class TrainingBatch:
    """What one round trains on, decided by the round's plan (node/sharing.py) and taken as it is by the trainer: the
    groups of the policy-gradient term, and the demonstrations of the imitation term, in the order they were marked
    (the trainer keeps the heaviest, the first of equal weight)."""

    groups: list[RolloutGroup]
    demonstrations: list[Demonstration] = field(default_factory=list)


@dataclass
class ExternalGroup:
    """A peer's question and completions as received: its rewards are not trusted, the node re-scores."""

    spec: TaskSpec
    completions: list[RolloutCompletion]  # text and the sender's token ids / behaviour log-probs
    claimed_rewards: list[float]  # advisory only: compared with our own scores, never trained on
    peer_id: str
    same_model: bool  # sender's model fingerprint equals ours: its token ids and log-probs are comparable
    policy_version: int  # the sender's policy version (its own counter)


@dataclass
class GenerationWork:
    """What a backend's sampling has cost, in token positions through the model (node/compute.py weighs them)."""

    prefill_tokens: int = 0
    """Prompt positions of the prefill forwards, pads included."""
    decode_tokens: int = 0
    """One per row of each decoding forward: a finished row keeps its slot until its batch ends."""
    decode_steps: int = 0
    """One per decoding forward, whatever its rows."""

    def since(self, earlier: GenerationWork) -> GenerationWork:
        return GenerationWork(
            self.prefill_tokens - earlier.prefill_tokens,
            self.decode_tokens - earlier.decode_tokens,
            self.decode_steps - earlier.decode_steps,
        )


class RolloutBackend(ABC):
    """Generates completions with the current policy."""

    @property
    def work(self) -> GenerationWork:
        """What this backend's sampling has cost so far (cumulative; a copy of it marks a point to measure from)."""
        if "_work" not in self.__dict__:
            self._work = GenerationWork()
        return self._work

    @abstractmethod
    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order; reproducible for a given seed."""

    @abstractmethod
    def sync_weights(self, model: torch.nn.Module, policy_version: int) -> None:
        """Make the next `generate` use these weights (called after every policy update)."""

    resumable: bool = False
    """Whether `sample_until` works: the backend can stop a batch midway and resume its rows later."""

    def sample_until(
        self, rows: list[PartialCompletion], group_of: list[int], groups_wanted: int, seed: int
    ) -> list[Completion | PartialCompletion]:
        """Each row sampled on from where it is, together, until `groups_wanted` groups (rows of one `group_of` value)
        have every row ended, or every row has: an ended row comes back a Completion, the others a PartialCompletion
        holding their tokens so far (rollout.over_sample). Reproducible for a given seed."""
        raise NotImplementedError(f"{type(self).__name__} cannot stop and resume completions")

    def close(self) -> None:
        """Release engines and memory."""
