"""GRPO policy update with DAPO's options.

Per question group: A_i = (r_i - mean(r)) / (std(r) + eps). Per completion token:
    loss_t = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A) * w_t  (+ beta * KL_t)
with rho_t = pi_theta / pi_old, and w_t an importance weight for samples produced by another
policy (a peer's, or an older ours): per token, truncated, min(c, pi_old / pi_behaviour); or per
sequence, HACPO's exponential form min(1, s)^(1 + alpha) with s = exp(mean_t log pi_old/pi_behaviour),
so that a peer's sample never counts more than one's own. A peer's group may also carry HACPO's
capability corrections (node/sharing.py): its advantages are taken against omega * mean(r) instead
of mean(r), and its loss is scaled by a discrepancy coefficient.
With trainer.imitation_coef > 0 the loss also holds an imitation term,
    imitation_coef * sum_i v_i * NLL_i / (demonstration tokens),
over the round's demonstrations: right answers marked with a weight v (a peer's where it knows more than
this node, and the node's own to anchor what it knows; node/sharing.py), whatever their reward spread.
The loss is averaged over all completion tokens of the round (DAPO's token-level mean),
whatever the micro-batching.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from node.config import TrainerConfig
from node.device import model_device
from node.rollouts.base import Completion, RolloutGroup


@dataclass
class TrainStats:
    loss: float = 0.0
    grad_norm: float = 0.0
    clip_fraction: float = 0.0
    kl: float = 0.0
    tokens: int = 0
    groups_used: int = 0
    groups_dropped: int = 0
    stepped: bool = False
    importance_weight_mean: float | None = None
    """Mean truncated importance weight over the tokens of off-policy samples (None: no such token).
    Near 0: peers' completions are ones this policy would rarely produce, and teach it little."""
    imitation_sequences: int = 0
    imitation_nll: float | None = None
    """Mean negative log-likelihood per token of the round's demonstrations (swarm.imitation), before the step."""


def group_advantages(rewards: list[float], eps: float, baseline_scale: float = 1.0) -> list[float]:
    """Rewards normalized within their group (sample std, as GRPO implementations do), against a
    baseline of baseline_scale * mean(rewards).

    The scale leaves a group whose rewards are all equal at zero advantage (it must not invent a
    signal), and a scaled baseline at or above the best reward falls back to the plain mean (HACPO's
    guard): otherwise every sample of the group, right ones included, would be pushed down."""
    values = torch.tensor(rewards, dtype=torch.float64)
    std = values.std(unbiased=True) if len(rewards) > 1 else torch.tensor(0.0, dtype=torch.float64)
    baseline = values.mean()
    if not is_uniform(rewards) and baseline * baseline_scale < values.max():
        baseline = baseline * baseline_scale
    return ((values - baseline) / (std + eps)).tolist()


def is_uniform(rewards: list[float]) -> bool:
    return max(rewards) - min(rewards) < 1e-9


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


def completion_logprobs(
    model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], pad_id: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each completion token given its prompt: [batch, max_completion], mask; on the model's device.

    Sequences are right-padded with positions 0..n-1, the same positions the sampler used. The
    batch is laid out on the CPU and moved once (a copy per tensor, not one per row).
    """
    device = model_device(model)
    seqs = [prompt + completion for prompt, completion in rows]
    width = max(map(len, seqs))
    max_completion = max(len(c) for _, c in rows)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    # where completion token j of row i is scored: targets[i, len(prompt) - 1 + j] (0 past its end, masked)
    scored_at = torch.zeros((len(rows), max_completion), dtype=torch.long)
    mask = torch.zeros((len(rows), max_completion), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(rows):
        input_ids[i, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
        attention_mask[i, : len(seqs[i])] = 1
        scored_at[i, : len(completion)] = torch.arange(len(prompt) - 1, len(seqs[i]) - 1)
        mask[i, : len(completion)] = True
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    scored_at, mask = scored_at.to(device), mask.to(device)
    position_ids = torch.arange(width, device=device).expand(len(seqs), width)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logprobs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    targets = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # targets[:, j] scores token j+1
    return targets.gather(1, scored_at).masked_fill(~mask, 0.0), mask


def _pad_rows(rows: list[list[float]], width: int, device: torch.device | None = None) -> torch.Tensor:
    """Rows of floats right-padded with zeros to `width`, on `device` (the trainer's, GRPOTrainer.device; None: left
    on the CPU, where they are laid out)."""
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out if device is None else out.to(device)


@dataclass
class _Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    behaviour_logprobs: list[float] | None
    on_policy: bool
    loss_scale: float = 1.0


class GRPOTrainer:
    """Owns the optimizer (and the optional frozen reference) of one policy."""

    def __init__(
        self,
        config: TrainerConfig,
        model: torch.nn.Module,
        pad_id: int,
        temperature: float,
        policy_version: int = 0,
        optimizer=None,
    ):
        self.config = config
        self.model = model
        self.pad_id = pad_id
        self.temperature = temperature
        self.policy_version = policy_version
        # A policy split across stage servers brings its own optimizer (node/pipeline/remote_model.py): each stage steps
        # itself.
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
        self.reference = None
        if config.kl_beta > 0:  # a copy of the policy, on the policy's device (a deep copy stays where it is)
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters are: every tensor the update makes for the policy goes there."""
        return model_device(self.model)

    def _samples(self, groups: list[RolloutGroup], stats: TrainStats) -> list[_Sample]:
        samples = []
        for group in groups:
            if self.config.drop_uniform_groups and is_uniform(group.rewards):
                stats.groups_dropped += 1
                continue
            stats.groups_used += 1
            for completion, advantage in zip(
                group.completions, group_advantages(group.rewards, self.config.advantage_eps, group.baseline_scale)
            ):
                if not completion.completion_ids:
                    continue  # nothing to score; never divides the loss by zero tokens
                samples.append(
                    _Sample(
                        prompt_ids=completion.prompt_ids,
                        completion_ids=completion.completion_ids,
                        advantage=advantage,
                        behaviour_logprobs=completion.logprobs,
                        on_policy=completion.policy_version == self.policy_version and completion.logprobs is not None,
                        loss_scale=group.loss_scale,
                    )
                )
        return samples

    @torch.no_grad()
    def _old_logprobs(self, batch: list[_Sample]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pi_old for the ratio, and the importance weight w.r.t. the behaviour policy (None: all on-policy)."""
        width = max(len(s.completion_ids) for s in batch)
        if all(s.on_policy for s in batch):
            return _pad_rows([s.behaviour_logprobs for s in batch], width), None
        recomputed, _ = completion_logprobs(
            self.model, [(s.prompt_ids, s.completion_ids) for s in batch], self.pad_id, self.temperature
        )
        old = recomputed.clone()
        weights = torch.ones_like(old)
        for i, sample in enumerate(batch):
            n = len(sample.completion_ids)
            if sample.on_policy:
                old[i, :n] = torch.tensor(sample.behaviour_logprobs)
            elif sample.behaviour_logprobs is not None:
                weights[i, :n] = self._importance_weights(recomputed[i, :n], torch.tensor(sample.behaviour_logprobs))
        return old, weights

    def _importance_weights(self, current: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
        """The importance weight of each token of one off-policy sample (see the module docstring)."""
        if self.config.importance_level == "sequence":
            ratio = torch.exp((current - behaviour).mean()).clamp(max=1.0)
            return (ratio ** (1.0 + self.config.importance_alpha)).expand_as(current)
        return torch.exp(current - behaviour).clamp(max=self.config.importance_cap)

    def step(self, groups: list[RolloutGroup], demonstration_groups: list[RolloutGroup] = ()) -> TrainStats:
        """One optimizer step on `groups` (the policy-gradient term, and the imitation term over their marked right
        answers) and on `demonstration_groups`, whose right answers enter the imitation term only."""
        stats = TrainStats()
        samples = self._samples(groups, stats)
        total_tokens = sum(len(s.completion_ids) for s in samples)
        stats.tokens = total_tokens
        demonstrations = (
            self._demonstrations([*groups, *demonstration_groups]) if self.config.imitation_coef > 0 else []
        )
        if total_tokens == 0 and not demonstrations:
            return stats  # every group uniform or empty: no update, policy version unchanged
        self.model.train()
        micro = self.config.micro_batch_size
        batches = [samples[i : i + micro] for i in range(0, len(samples), micro)]
        frozen = [self._old_logprobs(batch) for batch in batches]
        weighted = [
            weights[i, : len(s.completion_ids)]
            for batch, (_, weights) in zip(batches, frozen)
            if weights is not None
            for i, s in enumerate(batch)
            if not s.on_policy and s.behaviour_logprobs is not None
        ]
        if weighted:
            stats.importance_weight_mean = torch.cat(weighted).mean().item()
        loss_sum = clipped = kl_sum = 0.0
        for _ in range(self.config.epochs_per_round):
            self.optimizer.zero_grad(set_to_none=True)
            for batch, (old, weights) in zip(batches, frozen):
                rows = [(s.prompt_ids, s.completion_ids) for s in batch]
                logprobs, mask = completion_logprobs(self.model, rows, self.pad_id, self.temperature)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref, _ = completion_logprobs(self.reference, rows, self.pad_id, self.temperature)
                advantages = torch.tensor([s.advantage for s in batch], dtype=logprobs.dtype)
                if any(s.loss_scale != 1.0 for s in batch):
                    scales = torch.tensor([s.loss_scale for s in batch], dtype=logprobs.dtype)[:, None]
                    weights = scales if weights is None else weights * scales
                loss, info = policy_loss(
                    logprobs,
                    old,
                    advantages,
                    mask,
                    self.config.eps_low,
                    self.config.eps_high,
                    weights,
                    ref,
                    self.config.kl_beta,
                )
                (loss / total_tokens).backward()
                loss_sum += loss.item()
                clipped += info["clipped_tokens"].item()
                kl_sum += info["kl_sum"].item()
            if demonstrations:
                stats.imitation_nll = self._imitation_backward(demonstrations)
                stats.imitation_sequences = len(demonstrations)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise FloatingPointError(
                    f"non-finite gradient norm {grad_norm.item()} at policy version {self.policy_version}; update "
                    "refused"
                )
            self.optimizer.step()
            stats.grad_norm = grad_norm.item()
            # a pipeline's stages clip and report their own norms
            stage_norms = getattr(self.optimizer, "last_grad_norms", None)
            if stage_norms:
                stats.grad_norm = math.sqrt(sum(n * n for n in stage_norms.values()))
        self.model.eval()
        epoch_tokens = max(1, total_tokens * self.config.epochs_per_round)  # 0: only demonstrations this round
        stats.loss = loss_sum / epoch_tokens
        stats.clip_fraction = clipped / epoch_tokens
        stats.kl = kl_sum / epoch_tokens
        stats.stepped = True
        self.policy_version += 1
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"non-finite loss at policy version {self.policy_version}")
        return stats

    def _demonstrations(self, groups: list[RolloutGroup]) -> list[tuple[float, Completion]]:
        """The round's right answers marked for imitation, with their weights: the heaviest, up to
        imitation_max_sequences."""
        weighted = sorted(((g.imitation_weight, c) for g in groups for c in g.demonstrations()), key=lambda wc: -wc[0])
        return weighted[: self.config.imitation_max_sequences]

    def _imitation_backward(self, demonstrations: list[tuple[float, Completion]]) -> float:
        """Accumulate imitation_coef x the weighted mean token NLL of the demonstrations into .grad; the unweighted
        mean NLL."""
        total_tokens = sum(len(c.completion_ids) for _, c in demonstrations)
        nll_sum = 0.0
        micro = self.config.micro_batch_size
        for start in range(0, len(demonstrations), micro):
            batch = demonstrations[start : start + micro]
            logprobs, mask = completion_logprobs(
                self.model, [(c.prompt_ids, c.completion_ids) for _, c in batch], self.pad_id, self.temperature
            )
            weights = torch.tensor([w for w, _ in batch], dtype=logprobs.dtype)[:, None]
            token_nll = -(logprobs * mask)
            ((token_nll * weights).sum() * self.config.imitation_coef / total_tokens).backward()
            nll_sum += token_nll.sum().item()
        return nll_sum / total_tokens
