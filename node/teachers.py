"""Peers' policies as teachers: on-policy distillation of what a peer knows better (trainer.distill_coef).

A peer that is right more often than this node in a specialty can teach it without sending a single rollout: the node
answers that specialty's questions itself, and the peer's policy scores every token of those answers (the trainer
pulls this policy's next-token distribution toward the teacher's, KL(pi || pi_teacher)). The node learns on its own
samples, so its distribution moves only where the teacher disagrees with it, and a group the node got all wrong
still teaches (GRPO learns nothing from it). The default model is ~10 MB: a peer's whole policy is cheaper to move
than many rounds of rollouts.

This component holds the offers, one teacher per specialty (the strongest offered), and marks the node's own groups
of a specialty whose teacher is stronger than the node there. Where the offers come from is the caller's: a peer's
weights fetched over the weight exchange and its accuracy from its heartbeat, or, in benchmarks/sharing.py, the
in-process peers themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from node.rollouts.base import RolloutGroup
from node.sharing import CAPABILITY_PRIOR
from protocol import TaskSpec


@dataclass
class Teacher:
    peer: str
    policy: Any  # a torch module, in eval mode, on this node's device
    pass_rate: float
    """The teacher's accuracy in the specialty, as offered (a heartbeat's accuracy_by_dataset, say)."""


class Teachers:
    """The teacher offered for each specialty, and which of the node's groups it scores."""

    def __init__(self, own_accuracy: Mapping[str, float], label_of: Callable[[TaskSpec], str]):
        self.own_accuracy = own_accuracy  # the node's accuracy moving average per specialty, updated in place
        self.label_of = label_of
        self.by_label: dict[str, Teacher] = {}

    def offer(self, label: str, peer: str, policy: Any, pass_rate: float) -> None:
        """A peer's policy for `label`: kept if it is the first offer there, from the same peer, or stronger."""
        current = self.by_label.get(label)
        if current is None or current.peer == peer or pass_rate > current.pass_rate:
            self.by_label[label] = Teacher(peer, policy, pass_rate)

    def assign(self, groups: list[RolloutGroup]) -> int:
        """Marks each group whose specialty's teacher is right more often than this node there (a node that has not
        answered the specialty yet counts as CAPABILITY_PRIOR); the number marked."""
        marked = 0
        for group in groups:
            label = self.label_of(group.spec)
            teacher = self.by_label.get(label)
            own = self.own_accuracy.get(label, CAPABILITY_PRIOR)
            group.teacher = teacher.policy if teacher is not None and teacher.pass_rate > own else None
            marked += group.teacher is not None
        return marked
