"""What travels in an averaging exchange: round trips, error bounds, sizes, malformed bytes."""

from __future__ import annotations

import msgpack
import pytest
import torch

from node.weights.codec import CodecError, EncodedWeights, decode_weights, encode_weights


def sample() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(256, 256, generator=generator) * 0.05,
        "layer.bias": torch.randn(256, generator=generator),
        "odd": torch.randn(3, 5, generator=generator),  # 15 values: int4 pads one nibble
        "zeros": torch.zeros(4, 8),  # all-zero rows: scale 0
        "scalar": torch.tensor(0.75),
    }


def row_absmax(tensor: torch.Tensor) -> torch.Tensor:
    rows = tensor.reshape(tensor.shape[0], -1) if tensor.dim() >= 2 else tensor.reshape(1, -1)
    return rows.abs().amax(dim=1, keepdim=True)


def test_fp32_round_trip_is_exact_through_bytes():
    named = sample()
    decoded = decode_weights(EncodedWeights.from_bytes(encode_weights(named, "fp32").to_bytes()))
    assert list(decoded) == list(named)
    for name, tensor in named.items():
        assert decoded[name].dtype == torch.float32
        assert torch.equal(decoded[name], tensor)


def test_fp16_round_trip_within_half_precision():
    named = sample()
    decoded = decode_weights(EncodedWeights.from_bytes(encode_weights(named, "fp16").to_bytes()))
    for name, tensor in named.items():
        # float16 keeps 11 significant bits: relative error <= 2^-11 (plus subnormal spacing near 0)
        assert torch.all((decoded[name] - tensor).abs() <= tensor.abs() * 2**-11 + 2**-24), name


@pytest.mark.parametrize("mode, qmax", [("int8", 127), ("int4", 7)])
def test_quantized_round_trip_error_is_at_most_half_a_step_per_row(mode, qmax):
    named = sample()
    decoded = decode_weights(EncodedWeights.from_bytes(encode_weights(named, mode).to_bytes()))
    for name, tensor in named.items():
        rows_before = tensor.reshape(tensor.shape[0], -1) if tensor.dim() >= 2 else tensor.reshape(1, -1)
        rows_after = decoded[name].reshape(rows_before.shape)
        bound = row_absmax(tensor) / qmax / 2 * (1 + 1e-5) + 1e-12
        assert torch.all((rows_after - rows_before).abs() <= bound), name
        assert decoded[name].shape == tensor.shape
    assert torch.equal(decoded["zeros"], named["zeros"])


def test_sizes_per_mode():
    named = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    sizes = {mode: encode_weights(named, mode).nbytes for mode in ("fp32", "fp16", "int8", "int4")}
    assert sizes["fp32"] == 4 * (256 * 256 + 256)
    assert sizes["fp16"] * 2 == sizes["fp32"]
    assert 0.25 < sizes["int8"] / sizes["fp32"] < 0.26  # 1 byte per value + a float32 scale per row
    assert 0.125 < sizes["int4"] / sizes["fp32"] < 0.13
    for mode, nbytes in sizes.items():  # names and shapes cost little on the wire
        assert nbytes < len(encode_weights(named, mode).to_bytes()) < nbytes + 256


def test_declared_dtype_travels_and_can_be_restored():
    named = {"w": torch.randn(4, 4).to(torch.bfloat16)}
    encoded = EncodedWeights.from_bytes(encode_weights(named, "fp32").to_bytes())
    assert encoded.tensors[0].dtype == "bfloat16"
    assert decode_weights(encoded)["w"].dtype == torch.float32
    restored = decode_weights(encoded, dtype=None)["w"]
    assert restored.dtype == torch.bfloat16 and torch.equal(restored, named["w"])


def test_quantizing_non_finite_values_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        encode_weights({"w": torch.tensor([1.0, float("nan")])}, "int8")
    with pytest.raises(ValueError, match="mode"):
        encode_weights({"w": torch.ones(2)}, "int2")


def test_golden_bytes():
    """The wire format is pinned: changing it needs a new codec version."""
    fp32 = encode_weights({"w": torch.tensor([1.0, -2.0])}, "fp32").to_bytes()
    assert fp32.hex() == (
        "83a17601a46d6f6465a466703332a774656e736f72739185a46e616d65a177a56474797065a7666c6f61743332"
        "a573686170659102a464617461c4080000803f000000c0a57363616c65c0"
    )
    int4 = encode_weights({"w": torch.tensor([[1.0, -2.0, 0.5]])}, "int4").to_bytes()
    assert int4.hex() == (
        "83a17601a46d6f6465a4696e7434a774656e736f72739185a46e616d65a177a56474797065a7666c6f61743332"
        "a57368617065920103a464617461c4021b8aa57363616c65c4042549923e"
    )


def message(**overrides) -> bytes:
    entry = {"name": "w", "dtype": "float32", "shape": [2], "data": b"\0" * 8, "scale": None}
    body = {"v": 1, "mode": "fp32", "tensors": [entry]}
    body.update({k: v for k, v in overrides.items() if k in body})
    entry.update({k: v for k, v in overrides.items() if k in entry})
    return msgpack.packb(body, use_bin_type=True)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xc1garbage", "msgpack"),
        (message() + b"\x00", "msgpack"),
        (msgpack.packb([1, 2]), "map"),
        (message(v=2), "version"),
        (message(mode="int2"), "mode"),
        (message(dtype="int64"), "dtype"),
        (message(shape=[-1]), "shape"),
        (message(shape=[1] * 9), "shape|msgpack"),
        (message(data=b"\0" * 7), "data bytes"),
        (message(scale=b"\0" * 4), "scale"),
        (message(name=""), "name"),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "mode": "fp32",
                    "tensors": [{"name": "w", "dtype": "float32", "shape": [1], "data": b"\0" * 4, "scale": None}] * 2,
                },
                use_bin_type=True,
            ),
            "duplicate",
        ),
    ],
)
def test_malformed_bytes_are_refused(raw, match):
    with pytest.raises(CodecError, match=match):
        EncodedWeights.from_bytes(raw)


def test_size_bounds_are_checked_before_decoding():
    raw = encode_weights({"a": torch.zeros(10), "b": torch.zeros(10)}, "fp32").to_bytes()
    with pytest.raises(CodecError, match="more than 15 values"):
        EncodedWeights.from_bytes(raw, max_values=15)
    with pytest.raises(CodecError, match="at most|msgpack"):
        EncodedWeights.from_bytes(raw, max_tensors=1)
