"""The update's loss terms, each a function of a micro-batch's tensors: group-normalized advantages, the clipped
surrogate with its KL penalty, the truncated importance weight of an off-policy sample, and the imitation term.

Each returns a sum over tokens; the trainer divides by the round's token count, so that the mean is over the whole
round whatever the micro-batching (DAPO's token-level mean)."""

from __future__ import annotations

import torch


def group_advantages(rewards: list[float], eps: float) -> list[float]:
    """Rewards normalized within their group (sample std, as GRPO implementations do)."""
    values = torch.tensor(rewards, dtype=torch.float64)
    std = values.std(unbiased=True) if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
    return ((values - values.mean()) / (std + eps)).tolist()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    importance_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over masked tokens of the clipped surrogate (divide by the token count yourself).

    logprobs/old_logprobs/mask/importance_weights/ref_logprobs: [batch, tokens]; advantages: [batch].
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if importance_weights is not None:
        per_token = per_token * importance_weights
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None and kl_beta > 0:
        log_ratio = ref_logprobs - logprobs  # k3 estimator: unbiased, always >= 0
        kl = torch.exp(log_ratio) - log_ratio - 1
        per_token = per_token + kl_beta * kl
    mask = mask.to(per_token.dtype)
    info = {
        "clipped_tokens": ((unclipped != clipped).to(mask.dtype) * mask).sum().detach(),
        "kl_sum": (kl * mask).sum().detach(),
    }
    return (per_token * mask).sum(), info


def truncated_importance_weights(current: torch.Tensor, behaviour: torch.Tensor, cap: float) -> torch.Tensor:
    """The importance weight of each token of a sample another policy produced, min(cap, pi_old / pi_behaviour):
    truncated, so that a token this policy finds far likelier than its sampler did cannot dominate the step."""
    return torch.exp(current - behaviour).clamp(max=cap)


def imitation_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The imitation term's sum over a micro-batch, sum_i v_i * sum_t NLL_i,t (divide by the round's demonstration
    tokens yourself), and the unweighted NLL sum of its demonstrations, detached, for the round's stats.

    logprobs/mask: [batch, tokens]; weights: [batch], each row's demonstration weight v_i (0: no demonstration)."""
    row_weights = weights[:, None]
    token_nll = -(logprobs * mask)
    return (token_nll * row_weights).sum(), (token_nll.detach() * (row_weights > 0)).sum()
