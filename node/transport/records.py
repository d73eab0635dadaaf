"""What a swarm node's DHT accepts: only subkeyed, signed, owned, bounded records (hivemind's validator hook).

hivemind checks every record with the `RecordValidatorBase` chain given to `DHTNode.create`
when another peer asks to store it, when a peer returns it to a lookup, and when the node
stores its own (hivemind/dht/protocol.py `rpc_store`, `call_find`; node.py `store_many`).
A record that fails is never stored and never returned to the application, so it cannot
reach hivemind's own decoding (where one undecodable subkey used to fail the whole read
and leave an unretrieved task exception) nor replace a dictionary (a plain value with a
long expiration used to win over every subkey). The rule holds for every record on the
node's DHT, because hivemind hands validators the hashed key id, not the key: the swarm's
DHT carries nothing but our records.

A record is valid iff:
1. it has a subkey (a plain, subkey-less value is refused), and the subkey is a node id;
2. its value is a msgpack `bin` holding one of our signed envelopes (protocol/), of this
   swarm, within the receiver's size limits, with a valid signature;
3. the envelope's signer is the subkey: a peer can write only its own subkeys;
4. its expiration is at most `MAX_RECORD_TTL_S[kind]` (+ a little clock slack) after the
   envelope's signed timestamp: a replayed old envelope cannot be stored to live longer
   than its owner meant it to, so the owner's newer record (later timestamp, later
   expiration) always wins hivemind's "latest expiration wins" rule.
Refusals are counted by reason and by claimed owner (`RecordRefusals`, bounded) and shown
in `swarm.json`, `stats` and `/metrics`; logging is rate-limited.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import msgpack

from node.transport.protobuf_shim import import_hivemind_isolated

import_hivemind_isolated()

from hivemind.dht.validation import DHTRecord, RecordValidatorBase  # noqa: E402

from protocol import DEFAULT_LIMITS, Limits, MessageKind, ProtocolRejection, Refusal, decode_message, encode_message  # noqa: E402
from protocol.messages import NODE_ID_PATTERN  # noqa: E402

from node.stats import RecordRefusals  # noqa: E402

log = logging.getLogger(__name__)

# Longest a record of each kind may live past its signed timestamp. Senders store for less
# (heartbeat_ttl_s, max_batch_age_s, announce_ttl_s, the averaging timeout); these bounds are
# the receivers' policy, generous enough for any sane config.
MAX_RECORD_TTL_S: dict[MessageKind, float] = {
    MessageKind.PEER_STATS: 600.0,
    MessageKind.ROLLOUT_BATCH: 1800.0,
    MessageKind.STAGE_ANNOUNCEMENT: 600.0,
    MessageKind.AVERAGING_READY: 1800.0,
}
EXPIRATION_SLACK_S = 30.0  # clocks of honest peers differ by a little


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(self, swarm_id: str, limits: Limits = DEFAULT_LIMITS, refusals: RecordRefusals | None = None, clock: Callable[[], float] = time.time) -> None:
        self.swarm_id = swarm_id
        self.limits = limits
        self.refusals = refusals if refusals is not None else RecordRefusals()
        self.clock = clock

    def validate(self, record: DHTRecord) -> bool:
        reason, owner, detail = self.check(record)
        if reason is None:
            return True
        self.refusals.record(owner, reason, detail)
        return False

    def check(self, record: DHTRecord) -> tuple[str | None, str, str]:
        """(refusal reason or None, claimed owner, detail)."""
        try:
            subkey = msgpack.unpackb(record.subkey, raw=False, max_str_len=256, max_bin_len=256, max_array_len=4, max_map_len=4)
        except (ValueError, msgpack.ExtraData):
            return "bad_subkey", "?", "the subkey is not msgpack"
        if subkey is None:
            return "no_subkey", "?", "a value without a subkey would replace every subkey of the key"
        if not isinstance(subkey, str) or not NODE_ID_PATTERN.fullmatch(subkey):
            return "bad_subkey", str(subkey)[:64], "the subkey is not a node id"
        if len(record.value) > self.limits.max_message_bytes + 16:
            return Refusal.TOO_LARGE.value, subkey, f"{len(record.value)} bytes"
        try:
            value = msgpack.unpackb(record.value, raw=False, max_bin_len=self.limits.max_message_bytes, max_str_len=0, max_array_len=0, max_map_len=0)
        except (ValueError, msgpack.ExtraData):
            return Refusal.NOT_MSGPACK.value, subkey, "the value is not one msgpack bin"
        if not isinstance(value, bytes):
            return Refusal.BAD_STRUCTURE.value, subkey, f"the value is {type(value).__name__}, not a signed envelope"
        try:
            envelope = decode_message(value, swarm_id=self.swarm_id, limits=self.limits, now=self.clock())
        except ProtocolRejection as exc:
            return exc.reason.value, subkey, exc.detail
        if envelope.sender_id != subkey:
            return Refusal.SENDER_MISMATCH.value, subkey, f"signed by {envelope.sender_id[:12]}"
        longest = MAX_RECORD_TTL_S.get(envelope.kind)
        if longest is None:
            return Refusal.UNKNOWN_KIND.value, subkey, f"{envelope.kind.value} is not stored in the DHT"
        if record.expiration_time > envelope.timestamp + longest + EXPIRATION_SLACK_S:
            return "expiration_too_late", subkey, f"expires {record.expiration_time - envelope.timestamp:.0f}s after it was signed, limit {longest:.0f}s"
        return None, subkey, ""


class RecordWriter:
    """Signs this node's records and stores them under its own subkey (node id), with a sequence number
    that increases across restarts (microseconds since the epoch), so peers' replay checks accept a node that came back."""

    def __init__(self, identity, swarm_id: str) -> None:
        self.identity = identity
        self.swarm_id = swarm_id
        self._seq = 0

    def encode(self, message) -> bytes:
        self._seq = max(self._seq + 1, int(time.time() * 1e6))
        return encode_message(message, identity=self.identity, swarm_id=self.swarm_id, seq=self._seq, timestamp=time.time())

    async def store(self, dht, key: str, message, ttl: float, timeout: float, data: bytes | None = None) -> bool:
        """Store `message` (or its already-encoded `data`) under `key`; False when the DHT did not take it in time."""
        from node.transport.dht import store_value
        from hivemind.utils import get_dht_time

        return await store_value(dht, key, data if data is not None else self.encode(message), get_dht_time() + ttl, self.identity.node_id, timeout)


async def read_records(dht, key: str, swarm_id: str, kind: MessageKind, timeout: float, limit: int, on_refusal: Callable[[str, ProtocolRejection], None] | None = None) -> list:
    """Verified envelopes of `kind` stored under `key` (each signed by the node id it is stored under).

    The DHT's validator already refused what is malformed; this second check also holds
    when a value comes from a DHT node that runs without it (a test's plain DHTNode)."""
    from node.transport.dht import decode_verified, read_key

    now = time.time()
    envelopes = []
    for subkey, raw in await read_key(dht, key, timeout, limit=limit):
        try:
            envelopes.append(decode_verified(raw, subkey, swarm_id, kind, now))
        except ProtocolRejection as exc:
            if on_refusal is not None:
                on_refusal(str(subkey)[:64], exc)
    return envelopes
