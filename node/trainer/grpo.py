"""GRPOTrainer: the round's rollouts made training rows, and one update over them, composed of the scoring
(node/trainer/scoring.py), the loss terms (losses.py) and the optimizer's step (optim.py)."""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field

import torch

from node.config import TrainerConfig
from node.device import model_device
from node.rollouts.base import Demonstration, TrainingBatch, is_uniform
from node.trainer.losses import group_advantages, imitation_loss, policy_loss, truncated_importance_weights
from node.trainer.optim import build_optimizer, clipped_grad_norm, enable_gradient_checkpointing, stepped_grad_norm
from node.trainer.scoring import completion_logprobs, pad_rows, padded_positions, prompt_sharing_supported

log = logging.getLogger(__name__)


class StepNotApplied(RuntimeError):
    """The optimizer's step did not reach every part of the policy (a stage of a policy split over stage servers did
    not answer it): the round takes no further epoch, and an update none of whose epochs was applied is no new policy
    version."""


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
    train_tokens: int = 0
    """Token positions through forward and backward (pads included): the update's compute."""
    train_calls: int = 0
    """Forward-and-backward calls (micro-batches, every epoch): a cost per call beside the positions."""
    forward_tokens: int = 0
    """Token positions through no-grad forwards (pi_old with several epochs, the KL reference)."""
    optimizer_steps: int = 0


@dataclass
class _RoundSums:
    """What the round's micro-batches add up to for its stats: sums over every epoch's policy-term tokens, and the
    imitation NLL and the importance weights of the first epoch (before any step)."""

    policy_loss: float = 0.0
    clipped_tokens: float = 0.0
    kl: float = 0.0
    imitation_nll: float = 0.0
    importance_weights: list[torch.Tensor] = field(default_factory=list)


@dataclass
class TrainingRow:
    """One completion of the round's update: in the policy-gradient term, in the imitation term, or in both, so that
    a demonstration already in the batch costs no forward of its own."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float = 0.0
    behaviour_logprobs: list[float] | None = None
    on_policy: bool = True
    in_policy_term: bool = True
    imitation_weight: float = 0.0
    """Weight of this completion as a demonstration (0: none)."""
    masked_prefix: int = 0
    """Leading completion tokens the policy-gradient term leaves out (Completion.masked_prefix)."""

    @property
    def policy_tokens(self) -> int:
        """Tokens this row adds to the policy-gradient term."""
        return len(self.completion_ids) - self.masked_prefix if self.in_policy_term else 0

    @property
    def pair(self) -> tuple[list[int], list[int]]:
        return self.prompt_ids, self.completion_ids


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
        self.optimizer = build_optimizer(model, config, optimizer)
        # one forward per prompt rather than per completion, where the model takes the mask that needs
        self.share_prompts = config.share_prompt_forward and prompt_sharing_supported(model)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.reference = None
        if config.kl_beta > 0:  # a copy of the policy, on the policy's device (a deep copy stays where it is)
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters are: every tensor the update makes for the policy goes there."""
        return model_device(self.model)

    def training_rows(self, batch: TrainingBatch, stats: TrainStats | None = None) -> list[TrainingRow]:
        """The round's rows: each completion of a group with a reward spread (policy term), the demonstrations marked on
        one of them where the same tokens are there, and a row of its own for each other demonstration."""
        stats = stats if stats is not None else TrainStats()
        rows = []
        for group in batch.groups:
            if self.config.drop_uniform_groups and is_uniform(group.rewards):
                stats.groups_dropped += 1
                continue
            stats.groups_used += 1
            for completion, advantage in zip(
                group.completions, group_advantages(group.rewards, self.config.advantage_eps)
            ):
                if not completion.completion_ids:
                    continue  # nothing to score; never divides the loss by zero tokens
                rows.append(
                    TrainingRow(
                        prompt_ids=completion.prompt_ids,
                        completion_ids=completion.completion_ids,
                        advantage=advantage,
                        behaviour_logprobs=completion.logprobs,
                        on_policy=completion.policy_version == self.policy_version and completion.logprobs is not None,
                        masked_prefix=completion.masked_prefix,
                    )
                )
        if self.config.imitation_coef > 0:
            unmarked = {}
            for row in rows:
                unmarked.setdefault((tuple(row.prompt_ids), tuple(row.completion_ids)), row)
            for demonstration in self._heaviest(batch.demonstrations):
                completion = demonstration.completion
                row = unmarked.pop((tuple(completion.prompt_ids), tuple(completion.completion_ids)), None)
                if row is not None:
                    row.imitation_weight = demonstration.weight
                else:
                    rows.append(
                        TrainingRow(
                            completion.prompt_ids,
                            completion.completion_ids,
                            in_policy_term=False,
                            imitation_weight=demonstration.weight,
                        )
                    )
        return rows

    def frozen_logprobs(
        self, batch: list[TrainingRow], current: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """pi_old for the ratio, the importance weight w.r.t. the behaviour policy (None: every policy row on-policy),
        and the token positions of the no-grad forward this took (0: none).

        `current`: the log-probs of the batch under the policy before this round's step, detached. With one epoch a
        round that is the training forward itself, so no second forward is needed; without it one is run here."""
        width = max(len(row.completion_ids) for row in batch)
        policy = [row for row in batch if row.in_policy_term]
        device = self.device
        if all(row.on_policy for row in policy):
            behaviour = [row.behaviour_logprobs if row.in_policy_term else [] for row in batch]
            return pad_rows(behaviour, width, device), None, 0
        positions = 0
        if current is None:
            with torch.no_grad():
                current, _ = completion_logprobs(
                    self.model, [row.pair for row in batch], self.pad_id, self.temperature, self.share_prompts
                )
            positions = padded_positions([row.pair for row in batch], self.share_prompts)
        old = current.clone()
        weights = torch.ones_like(old)
        for i, row in enumerate(batch):
            n = len(row.completion_ids)
            if not row.in_policy_term:
                continue
            if row.on_policy:
                old[i, :n] = torch.tensor(row.behaviour_logprobs, dtype=old.dtype, device=old.device)
            elif row.behaviour_logprobs is not None:
                behaviour = torch.tensor(row.behaviour_logprobs, dtype=old.dtype, device=old.device)
                weights[i, :n] = truncated_importance_weights(current[i, :n], behaviour, self.config.importance_cap)
        return old, weights, positions

    def step(self, batch: TrainingBatch) -> TrainStats:
        """One optimizer step on the round's batch: its groups in the policy-gradient term, its demonstrations in the
        imitation term. A step the optimizer could not apply (StepNotApplied) ends the update; without an epoch applied
        before it, it is not stepped and no new policy version."""
        stats = TrainStats()
        rows = self.training_rows(batch, stats)
        policy_tokens = sum(row.policy_tokens for row in rows)
        demonstrations = [row for row in rows if row.imitation_weight > 0]
        demonstration_tokens = sum(len(row.completion_ids) for row in demonstrations)
        stats.tokens = policy_tokens
        stats.imitation_sequences = len(demonstrations)
        if not rows:
            return stats  # every group uniform or empty: no update, policy version unchanged
        self.model.train()
        micro = self.config.micro_batch_size
        batches = [rows[i : i + micro] for i in range(0, len(rows), micro)]
        frozen = None
        if self.config.epochs_per_round > 1:  # pi_old must not move with the first epoch's step: fixed before it
            frozen = [self.frozen_logprobs(batch) for batch in batches]
            stats.forward_tokens += sum(positions for _, _, positions in frozen)
        sums = _RoundSums()
        epochs_run = 0
        for epoch in range(self.config.epochs_per_round):
            epochs_run += 1
            self.optimizer.zero_grad(set_to_none=True)
            for k, batch in enumerate(batches):
                self._accumulate_gradient(
                    batch,
                    frozen[k] if frozen is not None else None,
                    policy_tokens,
                    demonstration_tokens,
                    epoch == 0,
                    sums,
                    stats,
                )
            grad_norm = clipped_grad_norm(self.model.parameters(), self.config.max_grad_norm, self.policy_version)
            try:
                self.optimizer.step()
            except StepNotApplied as missed:
                log.warning(
                    "%s: the round takes no further step (epoch %d of %d)",
                    missed,
                    epoch + 1,
                    self.config.epochs_per_round,
                )
                break
            stats.optimizer_steps += 1
            stats.grad_norm = stepped_grad_norm(self.optimizer, grad_norm)
        self.model.eval()
        if sums.importance_weights:
            stats.importance_weight_mean = torch.cat(sums.importance_weights).mean().item()
        if demonstrations:
            stats.imitation_nll = sums.imitation_nll / demonstration_tokens
        epoch_tokens = max(1, policy_tokens * epochs_run)  # 0: only demonstrations this round
        stats.loss = sums.policy_loss / epoch_tokens
        stats.clip_fraction = sums.clipped_tokens / epoch_tokens
        stats.kl = sums.kl / epoch_tokens
        stats.stepped = stats.optimizer_steps > 0  # an epoch applied before the one that was not moved the policy
        if stats.stepped:
            self.policy_version += 1
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"non-finite loss at policy version {self.policy_version}")
        return stats

    def _accumulate_gradient(
        self,
        batch: list[TrainingRow],
        frozen: tuple[torch.Tensor, torch.Tensor | None, int] | None,
        policy_tokens: int,
        demonstration_tokens: int,
        first_epoch: bool,
        sums: _RoundSums,
        stats: TrainStats,
    ) -> None:
        """One micro-batch's forward and backward: each term over the whole round's tokens, so that the gradients the
        micro-batches add up to are the round's mean whatever the micro-batching. `frozen`: pi_old and the importance
        weights fixed before the round's first step (several epochs); None: taken from this forward."""
        pairs = [row.pair for row in batch]
        positions = padded_positions(pairs, self.share_prompts)
        logprobs, mask = completion_logprobs(self.model, pairs, self.pad_id, self.temperature, self.share_prompts)
        stats.train_tokens += positions
        stats.train_calls += 1
        if frozen is not None:
            old, weights, _ = frozen
        else:
            old, weights, frozen_positions = self.frozen_logprobs(batch, logprobs.detach())
            stats.forward_tokens += frozen_positions
        if first_epoch and weights is not None:
            sums.importance_weights += [
                weights[i, row.masked_prefix : len(row.completion_ids)]
                for i, row in enumerate(batch)
                if row.in_policy_term and not row.on_policy and row.behaviour_logprobs is not None
            ]
        loss = logprobs.new_zeros(())
        # decided on the rows, not on a device tensor: no GPU sync per micro-batch
        if any(row.in_policy_term for row in batch):
            in_policy = torch.tensor([row.in_policy_term for row in batch], device=mask.device)
            policy_mask = mask & in_policy[:, None]
            if any(row.masked_prefix for row in batch):  # rollout.partial_prefix 'mask': an older policy's tokens
                trained_from = torch.tensor([row.masked_prefix for row in batch], device=mask.device)
                policy_mask = policy_mask & (
                    torch.arange(mask.shape[1], device=mask.device)[None, :] >= trained_from[:, None]
                )
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = completion_logprobs(
                        self.reference, pairs, self.pad_id, self.temperature, self.share_prompts
                    )
                stats.forward_tokens += positions
            advantages = torch.tensor([row.advantage for row in batch], dtype=logprobs.dtype, device=mask.device)
            policy_sum, info = policy_loss(
                logprobs,
                old,
                advantages,
                policy_mask,
                self.config.eps_low,
                self.config.eps_high,
                weights,
                ref,
                self.config.kl_beta,
            )
            loss = loss + policy_sum / policy_tokens
            sums.policy_loss += policy_sum.item()
            sums.clipped_tokens += info["clipped_tokens"].item()
            sums.kl += info["kl_sum"].item()
        if any(row.imitation_weight > 0 for row in batch):
            demonstration_weights = torch.tensor(
                [row.imitation_weight for row in batch], dtype=logprobs.dtype, device=mask.device
            )
            imitation_sum, nll_sum = imitation_loss(logprobs, mask, demonstration_weights)
            loss = loss + self.config.imitation_coef * (imitation_sum / demonstration_tokens)
            if first_epoch:  # before the step
                sums.imitation_nll += nll_sum.item()
        if loss.requires_grad:
            loss.backward()

    def _heaviest(self, demonstrations: list[Demonstration]) -> list[Demonstration]:
        """The demonstrations the imitation term trains: the heaviest, up to imitation_max_sequences (the first marked
        of equal weight)."""
        weighted = sorted((d for d in demonstrations if d.weight > 0), key=lambda d: -d.weight)
        return weighted[: self.config.imitation_max_sequences]
