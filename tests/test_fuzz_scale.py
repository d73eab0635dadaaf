"""Generated hostile inputs through every decoder a peer's bytes reach: each must end in that decoder's own
refusal, never in another exception. The default suite runs 2,000 inputs per decoder; `-m slow` runs 100,000
(count and time in benchmarks/RESULTS.md)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import msgpack
import pytest

from node.averaging.codec import CodecError, EncodedWeights, encode_weights
from node.pipeline.client import unpack
from node.transport.framing import FramingError, read_frame
from protocol import DEFAULT_LIMITS, NodeIdentity, ProtocolRejection, decode_message
from protocol.pipeline import DEFAULT_PIPELINE_LIMITS, PipelineFrame, StageCall, StageResult
from tests.test_dht_records import heartbeat


def mutations(seeds: list[bytes], rng: random.Random):
    """Random bytes, and valid messages flipped, cut, spliced and padded."""
    while True:
        base = bytearray(rng.choice(seeds))
        kind = rng.randrange(6)
        if kind == 0:
            yield rng.randbytes(rng.randrange(0, 512))
            continue
        if kind == 1 and base:
            for _ in range(rng.randrange(1, 8)):
                base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
        elif kind == 2:
            base = base[: rng.randrange(len(base) + 1)]
        elif kind == 3:
            at = rng.randrange(len(base) + 1)
            base[at:at] = rng.randbytes(rng.randrange(1, 32))
        elif kind == 4:
            other = rng.choice(seeds)
            base = base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1):]
        else:
            base += rng.randbytes(rng.randrange(1, 16))
        yield bytes(base)


def envelope_seeds() -> list[bytes]:
    identity = NodeIdentity.generate()
    return [heartbeat(identity, time.time())]


def call_seeds() -> list[bytes]:
    import torch

    from node.pipeline.tensors import to_wire

    call = StageCall(v=1, op="forward", stage=1, stage_fingerprint="a" * 16, call_id="c", parts=["layers"], train=True,
                     tensors={"hidden": to_wire(torch.randn(2, 3, 4)), "position_ids": to_wire(torch.arange(3).expand(2, 3).contiguous())}, scale=1.0)
    return [msgpack.packb(call.to_wire(), use_bin_type=True)]


def run_decoders(count: int, seed: int = 0) -> dict[str, Counter]:
    """Feed `count` inputs to each decoder; the refusal counts by decoder and reason (raises on anything unexpected)."""
    import torch

    rng = random.Random(seed)
    counts: dict[str, Counter] = {}

    def envelope(data: bytes) -> str:
        try:
            decode_message(data, swarm_id="test-swarm", limits=DEFAULT_LIMITS)
            return "accepted"
        except ProtocolRejection as exc:
            return exc.reason.value

    def pipeline(message_type):
        def decode(data: bytes) -> str:
            try:
                message_type.from_wire(unpack(data, DEFAULT_PIPELINE_LIMITS), DEFAULT_PIPELINE_LIMITS)
                return "accepted"
            except ProtocolRejection as exc:
                return exc.reason.value
            except ValueError:  # msgpack's unpack errors
                return "not_msgpack"

        return decode

    def weights(data: bytes) -> str:
        try:
            EncodedWeights.from_bytes(data, max_tensors=16, max_values=1 << 16)
            return "accepted"
        except CodecError:
            return "codec_error"

    def frame(data: bytes) -> str:
        async def read() -> str:
            reader = asyncio.StreamReader()
            reader.feed_data(data)
            reader.feed_eof()
            try:
                await read_frame(reader, PipelineFrame, lambda kind: 4096)
                return "accepted"
            except FramingError as exc:
                return type(exc).__name__
            except asyncio.IncompleteReadError:
                return "incomplete"

        return asyncio.run(read())

    weight_seed = [encode_weights({"w": torch.randn(4, 3), "b": torch.randn(3)}, mode).to_bytes() for mode in ("fp32", "fp16", "int8", "int4")]
    decoders = {
        "envelope": (envelope, envelope_seeds()),
        "pipeline_call": (pipeline(StageCall), call_seeds()),
        "pipeline_result": (pipeline(StageResult), call_seeds()),
        "weights_codec": (weights, weight_seed),
        "frame": (frame, [bytes([1]) + (10).to_bytes(8, "big") + b"0123456789", bytes([2, 0, 0, 0, 0, 0, 0, 0, 0])]),
    }
    for name, (decode, seeds) in decoders.items():
        inputs = mutations(seeds, rng)
        counts[name] = Counter(decode(next(inputs)) for _ in range(count))  # any other exception fails the test
    return counts


def test_fuzz_every_decoder_short():
    counts = run_decoders(2000)
    for name, outcomes in counts.items():
        assert sum(outcomes.values()) == 2000
        assert set(outcomes) - {"accepted"}, f"{name}: nothing was refused"


@pytest.mark.slow
def test_fuzz_every_decoder_100k():
    started = time.perf_counter()
    counts = run_decoders(100_000, seed=1)
    print(f"\n100,000 inputs per decoder in {time.perf_counter() - started:.0f}s: " + "; ".join(f"{n}: {dict(c.most_common(6))}" for n, c in counts.items()))
    assert all(sum(c.values()) == 100_000 for c in counts.values())
