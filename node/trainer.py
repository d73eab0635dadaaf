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
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from node.config import ConfigError, TrainerConfig
from node.device import model_device
from node.rollouts.base import Completion, RolloutGroup, is_uniform


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


def completion_logprobs(
    model: torch.nn.Module,
    rows: list[tuple[list[int], list[int]]],
    pad_id: int,
    temperature: float,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each completion token given its prompt: [batch, max_completion], mask; on the model's device.

    Sequences are right-padded with positions 0..n-1, the same positions the sampler used. The
    batch is laid out on the CPU and moved once (a copy per tensor, not one per row).

    Each log-prob is the sampled token's scaled logit less the logsumexp of its position: no
    [batch, tokens, vocab] log-distribution is kept for the backward (with a 49k vocabulary that tensor,
    not the weights, is what a micro-batch holds).

    share_prompts: rows with the same prompt go through the model as one sequence, the prompt once and each
    completion after it, a completion seeing the prompt and itself only (a 4-D attention mask; positions restart
    after the prompt for each). The same log-probs as one row each, for a fraction of the positions: a group's 8
    completions repeat its prompt, which is most of a row. Needs a model that takes a 4-D boolean mask
    (transformers' sdpa and eager attention; see prompt_sharing_supported).
    """
    scored = _scored_forward(model, rows, pad_id, share_prompts)
    scaled = scored.logits.float() / temperature
    del scored.logits  # the model's output is not needed by the backward of a division: free it now
    at = (scored.sequence_of[:, None], scored.scored_at)
    picked = scaled[(*at, scored.token_ids)]
    normaliser = torch.logsumexp(scaled, dim=-1)[at]
    return (picked - normaliser).masked_fill(~scored.mask, 0.0), scored.mask


@dataclass
class _ScoredForward:
    """One forward over a micro-batch, and where in it each completion token is scored."""

    logits: torch.Tensor
    """[sequences, width, vocab]: one sequence a row, or with shared prompts one a prompt and its completions."""
    sequence_of: torch.Tensor
    """[rows]: the sequence whose logits score row i."""
    scored_at: torch.Tensor
    """[rows, max_completion]: the position whose logits score completion token j of row i (0 past its end)."""
    token_ids: torch.Tensor
    """[rows, max_completion]: completion token j of row i (0 past its end)."""
    mask: torch.Tensor
    """[rows, max_completion]: whether token j of row i exists."""


def _scored_forward(
    model: torch.nn.Module, rows: list[tuple[list[int], list[int]]], pad_id: int, share_prompts: bool
) -> _ScoredForward:
    if share_prompts:
        return _shared_prompt_forward(model, rows)
    device = model_device(model)
    seqs = [prompt + completion for prompt, completion in rows]
    width = max(map(len, seqs))
    max_completion = max(len(c) for _, c in rows)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    # completion token j of row i is scored by the logits at the position before it: len(prompt) - 1 + j
    scored_at = torch.zeros((len(rows), max_completion), dtype=torch.long)
    token_ids = torch.zeros((len(rows), max_completion), dtype=torch.long)
    mask = torch.zeros((len(rows), max_completion), dtype=torch.bool)
    for i, (prompt, completion) in enumerate(rows):
        input_ids[i, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
        attention_mask[i, : len(seqs[i])] = 1
        scored_at[i, : len(completion)] = torch.arange(len(prompt) - 1, len(seqs[i]) - 1)
        token_ids[i, : len(completion)] = torch.tensor(completion, dtype=torch.long)
        mask[i, : len(completion)] = True
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = torch.arange(width, device=device).expand(len(seqs), width)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    sequence_of = torch.arange(len(rows), device=device)
    return _ScoredForward(logits, sequence_of, scored_at.to(device), token_ids.to(device), mask.to(device))


def _prompt_packs(rows: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], list[int]]]:
    """The rows by prompt, in first-seen order: (prompt, indices of its rows)."""
    packs: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, _) in enumerate(rows):
        packs.setdefault(tuple(prompt), []).append(i)
    return [(list(prompt), indices) for prompt, indices in packs.items()]


def _shared_prompt_forward(model: torch.nn.Module, rows: list[tuple[list[int], list[int]]]) -> _ScoredForward:
    device = model_device(model)
    packs = _prompt_packs(rows)
    lengths = [len(prompt) + sum(len(rows[i][1]) for i in indices) for prompt, indices in packs]
    width = max(lengths)
    max_completion = max(len(c) for _, c in rows)
    input_ids = torch.zeros((len(packs), width), dtype=torch.long)
    position_ids = torch.zeros((len(packs), width), dtype=torch.long)
    allowed = torch.zeros((len(packs), width, width), dtype=torch.bool)
    pack_of = torch.zeros(len(rows), dtype=torch.long)
    # completion token j of row i is scored at the position before it: the prompt's last for j = 0, else its own j-1
    scored_at = torch.zeros((len(rows), max_completion), dtype=torch.long)
    token_ids = torch.zeros((len(rows), max_completion), dtype=torch.long)
    mask = torch.zeros((len(rows), max_completion), dtype=torch.bool)
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    for p, (prompt, indices) in enumerate(packs):
        n = len(prompt)
        input_ids[p, :n] = torch.tensor(prompt, dtype=torch.long)
        position_ids[p, :n] = torch.arange(n)
        allowed[p, :n, :n] = causal[:n, :n]
        start = n
        for i in indices:
            completion = rows[i][1]
            end = start + len(completion)
            input_ids[p, start:end] = torch.tensor(completion, dtype=torch.long)
            position_ids[p, start:end] = torch.arange(n, n + len(completion))
            allowed[p, start:end, :n] = True
            allowed[p, start:end, start:end] = causal[: len(completion), : len(completion)]
            pack_of[i] = p
            if completion:
                scored_at[i, : len(completion)] = torch.tensor([n - 1, *range(start, end - 1)], dtype=torch.long)
            token_ids[i, : len(completion)] = torch.tensor(completion, dtype=torch.long)
            mask[i, : len(completion)] = True
            start = end
        padding = torch.arange(start, width)
        allowed[p, padding, padding] = True  # a pad sees itself: no row of the mask is empty
    input_ids, position_ids, allowed = input_ids.to(device), position_ids.to(device), allowed.to(device)
    logits = model(input_ids=input_ids, attention_mask=allowed[:, None], position_ids=position_ids).logits
    return _ScoredForward(logits, pack_of.to(device), scored_at.to(device), token_ids.to(device), mask.to(device))


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Keep only each decoder layer's input for the backward and recompute the rest (transformers' own checkpointing,
    non-reentrant): one more forward per micro-batch for most of the activations' memory. Only in training mode:
    sampling and no-grad forwards run as before. A model that cannot (a pipeline's remote model, whose stage servers
    hold the activations) is refused in one line."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not model.supports_gradient_checkpointing:
        raise ConfigError(
            f"trainer.gradient_checkpointing: {type(model).__name__} does not support it (a transformers model in this "
            "process does; a pipeline's stages keep their own activations)"
        )
    # transformers 5.24 renamed it (the old name warns, and goes in v6); 4.57 knows only the old one
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def prompt_sharing_supported(model: torch.nn.Module) -> bool:
    """Whether `model` takes the 4-D boolean attention mask of a shared-prompt forward: a transformers model with
    sdpa or eager attention (flash attention takes none; a pipeline's remote model passes 2-D masks on)."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):  # e.g. a pipeline's remote model: it carries an HF config, not the mask
        return False
    return model.config._attn_implementation in ("sdpa", "eager")


def padded_positions(rows: list[tuple[list[int], list[int]]], share_prompts: bool = False) -> int:
    """Token positions one forward over `rows` runs through the model (right-padded to the longest prompt+completion,
    or with share_prompts to the longest prompt and its completions): what a forward costs, pads included."""
    if share_prompts:
        packs = _prompt_packs(rows)
        return len(packs) * max(len(prompt) + sum(len(rows[i][1]) for i in indices) for prompt, indices in packs)
    return len(rows) * max(len(prompt) + len(completion) for prompt, completion in rows)


def _pad_rows(rows: list[list[float]], width: int, device: torch.device | None = None) -> torch.Tensor:
    """Rows of floats right-padded with zeros to `width`, on `device` (the trainer's, GRPOTrainer.device; None: left
    on the CPU, where they are laid out)."""
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out if device is None else out.to(device)


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
        # A policy split across stage servers brings its own optimizer (node/pipeline/remote_model.py): each stage steps
        # itself.
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
        )
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

    def training_rows(
        self, groups: list[RolloutGroup], demonstration_groups: list[RolloutGroup] = (), stats: TrainStats | None = None
    ) -> list[TrainingRow]:
        """The round's rows: each completion of a group with a reward spread (policy term), the demonstrations marked on
        one of them where the same tokens are there, and a row of its own for each other demonstration."""
        stats = stats if stats is not None else TrainStats()
        rows = []
        for group in groups:
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
                    )
                )
        if self.config.imitation_coef > 0:
            unmarked = {}
            for row in rows:
                unmarked.setdefault((tuple(row.prompt_ids), tuple(row.completion_ids)), row)
            for weight, completion in self._demonstrations([*groups, *demonstration_groups]):
                row = unmarked.pop((tuple(completion.prompt_ids), tuple(completion.completion_ids)), None)
                if row is not None:
                    row.imitation_weight = weight
                else:
                    rows.append(
                        TrainingRow(
                            completion.prompt_ids,
                            completion.completion_ids,
                            in_policy_term=False,
                            imitation_weight=weight,
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
            return _pad_rows(behaviour, width, device), None, 0
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
                weights[i, :n] = self._importance_weights(current[i, :n], behaviour)
        return old, weights, positions

    def _importance_weights(self, current: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
        """The truncated importance weight of each token of one off-policy sample, min(c, pi_old / pi_behaviour)."""
        return torch.exp(current - behaviour).clamp(max=self.config.importance_cap)

    def step(self, groups: list[RolloutGroup], demonstration_groups: list[RolloutGroup] = ()) -> TrainStats:
        """One optimizer step on `groups` (the policy-gradient term, and the imitation term over their marked right
        answers) and on `demonstration_groups`, whose right answers enter the imitation term only."""
        stats = TrainStats()
        rows = self.training_rows(groups, demonstration_groups, stats)
        policy_tokens = sum(len(row.completion_ids) for row in rows if row.in_policy_term)
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
        weighted: list[torch.Tensor] = []
        loss_sum = clipped = kl_sum = nll_sum = 0.0
        for epoch in range(self.config.epochs_per_round):
            self.optimizer.zero_grad(set_to_none=True)
            for k, batch in enumerate(batches):
                pairs = [row.pair for row in batch]
                positions_here = padded_positions(pairs, self.share_prompts)
                logprobs, mask = completion_logprobs(
                    self.model, pairs, self.pad_id, self.temperature, self.share_prompts
                )
                stats.train_tokens += positions_here
                stats.train_calls += 1
                if frozen is not None:
                    old, weights, _ = frozen[k]
                else:
                    old, weights, positions = self.frozen_logprobs(batch, logprobs.detach())
                    stats.forward_tokens += positions
                if epoch == 0 and weights is not None:
                    weighted += [
                        weights[i, : len(row.completion_ids)]
                        for i, row in enumerate(batch)
                        if row.in_policy_term and not row.on_policy and row.behaviour_logprobs is not None
                    ]
                loss = logprobs.new_zeros(())
                # decided on the rows, not on a device tensor: no GPU sync per micro-batch
                if any(row.in_policy_term for row in batch):
                    in_policy = torch.tensor([row.in_policy_term for row in batch], device=mask.device)
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref, _ = completion_logprobs(
                                self.reference, pairs, self.pad_id, self.temperature, self.share_prompts
                            )
                        stats.forward_tokens += positions_here
                    advantages = torch.tensor(
                        [row.advantage for row in batch], dtype=logprobs.dtype, device=mask.device
                    )
                    policy_sum, info = policy_loss(
                        logprobs,
                        old,
                        advantages,
                        mask & in_policy[:, None],
                        self.config.eps_low,
                        self.config.eps_high,
                        weights,
                        ref,
                        self.config.kl_beta,
                    )
                    loss = loss + policy_sum / policy_tokens
                    loss_sum += policy_sum.item()
                    clipped += info["clipped_tokens"].item()
                    kl_sum += info["kl_sum"].item()
                if any(row.imitation_weight > 0 for row in batch):
                    demonstration_weights = torch.tensor(
                        [row.imitation_weight for row in batch], dtype=logprobs.dtype, device=mask.device
                    )[:, None]
                    token_nll = -(logprobs * mask)
                    imitation = (token_nll * demonstration_weights).sum() / demonstration_tokens
                    loss = loss + self.config.imitation_coef * imitation
                    if epoch == 0:  # before the step
                        nll_sum += (token_nll.detach() * (demonstration_weights > 0)).sum().item()
                if loss.requires_grad:
                    loss.backward()
            grad_norm = self._clipped_grad_norm()
            self.optimizer.step()
            stats.optimizer_steps += 1
            stats.grad_norm = grad_norm
            # a pipeline's stages clip and report their own norms
            stage_norms = getattr(self.optimizer, "last_grad_norms", None)
            if stage_norms:
                stats.grad_norm = math.sqrt(sum(n * n for n in stage_norms.values()))
        self.model.eval()
        if weighted:
            stats.importance_weight_mean = torch.cat(weighted).mean().item()
        if demonstrations:
            stats.imitation_nll = nll_sum / demonstration_tokens
        epoch_tokens = max(1, policy_tokens * self.config.epochs_per_round)  # 0: only demonstrations this round
        stats.loss = loss_sum / epoch_tokens
        stats.clip_fraction = clipped / epoch_tokens
        stats.kl = kl_sum / epoch_tokens
        stats.stepped = True
        self.policy_version += 1
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"non-finite loss at policy version {self.policy_version}")
        return stats

    def _clipped_grad_norm(self) -> float:
        """The gradient's norm before clipping it to trainer.max_grad_norm; a non-finite one refuses the update."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.max_grad_norm)
        if not torch.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite gradient norm {grad_norm.item()} at policy version {self.policy_version}; update refused"
            )
        return grad_norm.item()

    def _demonstrations(self, groups: list[RolloutGroup]) -> list[tuple[float, Completion]]:
        """The round's right answers marked for imitation, with their weights: the heaviest, up to
        imitation_max_sequences."""
        weighted = sorted(
            ((g.imitation_weight, c) for g in groups for c in g.demonstrations()), key=lambda item: -item[0]
        )
        return weighted[: self.config.imitation_max_sequences]
