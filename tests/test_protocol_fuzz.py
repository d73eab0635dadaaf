"""Fuzzing the decoder: whatever arrives, `decode_message` returns an Envelope or raises
ProtocolRejection, never anything else; and every valid message survives a round trip."""

from __future__ import annotations

import dataclasses
import math

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    Envelope,
    MessageKind,
    PeerStats,
    ProtocolRejection,
    RolloutBatch,
    RolloutCompletion,
    RolloutQuestion,
    TaskSpec,
    decode_message,
    encode_message,
)
from protocol.envelope import SIGNING_CONTEXT
from protocol.messages import MAX_AHEAD_WAIT_S, MAX_CARRIED, MAX_SAMPLER_IDLE_S, MAX_VERSIONS_BEHIND
from test_protocol import IDENTITY, SWARM, T0, encode, make_batch, make_stats, signed

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
VALID = {"batch": encode(make_batch()), "stats": encode(make_stats(), seq=2)}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)


def decodes_or_refuses(data: bytes) -> Envelope | None:
    try:
        return decode_message(data, swarm_id=SWARM, now=T0)
    except ProtocolRejection:
        return None


@FUZZ
@given(st.binary(max_size=2000))
def test_arbitrary_bytes(data):
    decodes_or_refuses(data)


def test_every_truncation():
    for data in VALID.values():
        for length in range(len(data)):
            assert decodes_or_refuses(data[:length]) is None


@FUZZ
@given(st.sampled_from(sorted(VALID)), st.data())
def test_single_byte_mutations(name, draw):
    data = bytearray(VALID[name])
    position = draw.draw(st.integers(0, len(data) - 1))
    data[position] = draw.draw(st.integers(0, 255).filter(lambda b: b != data[position]))
    assert decodes_or_refuses(bytes(data)) is None  # the signature covers every byte that matters


@FUZZ
@given(st.sampled_from(list(MessageKind)), msgpack_values)
def test_arbitrary_payload_in_a_signed_envelope(kind, payload):
    decodes_or_refuses(signed(payload, kind=kind.value))


@FUZZ
@given(st.sampled_from(list(MessageKind)), st.data(), msgpack_values)
def test_one_field_replaced_in_a_signed_envelope(kind, draw, junk):
    """Replace one field anywhere in a valid payload, so the junk reaches deep validators."""
    payload = (make_batch() if kind is MessageKind.ROLLOUT_BATCH else make_stats()).to_wire()
    container = payload
    while True:
        key = draw.draw(
            st.sampled_from(sorted(container)) if isinstance(container, dict) else st.integers(0, len(container) - 1)
        )
        if not isinstance(container[key], (dict, list)) or not container[key] or draw.draw(st.booleans()):
            break
        container = container[key]
    container[key] = junk
    envelope = decodes_or_refuses(signed(payload, kind=kind.value))
    assert envelope is None or envelope.message.to_wire() == payload


@FUZZ
@given(st.lists(msgpack_values, max_size=9))
def test_arbitrary_body_in_a_signed_frame(body):
    raw = msgpack.packb(body)
    decodes_or_refuses(msgpack.packb([raw, IDENTITY.sign(SIGNING_CONTEXT + raw)]))


finite = st.floats(allow_nan=False, allow_infinity=False)
short_text = st.text(max_size=30)
completions = st.builds(
    lambda text, ids, with_logprobs, reason: RolloutCompletion(
        text, ids, [-abs(float(i)) / 7 for i in ids] if with_logprobs else None, reason
    ),
    short_text,
    st.lists(st.integers(0, 2**31 - 1), max_size=20),
    st.booleans(),
    st.sampled_from(["stop", "length"]),
)
questions = st.builds(
    lambda spec, done, rewards: RolloutQuestion(spec, done, [rewards[i % len(rewards)] for i in range(len(done))]),
    st.builds(
        TaskSpec,
        st.text(min_size=1, max_size=20),
        st.dictionaries(st.text(max_size=5), st.integers(-5, 5), max_size=3),
        st.integers(0, 2**62 - 1),
        st.integers(0, 2**62 - 1),
    ),
    st.lists(completions, min_size=1, max_size=4),
    st.lists(finite, min_size=1, max_size=4),
)
batches = st.builds(
    RolloutBatch,
    st.integers(0, 2**63 - 1),
    st.integers(0, 2**63 - 1),
    st.text(max_size=64),
    st.lists(questions, max_size=3),
)
# the overlap fields (minor 10, sampler_idle_s 11): each pair set or nil, the mean never above the max
overlaps = st.fixed_dictionaries(
    {},
    optional={
        "staleness": st.tuples(st.integers(0, MAX_VERSIONS_BEHIND), st.floats(0, 1)),
        "carried": st.tuples(st.integers(0, MAX_CARRIED), st.integers(0, MAX_CARRIED)),
        "ahead_wait_s": st.floats(0, MAX_AHEAD_WAIT_S),
        "sampler_idle_s": st.floats(0, MAX_SAMPLER_IDLE_S),
    },
).map(
    lambda o: {
        **(
            {"staleness_max": o["staleness"][0], "staleness_mean": o["staleness"][0] * o["staleness"][1]}
            if "staleness" in o
            else {}
        ),
        **({"carried_in": o["carried"][0], "carried_out": o["carried"][1]} if "carried" in o else {}),
        **({"ahead_wait_s": o["ahead_wait_s"]} if "ahead_wait_s" in o else {}),
        **({"sampler_idle_s": o["sampler_idle_s"]} if "sampler_idle_s" in o else {}),
    }
)
stats = st.builds(
    lambda count, rate, unit, text, addresses, overlap: dataclasses.replace(
        PeerStats(
            IDENTITY.node_id,
            text,
            text,
            "1.0",
            text,
            count,
            count,
            count,
            -rate,
            unit,
            count,
            count,
            count,
            count,
            rate,
            rate,
            rate,
            addresses,
            addresses[:2],
            count,
            count,
        ),
        **overlap,
    ),
    st.integers(0, 2**63 - 1),
    finite.map(abs),
    st.floats(0, 1),
    short_text,
    st.lists(short_text, max_size=16),
    overlaps,
)


@FUZZ
@given(batches | stats, st.integers(0, 2**63 - 1))
def test_valid_messages_round_trip(message, seq):
    envelope = decode_message(encode(message, seq=seq), swarm_id=SWARM, now=T0)
    assert envelope.message == message and envelope.seq == seq


@FUZZ
@given(
    st.sampled_from(["staleness_mean", "staleness_max", "carried_in", "carried_out", "ahead_wait_s", "sampler_idle_s"]),
    st.booleans(),
    msgpack_values,
)
def test_an_overlap_field_decodes_in_its_bounds_or_is_refused(field, overlapping, junk):
    base = make_stats(
        staleness_mean=0.5, staleness_max=1, carried_in=2, carried_out=3, ahead_wait_s=0.25, sampler_idle_s=0.75
    )
    envelope = decodes_or_refuses(
        signed({**(base if overlapping else make_stats()).to_wire(), field: junk}, kind="peer_stats")
    )
    if envelope is None:
        return
    stats = envelope.message
    assert (
        stats.staleness_max is None
        or type(stats.staleness_max) is int
        and 0 <= stats.staleness_max <= MAX_VERSIONS_BEHIND
    )
    assert (stats.staleness_mean is None) == (stats.staleness_max is None)
    assert (
        stats.staleness_mean is None
        or math.isfinite(stats.staleness_mean)
        and 0 <= stats.staleness_mean <= stats.staleness_max
    )
    assert (stats.carried_in is None) == (stats.carried_out is None)
    for count in (stats.carried_in, stats.carried_out):
        assert count is None or type(count) is int and 0 <= count <= MAX_CARRIED
    wait = stats.ahead_wait_s
    assert wait is None or type(wait) is float and 0 <= wait <= MAX_AHEAD_WAIT_S
    idle = stats.sampler_idle_s
    assert idle is None or type(idle) is float and 0 <= idle <= MAX_SAMPLER_IDLE_S


def test_encode_message_is_deterministic():
    assert encode_message(make_batch(), identity=IDENTITY, swarm_id=SWARM, seq=1, timestamp=T0) == VALID["batch"]
