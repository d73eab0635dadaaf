"""Token scoring: the log-prob of each completion token under a model, with the completions of a micro-batch packed
one a row or, sharing their prompt, one a prompt; and what such a forward costs in token positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node.device import model_device


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


def pad_rows(rows: list[list[float]], width: int, device: torch.device | None = None) -> torch.Tensor:
    """Rows of floats right-padded with zeros to `width`, on `device` (the trainer's, GRPOTrainer.device; None: left
    on the CPU, where they are laid out)."""
    out = torch.zeros((len(rows), width))
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out if device is None else out.to(device)
