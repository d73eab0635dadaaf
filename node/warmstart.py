"""Supervised warm start of the embedded default model.

RL needs a policy that is sometimes right: from random weights every reward is zero and
GRPO has nothing to push on. A short supervised phase on the default task mix teaches the
answer format and a little of the task, leaving most of the accuracy for RL to earn.
Its questions come from a seed that neither training nor the held-out set uses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from node.config import NodeConfig
from node.device import model_device
from node.tasks import TaskSource

log = logging.getLogger(__name__)

WARMSTART_SEED_OFFSET = 2_000_000_033


def supervised_batch(
    tokenizer, prompts: list[str], answers: list[str], device: torch.device
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+answer+eos sequences on `device`; labels only on the answer and eos."""
    rows, label_rows = [], []
    for prompt, answer in zip(prompts, answers):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        label_rows.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, label_row) in enumerate(zip(rows, label_rows)):
        input_ids[i, : len(row)] = torch.tensor(row)
        labels[i, : len(row)] = torch.tensor(label_row)
        attention_mask[i, : len(row)] = 1
    # built on the CPU and moved once: three copies per step, not one per row
    return {"input_ids": input_ids.to(device), "labels": labels.to(device), "attention_mask": attention_mask.to(device)}


def warm_start(
    model, tokenizer, config: NodeConfig, progress: bool | None = None, after_step: Callable[[int], None] | None = None
) -> None:
    settings = config.model.default
    if settings.warmup_steps == 0:
        return
    tasks = config.tasks
    if settings.warmup_labels:
        tasks = tasks.model_copy(
            update={"datasets": [d for d in tasks.datasets if d.display_label in settings.warmup_labels]}
        )
    source = TaskSource(tasks, seed=WARMSTART_SEED_OFFSET + settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.warmup_lr, weight_decay=0.01)
    warmup = max(1, settings.warmup_steps // 10)

    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, settings.warmup_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * done))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    bar = Progress(
        TextColumn("warm start"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(),
    )
    show_bar = progress if progress is not None else bar.console.is_terminal
    task_id = bar.add_task("warm start", total=settings.warmup_steps, loss=float("nan"))
    if show_bar:
        bar.start()
    try:
        for step in range(settings.warmup_steps):
            questions = source.batch(step * settings.warmup_batch_size, settings.warmup_batch_size)
            batch = supervised_batch(
                tokenizer, [source.prompt(q) for q in questions], [q.answer for q in questions], model_device(model)
            )
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            bar.update(task_id, advance=1, loss=loss.item())
            if after_step is not None:  # e.g. benchmarks/warm_start_probe.py evaluates the policy along the way
                after_step(step + 1)
                model.train()
            if not show_bar and (step + 1) % 50 == 0:
                log.info("warm start step %d/%d loss %.3f", step + 1, settings.warmup_steps, loss.item())
    finally:
        if show_bar:
            bar.stop()
    model.eval()
