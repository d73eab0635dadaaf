"""The exchange: this node's weights for a partner's, over one p2p stream, each side checking the other's.

One exchange, on a stream opened to `<prefix>/exchange/v2` (frames of
`node/transport/framing.py`; weights frames are bounded by our own model's fp32 size,
control frames by 64 KiB):
    caller -> HELLO {"v", "prefix", "round"} ; acceptor -> ACCEPT | REFUSE {"reason", "detail"}
    both, concurrently: WEIGHTS (codec.EncodedWeights bytes)
    each validates what it received (validation.py) -> COMMIT | REFUSE {"reason", "detail"}
    each commits the partner's weights iff its own check passed and it read the partner's COMMIT,
    then sends DONE and waits briefly for the partner's DONE.
The stream's peer id is authenticated by libp2p, so a weights message cannot claim to be
from someone else. Who calls whom, and when, is `node/averaging/matchmaking.py`'s; an acceptor
answers a caller by the state of its open round (`matchmaking.Round.refusal_for`).

Limits: a stream that breaks between the two COMMIT frames can leave one side averaged and the other
not (no protocol over a breakable stream can exclude it); the DONE frame detects it: a node that
averaged without its partner's DONE counts `outcome_unconfirmed` (test_averaging_faults.py).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections import Counter

import msgpack
import torch

from node.averaging.matchmaking import (
    DIAL_BACKOFF_S,
    MAX_DIAL_BACKOFFS,
    MAX_FAILED_CALLS,
    RETRYABLE,
    CallRefusal,
    Round,
)
from node.transport.framing import (
    FRAME_HEADER,
    P2PDaemonError,
    STREAM_FAILED,
    OversizedFrame,
    open_stream,
    read_frame,
    stream_failure,
    write_frame,
)
from node.weights.codec import CodecError, EncodedWeights, decode_weights, encode_weights
from node.weights.validation import WeightsRefusal, WeightsRefused, validate_partner_weights

log = logging.getLogger(__name__)

Named = dict[str, torch.Tensor]

EXCHANGE_VERSION = 2  # 2: the DONE frame
CONTROL_MAX_BYTES = 64 * 1024
DONE_WAIT_S = 2.0  # how long a node that committed waits for its partner's DONE
DEADLINE_MARGIN_S = 0.05  # the DONE wait ends this long before the round's deadline


class Frame(enum.IntEnum):
    HELLO = 1  # caller -> acceptor: msgpack {"v": int, "prefix": str, "round": int}
    ACCEPT = 2  # acceptor -> caller: empty; the weights follow
    REFUSE = 3  # either way: msgpack {"reason": str, "detail": str}; the stream ends
    WEIGHTS = 4  # both ways: EncodedWeights.to_bytes()
    COMMIT = 5  # both ways: empty; "your weights passed my checks"
    DONE = 6  # both ways: empty; "I read your COMMIT, so I average with you" (version 2)


class ExchangeError(Exception):
    """The partner broke the exchange protocol (an unexpected frame or a bad body)."""


def weights_limit(theta: Named) -> int:
    """The largest WEIGHTS frame we read: our own model's size in fp32, and some room for the codec's headers."""
    return 4 * sum(t.numel() for t in theta.values()) + 1024 * len(theta) + CONTROL_MAX_BYTES


async def _read_frame(reader: asyncio.StreamReader, max_weights_bytes: int) -> tuple[Frame, bytes]:
    return await read_frame(
        reader, Frame, lambda kind: max_weights_bytes if kind is Frame.WEIGHTS else CONTROL_MAX_BYTES
    )


def _refusal_body(reason: str, detail: str = "") -> bytes:
    return msgpack.packb({"reason": reason, "detail": detail[:500]})


_KNOWN_REFUSALS = frozenset(r.value for r in CallRefusal) | frozenset(r.value for r in WeightsRefusal)


def _parse_refusal(body: bytes) -> str:
    """The reason of a partner's REFUSE, from our own vocabulary only ("unknown" otherwise): it
    becomes a counter key, and free-form strings from every peer would grow the counters forever."""
    try:
        reason = msgpack.unpackb(body, raw=False)["reason"]
    # msgpack's unpack errors are ValueErrors; a malformed refusal is still a refusal
    except (
        ValueError,
        TypeError,
        KeyError,
    ):
        return "unparsable"
    if not isinstance(reason, str):
        return "unparsable"
    return reason if reason in _KNOWN_REFUSALS else "unknown"


def refused_by_dial_backoff(exc: BaseException) -> bool:
    """Whether p2pd refused our dial only because every address of the peer was in libp2p's dial backoff: a dial
    failed moments ago (the DHT's, or the one p2pd tried itself for the stream request that `open_stream` makes
    before dialing), and this one was not tried. p2pd says so in text only, one line per address:
    "...: all dials failed\n  * [/ip4/.../tcp/...] dial backoff"."""
    if not isinstance(exc, P2PDaemonError):
        return False
    text = str(exc)
    reasons = [line.partition("]")[2].strip() for line in text.splitlines() if line.strip().startswith("* [")]
    if reasons:
        return all(reason == "dial backoff" for reason in reasons)
    return text.rstrip().endswith("dial backoff")


def check_hello(
    kind: Frame, body: bytes, prefix: str, rnd: Round | None, latest_round_id: int | None, peer: str
) -> CallRefusal | None:
    """An acceptor's answer to a caller's first frame: why it refuses (None: it accepts). `rnd` is the round open to
    exchanges (None: none is), `latest_round_id` the latest round it has opened (rounds up to it are over once it is
    closed)."""
    if kind is not Frame.HELLO:
        return CallRefusal.BAD_HELLO
    try:
        hello = msgpack.unpackb(body, raw=False)
    except ValueError:  # msgpack's unpack errors (ExtraData, FormatError, StackError) are ValueErrors
        return CallRefusal.BAD_HELLO
    if not isinstance(hello, dict) or hello.get("v") != EXCHANGE_VERSION or type(hello.get("round")) is not int:
        return CallRefusal.BAD_HELLO
    if hello.get("prefix") != prefix:
        return CallRefusal.WRONG_GROUP
    if rnd is None or hello["round"] != rnd.round_id:
        past = latest_round_id is not None and hello["round"] <= latest_round_id
        return CallRefusal.FINISHED if past else CallRefusal.NOT_READY
    return rnd.refusal_for(peer)


class WeightExchange:
    """The exchange of the module docstring, both sides, for one node: `call` opens one with a partner of the round,
    `accept` answers a partner's call into the round that is open (`open`/`close`).

    `outgoing`, `send_weights`, `send_commit` and `send_done` decide what goes on the wire: the seams a subclass
    overrides to play a faulty peer (tests/test_averaging_faults.py)."""

    def __init__(
        self,
        p2p,
        prefix: str,
        *,
        mode: str,
        max_relative_distance: float,
        dht_timeout: float,
        refusals: Counter[str],
        failures: Counter[str],
        dial_backoff_s: float = DIAL_BACKOFF_S,
        busy_retry_s: float = 0.2,
    ) -> None:
        self.p2p = p2p  # the node's p2p daemon (its DHT node's), which carries the streams
        self.prefix = prefix
        self.mode = mode
        self.max_relative_distance = max_relative_distance
        self.dht_timeout = dht_timeout
        self.refusals = refusals  # the averager's: partners' weights we refused, by WeightsRefusal code
        self.failures = failures  # the averager's: everything else that kept an exchange from averaging
        self.dial_backoff_s = dial_backoff_s  # how long p2pd refuses to redial a peer after a failed dial
        # about how long before we call again a peer that was not ready or busy (jittered: two peers that called each
        # other at once and were both refused BUSY must not call each other at once again)
        self.busy_retry_s = busy_retry_s
        self.round: Round | None = None  # the round open to incoming exchanges
        self.latest_round_id: int | None = None  # rounds up to this one are over for us once it is closed

    @property
    def handler_name(self) -> str:
        return f"{self.prefix}/exchange/v{EXCHANGE_VERSION}"

    def open(self, rnd: Round) -> None:
        """Take partners' calls into `rnd` from now on."""
        self.latest_round_id = rnd.round_id if self.latest_round_id is None else max(self.latest_round_id, rnd.round_id)
        self.round = rnd

    def close(self) -> None:
        """No exchange joins the open round any more (those in flight commit nothing)."""
        if self.round is not None:
            self.round.closed = True
        self.round = None

    # what travels ------------------------------------------------------------------------

    def outgoing(self, theta: Named) -> Named:
        """The weights we send for our snapshot."""
        return theta

    def encode(self, theta: Named) -> bytes:
        """Our snapshot as the WEIGHTS body (blocking: run it off the event loop)."""
        return encode_weights(self.outgoing(theta), self.mode).to_bytes()

    async def send_weights(self, writer: asyncio.StreamWriter, payload: bytes) -> int:
        return await write_frame(writer, Frame.WEIGHTS, payload)

    async def send_commit(self, writer: asyncio.StreamWriter) -> int:
        return await write_frame(writer, Frame.COMMIT)

    async def send_done(self, writer: asyncio.StreamWriter) -> int:
        return await write_frame(writer, Frame.DONE)

    # both sides --------------------------------------------------------------------------

    async def call(self, rnd: Round, peer: str) -> bool:
        """Open an exchange with `peer`; True if its weights were committed."""
        rnd.engaged.add(peer)  # before any await: a concurrent incoming call now sees us busy
        writer = None
        try:
            try:
                reader, writer = await open_stream(
                    self.p2p, peer, rnd.addresses.get(peer, []), self.handler_name, self.dht_timeout
                )
            except STREAM_FAILED as exc:
                # A dial that failed leaves the peer's addresses in libp2p's backoff: a call before it passes gets
                # "dial backoff" without dialing (the lab, under load: the next poll's call, 3 ms later, spent the
                # second of MAX_FAILED_CALLS so, and a reachable partner was given up).
                rnd.retry_at[peer] = asyncio.get_running_loop().time() + self.dial_backoff_s
                if not refused_by_dial_backoff(exc):
                    raise
                log.info("round %d: %s is in p2pd's dial backoff; calling it again later", rnd.round_id, peer[:12])
                self.failures["dial_backoff"] += 1
                if rnd.dial_backoffs.bump(peer) >= MAX_DIAL_BACKOFFS:
                    rnd.given_up.add(peer)  # every dial to it keeps failing (the DHT's too): pair without it
                return False
            hello = msgpack.packb({"v": EXCHANGE_VERSION, "prefix": self.prefix, "round": rnd.round_id})
            rnd.bytes_sent += await write_frame(writer, Frame.HELLO, hello)
            kind, body = await _read_frame(reader, weights_limit(rnd.theta))
            rnd.bytes_received += FRAME_HEADER.size + len(body)
            if kind is Frame.REFUSE:
                reason = _parse_refusal(body)
                self.failures[f"call_refused:{reason}"] += 1
                if reason in RETRYABLE:
                    # Without a wait the matchmaker, woken by this call's end, called again at once: a partner that
                    # had not started the round took ~100 calls a second (226 in a loopback run's 2 s).
                    delay = self.busy_retry_s * random.uniform(0.5, 1.5)
                    rnd.retry_at[peer] = asyncio.get_running_loop().time() + delay
                else:
                    rnd.given_up.add(peer)
                return False
            if kind is not Frame.ACCEPT:
                raise ExchangeError(f"expected ACCEPT, got {kind.name}")
            weights = await self._swap(rnd, peer, reader, writer)
        except (ExchangeError, *STREAM_FAILED) as exc:
            log.info("round %d: exchange with %s failed: %s", rnd.round_id, peer[:12], stream_failure(exc))
            self.failures["exchange_failed"] += 1
            if rnd.failed_calls.bump(peer) >= MAX_FAILED_CALLS:
                rnd.given_up.add(peer)  # gone or broken: its "free" announcement stays until it expires
            return False
        finally:
            rnd.engaged.discard(peer)
            rnd.changed.set()
            if writer is not None:
                writer.close()
        return weights is not None and rnd.commit(peer, weights)

    async def accept(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer an incoming exchange (the p2p daemon's stream handler runs it)."""
        peer = stream_info.peer_id.to_base58()
        rnd, engaged = None, False
        try:
            kind, body = await asyncio.wait_for(_read_frame(reader, 0), timeout=self.dht_timeout)
            rnd = self.round
            refusal = check_hello(kind, body, self.prefix, rnd, self.latest_round_id, peer)
            if rnd is not None:
                rnd.bytes_received += FRAME_HEADER.size + len(body)
            if refusal is not None:
                sent = await write_frame(writer, Frame.REFUSE, _refusal_body(refusal.value))
                if rnd is not None:
                    rnd.bytes_sent += sent
                return
            rnd.engaged.add(peer)
            engaged = True
            rnd.bytes_sent += await write_frame(writer, Frame.ACCEPT)
            weights = await asyncio.wait_for(self._swap(rnd, peer, reader, writer), timeout=rnd.remaining())
            if weights is not None:
                rnd.commit(peer, weights)
        except (ExchangeError, *STREAM_FAILED) as exc:
            log.info("exchange from %s failed: %s: %s", peer[:12], type(exc).__name__, exc)
            self.failures["exchange_failed"] += 1
        finally:
            if rnd is not None and engaged:
                rnd.engaged.discard(peer)
                rnd.changed.set()
            writer.close()

    async def _swap(
        self, rnd: Round, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Named | None:
        """Send our weights while reading theirs, check theirs, trade verdicts; their weights if both passed."""
        rnd.swaps += 1
        sending = asyncio.create_task(self.send_weights(writer, rnd.payload))
        try:
            try:
                kind, body = await _read_frame(reader, weights_limit(rnd.theta))
            except OversizedFrame as exc:  # weights larger than our own model's: refused like any bad weights
                if exc.kind is not Frame.WEIGHTS:
                    raise
                refused = WeightsRefused(WeightsRefusal.MALFORMED, str(exc))
                self._refuse_weights(rnd, peer, refused)
                # Best effort: we close with its bytes still flowing, so p2pd may reset the stream first.
                rnd.bytes_sent += await write_frame(
                    writer, Frame.REFUSE, _refusal_body(refused.reason.value, refused.detail)
                )
                return None
            rnd.bytes_received += FRAME_HEADER.size + len(body)
            rnd.bytes_sent += await sending
        finally:
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        if kind is Frame.REFUSE:
            self.failures[f"call_refused:{_parse_refusal(body)}"] += 1
            return None
        if kind is not Frame.WEIGHTS:
            raise ExchangeError(f"expected WEIGHTS, got {kind.name}")
        try:
            weights = await asyncio.to_thread(self._decode_checked, rnd, body)
        except WeightsRefused as refused:
            self._refuse_weights(rnd, peer, refused)
            rnd.bytes_sent += await write_frame(
                writer, Frame.REFUSE, _refusal_body(refused.reason.value, refused.detail)
            )
            await self._read_partner_verdict(rnd, reader)
            return None
        if rnd.closed:
            # our round ended while the weights moved (its deadline, or the search's end as a call came in): we commit
            # to nobody, so the partner must not average with us either
            self.failures["round_closed_before_commit"] += 1
            rnd.bytes_sent += await write_frame(
                writer, Frame.REFUSE, _refusal_body(CallRefusal.FINISHED.value, "the round ended before the commit")
            )
            return None
        rnd.bytes_sent += await self.send_commit(writer)
        kind, body = await _read_frame(reader, 0)
        rnd.bytes_received += FRAME_HEADER.size + len(body)
        if kind is not Frame.COMMIT:
            self.failures["partner_refused_our_weights"] += 1
            rnd.given_up.add(peer)
            return None
        # We average from here on. The partner does iff it reads our COMMIT; its DONE says it did.
        # Without DONE we cannot know (no protocol can, over a stream that may break at any frame):
        # count it, so that a pair that may disagree is seen, not silent. A DONE we cannot send changes
        # nothing: the partner decides on our COMMIT, already sent. The wait ends just before the
        # round's deadline, which would otherwise cancel the exchange (silently) after we read COMMIT.
        try:
            rnd.bytes_sent += await self.send_done(writer)
            kind, body = await asyncio.wait_for(
                _read_frame(reader, 0), timeout=min(DONE_WAIT_S, max(rnd.remaining() - DEADLINE_MARGIN_S, 0.0))
            )
            rnd.bytes_received += FRAME_HEADER.size + len(body)
            confirmed = kind is Frame.DONE
        except (ExchangeError, *STREAM_FAILED):
            confirmed = False
        if not confirmed:
            self.failures["outcome_unconfirmed"] += 1
            log.warning(
                "round %d: averaged with %s, which did not confirm that it averaged too", rnd.round_id, peer[:12]
            )
        return weights

    async def _read_partner_verdict(self, rnd: Round, reader: asyncio.StreamReader) -> None:
        """Wait (briefly) for the partner's verdict before closing: p2pd resets a stream that is
        closed while data still flows towards us, and the reset can destroy our REFUSE before
        the partner reads it, leaving it waiting for a verdict until its timeout."""
        try:
            _, body = await asyncio.wait_for(_read_frame(reader, 0), timeout=min(2.0, rnd.remaining()))
            rnd.bytes_received += FRAME_HEADER.size + len(body)
        except (ExchangeError, *STREAM_FAILED):
            pass  # it went away or never answered: our verdict was sent either way

    def _refuse_weights(self, rnd: Round, peer: str, refused: WeightsRefused) -> None:
        self.refusals[refused.reason.value] += 1
        rnd.given_up.add(peer)
        log.warning("round %d: refused the weights of %s: %s", rnd.round_id, peer[:12], refused)

    def _decode_checked(self, rnd: Round, body: bytes) -> Named:
        try:
            encoded = EncodedWeights.from_bytes(
                body, max_tensors=len(rnd.theta) + 16, max_values=sum(t.numel() for t in rnd.theta.values()) * 2 + 1024
            )
            received = decode_weights(encoded, dtype=None)
        except CodecError as exc:
            raise WeightsRefused(WeightsRefusal.MALFORMED, str(exc)) from None
        validate_partner_weights(rnd.theta, received, self.max_relative_distance)
        return received
