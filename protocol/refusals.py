"""Why a message is refused: one enum whose every code carries a sentence for humans.

Decoding raises only `ProtocolRejection`, so a node can count refusals per peer and
reason (`RefusalCounter`) and show the sentence in its dashboard instead of a traceback.
"""

from __future__ import annotations

import enum
from collections import Counter

from protocol.bounded import BoundedDict


class SentencedEnum(str, enum.Enum):
    """Short codes for logs and counters, each with a sentence for humans (`.value` is the code).

    The base of every "why was this refused" enum in the project, so that each reads the same.
    """

    sentence: str

    def __new__(cls, code: str, sentence: str) -> "SentencedEnum":
        member = str.__new__(cls, code)
        member._value_ = code
        member.sentence = sentence
        return member


class Refusal(SentencedEnum):
    """A refusal reason; `.value` is the short wire/log code, `.sentence` explains it."""

    TOO_LARGE = ("too_large", "The message is larger than the receiver's size limit.")
    NOT_MSGPACK = ("not_msgpack", "The bytes are not one complete, well-formed msgpack value.")
    BAD_STRUCTURE = ("bad_structure", "A field has the wrong type, or a field is missing or unexpected.")
    UNKNOWN_VERSION = ("unknown_version", "The message uses a protocol major version this node does not speak.")
    UNKNOWN_KIND = ("unknown_kind", "The message kind is not one this node knows.")
    WRONG_SWARM = ("wrong_swarm", "The message belongs to another swarm.")
    BAD_SIGNATURE = ("bad_signature", "The signature does not match the sender's key and the signed bytes.")
    SENDER_MISMATCH = ("sender_mismatch", "The signing key is not the one the message claims or the receiver expected.")
    REPLAY = (
        "replay",
        "A message this node may have used already: its sequence number is not above what it remembers of the sender.",
    )
    STALE = (
        "stale",
        "The message is too old (or too far in the future), or refers to a round or policy that is too old.",
    )
    TOO_MANY_ITEMS = ("too_many_items", "A list in the message has more items than the receiver allows.")
    STRING_TOO_LONG = ("string_too_long", "A string in the message is longer than the receiver allows.")
    BAD_VALUE = ("bad_value", "A value is out of range: a non-finite float, a negative count, an unknown option.")
    BAD_SPEC = ("bad_spec", "A task spec is malformed or out of bounds.")
    UNSCORABLE = (
        "unscorable",
        "A task spec is well-formed but the receiver cannot materialize and score its question.",
    )
    WRONG_SHARD = (
        "wrong_shard",
        "The record is stored under a DHT shard its signer does not belong to (protocol/shards.py).",
    )


class ProtocolRejection(Exception):
    """A message refused for `reason`; `detail` names the field or the number that failed."""

    def __init__(self, reason: Refusal, detail: str = "") -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value

    def __reduce__(self):  # keeps the exception picklable across process boundaries
        return (type(self), (self.reason, self.detail))


class RefusalCounter:
    """Counts refusals per peer and reason, for stats and for deciding whom to distrust.

    Totals per reason are exact; per-peer counts keep the `max_peers` most recently
    refused peers, so a flood from throwaway identities cannot grow memory without bound.
    """

    def __init__(self, max_peers: int = 1024) -> None:
        self.max_peers = max_peers
        self._totals: Counter[Refusal] = Counter()
        self._peers: BoundedDict[str, Counter[Refusal]] = BoundedDict(max_peers)

    def record(self, peer_id: str, rejection: ProtocolRejection | Refusal) -> None:
        reason = rejection.reason if isinstance(rejection, ProtocolRejection) else rejection
        self._totals[reason] += 1
        counts = self._peers.get(peer_id) or Counter()
        counts[reason] += 1
        self._peers[peer_id] = counts

    def by_reason(self) -> dict[str, int]:
        return {reason.value: n for reason, n in self._totals.items()}

    def by_peer(self) -> dict[str, dict[str, int]]:
        return {peer: {reason.value: n for reason, n in counts.items()} for peer, counts in self._peers.items()}


class PipelineRefusal(SentencedEnum):
    """Why a stage server turned a pipeline call away (beyond the message checks of `Refusal`)."""

    WRONG_STAGE = ("wrong_stage", "The call is for a stage, or a stage fingerprint, this server does not serve.")
    NOT_READY = ("not_ready", "The server is still loading or recovering its stage.")
    MISSING_PART = ("missing_part", "The call asks for a part (embed, layers, head) this server does not hold.")
    BAD_TENSOR = ("bad_tensor", "An input tensor has the wrong name, dtype or shape, or values that are not finite.")
    UNKNOWN_CALL = (
        "unknown_call",
        "A backward for a forward this server does not hold (never made, already used, or expired).",
    )
    UNKNOWN_SESSION = ("unknown_session", "An inference step for a session this server does not hold.")
    BUSY = ("busy", "The server holds as many pending forwards or sessions as it allows.")
    FAILED = ("failed", "The server could not compute the call (its own error, logged there).")
    ONWARD_FAILED = (
        "onward_failed",
        "A later hop of a chained call failed, or its server is not among the stage announcements this server reads.",
    )
