"""The optimizer side of the update: which optimizer steps the policy, the gradient norm it steps with (clipped, and
refused when not finite), the norm reported for a policy split across stage servers, and gradient checkpointing."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from node.config import ConfigError, TrainerConfig


def build_optimizer(
    model: torch.nn.Module, config: TrainerConfig, optimizer: torch.optim.Optimizer | None = None
) -> torch.optim.Optimizer:
    """`optimizer` where one is given, else AdamW over the model's parameters as trainer.* configures it.

    A policy split across stage servers brings its own (node/pipeline/remote_model.py): each stage steps itself."""
    if optimizer is not None:
        return optimizer
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def clipped_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float, policy_version: int) -> float:
    """The gradient's norm before clipping it to `max_norm`; a non-finite one refuses the update, since a step along
    it would leave non-finite weights that every later round and every peer averaging with them would inherit."""
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(
            f"non-finite gradient norm {grad_norm.item()} at policy version {policy_version}; update refused"
        )
    return grad_norm.item()


def stepped_grad_norm(optimizer: torch.optim.Optimizer, local_norm: float) -> float:
    """The norm of the gradient the step applied: `local_norm`, or, where the optimizer's stages clip and report
    their own (optimizer.last_grad_norms, after its step), the norm of the whole gradient they make up."""
    stage_norms = getattr(optimizer, "last_grad_norms", None)
    if stage_norms:
        return math.sqrt(sum(n * n for n in stage_norms.values()))
    return local_norm


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
