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
   swarm, within the receiver's size limits, with a valid signature, of a kind stored in
   the DHT, signed no later than the receiver's clock allows (`max_clock_skew_s`);
3. the envelope's signer is the subkey: a peer can write only its own subkeys;
4. it expires no later than `RECORD_TTL_S[kind]` after the envelope's signed timestamp.

Why rule 4 and exact lifetimes: the expiration is not signed, and hivemind keeps, per
subkey, the value that expires last. Every writer therefore stores a record to expire
exactly `RECORD_TTL_S[kind]` after the timestamp it signed (`RecordWriter`), so an owner's
newer record always expires after any replay of its older ones, whatever expiration the
replayer asks for: the newer one replaces it everywhere it is stored, and a replay stored
after it is refused by hivemind's storage. Readers decide what is live from the signed
timestamp and their own config (heartbeat_ttl_s, max_batch_age_s, announce_ttl_s), not
from the DHT's expiration. A replay under another key (e.g. a genuine heartbeat stored
under a rollouts key) is refused by the reader's kind check.

Rule 2 never depends on how old a record is, only on whether it was signed in the future:
a record valid when stored stays valid until it expires. This matters because hivemind
drops a whole dictionary returned by a peer when one of its subkeys fails validation; a
rule that turned stored records invalid with age would make honest records poison their
neighbours' reads.

What one key holds is bounded too (`BoundedKeyStorage`): a node's storage refuses a new subkey
once the key's values would pass MAX_KEY_BYTES, below p2pd's 4 MiB message. Without it a crowd of
identities ground to one rollout shard made the key's reply too large to send: every reader of
that key got nothing, and hivemind did not even say the read failed. With it the key stays
readable (the flood fills it and later writers of that shard and window are refused, "key_full"),
and a reader decodes at most its round's budget of it.

What all keys hold together is bounded as well (MAX_STORAGE_BYTES): keys cost a writer nothing, and each record lives
its lifetime, so throwaway identities storing under ever new keys would otherwise hold as much of this node's memory
as their rate times RECORD_TTL_S. The sum is kept as it grows and counted again, expired records gone, when it would
pass the bound (at most once a second: a count reads every record); past it a new record is refused, "storage_full".
The DHT node's cache (values its reads found, and those peers push to it: hivemind's `cache_nearest`) is the same
storage with a bound of its own (MAX_CACHE_BYTES); what does not fit is not cached, and costs nothing: our reads ask
the network for the latest values whatever the cache holds (node/transport/kv.py).

Refusals are counted by reason and by claimed owner, each distinct record once
(`RecordRefusals`, bounded) and shown in `swarm.json`, `stats` and `/metrics`; logging is
rate-limited.

For new record kinds (e.g. pipeline stage announcements): give the kind a lifetime in
RECORD_TTL_S, store with `RecordWriter(identity, swarm_id).store(dht, key, message, timeout)`
and read with `read_records(dht, key, swarm_id, kind, timeout, limit, on_refusal)`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, NamedTuple

import msgpack

from node.transport.protobuf_shim import import_hivemind_isolated

import_hivemind_isolated()

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue  # noqa: E402
from hivemind.dht.validation import DHTRecord, RecordValidatorBase  # noqa: E402

from protocol import (  # noqa: E402
    DEFAULT_LIMITS,
    Limits,
    Message,
    MessageKind,
    ProtocolRejection,
    Refusal,
    decode_message,
    encode_message,
)
from protocol.messages import NODE_ID_PATTERN  # noqa: E402

from node.stats import ClockOffsets, RecordRefusals, RefusedOnce  # noqa: E402

log = logging.getLogger(__name__)

# How long a record of each kind lives in the DHT after its signed timestamp: exactly this for
# every writer (see rule 4), at most this for every receiver. Longer than any sane sender's
# config (heartbeat_ttl_s, max_batch_age_s, announce_ttl_s, the averaging timeout) so that a
# live node's record never expires between two of its writes. A protocol constant: every node
# must agree on it (a node with a shorter one would refuse the others' records).
RECORD_TTL_S: dict[MessageKind, float] = {
    MessageKind.PEER_STATS: 300.0,
    MessageKind.ROLLOUT_BATCH: 300.0,
    MessageKind.STAGE_ANNOUNCEMENT: 120.0,
    MessageKind.AVERAGING_READY: 120.0,
    MessageKind.STAGE_LOST: 120.0,
}


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(
        self,
        swarm_id: str,
        limits: Limits = DEFAULT_LIMITS,
        refusals: RecordRefusals | None = None,
        clock: Callable[[], float] = time.time,
        clock_offsets: ClockOffsets | None = None,
    ) -> None:
        self.swarm_id = swarm_id
        self.limits = limits
        # decode without the "too old" half of the clock check (rule 2 must not change with age); the future half is
        # ours
        self._ageless = dataclasses.replace(limits, max_clock_skew_s=float("inf"))
        self.refusals = refusals if refusals is not None else RecordRefusals()
        self.clock = clock
        self.clock_offsets = clock_offsets  # told each verified record's signing time, a refused one's too

    def validate(self, record: DHTRecord) -> bool:
        reason, owner, detail = self.check(record)
        if reason is None:
            return True
        self.refusals.record(
            owner,
            reason,
            detail,
            record=(record.key, record.subkey, record.value, repr(record.expiration_time).encode()),
        )
        return False

    def check(self, record: DHTRecord) -> tuple[str | None, str, str]:
        """(refusal reason or None, claimed owner, detail)."""
        try:
            subkey = msgpack.unpackb(
                record.subkey, raw=False, max_str_len=256, max_bin_len=256, max_array_len=4, max_map_len=4
            )
        except (ValueError, msgpack.ExtraData):
            return "bad_subkey", "?", "the subkey is not msgpack"
        if subkey is None:
            return "no_subkey", "?", "a value without a subkey would replace every subkey of the key"
        if not isinstance(subkey, str) or not NODE_ID_PATTERN.fullmatch(subkey):
            return "bad_subkey", str(subkey)[:64], "the subkey is not a node id"
        if len(record.value) > self.limits.max_message_bytes + 16:
            return Refusal.TOO_LARGE.value, subkey, f"{len(record.value)} bytes"
        try:
            value = msgpack.unpackb(
                record.value,
                raw=False,
                max_bin_len=self.limits.max_message_bytes,
                max_str_len=0,
                max_array_len=0,
                max_map_len=0,
            )
        except (ValueError, msgpack.ExtraData):
            return Refusal.NOT_MSGPACK.value, subkey, "the value is not one msgpack bin"
        if not isinstance(value, bytes):
            return Refusal.BAD_STRUCTURE.value, subkey, f"the value is {type(value).__name__}, not a signed envelope"
        try:
            envelope = decode_message(value, swarm_id=self.swarm_id, limits=self._ageless)
        except ProtocolRejection as exc:
            return exc.reason.value, subkey, exc.detail
        if envelope.sender_id != subkey:
            return Refusal.SENDER_MISMATCH.value, subkey, f"signed by {envelope.sender_id[:12]}"
        if self.clock_offsets is not None:
            self.clock_offsets.observe(subkey, envelope.timestamp, self.clock())
        if envelope.timestamp > self.clock() + self.limits.max_clock_skew_s:
            return Refusal.STALE.value, subkey, f"signed {envelope.timestamp - self.clock():.0f}s in the future"
        lifetime = RECORD_TTL_S.get(envelope.kind)
        if lifetime is None:
            return Refusal.UNKNOWN_KIND.value, subkey, f"{envelope.kind.value} is not stored in the DHT"
        # the writer computed this very sum: no tolerance needed
        if record.expiration_time > envelope.timestamp + lifetime:
            return (
                "expiration_too_late",
                subkey,
                f"expires {record.expiration_time - envelope.timestamp:.0f}s after it was signed, limit "
                f"{lifetime:.0f}s",
            )
        return None, subkey, ""


# all subkeys of one key together: a reply must fit p2pd's 4 MiB message (persistentConnMaxMsgSize)
MAX_KEY_BYTES = 3 << 20
# All keys together. A node that held every rollout key of its swarm for their 300 s, each full, would hold 30 windows
# of 10 s x 3 MiB = 90 MiB a write level; honest swarms hold far less, as their keys spread over the DHT's nodes.
MAX_STORAGE_BYTES = 256 << 20
STORAGE_RECOUNT_S = 1.0  # the sum over every record is counted again at most this often
MAX_CACHE_BYTES = 32 << 20  # the DHT node's cache of values found: what a round's reads need is a few keys


def value_bytes(value) -> int:
    """The bytes a stored value holds: a plain value's, or all of a dictionary's subkeys' values."""
    if isinstance(value, DictionaryDHTValue):
        return sum(len(item.value) for _, item in value.items())
    return len(value)


class BoundedKeyStorage(DHTLocalStorage):
    """hivemind's local record storage, refusing a new subkey (or a larger value for an existing one) that
    would take its key past `max_key_bytes`, so that every key this node serves fits in one reply, or every key
    together past `max_bytes`."""

    def __init__(
        self,
        refusals: RecordRefusals,
        max_key_bytes: int = MAX_KEY_BYTES,
        max_bytes: int = MAX_STORAGE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.refusals = refusals
        self.max_key_bytes = max_key_bytes
        self.max_bytes = max_bytes
        self.clock = clock
        # the values' bytes stored, less those replaced: at least what is held (an expired record stays in it until
        # the next count)
        self.held_bytes = 0
        self._counted_at = -float("inf")

    def count_held_bytes(self) -> int:
        """The bytes of every value held now, expired ones gone (reads every record)."""
        self.held_bytes = sum(value_bytes(held.value) for _, held in self.items())
        self._counted_at = self.clock()
        return self.held_bytes

    def clear(self) -> None:
        super().clear()
        self.held_bytes = 0

    def store(self, key, value, expiration_time: float, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        held = self.get(key)
        growth = value_bytes(value) - (value_bytes(held.value) if held is not None else 0)
        if not self._room_for(growth):
            self._refuse(key, "", value, "storage_full", self._full_detail(growth))
            return False
        stored = super().store(key, value, expiration_time)
        if stored:
            self.held_bytes += growth
        return stored

    def store_subkey(self, key, subkey, value: bytes, expiration_time: float) -> bool:
        held = self.get(key)
        replaced = None
        if held is not None and isinstance(held.value, DictionaryDHTValue):
            replaced = held.value.get(subkey)
            size = (
                sum(len(item.value) for _, item in held.value.items())
                - (len(replaced.value) if replaced is not None else 0)
                + len(value)
            )
            if size > self.max_key_bytes:
                self._refuse(
                    key, subkey, value, "key_full", f"the key would hold {size} bytes, limit {self.max_key_bytes}"
                )
                return False
        growth = len(value) - (len(replaced.value) if replaced is not None else 0)
        if not self._room_for(growth):
            self._refuse(key, subkey, value, "storage_full", self._full_detail(growth))
            return False
        stored = super().store_subkey(key, subkey, value, expiration_time)
        if stored:
            self.held_bytes += growth
        return stored

    def _room_for(self, growth: int) -> bool:
        if growth <= 0 or self.held_bytes + growth <= self.max_bytes:
            return True
        if self.clock() - self._counted_at < STORAGE_RECOUNT_S:
            return False
        return self.count_held_bytes() + growth <= self.max_bytes

    def _full_detail(self, growth: int) -> str:
        return f"the node would hold {self.held_bytes + growth} bytes of records, limit {self.max_bytes}"

    def _refuse(self, key, subkey, value: bytes, reason: str, detail: str) -> None:
        self.refusals.record(str(subkey)[:64], reason, detail, record=(key.to_bytes(), repr(subkey).encode(), value))


def bound_key_storage(dht, refusals: RecordRefusals | None = None) -> None:
    """Give a freshly created DHTNode a BoundedKeyStorage for its storage and another for its cache (hivemind takes
    no storage argument), keeping what they held while joining."""
    dht.protocol.storage = _bounded_copy(
        dht.protocol.storage, BoundedKeyStorage(refusals if refusals is not None else RecordRefusals())
    )
    # what is not cached is asked of the network again, so nobody is told: its refusals are counted nowhere
    dht.protocol.cache = _bounded_copy(
        dht.protocol.cache, BoundedKeyStorage(RecordRefusals(), max_bytes=MAX_CACHE_BYTES)
    )


def _bounded_copy(storage: DHTLocalStorage, bounded: BoundedKeyStorage) -> BoundedKeyStorage:
    for key, (value, expiration) in storage.items():
        if isinstance(value, DictionaryDHTValue):
            for subkey, (item, item_expiration) in value.items():
                bounded.store_subkey(key, subkey, item, item_expiration)
        else:
            bounded.store(key, value, expiration)
    return bounded


def clear_dht_cache(dht) -> int:
    """Empty the DHT node's local cache of the values its reads found, and return their bytes. Our reads ask for the
    latest values (node/transport/kv.py), which hivemind looks up on the network whatever its cache holds, so nothing
    is lost but memory: rollout keys of up to MAX_KEY_BYTES each, kept until they expire (RECORD_TTL_S)."""
    cache = dht.protocol.cache
    held = sum(value_bytes(value) for _, (value, _) in cache.items())
    cache.clear()
    return held


class SignedRecord(NamedTuple):
    """An encoded envelope and the DHT expiration it must be stored with (rule 4)."""

    data: bytes
    expiration: float


class RecordWriter:
    """Signs this node's records and stores them under its own subkey (node id), to expire exactly
    RECORD_TTL_S[kind] after they were signed (rule 4), with a sequence number that increases across
    restarts (microseconds since the epoch), so peers' replay checks accept a node that came back.

    One line to publish a signed record under any key: `await writer.store(dht, key, message, timeout)`."""

    def __init__(self, identity, swarm_id: str) -> None:
        self.identity = identity
        self.swarm_id = swarm_id
        self._seq = 0

    @property
    def last_seq(self) -> int:
        """The sequence number of the last record signed (0: none yet); every later record's is higher."""
        return self._seq

    def sign(self, message: Message) -> SignedRecord:
        """Encode and sign `message` (raises ProtocolRejection for what peers would refuse), with its expiration."""
        lifetime = RECORD_TTL_S[type(message).KIND]
        self._seq = max(self._seq + 1, int(time.time() * 1e6))
        timestamp = time.time()
        return SignedRecord(
            encode_message(message, identity=self.identity, swarm_id=self.swarm_id, seq=self._seq, timestamp=timestamp),
            timestamp + lifetime,
        )

    async def store(self, dht, key: str, message: Message | SignedRecord, timeout: float) -> bool:
        """Store `message` (signed here, or already signed by `sign`) under `key` and our subkey;
        False when the DHT did not take it within `timeout`."""
        from node.transport.kv import store_value

        record = message if isinstance(message, SignedRecord) else self.sign(message)
        return await store_value(dht, key, record.data, record.expiration, self.identity.node_id, timeout)


async def read_records(
    dht,
    key: str,
    swarm_id: str,
    kind: MessageKind,
    timeout: float,
    limit: int | None,
    on_refusal: Callable[[str, ProtocolRejection], None] | None = None,
    once: RefusedOnce | None = None,
) -> list:
    """Verified envelopes of `kind` stored under `key` (each signed by the node id it is stored under).

    One line to read what `RecordWriter.store` wrote under any key. The DHT's validator already
    refused what is malformed; this second check also holds when a value comes from a DHT node
    that runs without it (a test's plain DHTNode), and refuses a genuine record stored under a
    key of another kind. At most `limit` values are checked, drawn at random (None: all).
    `on_refusal(owner, rejection)` is called for each refused value, only
    the first time that value is read when `once` is given."""
    from node.transport.batches import decode_verified
    from node.transport.kv import read_key

    now = time.time()
    envelopes = []
    for subkey, raw in await read_key(dht, key, timeout, limit=limit):
        try:
            envelopes.append(decode_verified(raw, subkey, swarm_id, kind, now))
        except ProtocolRejection as exc:
            if on_refusal is not None and (
                once is None
                or once.first_time(
                    key.encode(), str(subkey).encode(), raw if isinstance(raw, bytes) else repr(raw).encode()
                )
            ):
                on_refusal(str(subkey)[:64], exc)
    return envelopes
