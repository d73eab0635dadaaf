"""GRPO policy update with DAPO's options.

Per question group: A_i = (r_i - mean(r)) / (std(r) + eps). Per completion token:
    loss_t = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A) * w_t  (+ beta * KL_t)
with rho_t = pi_theta / pi_old, and w_t an importance weight for samples produced by another
policy (a peer's, or an older ours): per token, truncated, min(c, pi_old / pi_behaviour).
With trainer.imitation_coef > 0 the loss also holds an imitation term,
    imitation_coef * sum_i v_i * sum_t NLL_i,t / (demonstration tokens),
over the round's demonstrations: right answers marked with a weight v (a peer's where it knows more than
this node, and the node's own to anchor what it knows; node/sharing.py), whatever their reward spread.
The policy term is averaged over all its completion tokens (DAPO's token-level mean), whatever the
micro-batching.

Cost: one forward and backward per micro-batch carries both terms (a demonstration that is also a
policy-term completion is not run twice), and with one epoch a round pi_old is that forward, detached:
the policy has not moved yet, so no separate no-grad pass over peers' samples is needed.

Parts: scoring.py scores completion tokens under a model (one row a completion, or one a prompt with its
completions); losses.py holds the loss terms above; optim.py the optimizer, the clipped gradient norm and gradient
checkpointing; grpo.py the trainer, whose `step` composes them.
"""

from node.rollouts.base import Demonstration, RolloutGroup, TrainingBatch
from node.trainer.grpo import GRPOTrainer, TrainingRow, TrainStats
from node.trainer.losses import group_advantages, policy_loss
from node.trainer.optim import enable_gradient_checkpointing
from node.trainer.scoring import completion_logprobs, padded_positions, prompt_sharing_supported

__all__ = [
    "Demonstration",
    "GRPOTrainer",
    "RolloutGroup",
    "TrainStats",
    "TrainingBatch",
    "TrainingRow",
    "completion_logprobs",
    "enable_gradient_checkpointing",
    "group_advantages",
    "padded_positions",
    "policy_loss",
    "prompt_sharing_supported",
]
