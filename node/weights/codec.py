"""What travels in an averaging exchange: named weight tensors, optionally quantized.

Modes (the sender picks; the receiver decodes whatever mode the message says):
    fp32  exact little-endian float32                                  4 bytes / value
    fp16  float16, values clamped to the float16 range (+-65504)       2 bytes / value
    int8  symmetric absmax per row: q = round(x / s), s = max|x_row| / 127,
          q in [-127, 127]; one float32 scale per row                   1 byte / value
    int4  as int8 with q in [-7, 7], stored as q + 8 in a nibble, two values
          per byte (low nibble first, an odd count padded with one nibble) 1/2 byte / value
"Row" is the first dimension of a tensor with two or more dimensions; a 0-d or 1-d tensor
is one row. Symmetric quantization has no zero point (it is 0), so only scales travel.
Per-element error of the quantized modes is at most s / 2 for the element's row.

Wire layout (`EncodedWeights.to_bytes`): one msgpack map
    {"v": 1, "mode": str, "tensors": [{"name": str, "dtype": str, "shape": [int],
                                       "data": bin, "scale": bin | nil}, ...]}
where "dtype" is the sender's original dtype of the tensor (its values travel as `mode`),
"data" is the packed values and "scale" the float32 row scales (nil for fp32/fp16).
`from_bytes` checks every field and bounds every size before allocating anything, and
raises `CodecError` on anything malformed: peer bytes never reach torch unchecked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import msgpack
import numpy as np
import torch

CODEC_VERSION = 1
Mode = Literal["fp32", "fp16", "int8", "int4"]
MODES: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")

# The original dtypes a peer may declare; the values always travel in the mode's format.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

_QMAX = {"int8": 127, "int4": 7}
_FP16_MAX = 65504.0
MAX_NAME_CHARS = 512
MAX_DIMS = 8


class CodecError(ValueError):
    """Bytes that are not a well-formed encoded-weights message (or exceed the receiver's bounds)."""


@dataclass
class EncodedTensor:
    name: str
    dtype: str  # the sender's dtype name, a key of DTYPES
    shape: tuple[int, ...]
    data: bytes  # packed values in the message's mode
    scale: bytes | None = None  # float32 scale per row (int8/int4); None for fp32/fp16

    @property
    def nbytes(self) -> int:
        return len(self.data) + (len(self.scale) if self.scale is not None else 0)


@dataclass
class EncodedWeights:
    mode: str
    tensors: list[EncodedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of values and scales (what the mode costs; names and shapes add a little on the wire)."""
        return sum(t.nbytes for t in self.tensors)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            {
                "v": CODEC_VERSION,
                "mode": self.mode,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "data": t.data, "scale": t.scale}
                    for t in self.tensors
                ],
            },
            use_bin_type=True,
        )

    @classmethod
    def from_bytes(cls, raw: bytes, max_tensors: int = 4096, max_values: int = 2**31) -> "EncodedWeights":
        """Parse and check a message; `max_values` bounds the total element count it may describe."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise CodecError(f"expected bytes, got {type(raw).__name__}")
        try:
            message = msgpack.unpackb(
                raw,
                raw=False,
                strict_map_key=True,
                max_array_len=max(max_tensors, MAX_DIMS),
                max_map_len=16,
                max_str_len=MAX_NAME_CHARS,
                max_bin_len=len(raw),
            )
        except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as exc:
            raise CodecError(f"not one msgpack value: {exc}") from None
        if not isinstance(message, dict) or set(message) != {"v", "mode", "tensors"}:
            raise CodecError("expected a map with keys v, mode, tensors")
        if message["v"] != CODEC_VERSION:
            raise CodecError(f"unknown codec version {message['v']!r}")
        mode = message["mode"]
        if not isinstance(mode, str) or mode not in MODES:
            raise CodecError(f"unknown mode {mode!r}")
        entries = message["tensors"]
        if not isinstance(entries, list) or len(entries) > max_tensors:
            raise CodecError(f"tensors must be a list of at most {max_tensors}")
        tensors, names, total = [], set(), 0
        for entry in entries:
            tensor = _parse_entry(entry, mode)
            if tensor.name in names:
                raise CodecError(f"duplicate tensor name {tensor.name!r}")
            names.add(tensor.name)
            total += math.prod(tensor.shape)
            if total > max_values:
                raise CodecError(f"more than {max_values} values in total")
            tensors.append(tensor)
        return cls(mode=mode, tensors=tensors)


def _parse_entry(entry: object, mode: str) -> EncodedTensor:
    if not isinstance(entry, dict) or set(entry) != {"name", "dtype", "shape", "data", "scale"}:
        raise CodecError("a tensor entry must have exactly name, dtype, shape, data, scale")
    name, dtype, shape, data, scale = (entry[k] for k in ("name", "dtype", "shape", "data", "scale"))
    if not isinstance(name, str) or not name:
        raise CodecError("tensor name must be a non-empty string")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a map or list here is unhashable: TypeError, not a refusal
        raise CodecError(f"{name}: unknown dtype {dtype!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(d) is int and 0 <= d < 2**31 for d in shape)
    ):
        raise CodecError(f"{name}: shape must be a list of at most {MAX_DIMS} non-negative ints")
    if not isinstance(data, bytes) or not (scale is None or isinstance(scale, bytes)):
        raise CodecError(f"{name}: data and scale must be bytes")
    shape = tuple(shape)
    rows, _ = _rows_cols(shape)
    expected = _data_nbytes(mode, math.prod(shape))
    if len(data) != expected:
        raise CodecError(f"{name}: {len(data)} data bytes, expected {expected} for {mode} {list(shape)}")
    if mode in _QMAX and (scale is None or len(scale) != 4 * rows):
        raise CodecError(f"{name}: {mode} needs a scale of {4 * rows} bytes (one float32 per row)")
    if mode not in _QMAX and scale is not None:
        raise CodecError(f"{name}: {mode} carries no scale")
    return EncodedTensor(name=name, dtype=dtype, shape=shape, data=data, scale=scale)


def _rows_cols(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        return 1, math.prod(shape)
    return shape[0], math.prod(shape[1:])


def _data_nbytes(mode: str, count: int) -> int:
    return {"fp32": 4 * count, "fp16": 2 * count, "int8": count, "int4": (count + 1) // 2}[mode]


def encode_weights(named: dict[str, torch.Tensor], mode: Mode = "fp32") -> EncodedWeights:
    """Encode floating-point tensors; quantized modes refuse non-finite values (ValueError)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    encoded = EncodedWeights(mode=mode)
    for name, tensor in named.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"{name}: cannot encode dtype {tensor.dtype}")
        values = tensor.detach().to("cpu", torch.float32).contiguous()
        data, scale = _encode_values(name, values, mode)
        encoded.tensors.append(
            EncodedTensor(
                name=name, dtype=_DTYPE_NAMES[tensor.dtype], shape=tuple(tensor.shape), data=data, scale=scale
            )
        )
    return encoded


def _encode_values(name: str, values: torch.Tensor, mode: str) -> tuple[bytes, bytes | None]:
    if mode == "fp32":
        return values.numpy().astype("<f4", copy=False).tobytes(), None
    if mode == "fp16":
        return values.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).numpy().astype("<f2", copy=False).tobytes(), None
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{name}: cannot quantize non-finite values")
    qmax = _QMAX[mode]
    rows, cols = _rows_cols(tuple(values.shape))
    matrix = values.reshape(rows, cols)
    absmax = matrix.abs().amax(dim=1) if cols else torch.zeros(rows)
    scale = absmax / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row quantizes to zeros
    q = torch.round(matrix / safe[:, None]).clamp(-qmax, qmax).to(torch.int8).reshape(-1)
    if mode == "int8":
        data = q.numpy().tobytes()
    else:
        nibbles = (q + 8).to(torch.uint8)
        if nibbles.numel() % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8)])
        pairs = nibbles.reshape(-1, 2)
        data = (pairs[:, 0] | (pairs[:, 1] << 4)).numpy().tobytes()
    return data, scale.numpy().astype("<f4", copy=False).tobytes()


def decode_weights(encoded: EncodedWeights, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
    """Tensors by name, in `dtype` (float32 by default; None: the dtype each tensor declares)."""
    out: dict[str, torch.Tensor] = {}
    for entry in encoded.tensors:
        count = math.prod(entry.shape)
        if encoded.mode == "fp32":
            flat = torch.from_numpy(np.frombuffer(entry.data, dtype="<f4", count=count).astype(np.float32))
        elif encoded.mode == "fp16":
            flat = torch.from_numpy(np.frombuffer(entry.data, dtype="<f2", count=count).astype(np.float32))
        else:
            raw = torch.from_numpy(np.frombuffer(entry.data, dtype=np.uint8).copy())
            if encoded.mode == "int8":
                q = raw.view(torch.int8).to(torch.float32)
            else:
                q = torch.stack([raw & 0x0F, raw >> 4], dim=1).reshape(-1)[:count].to(torch.float32) - 8
            rows, cols = _rows_cols(entry.shape)
            scale = torch.from_numpy(np.frombuffer(entry.scale, dtype="<f4", count=rows).astype(np.float32))
            flat = (q.reshape(rows, cols) * scale[:, None]).reshape(-1)
        out[entry.name] = flat.reshape(entry.shape).to(DTYPES[entry.dtype] if dtype is None else dtype)
    return out
