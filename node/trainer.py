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
    imitation_coef * sum_i v_i * sum_t phi_t * NLL_i,t / (demonstration tokens),
over the round's demonstrations: right answers marked with a weight v (a peer's where it knows more than
this node, and the node's own to anchor what it knows; node/sharing.py), whatever their reward spread;
phi_t = 1, or CHORD's p_t (1 - p_t) (trainer.imitation_token_weight), which spares the tokens the policy
already holds and those it finds absurd; the coefficient may decay (CHORD's mu, trainer.imitation_coef_final).
With trainer.distill_coef > 0, on-policy distillation: on the node's own completions of a specialty whose group has
a teacher (a peer's policy stronger there), distill_coef * sum_i,t KL(pi(.|x_i,<t) || pi_teacher(.|x_i,<t)) / (their
completion tokens), the reverse KL over the whole vocabulary at each position, the teacher's forward run without
gradients. Every completion of such a group counts, a group all wrong included.
The policy term is averaged over all its completion tokens (DAPO's token-level mean), whatever the
micro-batching. With trainer.specialty_weighting 'equal' each specialty of the round (a question's dataset and
configuration) has its terms averaged over its own tokens and the specialties weigh the same; with 'projected' each
specialty's gradient also loses its components that conflict with another's before they are summed (PCGrad); with
'separate_steps' each specialty's gradient is stepped by an AdamW of its own (SpecialtyAdamW).

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
from protocol import TaskSpec


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
    distill_kl: float | None = None
    """Mean KL(pi || pi_teacher) per distilled completion token, before the step (None: nothing distilled)."""
    distilled_sequences: int = 0


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
    kl_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over masked tokens of the clipped surrogate (divide by the token count yourself).

    logprobs/old_logprobs/mask/importance_weights/ref_logprobs: [batch, tokens]; advantages: [batch];
    kl_rows: [batch], the rows the KL penalty applies to (None: all).
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
        if kl_rows is not None:
            kl = kl * kl_rows.to(kl.dtype)[:, None]
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
    not the weights, is what a micro-batch holds). share_prompts: as completion_distributions.
    """
    scored = _scored_forward(model, rows, pad_id, share_prompts)
    scaled = scored.logits.float() / temperature
    del scored.logits  # the model's output is not needed by the backward of a division: free it now
    at = (scored.sequence_of[:, None], scored.scored_at)
    picked = scaled[(*at, scored.token_ids)]
    normaliser = torch.logsumexp(scaled, dim=-1)[at]
    return (picked - normaliser).masked_fill(~scored.mask, 0.0), scored.mask


def completion_distributions(
    model: torch.nn.Module,
    rows: list[tuple[list[int], list[int]]],
    pad_id: int,
    temperature: float,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """completion_logprobs, and the whole next-token log-distribution at each completion position: (log-probs
    [batch, max_completion], log-distributions [batch, max_completion, vocab], mask), from one forward. Only
    distillation needs the distributions; everything else asks completion_logprobs, which keeps none.

    share_prompts: rows with the same prompt go through the model as one sequence, the prompt once and each
    completion after it, a completion seeing the prompt and itself only (a 4-D attention mask; positions restart
    after the prompt for each). The same log-probs as one row each, for a fraction of the positions: a group's 8
    completions repeat its prompt, which is most of a row. Needs a model that takes a 4-D boolean mask
    (transformers' sdpa and eager attention; see prompt_sharing_supported)."""
    scored = _scored_forward(model, rows, pad_id, share_prompts)
    logprobs = torch.log_softmax(scored.logits.float() / temperature, dim=-1)
    distributions = logprobs[scored.sequence_of[:, None], scored.scored_at]  # [rows, max_completion, vocab]
    targets = distributions.gather(-1, scored.token_ids[..., None]).squeeze(-1)
    return targets.masked_fill(~scored.mask, 0.0), distributions, scored.mask


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
    loss_scale: float = 1.0
    in_policy_term: bool = True
    imitation_weight: float = 0.0
    """Weight of this completion as a demonstration (0: none)."""
    teacher: torch.nn.Module | None = None
    """The policy whose next-token distributions this completion is distilled toward (None: not distilled)."""
    specialty: str = ""
    """The specialty of the question (specialty_key): with trainer.specialty_weighting other than 'tokens', each
    specialty's terms are averaged over its own tokens."""
    kl_anchored: bool = True
    """Whether the KL penalty to the initial policy applies to it (trainer.kl_labels)."""

    @property
    def pair(self) -> tuple[list[int], list[int]]:
        return self.prompt_ids, self.completion_ids


@dataclass
class UpdateShare:
    """Rows of the round that share one normalisation: each term is averaged over the share's own tokens, then
    multiplied by the share's weight."""

    rows: list[TrainingRow]
    weight: float
    specialty: str = ""
    """The specialty of every row ('' where the round is one share)."""

    def __post_init__(self) -> None:
        self.policy_tokens = sum(len(row.completion_ids) for row in self.rows if row.in_policy_term)
        self.demonstration_tokens = sum(len(row.completion_ids) for row in self.rows if row.imitation_weight > 0)
        self.distilled_tokens = sum(len(row.completion_ids) for row in self.rows if row.teacher is not None)


def specialty_key(spec: TaskSpec) -> str:
    """A question's specialty as the trainer tells them apart: its dataset and configuration (its mix entry)."""
    return f"{spec.dataset}:{spec.config_key}"


def specialty_keys(datasets, labels: list[str]) -> frozenset[str] | None:
    """The specialty keys of the task-mix entries (tasks.datasets) labelled `labels` (None: no label named, all)."""
    if not labels:
        return None
    return frozenset(specialty_key(TaskSpec(d.name, d.config, 0, 0)) for d in datasets if d.display_label in labels)


def project_conflicts(gradients: list[torch.Tensor]) -> torch.Tensor:
    """PCGrad (Yu et al. 2020), in a fixed order: each gradient loses its component along every other gradient it
    conflicts with (negative dot product; checked against the partly projected gradient, as the paper does), and
    the projected gradients are summed. Two gradients that do not conflict are summed unchanged."""
    total = torch.zeros_like(gradients[0])
    for i, gradient in enumerate(gradients):
        projected = gradient.clone()
        for j, other in enumerate(gradients):
            if j == i:
                continue
            dot = torch.dot(projected, other)
            norm_sq = torch.dot(other, other)
            if dot < 0 and norm_sq > 0:
                projected -= (dot / norm_sq) * other
        total += projected
    return total


class SpecialtyAdamW:
    """One AdamW per specialty over the same parameters, created when a specialty first trains.

    Adam divides each coordinate's step by the root of its second moment. With one optimizer for a batch of two
    specialties, the one with the larger gradient this round (a swarm node's peers' groups of the specialty it lacks,
    every one with a reward spread) sets that moment, and the other specialty's step shrinks with it: the node learns
    what it knew at a fraction of a node alone's rate. Here each specialty's gradient is normalised by its own moments
    and stepped at the full learning rate, so what one specialty learns does not slow another's step (it may still
    undo it: the steps add). Weight decay is decoupled and applied once a round (decay_weights), not once per
    specialty."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float):
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.weight_decay = lr, betas, weight_decay
        self.by_specialty: dict[str, torch.optim.AdamW] = {}

    def for_specialty(self, specialty: str) -> torch.optim.AdamW:
        if specialty not in self.by_specialty:
            self.by_specialty[specialty] = torch.optim.AdamW(self.params, lr=self.lr, betas=self.betas, weight_decay=0)
        return self.by_specialty[specialty]

    @torch.no_grad()
    def decay_weights(self) -> None:
        """AdamW's decoupled weight decay, p <- p (1 - lr * weight_decay), once for the round's steps."""
        if self.weight_decay > 0:
            for p in self.params:
                p.mul_(1 - self.lr * self.weight_decay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @staticmethod
    def wrote(state: dict) -> bool:
        """Whether an optimizer state (a checkpoint's) is this optimizer's, one AdamW per specialty."""
        return "per_specialty" in state

    def state_dict(self) -> dict:
        return {"per_specialty": {key: opt.state_dict() for key, opt in self.by_specialty.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not self.wrote(state):
            raise ValueError(
                "the checkpoint's optimizer is one AdamW for every specialty; trainer.specialty_weighting "
                "'separate_steps' keeps one per specialty: resume with the weighting the checkpoint was written with"
            )
        for key, opt_state in state["per_specialty"].items():
            self.for_specialty(key).load_state_dict(opt_state)


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
        kl_specialties: frozenset[str] | None = None,
    ):
        """kl_specialties: the specialty keys whose questions carry the KL penalty (None: all; `specialty_keys` turns
        trainer.kl_labels into them)."""
        self.config = config
        self.kl_specialties = kl_specialties
        self.model = model
        self.pad_id = pad_id
        self.temperature = temperature
        self.policy_version = policy_version
        # A policy split across stage servers brings its own optimizer (node/pipeline/remote_model.py): each stage steps
        # itself.
        if optimizer is not None and config.specialty_weighting in ("projected", "separate_steps"):
            raise ValueError(
                f"trainer.specialty_weighting '{config.specialty_weighting}' needs the policy's gradients in this "
                "process; a policy split across stage servers steps each stage where it is: use 'equal' or 'tokens'"
            )
        if optimizer is None and config.specialty_weighting == "separate_steps":
            optimizer = SpecialtyAdamW(model.parameters(), config.lr, config.betas, config.weight_decay)
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
        distilled = self.config.distill_coef > 0
        for group in groups:
            teacher = group.teacher if distilled else None
            if self.config.drop_uniform_groups and is_uniform(group.rewards):
                stats.groups_dropped += 1
                if teacher is not None:  # no policy-gradient signal, but the teacher still has one
                    rows += [
                        TrainingRow(
                            c.prompt_ids,
                            c.completion_ids,
                            in_policy_term=False,
                            teacher=teacher,
                            specialty=specialty_key(group.spec),
                        )
                        for c in group.completions
                        if c.completion_ids
                    ]
                continue
            stats.groups_used += 1
            keep_negatives = self.config.off_policy_negatives or group.source == "local"
            for completion, advantage in zip(
                group.completions, group_advantages(group.rewards, self.config.advantage_eps, group.baseline_scale)
            ):
                if not completion.completion_ids:
                    continue  # nothing to score; never divides the loss by zero tokens
                if advantage < 0 and not keep_negatives:
                    continue  # a peer's wrong answer (trainer.off_policy_negatives)
                specialty = specialty_key(group.spec)
                rows.append(
                    TrainingRow(
                        prompt_ids=completion.prompt_ids,
                        completion_ids=completion.completion_ids,
                        advantage=advantage,
                        behaviour_logprobs=completion.logprobs,
                        on_policy=completion.policy_version == self.policy_version and completion.logprobs is not None,
                        loss_scale=group.loss_scale,
                        teacher=teacher,
                        specialty=specialty,
                        kl_anchored=self.kl_specialties is None or specialty in self.kl_specialties,
                    )
                )
        if self.config.imitation_coef > 0:
            unmarked = {}
            for row in rows:
                unmarked.setdefault((tuple(row.prompt_ids), tuple(row.completion_ids)), row)
            for weight, completion, specialty in self._demonstrations([*groups, *demonstration_groups]):
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
                            specialty=specialty,
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
        """The importance weight of each token of one off-policy sample (see the module docstring)."""
        if self.config.importance_level == "sequence":
            ratio = torch.exp((current - behaviour).mean()).clamp(max=1.0)
            return (ratio ** (1.0 + self.config.importance_alpha)).expand_as(current)
        return torch.exp(current - behaviour).clamp(max=self.config.importance_cap)

    def imitation_coef_now(self) -> float:
        """The imitation term's weight at this policy version: trainer.imitation_coef, moved linearly to
        imitation_coef_final over imitation_decay_updates updates (CHORD's decaying weight), then held."""
        config = self.config
        if config.imitation_coef_final is None:
            return config.imitation_coef
        done = min(1.0, self.policy_version / config.imitation_decay_updates)
        return config.imitation_coef + done * (config.imitation_coef_final - config.imitation_coef)

    def shares(self, rows: list[TrainingRow]) -> list[UpdateShare]:
        """How the round's rows share the update (trainer.specialty_weighting): one share of all rows ('tokens'), or
        one per specialty, in the order they first appear, each weighing 1 / (the number of specialties), or 1 where
        each is stepped alone ('separate_steps')."""
        if self.config.specialty_weighting == "tokens":
            parts = {"": rows}
        else:
            parts = {}
            for row in rows:
                parts.setdefault(row.specialty, []).append(row)
        weight = 1.0 if self.config.specialty_weighting == "separate_steps" else 1.0 / len(parts)
        return [UpdateShare(part_rows, weight, specialty) for specialty, part_rows in parts.items()]

    def step(self, groups: list[RolloutGroup], demonstration_groups: list[RolloutGroup] = ()) -> TrainStats:
        """One optimizer step on `groups` (the policy-gradient term, and the imitation term over their marked right
        answers) and on `demonstration_groups`, whose right answers enter the imitation term only."""
        stats = TrainStats()
        rows = self.training_rows(groups, demonstration_groups, stats)
        policy_tokens = sum(len(row.completion_ids) for row in rows if row.in_policy_term)
        demonstrations = [row for row in rows if row.imitation_weight > 0]
        demonstration_tokens = sum(len(row.completion_ids) for row in demonstrations)
        distilled_tokens = sum(len(row.completion_ids) for row in rows if row.teacher is not None)
        stats.tokens = policy_tokens
        stats.imitation_sequences = len(demonstrations)
        if not rows:
            return stats  # every group uniform or empty: no update, policy version unchanged
        coef = self.imitation_coef_now()
        self.model.train()
        micro = self.config.micro_batch_size
        shares = self.shares(rows)
        # micro-batches never mix shares: each is divided by its own share's token counts
        batches = [(share, share.rows[i : i + micro]) for share in shares for i in range(0, len(share.rows), micro)]
        projected = self.config.specialty_weighting == "projected" and len(shares) > 1
        separate = self.config.specialty_weighting == "separate_steps"
        frozen = None
        if self.config.epochs_per_round > 1:  # pi_old must not move with the first epoch's step: fixed before it
            frozen = [self.frozen_logprobs(batch) for _, batch in batches]
            stats.forward_tokens += sum(positions for _, _, positions in frozen)
        weighted: list[torch.Tensor] = []
        loss_sum = clipped = kl_sum = nll_sum = distill_sum = 0.0
        for epoch in range(self.config.epochs_per_round):
            self.optimizer.zero_grad(set_to_none=True)
            share_gradients: list[torch.Tensor] = []
            for k, (share, batch) in enumerate(batches):
                pairs = [row.pair for row in batch]
                positions_here = padded_positions(pairs, self.share_prompts)
                distributions = None  # the whole vocabulary's, only where a row is distilled
                if any(row.teacher is not None for row in batch):
                    logprobs, distributions, mask = completion_distributions(
                        self.model, pairs, self.pad_id, self.temperature, self.share_prompts
                    )
                else:
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
                    ref = kl_rows = None
                    if self.reference is not None and any(row.in_policy_term and row.kl_anchored for row in batch):
                        with torch.no_grad():
                            ref, _ = completion_logprobs(
                                self.reference, pairs, self.pad_id, self.temperature, self.share_prompts
                            )
                        stats.forward_tokens += positions_here
                        if not all(row.kl_anchored for row in batch):
                            kl_rows = torch.tensor([row.kl_anchored for row in batch], device=mask.device)
                    advantages = torch.tensor(
                        [row.advantage for row in batch], dtype=logprobs.dtype, device=mask.device
                    )
                    if any(row.loss_scale != 1.0 for row in batch):
                        scales = torch.tensor(
                            [row.loss_scale for row in batch], dtype=logprobs.dtype, device=mask.device
                        )[:, None]
                        weights = scales if weights is None else weights * scales
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
                        kl_rows,
                    )
                    loss = loss + share.weight * policy_sum / share.policy_tokens
                    loss_sum += policy_sum.item()
                    clipped += info["clipped_tokens"].item()
                    kl_sum += info["kl_sum"].item()
                if any(row.imitation_weight > 0 for row in batch):
                    demonstration_weights = torch.tensor(
                        [row.imitation_weight for row in batch], dtype=logprobs.dtype, device=mask.device
                    )[:, None]
                    token_nll = -(logprobs * mask)
                    token_weights = demonstration_weights
                    if self.config.imitation_token_weight == "p_one_minus_p":
                        p = logprobs.detach().exp()
                        token_weights = token_weights * p * (1 - p)
                    imitation = (token_nll * token_weights).sum() / share.demonstration_tokens
                    loss = loss + share.weight * coef * imitation
                    if epoch == 0:  # before the step
                        nll_sum += (token_nll.detach() * (demonstration_weights > 0)).sum().item()
                taught = [i for i, row in enumerate(batch) if row.teacher is not None]
                if taught:
                    distill, positions = self._distillation(batch, taught, distributions, mask)
                    stats.forward_tokens += positions
                    loss = loss + share.weight * self.config.distill_coef * distill / share.distilled_tokens
                    if epoch == 0:
                        distill_sum += distill.item()
                if loss.requires_grad:
                    loss.backward()
                if (projected or separate) and (k + 1 == len(batches) or batches[k + 1][0] is not share):
                    share_gradients.append(self._take_gradient())
            if separate:
                self.optimizer.decay_weights()
                norms = []
                for share, gradient in zip(shares, share_gradients):
                    self._put_gradient(gradient)
                    norms.append(self._clipped_grad_norm())
                    self.optimizer.for_specialty(share.specialty).step()
                    stats.optimizer_steps += 1
                stats.grad_norm = math.sqrt(sum(n * n for n in norms))
                continue
            if projected:
                self._put_gradient(project_conflicts(share_gradients))
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
        if distilled_tokens:
            stats.distill_kl = distill_sum / distilled_tokens
            stats.distilled_sequences = sum(1 for row in rows if row.teacher is not None)
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

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _take_gradient(self) -> torch.Tensor:
        """The gradient accumulated so far, flattened, and the parameters' gradients cleared for the next share."""
        params = self._trainable()
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        for p in params:
            p.grad = None
        return flat

    def _put_gradient(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self._trainable():
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def _distillation(
        self, batch: list[TrainingRow], taught: list[int], distributions: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """Sum over the taught rows' completion positions of KL(pi || pi_teacher), the whole vocabulary at each, and
        the token positions of the teachers' no-grad forwards (one per teacher in the micro-batch)."""
        total = distributions.new_zeros(())
        positions = 0
        by_teacher: dict[int, list[int]] = {}
        for i in taught:
            by_teacher.setdefault(id(batch[i].teacher), []).append(i)
        for indices in by_teacher.values():
            teacher = batch[indices[0]].teacher
            pairs = [batch[i].pair for i in indices]
            share = self.config.share_prompt_forward and prompt_sharing_supported(teacher)
            with torch.no_grad():
                _, teacher_distributions, _ = completion_distributions(
                    teacher, pairs, self.pad_id, self.temperature, share
                )
            positions += padded_positions(pairs, share)
            width = teacher_distributions.size(1)
            student = distributions[indices, :width]
            per_position = (student.exp() * (student - teacher_distributions.to(student.device))).sum(-1)
            total = total + (per_position * mask[indices, :width]).sum()
        return total, positions

    def _demonstrations(self, groups: list[RolloutGroup]) -> list[tuple[float, Completion, str]]:
        """The round's right answers marked for imitation, with their weights and specialties: the heaviest, up to
        imitation_max_sequences."""
        weighted = sorted(
            ((g.imitation_weight, c, specialty_key(g.spec)) for g in groups for c in g.demonstrations()),
            key=lambda item: -item[0],
        )
        return weighted[: self.config.imitation_max_sequences]
