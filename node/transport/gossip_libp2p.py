"""Gossip over py-libp2p gossipsub, run in one dedicated trio thread.

py-libp2p is trio-based and the node is asyncio, so a daemon thread runs `trio.run` and
owns the host, the pubsub and the gossipsub router; nothing else touches them. Calls from
asyncio are scheduled into that thread with its `TrioToken.run_sync_soon` (thread-safe,
never blocks) and answered through `loop.call_soon_threadsafe` on an asyncio future, so
no executor thread is held while a call is in flight and every call has a trio-side
deadline. Received messages land in per-topic deques under a lock; `drain` empties them
from the asyncio side. What the deques hold between two drains is bounded in messages and in bytes (each message is
a peer's, of any size up to 1 MiB); past either bound the oldest go first, counted (`dropped`, `dropped_bytes`), and
`shed` empties them when the process is short of memory (node/host_memory.py, `MemoryBudget`).

Settings that differ from py-libp2p 0.8.1's defaults, and why (../shared/NOTES.md):
- spam protection off: by default gossipsub drops everything past 10 messages per topic
  per second from a peer; our envelopes are signed and validated above this layer.
- heartbeat every second (library default 120 s): a peer that subscribes after we joined a
  topic only enters our mesh at a heartbeat, and until then our messages skip it.
- messages over 1 MiB are silently lost by pubsub: `publish` refuses anything over
  `max_message_bytes` (1,000,000, leaving room for the signature and framing).
- the pubsub sequence number starts at the current time in nanoseconds (library: seconds):
  with a deterministic key the peer id survives a restart, and peers' seen-caches would
  silently drop a restarted node's messages whose (peer id, seqno) they saw in the last
  two minutes.
- gossipsub's equivocation table keeps every message it ever forwarded, payload included,
  for the life of the process; it is cleared periodically. Nothing is lost: it is only
  consulted for message ids absent from the seen-cache, which remembers them for
  `seen_ttl` seconds anyway.
- the per-peer outbound queue holds 32 RPCs and drops what does not fit, silently:
  `publish` waits while a peer's queue is near full, up to 2 s; a peer still full after
  that counts as stalled and is not waited for again until its queue drains.

Other py-libp2p 0.8.1 behaviour this module works around (each has a test):
- leaving `host.run()` does not close the connections we dialed: the peer never sees us
  go. `stop()` closes the host explicitly.
- pubsub's seen-cache runs a sweeping thread that nothing stops; `stop()` stops it.
- TCP listeners use SO_REUSEPORT, so two nodes given the same fixed port would share it
  silently; `start()` refuses a fixed port something already listens on.
- each received message is handled in its own trio task, so a batch can reach the
  subscription out of order; `_receive` restores each sender's order by sequence number.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import itertools
import logging
import random
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.rpc_queue import OutBoundQueueSize
from libp2p.pubsub.subscription import TrioSubscriptionAPI
from libp2p.tools.anyio_service import background_trio_service

from node.transport.gossip import Gossip

log = logging.getLogger(__name__)
# py-libp2p switches its logger's propagation off when imported (unless LIBP2P_DEBUG is set), so its
# warnings bypassed the node's log file and reached stderr raw, through logging's last resort.
# Hand them back to the node's handlers (node/cli.py keeps gossipsub's chatter off the console).
logging.getLogger("libp2p").propagate = True
# Its auto-connector aims at 50+ connections, more than a swarm of a few nodes ever has, so it reports
# "below target ... initiating N new dials" at INFO every 10 s for the node's whole life (node.log, benchmarks).
logging.getLogger("libp2p.network.auto_connector").setLevel(logging.WARNING)

T = TypeVar("T")

MAX_MESSAGE_BYTES = 1_000_000  # pubsub loses messages over 1 MiB silently; the rest is margin for signature and framing
DEFAULT_BUFFER_MESSAGES = 1024  # per topic, between two drains; the oldest is dropped beyond it
# Bytes of all topics together between two drains; the oldest are dropped beyond it. A round decodes at most
# swarm.max_batches_read_per_round values (128), and 128 honest batches of SmolLM2's 8 x 8 completions of 256 tokens
# are about 32 MiB: room for them, while 256 buffered messages of 1 MiB each would be 256 MiB.
DEFAULT_BUFFER_BYTES = 64 << 20
THREAD_NAME_PREFIX = "libp2p-gossip"
GOSSIPSUB_PROTOCOLS = [PROTOCOL_ID_V12, PROTOCOL_ID_V11, PROTOCOL_ID]  # what go-libp2p (and p2pd) speak

START_TIMEOUT_S = 15.0  # host up is ~15 ms on this machine; generous for slow ones
DIAL_TIMEOUT_S = 5.0  # per peer; a loopback connect takes ~250 ms
CALL_TIMEOUT_S = 10.0  # trio-side deadline of subscribe / publish
# Heartbeats are untrusted: a flood of fake peers each advertising an address must not turn one
# heartbeat into a thousand dials. Unreached peers are offered again next beat, so a random
# sample per call still reaches every real one.
MAX_DIALS_PER_CONNECT = 64
CALL_SLACK_S = 5.0  # the asyncio side gives up this much later, in case the trio thread died mid-call
SHUTDOWN_GRACE_S = 3.0  # graceful close of services and connections, then cancelled
STOP_JOIN_TIMEOUT_S = SHUTDOWN_GRACE_S + 3.0

HEARTBEAT_INTERVAL_S = 1  # gossipsub spec default; mesh repair and late subscribers wait for it
OUTBOUND_HIGH_WATER = OutBoundQueueSize * 3 // 4  # a peer queue this full makes publish wait
OUTBOUND_WAIT_S = 2.0  # longest a publish waits for queues to drain; a peer still full after it is "stalled"
OUTBOUND_POLL_S = 0.005
EQUIVOCATION_CLEAR_INTERVAL_S = 60.0

_instance_ids = itertools.count()


def tolerate_expired_peers(peerstore) -> None:
    """Keep py-libp2p's periodic peerstore cleanup from killing the host when peers have gone.

    py-libp2p 0.8.1's `_cleanup_expired_records` calls `maybe_delete_peer_record` for each
    expired peer, which asks `addrs()` of that peer, which raises `PeerStoreError("peer ID is
    expired")` for exactly those peers whenever one left a signed peer record: the exception
    ends the host's nursery, the gossip thread dies and the node stops ("the gossip service
    died"; seen in the lab's churn run, 2 of 8 nodes within 5 minutes). An expired peer has no
    addresses, so its record is what the cleanup meant to drop: drop it."""
    from libp2p.peer.peerstore import PeerStoreError

    delete_if_no_addresses = peerstore.maybe_delete_peer_record

    def maybe_delete_peer_record(peer_id) -> None:
        try:
            delete_if_no_addresses(peer_id)
        except PeerStoreError:
            peerstore.peer_record_map.pop(peer_id, None)

    peerstore.maybe_delete_peer_record = maybe_delete_peer_record


class LibP2PGossip(Gossip):
    """Gossipsub on a py-libp2p host listening on listen_host:listen_port (0: any free port)."""

    def __init__(
        self,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: bytes | None = None,
        *,
        max_buffered: int = DEFAULT_BUFFER_MESSAGES,
        max_buffered_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        if seed is not None and len(seed) != 32:
            raise ValueError(f"seed must be 32 bytes, got {len(seed)}")
        if max_buffered < 1:
            raise ValueError("max_buffered must be at least 1")
        if max_buffered_bytes < 1:
            raise ValueError("max_buffered_bytes must be at least 1")
        ip = ipaddress.ip_address(listen_host)  # ValueError for host names: bind to an address
        self._listen_ip, self._listen_port = ip, int(listen_port)
        self._listen_addr = multiaddr.Multiaddr(f"/ip{ip.version}/{ip}/tcp/{self._listen_port}")
        self._seed = seed
        self.max_message_bytes = MAX_MESSAGE_BYTES
        self.max_buffered = max_buffered
        self.max_buffered_bytes = max_buffered_bytes

        # Shared with the trio thread, under _inbox_lock.
        self._inbox_lock = threading.Lock()
        self._inbox: dict[str, deque[bytes]] = {}
        self._inbox_bytes = 0  # of every topic's deque together
        self._dropped_total: dict[str, int] = {}
        self._dropped_bytes_total: dict[str, int] = {}
        self._dropped_since_drain: dict[str, int] = {}

        self._thread: threading.Thread | None = None
        self.failure: Exception | None = None  # what ended the trio thread, if it died
        self._stop_flag = threading.Event()  # set by stop(); read by the trio thread once it is up
        self._token: trio.lowlevel.TrioToken | None = None  # set once the trio thread is up

        # Owned by the trio thread.
        self._host: IHost | None = None
        self._pubsub: Pubsub | None = None
        self._router: GossipSub | None = None
        self._nursery: trio.Nursery | None = None
        self._stop_event: trio.Event | None = None
        self._own_id_bytes = b""
        self._subscribed: set[str] = set()
        self._stalled_peers: set[ID] = set()

    # ---- the Gossip interface (asyncio side) ----

    async def start(self) -> list[str]:
        if self._thread is not None:
            raise RuntimeError("LibP2PGossip.start() called twice")
        self._check_port_free()
        started: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name=f"{THREAD_NAME_PREFIX}-{next(_instance_ids)}", daemon=True
        )
        self._thread.start()
        try:
            addrs = await asyncio.wait_for(asyncio.wrap_future(started), START_TIMEOUT_S)
        except BaseException:
            await self.stop()
            raise
        log.info("gossip listening on %s", ", ".join(addrs))
        return addrs

    async def connect(self, addresses: list[str]) -> int:
        # The batch itself stops at DIAL_TIMEOUT_S (see _connect_in_trio); this deadline only
        # guards against a wedged trio thread, so it leaves room for a loaded machine.
        return await self._call(self._connect_in_trio, list(addresses), timeout=DIAL_TIMEOUT_S + CALL_TIMEOUT_S)

    async def publish(self, topic: str, data: bytes) -> None:
        if len(data) > self.max_message_bytes:
            raise ValueError(f"gossip message of {len(data)} bytes exceeds max_message_bytes={self.max_message_bytes}")
        await self._call(self._publish_in_trio, topic, bytes(data), timeout=CALL_TIMEOUT_S)

    def drain(self, topic: str) -> list[bytes]:
        with self._inbox_lock:
            buffered = self._inbox.get(topic)
            messages = list(buffered) if buffered else []
            if buffered:
                buffered.clear()
                self._inbox_bytes -= sum(len(data) for data in messages)
            dropped = self._dropped_since_drain.pop(topic, 0)
            dropped_total = self._dropped_total.get(topic, 0)
        if dropped:
            log.warning(
                "gossip topic %r: %d oldest messages dropped since the last drain (buffer %d messages, %d MiB); "
                "%d in all",
                topic,
                dropped,
                self.max_buffered,
                self.max_buffered_bytes >> 20,
                dropped_total,
            )
        return messages

    async def subscribe(self, topic: str) -> None:
        await self._call(self._subscribe_in_trio, topic, timeout=CALL_TIMEOUT_S)

    async def stop(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stop_flag.set()
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._request_stop_in_trio)
            except trio.RunFinishedError:
                pass  # the trio thread already ended
        await asyncio.to_thread(thread.join, STOP_JOIN_TIMEOUT_S)
        if thread.is_alive():
            log.error(
                "gossip thread %s did not stop within %.0f s; leaving it (daemon)", thread.name, STOP_JOIN_TIMEOUT_S
            )
        self._thread = None
        self._token = None

    def peer_count(self) -> int:
        host = self._host
        if host is None or self._token is None:
            return 0
        return len(host.get_network().connections)

    # ---- extras ----

    @property
    def running(self) -> bool:
        """Whether the trio thread is up and serving; False after stop() or if it died (see `failure`)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self._token is not None and not self._stop_flag.is_set()

    def dropped(self, topic: str) -> int:
        """How many received messages on topic were dropped: the buffer was full (in messages or bytes), or shed."""
        with self._inbox_lock:
            return self._dropped_total.get(topic, 0)

    def dropped_bytes(self, topic: str) -> int:
        """The bytes of the messages `dropped` counts."""
        with self._inbox_lock:
            return self._dropped_bytes_total.get(topic, 0)

    def buffered_bytes(self) -> int:
        """Bytes of received messages waiting for a drain, every topic together (at most `max_buffered_bytes`)."""
        with self._inbox_lock:
            return self._inbox_bytes

    def shed(self) -> int:
        """Drop every message waiting for a drain, counted as dropped, and return their bytes: the process is short
        of memory, and the next round still reads peers' batches from the DHT."""
        with self._inbox_lock:
            freed = self._inbox_bytes
            for topic, buffered in self._inbox.items():
                while buffered:
                    self._drop_oldest(topic, buffered, full=False)  # the shedder says so, in one line
        return freed

    def mesh_size(self, topic: str) -> int:
        """How many peers our gossipsub mesh of topic holds: the peers our messages on it are pushed to. None at first:
        a gossipsub heartbeat (every second) grafts the peers subscribed by then."""
        router = self._router
        if router is None or not self.running:
            return 0
        # read from the asyncio thread while the trio thread changes it: a lookup and a len are atomic under the GIL
        return len(router.mesh.get(topic, ()))

    def _check_port_free(self) -> None:
        """Raise OSError if something already listens on our fixed port.

        py-libp2p listens with SO_REUSEPORT (for hole punching), so a second node given the
        same port would bind it silently and the kernel would split incoming dials between
        the two. A probe without SO_REUSEPORT fails instead. (SO_REUSEADDR on the probe lets
        a restarted node reuse its port while old connections sit in TIME_WAIT.)
        """
        if self._listen_port == 0:
            return
        family = socket.AF_INET6 if self._listen_ip.version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((str(self._listen_ip), self._listen_port))
            except OSError as exc:
                raise OSError(
                    exc.errno, f"gossip port {self._listen_ip}:{self._listen_port} is in use: {exc.strerror}"
                ) from exc

    # ---- the bridge ----

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T:
        """Run `await fn(*args)` in the trio thread under a deadline and return its result here."""
        token = self._token
        if token is None or self._stop_flag.is_set():
            raise RuntimeError("gossip is not running (start() not called, failed, or stopped)")
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[T] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:  # runs in the asyncio thread
            if answer.done():
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)

        def reply(result: Any, error: BaseException | None) -> None:  # runs in the trio thread
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is waiting any more

        async def run_in_trio() -> None:
            try:
                with trio.fail_after(timeout):
                    result = await fn(*args)
            except trio.Cancelled:
                reply(None, RuntimeError("gossip stopped before the call completed"))
                raise
            except trio.TooSlowError:
                reply(None, TimeoutError(f"gossip {fn.__name__} took more than {timeout} s"))
            except Exception as exc:  # handed to the asyncio caller, who re-raises it
                reply(None, exc)
            else:
                reply(result, None)

        def spawn() -> None:  # runs in the trio thread
            if self._nursery is None:
                reply(None, RuntimeError("gossip is shutting down"))
                return
            try:
                self._nursery.start_soon(run_in_trio)
            except RuntimeError as exc:  # the nursery is closed: shutting down
                reply(None, RuntimeError(f"gossip is shutting down: {exc}"))

        try:
            token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise RuntimeError("gossip thread is not running") from None
        return await asyncio.wait_for(answer, timeout + CALL_SLACK_S)

    # ---- the trio thread ----

    def _thread_main(self, started: concurrent.futures.Future[list[str]]) -> None:
        try:
            trio.run(self._trio_main, started)
        except Exception as exc:
            self.failure = exc
            if _settle(started, error=exc):
                return
            if self._stop_flag.is_set():
                # asked to stop: py-libp2p's services can trip over sockets its own shutdown closed (its gossipsub
                # heartbeat's EBADF, seen at a soak's stop); nothing is lost, and a stop prints no traceback
                log.info("gossip thread ended with an error while stopping: %s: %s", type(exc).__name__, exc)
                return
            log.error("gossip thread died", exc_info=exc)
        finally:
            self._token = None
            self._nursery = None
            _settle(started, error=RuntimeError("gossip thread ended before the host was up"))

    async def _trio_main(self, started: concurrent.futures.Future[list[str]]) -> None:
        host = new_host(key_pair=create_new_key_pair(self._seed), listen_addrs=[self._listen_addr])
        tolerate_expired_peers(host.get_peerstore())  # before host.run() starts its own cleanup task
        router = GossipSub(
            protocols=GOSSIPSUB_PROTOCOLS,
            degree=6,
            degree_low=4,
            degree_high=12,
            heartbeat_initial_delay=0.1,
            heartbeat_interval=HEARTBEAT_INTERVAL_S,
            spam_protection_enabled=False,
        )
        pubsub = Pubsub(host, router)
        pubsub.counter = time.time_ns()  # seqno base; see the module docstring
        own_id = host.get_id()
        self._stop_event = trio.Event()
        try:
            with trio.CancelScope() as outer:
                async with (
                    host.run(listen_addrs=[self._listen_addr]),
                    background_trio_service(pubsub),
                    background_trio_service(router),
                ):
                    async with trio.open_nursery() as nursery:
                        await pubsub.wait_until_ready()
                        self._host, self._pubsub, self._router = host, pubsub, router
                        self._nursery = nursery
                        nursery.start_soon(host.get_peerstore().start_cleanup_task, 60)
                        nursery.start_soon(self._clear_equivocation_table, router)
                        self._own_id_bytes = own_id.to_bytes()
                        self._token = trio.lowlevel.current_trio_token()
                        # start() may have given up waiting, and stop() may have run before the
                        # token was visible: then shut down at once.
                        if (
                            _settle(started, result=[str(addr) for addr in host.get_addrs()])
                            and not self._stop_flag.is_set()
                        ):
                            await self._stop_event.wait()
                        # Close services and connections gracefully, but not for ever.
                        outer.deadline = trio.current_time() + SHUTDOWN_GRACE_S
                        self._nursery = None
                        nursery.cancel_scope.cancel()
                    # Leaving host.run() only cancels the network service: the sockets of
                    # connections we dialed stay open and the peer never sees us go.
                    await host.close()
            if outer.cancelled_caught:
                log.warning("gossip shutdown took over %.0f s; cancelled", SHUTDOWN_GRACE_S)
        finally:
            # Pubsub's seen-cache sweeps in a thread of its own that pubsub never stops.
            pubsub.seen_messages.stop()

    def _request_stop_in_trio(self) -> None:
        if self._stop_event is not None:
            self._stop_event.set()

    async def _connect_in_trio(self, addresses: list[str]) -> int:
        assert self._host is not None
        host = self._host
        addrs_by_peer: dict[ID, list[multiaddr.Multiaddr]] = {}
        for text in addresses:
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(text))
            except Exception as exc:  # peers' addresses are untrusted input; multiaddr raises several types
                log.info("ignoring malformed gossip address %r: %s", text, exc)
                continue
            if info.peer_id != host.get_id():
                addrs_by_peer.setdefault(info.peer_id, []).extend(info.addrs)
        connected = host.get_network().connections
        to_dial = [peer for peer in addrs_by_peer if peer not in connected]
        if len(to_dial) > MAX_DIALS_PER_CONNECT:
            to_dial = random.sample(to_dial, MAX_DIALS_PER_CONNECT)
        succeeded = 0

        async def dial(peer: ID) -> None:
            nonlocal succeeded
            try:
                with trio.fail_after(DIAL_TIMEOUT_S):
                    await host.connect(PeerInfo(peer, addrs_by_peer[peer]))
            except Exception as exc:  # unreachable peers are normal in a swarm: report, never raise
                log.info("could not reach gossip peer %s at %s: %r", peer, [str(a) for a in addrs_by_peer[peer]], exc)
                return
            succeeded += 1

        # dials still pending then are given up: they are offered again next beat
        with trio.move_on_after(DIAL_TIMEOUT_S):
            async with trio.open_nursery() as dials:
                for peer in to_dial:
                    dials.start_soon(dial, peer)
        return succeeded

    async def _subscribe_in_trio(self, topic: str) -> None:
        assert self._pubsub is not None and self._nursery is not None
        if topic in self._subscribed:
            return
        with self._inbox_lock:
            self._inbox.setdefault(topic, deque())
        subscription = await self._pubsub.subscribe(topic)
        assert isinstance(subscription, TrioSubscriptionAPI)  # what pubsub 0.8.1 returns; _receive reads its channel
        self._subscribed.add(topic)
        self._nursery.start_soon(self._receive, topic, subscription)

    async def _receive(self, topic: str, subscription: TrioSubscriptionAPI) -> None:
        """Move every message of topic from pubsub's 32-slot channel into our buffer, at once.

        Pubsub handles each incoming message in a task of its own, and trio runs the tasks
        that became runnable together in random order: messages parsed in one step can
        reach the channel out of order. All of them are in the channel by the time this
        task wakes, so each wake-up takes everything there and restores every sender's
        order by its sequence number.
        """
        async for first in subscription:
            batch = [first]
            while True:
                try:
                    batch.append(subscription.receive_channel.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            for data in in_sender_order(batch, self._own_id_bytes):
                self._buffer(topic, data)

    def _buffer(self, topic: str, data: bytes) -> None:
        with self._inbox_lock:
            buffered = self._inbox.setdefault(topic, deque())
            dropped_before = self._dropped_since_drain.get(topic, 0)
            buffered.append(data)
            self._inbox_bytes += len(data)
            while len(buffered) > self.max_buffered:
                self._drop_oldest(topic, buffered)
            # The bound is on every topic together, and the topic that grew past it gives: with this one emptied the
            # rest hold no more than they did before, within the bound.
            while self._inbox_bytes > self.max_buffered_bytes:
                self._drop_oldest(topic, buffered)
            first_drop = dropped_before == 0 and self._dropped_since_drain.get(topic, 0) > 0
        if first_drop:
            log.warning(
                "gossip topic %r: buffer of %d messages or %d MiB full, dropping the oldest messages until drained",
                topic,
                self.max_buffered,
                self.max_buffered_bytes >> 20,
            )

    def _drop_oldest(self, topic: str, buffered: deque[bytes], full: bool = True) -> None:
        """Drop the oldest message of topic's buffer, counted; `full`: because the buffer was, which the next drain
        reports (the caller holds _inbox_lock)."""
        size = len(buffered.popleft())
        self._inbox_bytes -= size
        self._dropped_total[topic] = self._dropped_total.get(topic, 0) + 1
        self._dropped_bytes_total[topic] = self._dropped_bytes_total.get(topic, 0) + size
        if full:
            self._dropped_since_drain[topic] = self._dropped_since_drain.get(topic, 0) + 1

    async def _publish_in_trio(self, topic: str, data: bytes) -> None:
        assert self._pubsub is not None
        await self._wait_for_outbound_room()
        await self._pubsub.publish(topic, data)

    async def _wait_for_outbound_room(self) -> None:
        """Wait while a peer's outbound queue is nearly full, so that a burst is not dropped.

        A peer whose queue stays full for OUTBOUND_WAIT_S is marked stalled and not waited
        for again until its queue drains below the mark: one hung peer must not slow every
        publish.
        """
        assert self._pubsub is not None
        queues = self._pubsub.peer_queues
        self._stalled_peers = {
            peer for peer in self._stalled_peers if peer in queues and len(queues[peer]) >= OUTBOUND_HIGH_WATER
        }
        deadline = trio.current_time() + OUTBOUND_WAIT_S
        while True:
            full = [
                peer
                for peer, queue in queues.items()
                if len(queue) >= OUTBOUND_HIGH_WATER and peer not in self._stalled_peers
            ]
            if not full:
                return
            if trio.current_time() >= deadline:
                log.info(
                    "gossip: outbound queue to %d peer(s) still full after %.1f s; not waiting for them",
                    len(full),
                    OUTBOUND_WAIT_S,
                )
                self._stalled_peers.update(full)
                return
            await trio.sleep(OUTBOUND_POLL_S)

    @staticmethod
    async def _clear_equivocation_table(router: GossipSub) -> None:
        while True:
            await trio.sleep(EQUIVOCATION_CLEAR_INTERVAL_S)
            router.equivocation_detection.clear()


def _settle(future: concurrent.futures.Future[T], result: Any = None, error: BaseException | None = None) -> bool:
    """Resolve future unless it is already done or was cancelled; return whether this call resolved it."""
    if future.done() or not future.set_running_or_notify_cancel():
        return False
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
    return True


def in_sender_order(messages, own_id: bytes) -> list[bytes]:
    """The data of pubsub messages handed over together, each sender's in the order it sent them (by
    sequence number), ours left out (pubsub hands a node its own messages too)."""
    ordered = sorted(messages, key=lambda message: (message.from_id, int.from_bytes(message.seqno, "big")))
    return [message.data for message in ordered if message.from_id != own_id]
