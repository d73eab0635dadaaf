"""The wire protocol of swarm-node: every message, its version, envelope, signing and validation.

Torch-free and independent of `node/`: peers written in anything can implement it.
"""

from protocol.envelope import Envelope, ReplayGuard, decode_message, encode_message
from protocol.identity import NodeIdentity, node_id_from_public_key, verify_signature
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    MESSAGE_TYPES,
    AveragingReady,
    Message,
    MessageKind,
    PeerStats,
    RolloutBatch,
    RolloutCompletion,
    RolloutQuestion,
    StageAnnouncement,
    StageLost,
)
from protocol.refusals import ProtocolRejection, Refusal, RefusalCounter
from protocol.specs import SpecError, TaskSpec
from protocol.version import PROTOCOL_MAJOR, PROTOCOL_MINOR, PROTOCOL_VERSION

__all__ = [
    "DEFAULT_LIMITS",
    "MESSAGE_TYPES",
    "AveragingReady",
    "PROTOCOL_MAJOR",
    "PROTOCOL_MINOR",
    "PROTOCOL_VERSION",
    "Envelope",
    "Limits",
    "Message",
    "MessageKind",
    "NodeIdentity",
    "PeerStats",
    "ProtocolRejection",
    "Refusal",
    "RefusalCounter",
    "ReplayGuard",
    "RolloutBatch",
    "RolloutCompletion",
    "RolloutQuestion",
    "SpecError",
    "StageAnnouncement",
    "StageLost",
    "TaskSpec",
    "decode_message",
    "encode_message",
    "node_id_from_public_key",
    "verify_signature",
]
