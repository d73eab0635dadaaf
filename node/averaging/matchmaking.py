"""Finding a partner: the averaging rendezvous of one round, and what this node has agreed in it.

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
partner is busy or not ready yet retries on the next poll, with a fresh view; one whose partner
could not be reached calls it again only once libp2p's dial backoff has passed (DIAL_BACKOFF_S:
p2pd refuses to redial an address that long after a failed dial, so the next poll's call could only
be refused). A peer whose exchanges broke twice, whose address was still in backoff at
MAX_DIAL_BACKOFFS calls, or whose weights were refused, is given up for the round; the odd
one out skips (returns None) at its timeout, or earlier once every other announced peer
is done and `settle_s` has passed, or once the caller's window for the round is over with no
exchange begun (`Round.find_by`: later peers look in the next window's round; the round is then
closed at once, so a call that comes in as it ends commits nothing). All mode (`group_size=None`): during the gather
window a node calls every announced peer with a higher id and accepts calls from any
peer (at most MAX_GROUP_PARTNERS per round: no view holds more); a lower id still shown free
`call_patience_s` after the window is called too (it may be slow to call, or a stale "free"); it
finishes when no announced peer it has not exchanged with is still free. Per-round memories of peers (given
up, failed calls) keep the newest MAX_ROUND_PEERS ids, so throwaway ids cannot grow them.

The ready announcements are signed by their node; a node that names someone else's p2p peer id in its
own announcement only costs callers a refused call. The exchange with a partner found here is
`node/averaging/exchange.py`'s, handed to the `Matchmaker` as `call`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protocol import DEFAULT_LIMITS, AveragingReady, MessageKind
from protocol.bounded import BoundedDict
from protocol.refusals import SentencedEnum

from node.transport.records import RecordWriter, read_records

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MAX_READY_ENTRIES = 256  # announcements read per round: bounds the work a flood of subkeys can cause
MAX_FAILED_CALLS = 2  # broken exchanges with one peer before it is given up for the round
# calls to one peer that our daemon refused with "dial backoff" (no dial made) before it is given up for the round
MAX_DIAL_BACKOFFS = 3
# go-libp2p's BackoffBase: how long p2pd refuses to redial an address after a failed dial ("dial backoff")
DIAL_BACKOFF_S = 5.0
MAX_GROUP_PARTNERS = MAX_READY_ENTRIES - 1  # all mode: partners committed (or in flight) per round; no view holds more
# peers a round remembers as given up / failed (throwaway ids rotate through views)
MAX_ROUND_PEERS = 4 * MAX_READY_ENTRIES


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


RETRYABLE = frozenset({CallRefusal.NOT_READY.value, CallRefusal.BUSY.value})  # a caller tries such a peer again


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
class Round:
    """One averaging round of this node: what it offers, whom it has agreed with, and whom it no longer tries."""

    round_id: int
    theta: dict[str, torch.Tensor]  # our snapshot, original dtypes: what partners' weights are checked against
    payload: bytes  # our encoded weights
    capacity: int  # partners to commit: 1 for pairs, MAX_GROUP_PARTNERS for all
    deadline: float  # loop time
    find_by: float | None = None  # loop time after which the round ends if no exchange has begun (None: the deadline)
    received: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # committed partners' weights
    engaged: set[str] = field(default_factory=set)  # peers with an exchange in flight
    # p2p multiaddrs peers announced (at most MAX_READY_ENTRIES)
    addresses: dict[str, list[str]] = field(default_factory=dict)
    given_up: _RecentPeers = field(default_factory=_RecentPeers)  # peers not to try again this round
    failed_calls: _RecentPeers = field(default_factory=_RecentPeers)  # broken exchanges we opened, per peer
    dial_backoffs: _RecentPeers = field(default_factory=_RecentPeers)  # our calls p2pd refused as "dial backoff"
    # loop time before which we do not call a peer again (a failed dial of ours to it is in libp2p's backoff)
    retry_at: BoundedDict[str, float] = field(default_factory=lambda: BoundedDict(MAX_ROUND_PEERS))
    closed: bool = False
    search_ended: bool = False  # the round ended at find_by with no exchange begun
    swaps: int = 0  # exchanges that got as far as sending our weights (committed or not)
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
        return None

    def may_call(self, peer: str) -> bool:
        """Whether we may open an exchange with `peer` now: one could start (`refusal_for`), and no dial of ours to it
        failed within libp2p's backoff (a call now could only be refused; its own calls to us are still taken)."""
        return self.refusal_for(peer) is None and asyncio.get_running_loop().time() >= self.retry_at.get(peer, 0.0)

    def commit(self, peer: str, weights: dict[str, torch.Tensor]) -> bool:
        if self.closed or peer in self.received or len(self.received) >= self.capacity:
            return False
        self.received[peer] = weights
        self.changed.set()
        return True

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    def past_search(self) -> bool:
        """Whether the round ends now because its time to find a partner is over and no exchange has begun; it is
        then closed at once, so that no call accepted before our caller closes it can commit."""
        if self.find_by is None or self.received or self.engaged or asyncio.get_running_loop().time() < self.find_by:
            return False
        self.search_ended = self.closed = True
        return True


def pair_order(peers: list[str], round_id: int) -> list[str]:
    """The round's random-looking but agreed order of peers: pairs are (0, 1), (2, 3), ..."""
    return sorted(peers, key=lambda peer: hashlib.sha256(f"{round_id}:{peer}".encode()).digest())


def pair_partner(peers: list[str], me: str, round_id: int) -> str | None:
    """My partner among `peers` (which include me) this round; None for the odd one out."""
    order = pair_order(sorted(set(peers)), round_id)
    index = order.index(me)
    mate = index + 1 if index % 2 == 0 else index - 1
    return order[mate] if mate < len(order) else None


# Opens an exchange with a peer this round (exchange.WeightExchange.call): True if its weights were committed.
Call = Callable[[Round, str], Awaitable[bool]]


class Matchmaker:
    """The rendezvous of the module docstring, for one node: announces it, reads who else is in the round, and
    calls the partners it chooses (`call`) until the round has what it needs or nobody is left."""

    def __init__(
        self,
        dht,
        writer: RecordWriter,
        prefix: str,
        peer_id: str,
        call: Call,
        failures: Counter[str],
        *,
        addresses: Callable[[], list[str]],
        group_size: int | None,
        poll_interval: float,
        call_patience_s: float,
        settle_s: float,
        gather_s: float,
        dht_timeout: float,
    ) -> None:
        self.dht = dht
        self.writer = writer  # signs our announcements: only we can say we are free or done
        self.prefix = prefix
        self.peer_id = peer_id
        self.call = call
        self.failures = failures  # the averager's: announcements refused while reading a view are counted there
        self.group_size = group_size
        self.poll_interval = poll_interval
        self.call_patience_s = call_patience_s
        self.settle_s = settle_s
        self.gather_s = gather_s
        self.dht_timeout = dht_timeout
        # where our daemon can be dialed now: read for each announcement, as the session's membership refreshes them
        self.addresses = addresses

    def ready_key(self, round_id: int) -> str:
        return f"{self.prefix}/ready/{round_id}"

    async def run(self, rnd: Round) -> None:
        """Announce ourselves free and find the round's partners (returns when there is nobody left to find)."""
        await self.announce(rnd.round_id, "free")
        if self.group_size == 2:
            await self._run_pairs(rnd)
        else:
            await self._run_all(rnd)

    async def _run_pairs(self, rnd: Round) -> None:
        loop = asyncio.get_running_loop()
        settle_at = loop.time() + self.settle_s
        awaited, awaited_since = None, loop.time()  # the partner expected to call us, and since when
        while not rnd.received and not rnd.closed and not rnd.past_search():
            view = await self.read_view(rnd)
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
                and rnd.may_call(partner)
                and (self.peer_id < partner or loop.time() - awaited_since >= self.call_patience_s)
            ):
                if await self.call(rnd, partner):
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

    async def _run_all(self, rnd: Round) -> None:
        loop = asyncio.get_running_loop()
        gather_end = loop.time() + min(self.gather_s, rnd.remaining() / 2)
        calls: dict[str, asyncio.Task] = {}
        try:
            while not rnd.closed:
                view = await self.read_view(rnd)
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
                    if rnd.may_call(peer) and (peer not in calls or calls[peer].done()):
                        calls[peer] = asyncio.create_task(self.call(rnd, peer))
                pending = [
                    p
                    for p, state in view.items()
                    if p != self.peer_id
                    and p not in rnd.received
                    and p not in rnd.given_up
                    and (state == "free" or p in rnd.engaged)
                ]
                if (not gathering and not pending and not rnd.engaged) or rnd.past_search():
                    return
                await self._wait_for_change(rnd)
        finally:
            for task in calls.values():
                task.cancel()
            if calls:
                await asyncio.gather(*calls.values(), return_exceptions=True)

    async def _wait_for_change(self, rnd: Round) -> None:
        try:
            await asyncio.wait_for(rnd.changed.wait(), timeout=min(self.poll_interval, rnd.remaining()))
        except asyncio.TimeoutError:
            pass
        rnd.changed.clear()

    # the ready key ---------------------------------------------------------------------

    async def announce(self, round_id: int, state: str) -> None:
        """Sign and store our state for the round; it expires records.RECORD_TTL_S after signing, so our
        "done" (signed later) always outlives, and replaces, any replay of our "free"."""
        maddrs = self.addresses()[: DEFAULT_LIMITS.max_addresses]
        message = AveragingReady(p2p_peer_id=self.peer_id, round=round_id, state=state, p2p_maddrs=maddrs)
        if not await self.writer.store(self.dht, self.ready_key(round_id), message, self.dht_timeout):
            log.warning("round %d: the DHT did not take our '%s' announcement", round_id, state)

    async def read_view(self, rnd: Round) -> dict[str, str]:
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
