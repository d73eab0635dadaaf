"""Batched sampling with a plain transformers model and its KV cache.

We sample with our own loop instead of `model.generate` because the trainer must see the
exact same distribution: behaviour log-probs are log_softmax(logits / temperature) of the
sampled token, over the same positions (left padding with explicit position ids, so pads
never shift positions) that the trainer will use when it recomputes them.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from node.config import RolloutConfig
from node.device import HOST, model_device
from node.rollouts.base import Completion, PartialCompletion, RolloutBackend


def left_pad(
    rows: list[list[int]], pad_id: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded token ids and their attention mask, laid out on the CPU and moved to `device` once (None: left
    there)."""
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    if device is None:
        return input_ids, attention_mask
    return input_ids.to(device), attention_mask.to(device)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled token ids and their log-probs under softmax(logits / temperature)."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if greedy:
        tokens = logprobs.argmax(dim=-1)
    else:
        probs = logprobs.exp()
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which `model.forward` takes its KV cache.

    transformers 5.24 renamed `past_key_values` to `cache`: the old name still works there
    but warns on every first call and goes away in 5.40. Older releases know only
    `past_key_values`, and their forwards take `**kwargs`: 4.57's Qwen2 accepts an unknown
    `cache` without a word and leaves it empty, so ask the signature, never try and see.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TransformersBackend(RolloutBackend):
    resumable = True

    def __init__(self, config: RolloutConfig, model: torch.nn.Module, tokenizer, policy_version: int = 0):
        self.config = config
        self.model = model  # shared with the trainer: updates are visible without copying
        self.tokenizer = tokenizer
        self.policy_version = policy_version

    def sync_weights(self, model: torch.nn.Module, policy_version: int) -> None:
        self.model = model
        self.policy_version = policy_version

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> list[list[Completion]]:
        # sampling draws where the logits are (a CPU generator cannot drive a GPU's multinomial); the same seed
        # gives the same completions on one kind of device, not across kinds
        generator = torch.Generator(device=model_device(self.model)).manual_seed(seed)
        encoded = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        flat = [ids for ids in encoded for _ in range(n)]
        results: list[Completion] = []
        step = self.config.generation_batch_size
        for start in range(0, len(flat), step):
            results.extend(self._generate_batch(flat[start : start + step], generator, greedy))
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]

    def sample_until(
        self, rows: list[PartialCompletion], group_of: list[int], groups_wanted: int, seed: int
    ) -> list[Completion | PartialCompletion]:
        generator = torch.Generator(device=model_device(self.model)).manual_seed(seed)
        results: list[Completion | PartialCompletion] = list(rows)
        step = self.config.generation_batch_size
        for start in range(0, len(rows), step):
            chunk = range(start, min(start + step, len(rows)))
            # a group is complete once all its rows are, those of the other batches included (a later batch's have
            # not started)
            undone_elsewhere = [0] * (max(group_of) + 1)
            for i, row in enumerate(results):
                if i not in chunk and not isinstance(row, Completion):
                    undone_elsewhere[group_of[i]] += 1
            in_chunk = {group_of[i] for i in chunk}
            done = sum(count == 0 and g not in in_chunk for g, count in enumerate(undone_elsewhere))
            if done >= groups_wanted:
                break  # the rows left are returned as they came, to be resumed later
            results[start : chunk.stop] = self._generate_batch(
                [rows[i].prompt_ids for i in chunk],
                generator,
                False,
                prefixes=[rows[i] for i in chunk],
                quota=(torch.tensor([group_of[i] for i in chunk]), torch.tensor(undone_elsewhere), groups_wanted),
            )
        return results

    def _extend(self, prefixes: list[list[int]], out, cache: dict, fills_in_place: bool, attention_mask, next_position):
        """The resumed rows' tokens so far run through the model after their prompts' cache (shared by a group's rows,
        as a fresh row's prompt is), in one forward: each row's tokens right-aligned, the pads before them masked, so
        that the last position of every row that has tokens is its own last token. Rows without any keep their
        prompt's logits. Returns the logits to sample from, the attention mask and the next positions."""
        device = attention_mask.device
        width = max(map(len, prefixes))
        lengths = torch.tensor([len(p) for p in prefixes], device=device)
        ids = torch.tensor([[self.tokenizer.pad_token_id] * (width - len(p)) + p for p in prefixes], device=device)
        mask = (torch.arange(width, device=device)[None, :] >= (width - lengths)[:, None]).long()
        positions = next_position + (mask.cumsum(-1) - 1).clamp(min=0)
        attention_mask = torch.cat([attention_mask, mask], dim=1)
        extended = self.model(
            input_ids=ids,
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **(cache if fills_in_place else {"past_key_values": out.past_key_values}),
        )
        self.work.prefill_tokens += ids.numel()
        has_tokens = (lengths > 0)[:, None, None]
        extended.logits = torch.where(has_tokens, extended.logits, out.logits[:, -1:, :])
        return extended, attention_mask, next_position + lengths[:, None]

    @torch.no_grad()
    def _generate_batch(
        self,
        prompt_rows: list[list[int]],
        generator: torch.Generator,
        greedy: bool,
        prefixes: list[PartialCompletion] | None = None,
        quota: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> list[Completion | PartialCompletion]:
        """The rows' completions. `prefixes`: each row resumed after the tokens it has, up to max_new_tokens in all;
        `quota` (each row's group, the rows of each group not done outside this batch, groups wanted): the batch
        stops once that many groups are done, its rows not ended coming back as PartialCompletions."""
        was_training = self.model.training
        self.model.eval()
        eos_id, pad_id = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        device = model_device(self.model)  # the KV-cache loop runs there; completions leave it once, at the end
        batch = len(prompt_rows)
        budgets = None  # new tokens each row may still take; None: max_new_tokens, all
        new_tokens = self.config.max_new_tokens
        if prefixes is not None:
            budgets = torch.tensor(
                [self.config.max_new_tokens - len(r.completion_ids) for r in prefixes], device=device
            )
            new_tokens = int(budgets.max())
        # each distinct prompt prefilled once, its cache then copied to its rows (a transformers model's cache object
        # can be re-indexed; a pipeline's remote sessions cannot)
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(row), len(distinct)) for row in prompt_rows]
        shared = self.config.share_prompt_prefill and len(distinct) < batch and isinstance(self.model, PreTrainedModel)
        prefill_rows = [list(row) for row in distinct] if shared else prompt_rows
        input_ids, attention_mask = left_pad(prefill_rows, pad_id, device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        tokens_out = torch.full((batch, new_tokens), pad_id, dtype=torch.long, device=device)
        logprobs_out = torch.zeros((batch, new_tokens), device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        ended_rows = torch.zeros(batch, dtype=torch.bool, device=device)  # over the whole batch, dropped rows too
        if quota is not None:
            group_of, undone_elsewhere, groups_wanted = quota
            group_of, undone_elsewhere = group_of.to(device), undone_elsewhere.to(device)
        # A forward that declares `cache` (transformers 5.24 on) fills our own cache object in
        # place. Older releases, and a model that keeps its cache elsewhere (the pipeline's
        # remote sessions), return theirs in `past_key_values`, handed back on the next call.
        fills_in_place = cache_keyword(self.model) == "cache"
        cache = {"cache": DynamicCache()} if fills_in_place else {}
        # logits_to_keep=1: the prefill needs only the last position's logits, not a
        # [batch, prompt, vocab] tensor (which dominates memory for large vocabularies).
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **cache,
        )
        self.work.prefill_tokens += input_ids.numel()
        if shared:
            expand = torch.tensor(row_of, dtype=torch.long, device=device)
            (cache["cache"] if fills_in_place else out.past_key_values).reorder_cache(expand)
            out.logits = out.logits[expand]
            attention_mask, position_ids = attention_mask[expand], position_ids[expand]
        next_position = position_ids[:, -1:] + 1
        if prefixes is not None and any(r.completion_ids for r in prefixes):
            out, attention_mask, next_position = self._extend(
                [r.completion_ids for r in prefixes], out, cache, fills_in_place, attention_mask, next_position
            )
        # rows of the batch still in the forward: those that ended leave it, with their cache, once a quarter have
        in_forward = torch.arange(batch, device=device)
        droppable = self.config.drop_finished_rows and isinstance(self.model, PreTrainedModel)
        for t in range(new_tokens):
            tokens, logprobs = sample_next(
                out.logits[:, -1, :], self.config.temperature, self.config.top_p, generator, greedy
            )
            tokens = tokens.masked_fill(finished, pad_id)
            tokens_out[in_forward, t] = tokens
            logprobs_out[in_forward, t] = logprobs
            lengths[in_forward] += (~finished).long()
            finished |= tokens == eos_id
            if budgets is not None:
                finished |= lengths[in_forward] >= budgets[in_forward]
            ended = int(finished.sum())  # one sync a step, as the check below always made
            if ended == len(in_forward) or t + 1 == new_tokens:
                break
            if quota is not None:
                ended_rows[in_forward] = finished
                if int((undone_elsewhere.index_add(0, group_of, (~ended_rows).long()) == 0).sum()) >= groups_wanted:
                    break
            if not fills_in_place:
                cache = {"past_key_values": out.past_key_values}
            if droppable and 4 * ended >= len(in_forward):
                keep = (~finished).nonzero().squeeze(-1)
                (cache["cache"] if fills_in_place else cache["past_key_values"]).reorder_cache(keep)
                in_forward, tokens, finished = in_forward[keep], tokens[keep], finished[keep]
                attention_mask, next_position = attention_mask[keep], next_position[keep]
            rows_now = len(in_forward)
            attention_mask = torch.cat(
                [attention_mask, torch.ones((rows_now, 1), dtype=torch.long, device=device)], dim=1
            )
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position,
                use_cache=True,
                **cache,
            )
            self.work.decode_tokens += rows_now
            self.work.decode_steps += 1
            next_position = next_position + 1
        if was_training:
            self.model.train()
        ended_rows[in_forward] = finished
        tokens_out, logprobs_out, lengths = tokens_out.to(HOST), logprobs_out.to(HOST), lengths.tolist()
        ended_rows = ended_rows.tolist()
        completions: list[Completion | PartialCompletion] = []
        for i, prompt_ids in enumerate(prompt_rows):
            ids = tokens_out[i, : lengths[i]].tolist()
            logprobs = logprobs_out[i, : lengths[i]].tolist()
            versions = None
            if prefixes is not None:
                before = prefixes[i]
                versions = before.token_versions + [self.policy_version] * len(ids)
                ids, logprobs = before.completion_ids + ids, before.logprobs + logprobs
                if not ended_rows[i]:
                    completions.append(PartialCompletion(list(prompt_ids), ids, logprobs, versions))
                    continue
                if not before.completion_ids:
                    versions = None  # sampled by one policy: nothing to say per token
            stopped = bool(ids) and ids[-1] == eos_id
            text_ids = ids[:-1] if stopped else ids
            completions.append(
                Completion(
                    prompt_ids=list(prompt_ids),
                    completion_ids=ids,
                    text=self.tokenizer.decode(text_ids, skip_special_tokens=False),
                    logprobs=logprobs,
                    finish_reason="stop" if stopped else "length",
                    policy_version=min(versions) if versions else self.policy_version,
                    token_versions=versions,
                )
            )
        return completions
