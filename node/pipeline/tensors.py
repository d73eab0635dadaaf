"""torch tensors <-> `protocol.pipeline.WireTensor`, and the checks a received tensor must pass.

The protocol bounds sizes and byte counts before anything is built; here the bytes become
a tensor (a copy: the frame's buffer is not kept alive) and the values are checked, since
only now are they numbers: a float tensor with a NaN or an infinity is refused, and so is
a token id outside the vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

from protocol.pipeline import WireTensor
from protocol.refusals import PipelineRefusal

_TORCH = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
_NAMES = {dtype: name for name, dtype in _TORCH.items()}


class TensorRefused(ValueError):
    """A received tensor that is well-formed on the wire but unusable here."""

    def __init__(self, detail: str, reason: PipelineRefusal = PipelineRefusal.BAD_TENSOR) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def to_wire(tensor: torch.Tensor) -> WireTensor:
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype not in _NAMES:
        raise TypeError(f"tensors of dtype {tensor.dtype} do not travel in pipeline calls")
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16: ship the raw 16-bit patterns
        data = tensor.view(torch.int16).numpy().tobytes()
    else:
        data = tensor.numpy().tobytes()
    return WireTensor(dtype=_NAMES[tensor.dtype], shape=list(tensor.shape), data=data)


def from_wire(wire: WireTensor) -> torch.Tensor:
    dtype = _TORCH[wire.dtype]
    if dtype is torch.bfloat16:
        array = np.frombuffer(wire.data, dtype=np.int16).copy()
        return torch.from_numpy(array).view(torch.bfloat16).reshape(wire.shape)
    array = np.frombuffer(wire.data, dtype=torch.empty((), dtype=dtype).numpy().dtype).copy()
    return torch.from_numpy(array).reshape(wire.shape)


FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # what hidden states and their gradients may travel as


def expect(
    tensors: dict[str, WireTensor],
    name: str,
    dtype: torch.dtype | tuple[torch.dtype, ...],
    shape: tuple[int | None, ...],
) -> torch.Tensor:
    """The named input as a tensor of `dtype` (or of one of several) and `shape` (None: any size), finite if float;
    else TensorRefused."""
    if name not in tensors:
        raise TensorRefused(f"the call lacks tensor {name!r}")
    wire = tensors[name]
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if _TORCH[wire.dtype] not in allowed:
        raise TensorRefused(f"{name} is {wire.dtype}, expected {' or '.join(_NAMES[d] for d in allowed)}")
    if len(wire.shape) != len(shape) or any(want is not None and got != want for got, want in zip(wire.shape, shape)):
        raise TensorRefused(f"{name} has shape {wire.shape}, expected {['*' if s is None else s for s in shape]}")
    tensor = from_wire(wire)
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise TensorRefused(f"{name} has values that are not finite")
    return tensor
