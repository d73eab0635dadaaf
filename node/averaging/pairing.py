"""The weight exchange: pairs of peers (NoLoCo) or all live peers (DiLoCo baseline).

Design choice: our own exchange over the node's p2p daemon, not hivemind's averager.
hivemind's `DecentralizedAverager` is an `mp.Process` that needs a `hivemind.DHT` (it calls
`dht.replicate_p2p()` and `dht.get(..., return_future=True)`), i.e. the DHT child process
the node deliberately does not run, and its own forked child with a uvloop loop (the
loop behind the pipe crash in ../shared/NOTES.md). Using it would mean two extra
processes per node, a second p2p identity bootstrapped from our multiaddrs, patching
`switch_to_uvloop` in two hivemind modules, and forking a process that already runs torch
and libp2p threads. Worse for us, its butterfly all-reduce has every peer reduce a part
of everyone's vector: a receiver never sees a partner's whole theta, so it cannot refuse
NaN, wrong-shaped or far-away weights before they are mixed in (it could only inspect the
mean, and in a group of more than two not tell who spoiled it). A pair exchange is
simple enough to do directly, in the node's own asyncio loop, on the `DHTNode` it
already runs: rendezvous through DHT keys, the tensors over a raw libp2p stream of the
same p2pd (streams are not DHT values, so neither the ~4 MB DHT value limit nor the
pipe crash applies), each side validating the other's full weights before committing.

Measured (2 peers in one process on loopback, 2 busy cores, 3M float32 = 12 MB, rendezvous
included): 0.14-0.39 s per exchange, median 0.16 s (first round 0.7 s: connections);
fp16 0.12 s, int8 0.12 s, int4 0.10 s (the 0.2 s poll and the DHT dominate below ~6 MB).

Rendezvous, per round r (no barrier, no leader). Peers must agree on r: it is the caller's
job to derive it from something shared (an outer-step counter, floor(time / period)).
    <prefix>/ready/<r>   subkey = node id, value = a signed protocol.AveragingReady
                         {p2p peer id, round, "free" | "done"}
expiring a fixed time after it was signed (node/transport/records.py: only the owner can write its subkey, and
its newer announcement always replaces its older ones). A node announces "free", then polls the key. Pairs
mode: the free peers are ordered by sha256("<r>:<peer id>") and paired consecutively
((0, 1), (2, 3), ...), so peers with the same view agree on a fresh random partner every
round without talking; the lower id of a pair opens the stream, and the higher one does after
`call_patience_s` without a call (its partner may have ended the round while some DHT replica
still shows its "free": such a partner answers FINISHED and is given up). Views can differ (a peer
appears late), so an acceptor takes any caller while it is still free: each node holds
at most one exchange at a time and commits at most one partner per round. A node whose
partner is busy or not ready yet retries on the next poll, with a fresh view (a peer
whose exchanges broke twice, or whose weights were refused, is given up for the round); the odd
one out skips (returns None) at its timeout, or earlier once every other announced peer
is done and `settle_s` has passed. All mode (`group_size=None`): during the gather
window a node calls every announced peer with a higher id and accepts calls from any
peer (at most MAX_GROUP_PARTNERS per round: no view holds more); a lower id still shown free
`call_patience_s` after the window is called too (it may be slow to call, or a stale "free"); it
finishes when no announced peer it has not exchanged with is still free. Per-round memories of peers (given
up, failed calls) keep the newest MAX_ROUND_PEERS ids, so throwaway ids cannot grow them.

One exchange, on a stream opened to `<prefix>/exchange/v1` (frames of
`node/transport/framing.py`; weights frames are bounded by our own model's fp32 size,
control frames by 64 KiB):
    caller -> HELLO {"v", "prefix", "round"} ; acceptor -> ACCEPT | REFUSE {"reason", "detail"}
    both, concurrently: WEIGHTS (codec.EncodedWeights bytes)
    each validates what it received (validation.py) -> COMMIT | REFUSE {"reason", "detail"}
    each commits the partner's weights iff its own check passed and it read the partner's COMMIT,
    then sends DONE and waits briefly for the partner's DONE.
The stream's peer id is authenticated by libp2p, so a weights message cannot claim to be
from someone else. The ready announcements are signed by their node; a node that names
someone else's p2p peer id in its own announcement only costs callers a refused call.

What to average: theta, for both rules. NoLoCo needs mean_G(theta) (outer.noloco_step);
DiLoCo's replicas share phi, so mean(phi - theta) = phi - mean(theta) and the node gets
its mean delta from the mean theta without sending noisy deltas, whose relative distance
from each other is far larger than the distance between thetas (the `too_far` check).

Results: the mean over this node and its committed partners, in fp32, summed in sorted
peer-id order so that all members of a group compute bit-identical means when they
exchanged fp32 weights. A node's own theta enters exactly; with fp16/int8/int4 on the
wire each side sees the other's quantized weights, so the two means differ by the
quantization error. Limits: a stream that breaks between the two COMMIT frames can leave
one side averaged and the other not (no protocol over a breakable stream can exclude it);
the DONE frame detects it: a node that averaged without its partner's DONE counts
`outcome_unconfirmed` (test_averaging_faults.py); in all mode, peers whose views differ (churn) can end
with different groups and so different means.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import torch

from protocol.refusals import SentencedEnum

from node.weights.codec import MODES, CodecError, EncodedWeights, decode_weights, encode_weights
from node.weights.validation import WeightsRefusal, WeightsRefused, validate_partner_weights
from node.transport.records import RecordWriter, read_records
from protocol import DEFAULT_LIMITS, AveragingReady, MessageKind
from node.transport.framing import FRAME_HEADER, FramingError, OversizedFrame, open_stream, read_frame, write_frame
from node.transport.protobuf_shim import import_hivemind_isolated
from protocol.bounded import BoundedDict

import_hivemind_isolated()  # before any hivemind import: keeps its protobuf names out of libp2p's way

from hivemind.p2p import P2PDaemonError, P2PHandlerError  # noqa: E402

log = logging.getLogger(__name__)

Named = dict[str, torch.Tensor]

EXCHANGE_VERSION = 2  # 2: the DONE frame
CONTROL_MAX_BYTES = 64 * 1024
MAX_READY_ENTRIES = 256  # announcements read per round: bounds the work a flood of subkeys can cause
DONE_WAIT_S = 2.0  # how long a node that committed waits for its partner's DONE
DEADLINE_MARGIN_S = 0.05  # the DONE wait ends this long before the round's deadline
MAX_FAILED_CALLS = 2  # broken exchanges with one peer before it is given up for the round
MAX_GROUP_PARTNERS = MAX_READY_ENTRIES - 1  # all mode: partners committed (or in flight) per round; no view holds more
# peers a round remembers as given up / failed (throwaway ids rotate through views)
MAX_ROUND_PEERS = 4 * MAX_READY_ENTRIES


class Frame(enum.IntEnum):
    HELLO = 1  # caller -> acceptor: msgpack {"v": int, "prefix": str, "round": int}
    ACCEPT = 2  # acceptor -> caller: empty; the weights follow
    REFUSE = 3  # either way: msgpack {"reason": str, "detail": str}; the stream ends
    WEIGHTS = 4  # both ways: EncodedWeights.to_bytes()
    COMMIT = 5  # both ways: empty; "your weights passed my checks"
    DONE = 6  # both ways: empty; "I read your COMMIT, so I average with you" (version 2)


class CallRefusal(SentencedEnum):
    """Why an acceptor turned a caller away before any weights moved."""

    NOT_READY = ("not_ready", "The acceptor has not started this round yet.")
    FINISHED = (
        "finished",
        "The acceptor has ended this round already: the 'free' announcement the caller read is stale.",
    )
    BUSY = (
        "busy",
        "The acceptor already has its partner (or an exchange in flight, possibly with this caller) for this round.",
    )
    DUPLICATE = ("duplicate", "The acceptor already exchanged with this caller this round.")
    WRONG_GROUP = ("wrong_group", "The caller's averaging prefix (swarm, model fingerprint) is not the acceptor's.")
    BAD_HELLO = ("bad_hello", "The caller's first frame is not a well-formed HELLO.")
    GIVEN_UP = ("given_up", "The acceptor refused this caller's weights, or was refused by it, earlier this round.")


_RETRYABLE = {CallRefusal.NOT_READY.value, CallRefusal.BUSY.value}


class ExchangeError(Exception):
    """The partner broke the exchange protocol (an unexpected frame or a bad body)."""


@dataclass
class AveragingResult:
    mean_theta: Named  # fp32 mean over this node and partner_ids
    partner_ids: list[str]  # base58 p2p ids of the peers whose weights are in the mean
    bytes_sent: int  # all bytes this node wrote for the round, failed attempts included
    bytes_received: int
    seconds: float  # from the call of average() to the result
    round_id: int

    @property
    def group_size(self) -> int:
        return 1 + len(self.partner_ids)


class _RecentPeers:
    """Peer ids a round remembers, with a count each, at most `cap` of them: past the cap the oldest is
    forgotten (at worst it is tried once more this round), so a flood of throwaway ids cannot grow it."""

    def __init__(self, cap: int = MAX_ROUND_PEERS) -> None:
        self.cap = cap
        self._counts: BoundedDict[str, int] = BoundedDict(cap)

    def __contains__(self, peer: object) -> bool:
        return peer in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def add(self, peer: str) -> None:
        self.bump(peer, 0)

    def bump(self, peer: str, by: int = 1) -> int:
        """Add `by` to peer's count (remembering it as the newest); its new count."""
        count = self._counts.get(peer, 0) + by
        self._counts[peer] = count
        return count


@dataclass
class _Round:
    round_id: int
    theta: Named  # our snapshot, original dtypes: what partners' weights are checked against
    payload: bytes  # our encoded weights
    capacity: int  # partners to commit: 1 for pairs, MAX_GROUP_PARTNERS for all
    deadline: float  # loop time
    received: dict[str, Named] = field(default_factory=dict)  # committed partners' weights
    engaged: set[str] = field(default_factory=set)  # peers with an exchange in flight
    # p2p multiaddrs peers announced (at most MAX_READY_ENTRIES)
    addresses: dict[str, list[str]] = field(default_factory=dict)
    given_up: _RecentPeers = field(default_factory=_RecentPeers)  # peers not to try again this round
    failed_calls: _RecentPeers = field(default_factory=_RecentPeers)  # broken exchanges we opened, per peer
    closed: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_sent: int = 0
    bytes_received: int = 0

    def refusal_for(self, peer: str) -> CallRefusal | None:
        """Why a new exchange with `peer` cannot start now (None: it can)."""
        if self.closed:
            return CallRefusal.FINISHED
        if peer in self.given_up:
            return CallRefusal.GIVEN_UP
        if peer in self.received:
            return CallRefusal.DUPLICATE
        # two peers calling each other: both retry
        if len(self.received) + len(self.engaged) >= self.capacity or peer in self.engaged:
            return CallRefusal.BUSY
            return CallRefusal.BUSY
        return None

    def commit(self, peer: str, weights: Named) -> bool:
        if self.closed or peer in self.received or len(self.received) >= self.capacity:
            return False
        self.received[peer] = weights
        self.changed.set()
        return True

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


def pair_order(peers: list[str], round_id: int) -> list[str]:
    """The round's random-looking but agreed order of peers: pairs are (0, 1), (2, 3), ..."""
    return sorted(peers, key=lambda peer: hashlib.sha256(f"{round_id}:{peer}".encode()).digest())


def pair_partner(peers: list[str], me: str, round_id: int) -> str | None:
    """My partner among `peers` (which include me) this round; None for the odd one out."""
    order = pair_order(sorted(set(peers)), round_id)
    index = order.index(me)
    mate = index + 1 if index % 2 == 0 else index - 1
    return order[mate] if mate < len(order) else None


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


class PairAverager:
    """Averages named tensors with one partner (group_size=2) or all live peers (group_size=None).

    `dht` is the node's running hivemind `DHTNode` (its `p2p` carries the streams). The
    caller owns the DHT; `stop()` leaves it running.
    """

    def __init__(
        self,
        dht,
        prefix: str,
        *,
        group_size: int | None = 2,
        mode: str = "fp32",
        max_relative_distance: float = 0.5,  # of a partner's tensors from ours: see validation.py
        poll_interval: float = 0.2,
        call_patience_s: float = 2.0,
        settle_s: float = 2.0,
        gather_s: float = 2.0,
        dht_timeout: float = 5.0,
        writer: RecordWriter,
    ) -> None:
        if group_size not in (2, None):
            raise ValueError("group_size must be 2 (NoLoCo pairs) or None (all live peers)")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.dht = dht
        self.writer = writer  # signs our announcements: only we can say we are free or done
        self.prefix = prefix
        self.group_size = group_size
        self.mode = mode
        self.max_relative_distance = max_relative_distance
        self.poll_interval = poll_interval
        self.call_patience_s = call_patience_s
        self.settle_s = settle_s
        self.gather_s = gather_s
        self.dht_timeout = dht_timeout
        self.peer_id = dht.peer_id.to_base58()
        self.refusals: Counter[str] = Counter()  # partners' weights we refused, by WeightsRefusal code
        self.failures: Counter[str] = Counter()  # everything else that kept a round or an attempt from averaging
        self.rounds_averaged = 0
        self.rounds_skipped = 0
        self.rounds_to_deadline = 0  # rounds that ran until their deadline (rather than ending when nobody was left)
        self._round: _Round | None = None  # the round open to incoming exchanges
        self._latest_round_id: int | None = None  # rounds up to this one are over for us once it is closed
        self._averaging = False  # an average() call is running (set before its first await)
        self._max_payload = 0
        self._maddrs: list[str] = []  # where our daemon can be dialed: announced with "free"
        self._tasks: set[asyncio.Task] = set()  # stream handlers and late announcements in flight
        self._started = False

    @property
    def handler_name(self) -> str:
        return f"{self.prefix}/exchange/v{EXCHANGE_VERSION}"

    def ready_key(self, round_id: int) -> str:
        return f"{self.prefix}/ready/{round_id}"

    # lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._maddrs = [str(a) for a in await self.dht.get_visible_maddrs()][: DEFAULT_LIMITS.max_addresses]
        await self.dht.p2p.add_binary_stream_handler(self.handler_name, self._handle)
        self._started = True

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting exchanges and end the ones in flight (within `timeout`)."""
        if self._round is not None:
            self._round.closed = True
        if self._started:
            self._started = False
            try:
                await asyncio.wait_for(self.dht.p2p.remove_binary_stream_handler(self.handler_name), timeout)
            except (asyncio.TimeoutError, P2PDaemonError, OSError, ConnectionError) as exc:
                log.warning("could not remove the averaging handler (%s); p2pd may be gone", type(exc).__name__)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # what travels: the public seams a subclass overrides to play a faulty peer (tests/test_averaging_faults.py) ----

    def outgoing(self, theta: Named) -> Named:
        """The weights we send for our snapshot."""
        return theta

    async def send_weights(self, writer: asyncio.StreamWriter, payload: bytes) -> int:
        return await write_frame(writer, Frame.WEIGHTS, payload)

    async def send_commit(self, writer: asyncio.StreamWriter) -> int:
        return await write_frame(writer, Frame.COMMIT)

    async def send_done(self, writer: asyncio.StreamWriter) -> int:
        return await write_frame(writer, Frame.DONE)

    # one round -----------------------------------------------------------------------

    async def average(self, named_theta: Named, round_id: int, timeout: float) -> AveragingResult | None:
        """Average a snapshot of `named_theta` (taken now; the tensors are never modified) with peers.

        Returns None when no partner committed within `timeout` seconds (or every
        partner's weights were refused); never waits on peers beyond the timeout.
        """
        if not self._started:
            raise RuntimeError("PairAverager.start() was not awaited")
        if self._averaging:
            raise RuntimeError("an exchange is already running; average() rounds must not overlap")
        self._averaging = True
        try:
            return await self._average(named_theta, round_id, timeout)
        finally:
            self._averaging = False

    async def _average(self, named_theta: Named, round_id: int, timeout: float) -> AveragingResult | None:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        theta = {name: t.detach().to("cpu").clone() for name, t in named_theta.items()}
        if not all(bool(torch.isfinite(t).all()) for t in theta.values()):
            log.warning("round %d: not averaging: our own weights are not finite", round_id)
            self.failures["own_weights_not_finite"] += 1
            self.rounds_skipped += 1
            return None
        payload = await asyncio.to_thread(lambda: encode_weights(self.outgoing(theta), self.mode).to_bytes())
        numel = sum(t.numel() for t in theta.values())
        self._max_payload = 4 * numel + 1024 * len(theta) + CONTROL_MAX_BYTES
        self._latest_round_id = round_id if self._latest_round_id is None else max(self._latest_round_id, round_id)
        rnd = _Round(
            round_id=round_id,
            theta=theta,
            payload=payload,
            capacity=1 if self.group_size == 2 else MAX_GROUP_PARTNERS,
            deadline=deadline,
        )
        self._round = rnd
        try:
            await asyncio.wait_for(self._run(rnd), timeout=rnd.remaining())
        except asyncio.TimeoutError:
            self.rounds_to_deadline += 1
        finally:
            rnd.closed = True
            self._round = None
        # "done" either way: we no longer take partners this round (our "free" would otherwise outlive the round)
        self._spawn(self._announce(round_id, "done"), name=f"averaging-done-{round_id}")
        if not rnd.received:
            self.failures["no_partner"] += 1
            self.rounds_skipped += 1
            return None
        peers = sorted(rnd.received)
        mean = await asyncio.to_thread(self._mean, rnd)
        self.rounds_averaged += 1
        return AveragingResult(
            mean_theta=mean,
            partner_ids=peers,
            bytes_sent=rnd.bytes_sent,
            bytes_received=rnd.bytes_received,
            seconds=time.perf_counter() - started,
            round_id=round_id,
        )

    def _mean(self, rnd: _Round) -> Named:
        members = sorted([(self.peer_id, rnd.theta), *rnd.received.items()], key=lambda item: item[0])
        mean = {}
        for name in rnd.theta:
            total = members[0][1][name].to(torch.float32).clone()
            for _, weights in members[1:]:
                total += weights[name].to(torch.float32)
            mean[name] = total / len(members)
        return mean

    async def _run(self, rnd: _Round) -> None:
        await self._announce(rnd.round_id, "free")
        if self.group_size == 2:
            await self._run_pairs(rnd)
        else:
            await self._run_all(rnd)

    async def _run_pairs(self, rnd: _Round) -> None:
        loop = asyncio.get_running_loop()
        settle_at = loop.time() + self.settle_s
        awaited, awaited_since = None, loop.time()  # the partner expected to call us, and since when
        while not rnd.received and not rnd.closed:
            view = await self._read_view(rnd)
            free = [p for p, state in view.items() if state == "free" and p not in rnd.given_up]
            free.append(self.peer_id)
            partner = pair_partner(free, self.peer_id, rnd.round_id)
            if partner != awaited:
                awaited, awaited_since = partner, loop.time()
            # The lower id calls. The higher one calls too once its partner has kept silent for
            # call_patience_s: the partner may have ended the round while a DHT replica still shows it
            # "free" (its "done" did not reach every replica), and waiting for its call would idle us to
            # the deadline; calling it gets FINISHED, and the partner is given up, so the next view pairs us anew.
            if (
                partner is not None
                and rnd.refusal_for(partner) is None
                and (self.peer_id < partner or loop.time() - awaited_since >= self.call_patience_s)
            ):
                if await self._call(rnd, partner):
                    return
                awaited_since = loop.time()
            others = [p for p in view if p != self.peer_id]
            if (
                others
                and all(view[p] == "done" or p in rnd.given_up for p in others)
                and not rnd.engaged
                and loop.time() >= settle_at
            ):
                return  # everyone else has paired (or was refused) this round: nobody is left to pair with
            await self._wait_for_change(rnd)

    async def _run_all(self, rnd: _Round) -> None:
        loop = asyncio.get_running_loop()
        gather_end = loop.time() + min(self.gather_s, rnd.remaining() / 2)
        calls: dict[str, asyncio.Task] = {}
        try:
            while not rnd.closed:
                view = await self._read_view(rnd)
                gathering = loop.time() < gather_end
                for peer, state in view.items():
                    if peer == self.peer_id or peer in rnd.given_up or state != "free":
                        continue
                    if peer < self.peer_id:
                        # A lower id calls us. One still shown "free" after the window and call_patience_s has not
                        # come round to us (busy with others: the lab's N = 16 groups waited to the deadline), or ended
                        # its round while a DHT replica kept its "free". Calling it joins it to the group, or gets
                        # FINISHED and it is given up (the pairs rule, _run_pairs, for the same stale announcement).
                        if loop.time() < gather_end + self.call_patience_s:
                            continue
                    # after the window: only retry higher ids already in the group
                    elif not (gathering or peer in calls):
                        continue
                    if rnd.refusal_for(peer) is None and (peer not in calls or calls[peer].done()):
                        calls[peer] = asyncio.create_task(self._call(rnd, peer))
                pending = [
                    p
                    for p, state in view.items()
                    if p != self.peer_id
                    and p not in rnd.received
                    and p not in rnd.given_up
                    and (state == "free" or p in rnd.engaged)
                ]
                if not gathering and not pending and not rnd.engaged:
                    return
                await self._wait_for_change(rnd)
        finally:
            for task in calls.values():
                task.cancel()
            if calls:
                await asyncio.gather(*calls.values(), return_exceptions=True)

    async def _wait_for_change(self, rnd: _Round) -> None:
        try:
            await asyncio.wait_for(rnd.changed.wait(), timeout=min(self.poll_interval, rnd.remaining()))
        except asyncio.TimeoutError:
            pass
        rnd.changed.clear()

    # rendezvous ----------------------------------------------------------------------

    async def _announce(self, round_id: int, state: str) -> None:
        """Sign and store our state for the round; it expires records.RECORD_TTL_S after signing, so our
        "done" (signed later) always outlives, and replaces, any replay of our "free"."""
        message = AveragingReady(p2p_peer_id=self.peer_id, round=round_id, state=state, p2p_maddrs=self._maddrs)
        if not await self.writer.store(self.dht, self.ready_key(round_id), message, self.dht_timeout):
            log.warning("round %d: the DHT did not take our '%s' announcement", round_id, state)

    async def _read_view(self, rnd: _Round) -> dict[str, str]:
        """Announced peers of the round (by p2p peer id) and their state ("free" or "done"); refused entries are
        counted, and the addresses peers announced are kept in `rnd.addresses` for dialing them."""
        round_id = rnd.round_id

        def refused(_owner: str, rejection) -> None:
            self.failures[f"announcement_refused:{rejection.reason.value}"] += 1

        view = {}
        for envelope in await read_records(
            self.dht,
            self.ready_key(round_id),
            self.writer.swarm_id,
            MessageKind.AVERAGING_READY,
            self.dht_timeout,
            MAX_READY_ENTRIES,
            refused,
        ):
            ready: AveragingReady = envelope.message
            if ready.round == round_id and 0 < len(ready.p2p_peer_id) <= 64:
                view[ready.p2p_peer_id] = ready.state
                if ready.p2p_maddrs and (ready.p2p_peer_id in rnd.addresses or len(rnd.addresses) < MAX_READY_ENTRIES):
                    rnd.addresses[ready.p2p_peer_id] = ready.p2p_maddrs
        return view

    # the exchange --------------------------------------------------------------------

    async def _call(self, rnd: _Round, peer: str) -> bool:
        """Open an exchange with `peer`; True if its weights were committed."""
        rnd.engaged.add(peer)  # before any await: a concurrent incoming call now sees us busy
        writer = None
        try:
            reader, writer = await open_stream(
                self.dht.p2p, peer, rnd.addresses.get(peer, []), self.handler_name, self.dht_timeout
            )
            hello = msgpack.packb({"v": EXCHANGE_VERSION, "prefix": self.prefix, "round": rnd.round_id})
            rnd.bytes_sent += await write_frame(writer, Frame.HELLO, hello)
            kind, body = await _read_frame(reader, self._max_payload)
            rnd.bytes_received += FRAME_HEADER.size + len(body)
            if kind is Frame.REFUSE:
                reason = _parse_refusal(body)
                self.failures[f"call_refused:{reason}"] += 1
                if reason not in _RETRYABLE:
                    rnd.given_up.add(peer)
                return False
            if kind is not Frame.ACCEPT:
                raise ExchangeError(f"expected ACCEPT, got {kind.name}")
            weights = await self._swap(rnd, peer, reader, writer)
        except (
            ExchangeError,
            FramingError,
            asyncio.IncompleteReadError,
            ConnectionError,
            OSError,
            P2PDaemonError,
            P2PHandlerError,
            ValueError,
        ) as exc:
            log.info("round %d: exchange with %s failed: %s: %s", rnd.round_id, peer[:12], type(exc).__name__, exc)
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

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An incoming exchange (called by the p2p daemon's stream handler)."""
        task = asyncio.current_task()
        self._tasks.add(task)
        peer = stream_info.peer_id.to_base58()
        rnd, engaged = None, False
        try:
            kind, body = await asyncio.wait_for(_read_frame(reader, 0), timeout=self.dht_timeout)
            rnd = self._round
            refusal = self._check_hello(kind, body, rnd, peer)
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
        except (
            ExchangeError,
            FramingError,
            asyncio.IncompleteReadError,
            asyncio.TimeoutError,
            ConnectionError,
            OSError,
            ValueError,
        ) as exc:
            log.info("exchange from %s failed: %s: %s", peer[:12], type(exc).__name__, exc)
            self.failures["exchange_failed"] += 1
        finally:
            if rnd is not None and engaged:
                rnd.engaged.discard(peer)
                rnd.changed.set()
            writer.close()
            self._tasks.discard(task)

    def _check_hello(self, kind: Frame, body: bytes, rnd: _Round | None, peer: str) -> CallRefusal | None:
        if kind is not Frame.HELLO:
            return CallRefusal.BAD_HELLO
        try:
            hello = msgpack.unpackb(body, raw=False)
        except ValueError:  # msgpack's unpack errors (ExtraData, FormatError, StackError) are ValueErrors
            return CallRefusal.BAD_HELLO
        if not isinstance(hello, dict) or hello.get("v") != EXCHANGE_VERSION or type(hello.get("round")) is not int:
            return CallRefusal.BAD_HELLO
        if hello.get("prefix") != self.prefix:
            return CallRefusal.WRONG_GROUP
        if rnd is None or hello["round"] != rnd.round_id:
            past = self._latest_round_id is not None and hello["round"] <= self._latest_round_id
            return CallRefusal.FINISHED if past else CallRefusal.NOT_READY
        return rnd.refusal_for(peer)

    async def _swap(
        self, rnd: _Round, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Named | None:
        """Send our weights while reading theirs, check theirs, trade verdicts; their weights if both passed."""
        sending = asyncio.create_task(self.send_weights(writer, rnd.payload))
        try:
            try:
                kind, body = await _read_frame(reader, self._max_payload)
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
        except (
            ExchangeError,
            FramingError,
            asyncio.IncompleteReadError,
            asyncio.TimeoutError,
            ConnectionError,
            OSError,
        ):
            confirmed = False
        if not confirmed:
            self.failures["outcome_unconfirmed"] += 1
            log.warning(
                "round %d: averaged with %s, which did not confirm that it averaged too", rnd.round_id, peer[:12]
            )
        return weights

    async def _read_partner_verdict(self, rnd: _Round, reader: asyncio.StreamReader) -> None:
        """Wait (briefly) for the partner's verdict before closing: p2pd resets a stream that is
        closed while data still flows towards us, and the reset can destroy our REFUSE before
        the partner reads it, leaving it waiting for a verdict until its timeout."""
        try:
            _, body = await asyncio.wait_for(_read_frame(reader, 0), timeout=min(2.0, rnd.remaining()))
            rnd.bytes_received += FRAME_HEADER.size + len(body)
        except (
            ExchangeError,
            FramingError,
            asyncio.IncompleteReadError,
            asyncio.TimeoutError,
            ConnectionError,
            OSError,
        ):
            pass  # it went away or never answered: our verdict was sent either way

    def _refuse_weights(self, rnd: _Round, peer: str, refused: WeightsRefused) -> None:
        self.refusals[refused.reason.value] += 1
        rnd.given_up.add(peer)
        log.warning("round %d: refused the weights of %s: %s", rnd.round_id, peer[:12], refused)

    def _decode_checked(self, rnd: _Round, body: bytes) -> Named:
        try:
            encoded = EncodedWeights.from_bytes(
                body, max_tensors=len(rnd.theta) + 16, max_values=sum(t.numel() for t in rnd.theta.values()) * 2 + 1024
            )
            received = decode_weights(encoded, dtype=None)
        except CodecError as exc:
            raise WeightsRefused(WeightsRefusal.MALFORMED, str(exc)) from None
        validate_partner_weights(rnd.theta, received, self.max_relative_distance)
        return received
