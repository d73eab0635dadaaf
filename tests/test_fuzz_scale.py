"""Generated hostile inputs through every decoder a peer's bytes reach: each must end in that decoder's own
refusal (or a valid decode), never in another exception. The default suite runs 2,000 inputs per decoder;
`-m slow` runs 100,000 (count and time in benchmarks/notebook/2026-11-22-fuzz-at-scale.md).

The decoders are the DECODERS registry below. A new stream protocol or message joins it with one
function decorated `@fuzzed("name")` that returns (decode, seeds): `decode(bytes) -> outcome name`
(a refusal's name, or "accepted"), and seeds, valid inputs that the mutations start from. Seeds that
are msgpack also get structural mutations (a value swapped for one of another type or size, a field
dropped or added), which reach the checks behind a successful unpack far more often than flipped bits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable

import msgpack
import pytest

from node.weights.codec import CodecError, EncodedWeights, encode_weights
from node.averaging.exchange import CONTROL_MAX_BYTES, EXCHANGE_VERSION, Frame, _parse_refusal, check_hello
from node.averaging.matchmaking import Round
from node.pipeline.client import unpack
from node.transport.framing import FRAME_HEADER, FramingError, read_frame
from protocol import (
    DEFAULT_LIMITS,
    MESSAGE_TYPES,
    AveragingReady,
    ProtocolRejection,
    StageAnnouncement,
    StageLost,
    decode_message,
    encode_message,
)
from protocol.pipeline import DEFAULT_PIPELINE_LIMITS, PIPELINE_VERSION, PipelineFrame, RouteHop, StageCall, StageResult
from tests.helpers.messages import IDENTITY, SWARM, T0, make_batch, make_stats, signed

Decode = Callable[[bytes], str]
DECODERS: dict[
    str, Callable[[], tuple[Decode, list[bytes]]]
] = {}  # name -> () -> (decode, seeds); see the module docstring


def fuzzed(name: str):
    def register(build: Callable[[], tuple[Decode, list[bytes]]]):
        DECODERS[name] = build
        return build

    return register


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
            base = base[: rng.randrange(len(base) + 1)] + other[rng.randrange(len(other) + 1) :]
        else:
            base += rng.randbytes(rng.randrange(1, 16))
        yield bytes(base)


def _odd_value(rng: random.Random):
    """A value of a random type and size, including the edges decoders must refuse."""
    return rng.choice(
        [
            None,
            True,
            False,
            0,
            -1,
            2**63 - 1,
            -(2**63),
            2**64 - 1,
            rng.randrange(-1000, 1000),
            float("nan"),
            float("inf"),
            -0.0,
            1e308,
            "",
            "x" * rng.randrange(1, 5000),
            "\u202e\x00",
            b"",
            rng.randbytes(rng.randrange(1, 300)),
            [],
            [None] * rng.randrange(1, 300),
            {},
            {"k": 1},
            [[[[[]]]]],
            {1: 2},
        ]
    )


def _restructure(value, rng: random.Random):
    """`value` (unpacked msgpack) with one random node replaced, dropped or joined by another."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        value = dict(value)
        action = rng.randrange(4)
        if action == 0:
            del value[key]
        elif action == 1:
            value[rng.choice([key + "_x", "extra", 7])] = _odd_value(rng)
        else:
            value[key] = _restructure(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.8:
        value = list(value)
        at = rng.randrange(len(value))
        action = rng.randrange(4)
        if action == 0:
            del value[at]
        elif action == 1:
            value.insert(at, _odd_value(rng))
        else:
            value[at] = _restructure(value[at], rng)
        return value
    return _odd_value(rng)


def structural_mutations(seeds: list[bytes], rng: random.Random):
    """Valid msgpack inputs unpacked, restructured and packed again (a leading non-msgpack byte, such as a
    kind selector, is kept as it is)."""
    while True:
        seed = rng.choice(seeds)
        prefix, body = (
            (seed[:1], seed[1:]) if seed[:1] < b"\x80" and len(seed) > 1 and _unpackable(seed[1:]) else (b"", seed)
        )
        value = msgpack.unpackb(body, raw=False, strict_map_key=False)
        yield prefix + msgpack.packb(_restructure(value, rng), use_bin_type=True)


def _unpackable(data: bytes) -> bool:
    try:
        msgpack.unpackb(data, raw=False, strict_map_key=False)
        return True
    except (ValueError, TypeError):
        return False


def _frame(kind: int, body: bytes = b"") -> bytes:
    return FRAME_HEADER.pack(kind, len(body)) + body


def _read_one_frame(data: bytes, kinds, limit) -> tuple[str | None, tuple | None]:
    """(refusal name, None) or (None, (kind, body)) for the first frame of `data` read as a stream."""

    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, kinds, limit)

    try:
        return None, _LOOP.run_until_complete(read())
    except FramingError as exc:
        return type(exc).__name__, None
    except asyncio.IncompleteReadError:
        return "incomplete", None


_LOOP: asyncio.AbstractEventLoop | None = None  # one loop for all stream reads of a run (set by run_decoders)


def _weights(data: bytes) -> str:
    try:
        EncodedWeights.from_bytes(data, max_tensors=16, max_values=1 << 16)
        return "accepted"
    except CodecError:
        return "codec_error"


def _weights_seeds() -> list[bytes]:
    import torch

    return [
        encode_weights({"w": torch.randn(4, 3), "b": torch.randn(3)}, mode).to_bytes()
        for mode in ("fp32", "fp16", "int8", "int4")
    ]


@fuzzed("envelope")
def _envelope():
    """The signed envelope as read from the DHT or gossip (most mutations die at the signature)."""

    def decode(data: bytes) -> str:
        try:
            decode_message(data, swarm_id=SWARM, limits=DEFAULT_LIMITS, now=T0)
            return "accepted"
        except ProtocolRejection as exc:
            return exc.reason.value

    return decode, [
        encode_message(message, identity=IDENTITY, swarm_id=SWARM, seq=1, timestamp=T0)
        for message in (make_stats(), make_batch())
    ]


@fuzzed("signed_messages")
def _signed_messages():
    """Every message kind's payload, mutated and then correctly signed, so that each decoder past the
    signature (payload structure, values, claimed node id) sees it. Input: one byte picking the kind,
    then the raw payload."""
    kinds = list(MESSAGE_TYPES)
    announcement = StageAnnouncement(
        node_id=IDENTITY.node_id,
        p2p_peer_id="12D3KooWStage",
        model_fingerprint="m",
        num_stages=2,
        stage=0,
        stage_fingerprint="a" * 16,
        layer_start=0,
        layer_end=1,
        parts=["layers"],
        state="serving",
        step=3,
        grad_norm=0.5,
        samples_per_s=1.5,
        recoveries=0,
        replicas=[],
    )
    lost = StageLost(node_id=IDENTITY.node_id, model_fingerprint="m", num_stages=4, stages=[1, 2])
    examples = {
        type(m).KIND: m
        for m in (
            make_batch(),
            make_stats(),
            announcement,
            AveragingReady(p2p_peer_id="12D3KooWPeer", round=4, state="free"),
            lost,
        )
    }
    assert set(examples) == set(kinds), "a new message kind needs an example here"

    def decode(data: bytes) -> str:
        if not data:
            return "empty"
        try:
            decode_message(
                signed(None, kind=kinds[data[0] % len(kinds)].value, raw_payload=data[1:]), swarm_id=SWARM, now=T0
            )
            return "accepted"
        except ProtocolRejection as exc:
            return exc.reason.value

    return decode, [bytes([kinds.index(kind)]) + msgpack.packb(message.to_wire()) for kind, message in examples.items()]


def _pipeline(message_type) -> Decode:
    def decode(data: bytes) -> str:
        try:
            message_type.from_wire(unpack(data, DEFAULT_PIPELINE_LIMITS), DEFAULT_PIPELINE_LIMITS)
            return "accepted"
        except ProtocolRejection as exc:
            return exc.reason.value
        except ValueError:  # msgpack's unpack errors
            return "not_msgpack"

    return decode


def _call_seeds() -> list[bytes]:
    import torch

    from node.pipeline.tensors import to_wire

    call = StageCall(
        v=PIPELINE_VERSION,
        op="forward",
        stage=1,
        stage_fingerprint="a" * 16,
        call_id="c",
        parts=["layers"],
        train=True,
        tensors={
            "hidden": to_wire(torch.randn(2, 3, 4)),
            "position_ids": to_wire(torch.arange(3).expand(2, 3).contiguous()),
        },
        scale=1.0,
    )
    chained = dataclasses.replace(  # a chained forward: the route every server it passes through decodes
        call,
        origin="Qm" + "a" * 44,
        route=[RouteHop(stage=2, stage_fingerprint="b" * 16, peer_id="Qm" + "b" * 44, call_id="c2", parts=["layers"])],
    )
    return [msgpack.packb(c.to_wire(), use_bin_type=True) for c in (call, chained)]


@fuzzed("pipeline_call")
def _pipeline_call():
    return _pipeline(StageCall), _call_seeds()


@fuzzed("pipeline_result")
def _pipeline_result():
    return _pipeline(StageResult), _call_seeds()


@fuzzed("pipeline_frames")
def _pipeline_frames():
    """The pipeline stream's framing (node/transport/framing.py with PipelineFrame types)."""

    def decode(data: bytes) -> str:
        refused, _ = _read_one_frame(data, PipelineFrame, lambda kind: 4096)
        return refused or "accepted"

    return decode, [bytes([1]) + (10).to_bytes(8, "big") + b"0123456789", bytes([2, 0, 0, 0, 0, 0, 0, 0, 0])]


@fuzzed("weights_codec")
def _weights_codec():
    return _weights, _weights_seeds()


@fuzzed("averaging_frames")
def _averaging_frames():
    """The weight exchange's first frame as an acceptor reads it, and its body as the exchange parses it:
    HELLO (the acceptor's checks), REFUSE (the reason), WEIGHTS (the codec)."""
    prefix = "swarm/v1/averaging/m"
    hello = msgpack.packb({"v": EXCHANGE_VERSION, "prefix": prefix, "round": 1})

    def decode(data: bytes) -> str:
        refused, frame = _read_one_frame(
            data, Frame, lambda kind: 1 << 16 if kind is Frame.WEIGHTS else CONTROL_MAX_BYTES
        )
        if refused:
            return refused
        kind, body = frame
        if kind is Frame.HELLO:
            rnd = Round(round_id=1, theta={}, payload=b"", capacity=1, deadline=float("inf"))
            refusal = check_hello(kind, body, prefix, rnd, 1, "12D3KooWCaller")
            return f"hello:{refusal.value if refusal else 'accepted'}"
        if kind is Frame.REFUSE:
            return f"refuse:{_parse_refusal(body)}"
        if kind is Frame.WEIGHTS:
            return f"weights:{_weights(body)}"
        return kind.name.lower()

    seeds = [
        _frame(Frame.HELLO, hello),
        _frame(Frame.REFUSE, msgpack.packb({"reason": "busy", "detail": ""})),
        _frame(Frame.ACCEPT),
        _frame(Frame.COMMIT),
        _frame(Frame.DONE),
        *(_frame(Frame.WEIGHTS, w) for w in _weights_seeds()[1:3]),
    ]
    return decode, seeds


def run_decoders(count: int, seed: int = 0) -> dict[str, Counter]:
    """Feed `count` inputs to each decoder; the outcome counts by decoder (raises on anything unexpected)."""
    global _LOOP
    rng = random.Random(seed)
    counts: dict[str, Counter] = {}
    _LOOP = asyncio.new_event_loop()
    try:
        for name, build in DECODERS.items():
            decode, seeds = build()
            byte_level = mutations(seeds, rng)
            structured = [s for s in seeds if _unpackable(s) or (len(s) > 1 and _unpackable(s[1:]))]
            structural = structural_mutations(structured, rng) if structured else byte_level
            # Half and half where the seeds are msgpack: flipped bits mostly stop at the unpacker.
            # any other exception fails the test
            counts[name] = Counter(decode(next(structural if i % 2 else byte_level)) for i in range(count))
    finally:
        _LOOP.close()
    return counts


def test_fuzz_every_decoder_short():
    counts = run_decoders(2000)
    assert set(counts) >= {
        "envelope",
        "signed_messages",
        "pipeline_call",
        "pipeline_result",
        "pipeline_frames",
        "weights_codec",
        "averaging_frames",
    }
    for name, outcomes in counts.items():
        assert sum(outcomes.values()) == 2000
        assert set(outcomes) - {"accepted"}, f"{name}: nothing was refused"
    # Mutated payloads under a valid signature reach the message decoders, not only the signature check.
    assert counts["signed_messages"]["bad_signature"] == 0 and counts["signed_messages"]["bad_structure"] > 0


@pytest.mark.slow
def test_fuzz_every_decoder_100k():
    started = time.perf_counter()
    counts = run_decoders(100_000, seed=1)
    elapsed = time.perf_counter() - started
    print(f"\n{100_000 * len(counts):,} inputs ({len(counts)} decoders x 100,000) in {elapsed:.0f}s")
    for name, outcomes in counts.items():
        print(f"{name}: {dict(outcomes.most_common(8))}")
    assert all(sum(c.values()) == 100_000 for c in counts.values())


@pytest.mark.parametrize("field", ["dtype", "mode"])
def test_weights_with_an_unhashable_dtype_or_mode_are_refused_not_raised(field):
    """Found by the structural mutations: a map where the codec expects a dtype name raised TypeError,
    which no exchange handler caught (a partner could have crashed the averaging service)."""
    from node.weights.codec import CODEC_VERSION

    entry = {"name": "w", "dtype": "float32", "shape": [1], "data": b"\0" * 4, "scale": None}
    message = {"v": CODEC_VERSION, "mode": "fp32", "tensors": [entry]}
    (entry if field == "dtype" else message)[field] = {"a": 1}
    with pytest.raises(CodecError):
        EncodedWeights.from_bytes(msgpack.packb(message))
