"""Frames on a raw p2p stream: the one framing every stream protocol of the node uses.

The averaging exchange (`node/averaging/exchange.py`) and the pipeline calls
(`node/pipeline/`) both talk over streams of the node's own p2p daemon. A stream is a
byte pipe with no message boundaries (a read may return fewer bytes than asked), so each
message travels as one frame:

    1 byte   frame type (each protocol has its own IntEnum of types)
    8 bytes  body length, big-endian
    N bytes  body

The receiver bounds every frame before reading its body: each protocol says how long a
frame of each type may be, and a longer one raises `OversizedFrame` with nothing of its
body read (so a peer cannot make us allocate what it announces). An unknown type raises
`FramingError`. Both are the caller's to count and answer with a refusal.

Whatever can go wrong with the stream itself (it cannot be opened, it breaks, it ends inside a
frame, it breaks the framing, it stays silent past a deadline) is one of `STREAM_FAILED`: the
caller gives that stream up and counts it; what its own protocol refuses it adds on its own.
"""

from __future__ import annotations

import asyncio
import enum
import struct
from collections.abc import Callable
from typing import TypeVar

from node.transport import hivemind_p2p  # first: checks hivemind's version, imports it through the protobuf shim

from hivemind.p2p import P2PDaemonError, P2PHandlerError

FRAME_HEADER = struct.Struct(">BQ")

K = TypeVar("K", bound=enum.IntEnum)


class FramingError(Exception):
    """The stream broke the framing: an unknown frame type, or a frame longer than allowed."""


class OversizedFrame(FramingError):
    """A frame longer than the receiver allows for its type; nothing of its body was read."""

    def __init__(self, kind: enum.IntEnum, length: int, limit: int) -> None:
        super().__init__(f"{kind.name} frame of {length} bytes exceeds {limit}")
        self.kind = kind
        self.length = length
        self.limit = limit


# A stream failed: what opening (p2pd: no route, no handler; a malformed peer id is a ValueError), reading and
# writing one raise, framing errors and timeouts (TimeoutError is an OSError) included.
STREAM_FAILED: tuple[type[Exception], ...] = (
    FramingError,
    asyncio.IncompleteReadError,
    ConnectionError,
    OSError,
    ValueError,
    P2PDaemonError,
    P2PHandlerError,
)


def frame_bytes(kind: int, body: bytes = b"") -> bytes:
    """One whole frame as bytes (for tests that write raw or truncated frames)."""
    return FRAME_HEADER.pack(kind, len(body)) + body


async def write_frame(writer: asyncio.StreamWriter, kind: enum.IntEnum, body: bytes = b"") -> int:
    """Write one frame and wait until it is handed to the transport; the bytes written."""
    writer.write(FRAME_HEADER.pack(kind, len(body)))
    if body:
        writer.write(body)
    await writer.drain()
    return FRAME_HEADER.size + len(body)


async def read_frame(reader: asyncio.StreamReader, kinds: type[K], limit: Callable[[K], int]) -> tuple[K, bytes]:
    """Read one frame whose type is a member of `kinds` and whose body is at most `limit(type)` bytes.

    Raises FramingError / OversizedFrame as described above, and asyncio.IncompleteReadError
    when the stream ends inside a frame.
    """
    raw_kind, length = FRAME_HEADER.unpack(await reader.readexactly(FRAME_HEADER.size))
    try:
        kind = kinds(raw_kind)
    except ValueError:
        raise FramingError(f"unknown {kinds.__name__} frame type {raw_kind}") from None
    allowed = limit(kind)
    if length > allowed:
        raise OversizedFrame(kind, length, allowed)
    return kind, await reader.readexactly(length)


async def open_stream(
    p2p, peer_id: str, maddrs: list[str], handler: str, dial_timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a stream to `handler` of the peer `peer_id`, dialing `maddrs` (from its signed
    announcement) when our daemon has no connection to it yet.

    p2pd opens a stream only to a peer it is connected to or can route to, and it routes by
    its own peerstore, not by our DHT: on one host every peer is soon connected through DHT
    traffic, but across hosts a random partner or stage server often is not ("routing: not
    found"). A connected peer needs no dial, so we dial only after a first attempt found no
    route. Raises what the stream call raises (P2PDaemonError, ...); after a dial, with a note of what the first
    request was told (`stream_failure` prints both)."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    peer = PeerID.from_base58(peer_id)
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
        return reader, writer
    except P2PDaemonError as exc:
        before_dial = exc
        addresses = []
        for text in maddrs:
            try:
                addresses.append(Multiaddr(text))
            except Exception:  # an unparsable address from the announcement: skip it
                continue
        if not addresses:
            raise
    try:
        await asyncio.wait_for(hivemind_p2p.connect(p2p, peer, addresses), dial_timeout)
        _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
    except Exception as exc:  # why the first request found no route is half of why the peer is unreachable
        exc.add_note(f"before the dial, p2pd said: {before_dial}")
        raise
    return reader, writer


def stream_failure(exc: BaseException) -> str:
    """A failed stream in one line, for logs and hop reports: its type, its message, and its notes (what p2pd said
    before `open_stream` dialed)."""
    return "; ".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", [])])
