"""Reserving a slot on a circuit relay ourselves: the two messages of libp2p's circuit relay v2 "hop" protocol a node
behind NAT needs, RESERVE and the relay's STATUS answer.

Why a node speaks it at all, when its p2p daemon has autorelay: go-libp2p's autorelay puts a relay "on backoff" for an
hour from every reservation attempt, successful ones included (`relayFinder.connectToRelay` in go-libp2p 0.32; the
backoff is not settable through p2pd's flags). When that relay restarts, the daemon loses its slot and does not ask
the same relay again within the hour, even once connected to it again: a node whose only relay restarted stayed
unreachable (benchmarks/notebook/2026-11-26-nat-and-relay.md, "A relay restart"). So the session's membership
(node/transport/membership.py)
reserves the slot itself over a stream its daemon opens, whenever the daemon holds none.

The wire, as the spec has it (libp2p/specs, relay/circuit-v2.md; protocol HOP_PROTOCOL): each message is a protobuf
preceded by its length as an unsigned varint, at most MAX_HOP_MESSAGE_BYTES (go-libp2p's limit). We send

    HopMessage { type = RESERVE (0) }                                   bytes 02 08 00

and read one HopMessage back, of which we use

    field 1  type         varint   must be STATUS (2)
    field 3  reservation  message  { 1: expire (varint, Unix seconds), 2: addrs (bytes, repeated), 3: voucher }
    field 4  limit        message  { 1: duration (varint, seconds), 2: data (varint, bytes) }
    field 5  status       varint   OK (100), or why the relay said no (STATUS_NAMES)

Every other field is skipped by its wire type. The answer is a peer's bytes: bounded before it is read, and anything
that is not a well-formed protobuf of this shape raises ProtocolRejection. It is never stored or forwarded.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.refusals import Refusal
from protocol.validation import reject

HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
MAX_HOP_MESSAGE_BYTES = 4096  # go-libp2p's maxMessageSize for relay messages; the answer's voucher is ~700 bytes
MAX_VARINT_BYTES = 10  # a uint64

HOP_RESERVE, HOP_CONNECT, HOP_STATUS = 0, 1, 2
STATUS_OK = 100
STATUS_NAMES = {
    100: "OK",
    200: "RESERVATION_REFUSED",
    201: "RESOURCE_LIMIT_EXCEEDED",
    202: "PERMISSION_DENIED",
    203: "CONNECTION_FAILED",
    204: "NO_RESERVATION",
    400: "MALFORMED_MESSAGE",
    401: "UNEXPECTED_MESSAGE",
}

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5  # the protobuf wire types a field may have here


@dataclass(frozen=True)
class HopStatus:
    """The relay's answer to RESERVE. `expire` (Unix seconds) is set when `status` is STATUS_OK; `limit_s` and
    `limit_bytes` bound each relayed connection (None: the relay set no limit)."""

    status: int
    expire: int | None = None
    limit_s: int | None = None
    limit_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, f"status {self.status}")


def encode_uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def decode_uvarint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at data[pos:] and the position after it."""
    value = 0
    for i in range(MAX_VARINT_BYTES):
        if pos + i >= len(data):
            reject(Refusal.BAD_STRUCTURE, "relay message: a varint runs past the end")
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return value, pos + i + 1
    reject(Refusal.BAD_STRUCTURE, f"relay message: a varint longer than {MAX_VARINT_BYTES} bytes")


def encode_reserve() -> bytes:
    """RESERVE, with its length prefix: what a node writes on a new HOP_PROTOCOL stream."""
    body = bytes([1 << 3 | VARINT, HOP_RESERVE])
    return encode_uvarint(len(body)) + body


def _fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field of one protobuf message, in order."""
    fields, pos = [], 0
    while pos < len(data):
        key, pos = decode_uvarint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            reject(Refusal.BAD_STRUCTURE, "relay message: field number 0")
        if wire_type == VARINT:
            value, pos = decode_uvarint(data, pos)
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            if pos + size > len(data):
                reject(Refusal.BAD_STRUCTURE, f"relay message: field {number} runs past the end")
            value, pos = data[pos : pos + size], pos + size
        elif wire_type == LENGTH_DELIMITED:
            size, pos = decode_uvarint(data, pos)
            if pos + size > len(data):
                reject(Refusal.BAD_STRUCTURE, f"relay message: field {number} runs past the end")
            value, pos = data[pos : pos + size], pos + size
        else:
            reject(Refusal.BAD_STRUCTURE, f"relay message: field {number} has wire type {wire_type}")
        fields.append((number, wire_type, value))
    return fields


def _field(fields, number: int, wire_type: int, what: str):
    """The last value of field `number` (protobuf's rule for a repeated scalar), None when absent."""
    values = [value for n, t, value in fields if n == number]
    if any(t != wire_type for n, t, _ in fields if n == number):
        reject(Refusal.BAD_STRUCTURE, f"relay message: {what} has the wrong wire type")
    return values[-1] if values else None


def decode_hop_status(data: bytes) -> HopStatus:
    """The relay's answer to RESERVE (the bytes after the length prefix), or ProtocolRejection."""
    if len(data) > MAX_HOP_MESSAGE_BYTES:
        reject(Refusal.TOO_LARGE, f"relay answer of {len(data)} bytes, limit {MAX_HOP_MESSAGE_BYTES}")
    fields = _fields(data)
    kind = _field(fields, 1, VARINT, "type")
    if kind != HOP_STATUS:
        reject(Refusal.BAD_VALUE, f"relay answer of type {kind}, expected STATUS ({HOP_STATUS})")
    status = _field(fields, 5, VARINT, "status")
    if status is None:
        reject(Refusal.BAD_STRUCTURE, "relay answer without a status")
    if status != STATUS_OK:
        return HopStatus(status)
    reservation = _field(fields, 3, LENGTH_DELIMITED, "reservation")
    expire = None if reservation is None else _field(_fields(reservation), 1, VARINT, "expire")
    if expire is None:
        reject(Refusal.BAD_STRUCTURE, "relay answer OK without a reservation's expiry")
    limit = _field(fields, 4, LENGTH_DELIMITED, "limit")
    limit_fields = _fields(limit) if limit is not None else []
    return HopStatus(
        status,
        expire=expire,
        limit_s=_field(limit_fields, 1, VARINT, "limit duration"),
        limit_bytes=_field(limit_fields, 2, VARINT, "limit data"),
    )
