"""The signed, versioned envelope every message travels in, and the receiver's guards.

Layout (msgpack, all arrays, so that field order is the format):

    frame = [body: bin, signature: bin(64)]
    body  = [[major, minor], kind: str, swarm_id: str, sender: bin(32), seq: int,
             timestamp: float, payload: map, ...fields appended by later minors]

`signature` is Ed25519 by `sender` over SIGNING_CONTEXT + body, where body is the exact
byte string carried in the frame. Signing opaque bytes, rather than re-encoding decoded
fields, means no canonical encoding has to be agreed on between implementations: the
receiver verifies the bytes it got, then decodes them. The context prefix keeps these
signatures from being valid for anything else the same key might sign. The frame itself
must be the canonical packing of [body, signature] (shortest headers, as every common
msgpack encoder writes them; checked by re-packing), so one message has exactly one byte
string and `sha256(data)` can serve as its id.

The only thing fixed across majors is the frame and body[0] = [major, minor], so any
version can at least tell which version it was sent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, node_id_from_public_key, verify_signature
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import MESSAGE_TYPES, Message, MessageKind
from protocol.refusals import ProtocolRejection, Refusal
from protocol.validation import check_bytes, check_float, check_int, check_str, reject
from protocol.version import PROTOCOL_MAJOR, PROTOCOL_MINOR
from protocol.bounded import BoundedDict

SIGNING_CONTEXT = b"swarm-node/envelope\x00"
MAX_SWARM_ID_CHARS = 64
BODY_FIELDS = 7  # version, kind, swarm_id, sender, seq, timestamp, payload
_KINDS = frozenset(kind.value for kind in MessageKind)


@dataclass(frozen=True)
class Envelope:
    """A decoded, authenticated message and who sent it when."""

    version: tuple[int, int]  # the sender's (major, minor)
    kind: MessageKind  # which message class `message` is
    swarm_id: str  # the swarm it was sent to (equals the receiver's)
    sender: bytes  # the sender's raw Ed25519 public key, which signed it
    sender_id: str  # node id derived from `sender`
    seq: int  # the sender's sequence number for this kind
    timestamp: float  # unix seconds when the sender signed it
    message: Message  # the validated payload


def encode_message(
    message: Message,
    *,
    identity: NodeIdentity,
    swarm_id: str,
    seq: int,
    timestamp: float | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """Sign and encode `message`. Raises ProtocolRejection for anything a receiver with the
    same `limits` would refuse (checked with the receiver's own validators), including a
    result larger than `limits.max_message_bytes`: never silently truncated or dropped."""
    kind = getattr(type(message), "KIND", None)
    if MESSAGE_TYPES.get(kind) is not type(message):
        raise TypeError(f"{type(message).__name__} is not a protocol message")
    payload = message.to_wire()
    type(message).from_wire(payload, limits)
    check_str(swarm_id, "swarm_id", MAX_SWARM_ID_CHARS)
    check_int(seq, "seq")
    timestamp = check_float(float(time.time() if timestamp is None else timestamp), "timestamp", lo=0.0)
    body = _pack(
        [[PROTOCOL_MAJOR, PROTOCOL_MINOR], kind.value, swarm_id, identity.public_key_bytes, seq, timestamp, payload]
    )
    data = _pack([body, identity.sign(SIGNING_CONTEXT + body)])
    if len(data) > limits.max_message_bytes:
        reject(Refusal.TOO_LARGE, f"{kind.value} encodes to {len(data)} bytes, limit {limits.max_message_bytes}")
    return data


def decode_message(
    data: bytes,
    *,
    swarm_id: str,
    limits: Limits = DEFAULT_LIMITS,
    now: float | None = None,
    expected_sender: bytes | None = None,
) -> Envelope:
    """Decode and authenticate `data`; raises ProtocolRejection and nothing else.

    Cheap checks come first and the payload's own validation last, so garbage costs
    little: size, msgpack, frame and header structure, version, kind, swarm, signature,
    expected sender, clock skew, payload, and finally the payload's claimed node id.
    Replays are the caller's to check, with a ReplayGuard, after this succeeds.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        reject(Refusal.NOT_MSGPACK, f"expected bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > limits.max_message_bytes:
        reject(Refusal.TOO_LARGE, f"{len(data)} bytes, limit {limits.max_message_bytes}")
    frame = _unpack(data, limits)
    if type(frame) is not list or len(frame) != 2 or type(frame[0]) is not bytes:
        reject(Refusal.BAD_STRUCTURE, "a frame is [body bytes, signature]")
    body_bytes, signature = frame
    check_bytes(signature, "signature", SIGNATURE_BYTES)
    if _pack(frame) != data:
        reject(Refusal.BAD_STRUCTURE, "the frame is not canonically packed")

    body = _unpack(body_bytes, limits)
    if type(body) is not list or not body or type(body[0]) is not list or len(body[0]) != 2:
        reject(Refusal.BAD_STRUCTURE, "an envelope body is an array starting with [major, minor]")
    major, minor = check_int(body[0][0], "major"), check_int(body[0][1], "minor")
    if major != PROTOCOL_MAJOR:
        reject(Refusal.UNKNOWN_VERSION, f"protocol {major}.{minor}, this node speaks {PROTOCOL_MAJOR}.x")
    if len(body) < BODY_FIELDS or (len(body) > BODY_FIELDS and minor <= PROTOCOL_MINOR):
        reject(
            Refusal.BAD_STRUCTURE,
            f"an envelope body of version {major}.{minor} has {BODY_FIELDS} fields, got {len(body)}",
        )
    _, kind, sent_swarm, sender, seq, timestamp, payload = body[:BODY_FIELDS]
    if check_str(kind, "kind", limits.max_name_chars) not in _KINDS:
        reject(Refusal.UNKNOWN_KIND, f"kind {kind!r}")
    if check_str(sent_swarm, "swarm_id", MAX_SWARM_ID_CHARS) != swarm_id:
        reject(Refusal.WRONG_SWARM, f"sent to swarm {sent_swarm!r}, this is {swarm_id!r}")
    check_bytes(sender, "sender", PUBLIC_KEY_BYTES)
    check_int(seq, "seq")
    check_float(timestamp, "timestamp", lo=0.0)

    sender_id = node_id_from_public_key(sender)
    if not verify_signature(sender, signature, SIGNING_CONTEXT + body_bytes):
        reject(Refusal.BAD_SIGNATURE, f"claimed sender {sender_id}")
    if expected_sender is not None and sender != expected_sender:
        reject(Refusal.SENDER_MISMATCH, f"signed by {sender_id}, expected {_node_id_or_hex(expected_sender)}")
    now = time.time() if now is None else now
    if abs(timestamp - now) > limits.max_clock_skew_s:
        reject(Refusal.STALE, f"timestamp is {timestamp - now:+.0f} s from now, limit ±{limits.max_clock_skew_s:.0f} s")

    message = MESSAGE_TYPES[MessageKind(kind)].from_wire(payload, limits, minor=minor)
    claimed = message.claimed_node_id()
    if claimed is not None and claimed != sender_id:
        reject(Refusal.SENDER_MISMATCH, f"message claims node {claimed}, signed by {sender_id}")
    return Envelope(
        version=(major, minor),
        kind=MessageKind(kind),
        swarm_id=sent_swarm,
        sender=sender,
        sender_id=sender_id,
        seq=seq,
        timestamp=timestamp,
        message=message,
    )


class ReplayGuard:
    """Refuses a message whose seq is not above the highest seen from its sender and kind.

    Feed it only envelopes that `decode_message` accepted, or a forger could advance a
    victim's counter. Senders must therefore use a seq that increases per kind and
    survives restarts (e.g. microseconds since the epoch). It remembers the `max_senders`
    most recently active (sender, kind) pairs; one forgotten could be replayed only
    within the clock-skew window, which `decode_message` enforces.
    """

    def __init__(self, max_senders: int = 4096) -> None:
        self.max_senders = max_senders
        self._highest: BoundedDict[tuple[bytes, MessageKind], int] = BoundedDict(max_senders)

    def check_and_record(self, envelope: Envelope) -> None:
        key = (envelope.sender, envelope.kind)
        highest = self._highest.get(key)
        if highest is not None and envelope.seq <= highest:
            reject(
                Refusal.REPLAY,
                f"{envelope.kind.value} seq {envelope.seq} from {envelope.sender_id}, already saw {highest}",
            )
        self._highest[key] = envelope.seq


def _pack(obj: Any) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:  # e.g. a spec config with an int beyond 64 bits
        reject(Refusal.BAD_VALUE, f"not encodable as msgpack: {exc}")


def _unpack(data: bytes, limits: Limits) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_refuse_ext,
            object_pairs_hook=_unique_keys,
            **limits.msgpack_limits(),
        )
    except ProtocolRejection:
        raise
    except (ValueError, msgpack.UnpackException) as exc:  # FormatError, StackError, ExtraData, bad UTF-8, caps
        text = str(exc)
        reason = (
            Refusal.STRING_TOO_LONG
            if "max_str_len" in text
            else Refusal.TOO_MANY_ITEMS
            if "max_array_len" in text or "max_map_len" in text
            else Refusal.NOT_MSGPACK
        )
        reject(reason, text or type(exc).__name__)


def _refuse_ext(code: int, data: bytes) -> Any:
    reject(Refusal.BAD_STRUCTURE, f"msgpack ext type {code} is not used by this protocol")


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """Maps with a repeated key are refused: implementations disagree on which value wins."""
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        reject(Refusal.BAD_STRUCTURE, "a map repeats a key")
    return mapping


def _node_id_or_hex(public_key: bytes) -> str:
    try:
        return node_id_from_public_key(public_key)
    except ValueError:
        return public_key.hex() if isinstance(public_key, bytes) else repr(public_key)
