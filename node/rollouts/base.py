"""The rollout backend interface: prompts in, sampled completions with behaviour log-probs out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class Completion:
    """One sampled completion, exactly as the trainer will score it."""

    prompt_ids: list[int]
    completion_ids: list[int]  # ends with the eos id when finish_reason == "stop"
    text: str  # decoded completion, eos excluded
    logprobs: list[float] | None  # behaviour log-probs, one per completion id, at the sampling temperature
    finish_reason: Literal["stop", "length"]
    policy_version: int  # version of the policy that sampled it


class RolloutBackend(ABC):
    """Generates completions with the current policy."""

    @abstractmethod
    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> list[list[Completion]]:
        """`n` completions for each prompt, in prompt order; reproducible for a given seed."""

    @abstractmethod
    def sync_weights(self, model: torch.nn.Module, policy_version: int) -> None:
        """Make the next `generate` use these weights (called after every policy update)."""

    def close(self) -> None:
        """Release engines and memory."""
