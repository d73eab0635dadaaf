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


def _values(wire: WireTensor) -> np.ndarray:
    """The wire bytes as a numpy array of their own (a copy: the frame's buffer is not kept alive); bfloat16 as its
    16-bit patterns, since numpy has no bfloat16."""
    numpy_dtype = np.int16 if wire.dtype == "bfloat16" else torch.empty((), dtype=_TORCH[wire.dtype]).numpy().dtype
    return np.frombuffer(wire.data, dtype=numpy_dtype).copy()


def _as_tensor(values: np.ndarray, wire: WireTensor) -> torch.Tensor:
    tensor = torch.from_numpy(values)
    return (tensor.view(torch.bfloat16) if wire.dtype == "bfloat16" else tensor).reshape(wire.shape)


def from_wire(wire: WireTensor) -> torch.Tensor:
    return _as_tensor(_values(wire), wire)


BFLOAT16_EXPONENT = 0x7F80  # a bfloat16 whose 8 exponent bits are all set is an infinity or a NaN


def all_finite(values: np.ndarray, wire_dtype: str) -> bool:
    """Whether every value of a float tensor's wire array (`_values`) is finite. numpy's check, not torch's: a stage
    server checks every hidden state and gradient it receives, and on one CPU thread torch.isfinite(t).all() cost 6x
    numpy's over a 1 MB float32 tensor and 8.5x in bfloat16 on a quiet machine
    (benchmarks/notebook/2026-11-30-pipeline-throughput.md,
    pipeline_throughput `--check-cost`)."""
    if wire_dtype == "bfloat16":
        return not bool(np.any((values & BFLOAT16_EXPONENT) == BFLOAT16_EXPONENT))
    return bool(np.isfinite(values).all())


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
    values = _values(wire)
    if _TORCH[wire.dtype] in FLOATS and not all_finite(values, wire.dtype):
        raise TensorRefused(f"{name} has values that are not finite")
    return _as_tensor(values, wire)
