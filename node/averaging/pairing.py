"""Averaging with peers: pairs of peers (NoLoCo) or all live peers (DiLoCo baseline), one round at a time.

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

A round, in two rooms (hivemind splits its averager the same way: matchmaking.py and allreduce.py):
- finding partners, `node/averaging/matchmaking.py`: signed "free"/"done" announcements under the round's DHT
  key, an agreed random pairing (or everyone, in all mode), who calls whom and when to give up;
- the exchange, `node/averaging/exchange.py`: our weights for a partner's over one p2p stream, each side
  validating the other's full weights before committing.
`PairAverager` here runs a round from the snapshot to the mean, and the node's stream handler for the exchange.

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
`outcome_unconfirmed` (exchange.py); in all mode, peers whose views differ (churn) can end
with different groups and so different means.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.averaging.exchange import Named, WeightExchange
from node.averaging.matchmaking import DIAL_BACKOFF_S, MAX_GROUP_PARTNERS, Matchmaker, Round
from node.transport.protobuf_shim import import_hivemind_isolated
from node.transport.records import RecordWriter
from node.weights.codec import MODES

import_hivemind_isolated()  # before any hivemind import: keeps its protobuf names out of libp2p's way

from hivemind.p2p import P2PDaemonError  # noqa: E402

log = logging.getLogger(__name__)


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


class PairAverager:
    """Averages named tensors with one partner (group_size=2) or all live peers (group_size=None).

    `dht` is the node's running hivemind `DHTNode` (its `p2p` carries the streams). The
    caller owns the DHT; `stop()` leaves it running. `exchange` builds the exchange's two sides
    (exchange.WeightExchange, or a subclass that plays a faulty peer in tests). `addresses` says where
    peers dial this node now, read for each announcement: the swarm session's, which its membership
    refreshes (a relay slot reserved late, or again after a relay restart). Without it (a bare DHT
    node: tests, benchmarks) the daemon's visible addresses at `start()` are announced.
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
        dial_backoff_s: float = DIAL_BACKOFF_S,  # libp2p's; a peer we failed to dial is called again after it
        writer: RecordWriter,
        exchange: Callable[..., WeightExchange] = WeightExchange,
        addresses: Callable[[], list[str]] | None = None,
    ) -> None:
        if group_size not in (2, None):
            raise ValueError("group_size must be 2 (NoLoCo pairs) or None (all live peers)")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        self.dht = dht
        self.prefix = prefix
        self.group_size = group_size
        self.peer_id = dht.peer_id.to_base58()
        self.refusals: Counter[str] = Counter()  # partners' weights we refused, by WeightsRefusal code
        self.failures: Counter[str] = Counter()  # everything else that kept a round or an attempt from averaging
        self.rounds_averaged = 0
        self.rounds_skipped = 0
        self.rounds_to_deadline = 0  # rounds that ran until their deadline (rather than ending when nobody was left)
        # why the last average() returned None (None: it averaged): "no_partner" / "no_partner_in_window" (nobody to
        # exchange with), "not_committed" (weights moved but were refused, or the stream broke), or
        # "own_weights_not_finite"
        self.last_skip: str | None = None
        self.exchange = exchange(
            dht.p2p,
            prefix,
            mode=mode,
            max_relative_distance=max_relative_distance,
            dht_timeout=dht_timeout,
            refusals=self.refusals,
            failures=self.failures,
            dial_backoff_s=dial_backoff_s,
            busy_retry_s=poll_interval,
        )
        self._addresses = addresses
        self.matchmaker = Matchmaker(
            dht,
            writer,
            prefix,
            self.peer_id,
            self.exchange.call,
            self.failures,
            addresses=lambda: self._addresses(),
            group_size=group_size,
            poll_interval=poll_interval,
            call_patience_s=call_patience_s,
            settle_s=settle_s,
            gather_s=gather_s,
            dht_timeout=dht_timeout,
        )
        self._averaging = False  # an average() call is running (set before its first await)
        self._tasks: set[asyncio.Task] = set()  # stream handlers and late announcements in flight
        self._done_announcements: set[asyncio.Task] = set()  # "done" announcements in flight: stop() lets them land
        self._started = False

    # lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        if self._addresses is None:  # nothing refreshes a bare DHT node's addresses: ask its daemon once
            visible = [str(a) for a in await self.dht.get_visible_maddrs()]
            self._addresses = lambda: visible
        await self.dht.p2p.add_binary_stream_handler(self.exchange.handler_name, self._handle)
        self._started = True

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting exchanges and end the ones in flight (within `timeout`), after the last round's "done"
        announcement has landed (within `timeout` too): a node that leaves right after a round must not stay "free" in
        its peers' views. They would call a dead daemon, and each failed dial costs them libp2p's dial backoff: two of
        four lab peers gave up a round that way under load (tests/test_lab.py's NoLoCo pairs)."""
        if self._done_announcements:
            await asyncio.wait(list(self._done_announcements), timeout=timeout)
        self.exchange.close()
        if self._started:
            self._started = False
            try:
                await asyncio.wait_for(self.dht.p2p.remove_binary_stream_handler(self.exchange.handler_name), timeout)
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

    async def _handle(self, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """An incoming exchange (called by the p2p daemon's stream handler); `stop()` ends it."""
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self.exchange.accept(stream_info, reader, writer)
        finally:
            self._tasks.discard(task)

    # one round -----------------------------------------------------------------------

    async def average(
        self, named_theta: Named, round_id: int, timeout: float, find_within: float | None = None
    ) -> AveragingResult | None:
        """Average a snapshot of `named_theta` (taken now; the tensors are never modified) with peers.

        Returns None when no partner committed within `timeout` seconds (or every partner's weights were refused);
        never waits on peers beyond the timeout. With `find_within`, the round also ends after that many seconds if
        no exchange has begun by then (the caller's window for the round is over: later peers are in another).
        """
        if not self._started:
            raise RuntimeError("PairAverager.start() was not awaited")
        if self._averaging:
            raise RuntimeError("an exchange is already running; average() rounds must not overlap")
        self._averaging = True
        self.last_skip = None
        try:
            return await self._average(named_theta, round_id, timeout, find_within)
        finally:
            self._averaging = False

    async def _average(
        self, named_theta: Named, round_id: int, timeout: float, find_within: float | None
    ) -> AveragingResult | None:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # a window that outlasts the deadline changes nothing: the round ends at its deadline as without one
        find_by = None if find_within is None or find_within >= timeout else loop.time() + max(0.0, find_within)
        theta = {name: t.detach().to("cpu").clone() for name, t in named_theta.items()}
        if not all(bool(torch.isfinite(t).all()) for t in theta.values()):
            log.warning("round %d: not averaging: our own weights are not finite", round_id)
            self.failures["own_weights_not_finite"] += 1
            self.rounds_skipped += 1
            self.last_skip = "own_weights_not_finite"
            return None
        payload = await asyncio.to_thread(self.exchange.encode, theta)
        rnd = Round(
            round_id=round_id,
            theta=theta,
            payload=payload,
            capacity=1 if self.group_size == 2 else MAX_GROUP_PARTNERS,
            deadline=deadline,
            find_by=find_by,
        )
        self.exchange.open(rnd)
        try:
            await asyncio.wait_for(self.matchmaker.run(rnd), timeout=rnd.remaining())
        except asyncio.TimeoutError:
            self.rounds_to_deadline += 1
        finally:
            self.exchange.close()
        # "done" either way: we no longer take partners this round (our "free" would otherwise outlive the round)
        done = self._spawn(self.matchmaker.announce(round_id, "done"), name=f"averaging-done-{round_id}")
        self._done_announcements.add(done)
        done.add_done_callback(self._done_announcements.discard)
        if not rnd.received:
            if rnd.swaps:
                self.last_skip = "not_committed"  # weights moved, and one side refused or the stream broke
            else:
                self.last_skip = "no_partner_in_window" if rnd.search_ended else "no_partner"
            self.failures[self.last_skip] += 1
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

    def _mean(self, rnd: Round) -> Named:
        members = sorted([(self.peer_id, rnd.theta), *rnd.received.items()], key=lambda item: item[0])
        mean = {}
        for name in rnd.theta:
            total = members[0][1][name].to(torch.float32).clone()
            for _, weights in members[1:]:
                total += weights[name].to(torch.float32)
            mean[name] = total / len(members)
        return mean
