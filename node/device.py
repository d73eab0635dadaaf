"""Where a node's tensors live: the one place that turns `model.device` and `model.dtype` into torch's.

`resolve_device` is the only reading of the config: 'auto' is the GPU torch sees (cuda:0) or
else the CPU, so a user with a GPU trains on it without a flag. Everything after that follows
the policy's parameters: a component that makes tensors for the policy asks `model_device(model)`
where the model is, and never decides for itself. What leaves the device for the wire (rollouts,
pipeline activations, NoLoCo's weights) goes to the CPU at the edge and comes back at the other.

dtype: float32 everywhere; bfloat16 where the device computes in it (a CPU does, slowly; a GPU
from Ampere on); float16 on a GPU, and on a CPU as before (configs that ran keep running).
"""

from __future__ import annotations

import torch

from node.config import ConfigError, ModelConfig

HOST = torch.device("cpu")  # where tensors travel from and arrive: the wire, numpy, checkpoints on disk


class DeviceError(ConfigError):
    """The configured device or dtype cannot be used on this machine; its message is one readable line."""


def resolve_device(config: ModelConfig) -> torch.device:
    """The device `config.device` names on this machine, with `config.dtype` checked against it."""
    if config.device == "auto":
        device = torch.device("cuda", 0) if torch.cuda.is_available() else HOST
    elif config.device == "cpu":
        device = HOST
    else:
        device = torch.device(config.device)
        if device.index is None:
            device = torch.device("cuda", 0)
        if not torch.cuda.is_available():
            raise DeviceError(
                f"model.device is {config.device!r} but torch {torch.__version__} sees no CUDA device "
                f"({'no GPU visible' if torch.backends.cuda.is_built() else 'a CPU-only build'}): "
                "set model.device to auto or cpu"
            )
        if device.index >= torch.cuda.device_count():
            raise DeviceError(
                f"model.device is {config.device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    if config.dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError(
            f"model.dtype bfloat16 is not supported on {describe_device(device)}: set model.dtype to float16 or float32"
        )
    if device.type == "cuda":
        avoid_cudnn_attention()
    return device


def avoid_cudnn_attention() -> None:
    """Keep scaled-dot-product attention off cuDNN's kernel, process-wide.

    For bfloat16 and float16 on Hopper, PyTorch picks cuDNN's fused attention first, and it builds an execution plan for
    every new shape. A node's shapes change on every call: each sampler step grows the KV cache by one, and each
    micro-batch has its own length. On an H200 that cost 1.5 ms of CPU for each attention forward and 6.7 ms for each
    backward, at about 12 us of GPU work each, and made a bfloat16 round 4x slower than a float32 one
    (benchmarks/notebook/2026-11-27-gpu.md
    "bfloat16 on a GPU").
    The memory-efficient kernel takes the same masks and needs no plan; float32 already ran on it."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def policy_dtype(config: ModelConfig) -> torch.dtype:
    return getattr(torch, config.dtype)


def model_device(model: torch.nn.Module) -> torch.device:
    """Where `model`'s parameters are: the device every tensor made for it must be on (the CPU for a model
    without parameters of its own)."""
    for parameter in model.parameters():
        return parameter.device
    return HOST


def describe_device(device: torch.device) -> str:
    """The device as a person reads it: 'cpu', or 'cuda:0 NVIDIA H100 80GB HBM3' (heartbeats, the live table)."""
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return device.type
