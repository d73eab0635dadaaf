"""Signed protocol messages for tests: fixed identities and times, a valid batch and heartbeat, and an
envelope signed around any payload (to reach the checks after the signature)."""

from __future__ import annotations

from dataclasses import replace

import msgpack
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    Envelope,
    NodeIdentity,
    PeerStats,
    RolloutBatch,
    RolloutCompletion,
    RolloutQuestion,
    TaskSpec,
    decode_message,
    encode_message,
)
from protocol.envelope import SIGNING_CONTEXT

IDENTITY = NodeIdentity(Ed25519PrivateKey.from_private_bytes(bytes(range(32))))
OTHER = NodeIdentity(Ed25519PrivateKey.from_private_bytes(bytes(32)))
SWARM = "test-swarm"
T0 = 1_700_000_000.5


def make_batch(**overrides) -> RolloutBatch:
    question = RolloutQuestion(
        spec=TaskSpec("basic_arithmetic", {"min_terms": 2}, 7, 1),
        completions=[
            RolloutCompletion("4", [19, 2], [-0.5, -0.25], "stop"),
            RolloutCompletion("five", [20], None, "length"),
        ],
        claimed_rewards=[1.0, 0.0],
    )
    return replace(
        RolloutBatch(round=3, policy_version=2, model_fingerprint="tiny-qwen", questions=[question]), **overrides
    )


def make_stats(identity: NodeIdentity = IDENTITY, **overrides) -> PeerStats:
    stats = PeerStats(
        node_id=identity.node_id,
        display_name="alice",
        software_version="0.1.0",
        protocol_version="1.0",
        model_name="tiny",
        model_parameters=12345,
        round=3,
        policy_version=2,
        reward_mean=0.5,
        accuracy=0.25,
        rollouts_published=10,
        rollouts_received=20,
        rollouts_accepted=15,
        rollouts_rejected=5,
        tokens_per_s=123.5,
        uptime_s=60.0,
        last_seen=1_700_000_000.0,
        addresses=["/ip4/127.0.0.1/tcp/4001"],
        gossip_addresses=["/ip4/127.0.0.1/tcp/4002"],
        outer_steps=4,
        outer_steps_skipped=1,
        accuracy_by_dataset={"basic_arithmetic": 0.5, "chain_sum": 0.125},
        device="cuda:0 NVIDIA H100 80GB HBM3",
        rejoins=2,
        restarts=1,
    )
    return replace(stats, **overrides)


def encode(message, seq: int = 1, identity: NodeIdentity = IDENTITY, **kwargs) -> bytes:
    return encode_message(message, identity=identity, swarm_id=SWARM, seq=seq, timestamp=T0, **kwargs)


def decode(data: bytes, **kwargs) -> Envelope:
    kwargs.setdefault("swarm_id", SWARM)
    kwargs.setdefault("now", T0)
    return decode_message(data, **kwargs)


def signed(
    payload,
    *,
    version=(PROTOCOL_MAJOR, PROTOCOL_MINOR),
    kind="rollout_batch",
    swarm=SWARM,
    seq=1,
    timestamp=T0,
    extra=(),
    identity: NodeIdentity = IDENTITY,
    raw_payload: bytes | None = None,
) -> bytes:
    """A correctly signed envelope around anything (`raw_payload`: exact payload bytes), so
    that it reaches the checks after the signature."""
    header = [list(version), kind, swarm, identity.public_key_bytes, seq, timestamp]
    if raw_payload is None:
        body = msgpack.packb([*header, payload, *extra])
    else:  # a msgpack array is its length prefix followed by its items
        body = bytes([0x90 + len(header) + 1]) + b"".join(msgpack.packb(x) for x in header) + raw_payload
    return frame(body, identity.sign(SIGNING_CONTEXT + body))


def frame(body: bytes, signature: bytes) -> bytes:
    return msgpack.packb([body, signature])


def stats_message(identity: NodeIdentity, now: float) -> PeerStats:
    return PeerStats(
        node_id=identity.node_id,
        display_name="x",
        software_version="0",
        protocol_version="1.1",
        model_name="m",
        model_parameters=1,
        round=1,
        policy_version=1,
        reward_mean=0.0,
        accuracy=0.0,
        rollouts_published=0,
        rollouts_received=0,
        rollouts_accepted=0,
        rollouts_rejected=0,
        tokens_per_s=0.0,
        uptime_s=0.0,
        last_seen=now,
        addresses=[],
        gossip_addresses=[],
        outer_steps=0,
        outer_steps_skipped=0,
    )
