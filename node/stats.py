"""Swarm statistics of one node: per-peer counters, the heartbeat it publishes, /metrics.

Counters are plain integers owned by the node; the transport and the loop record into
them, the heartbeat and the Prometheus endpoint read them, and `swarm.json` in the state
directory keeps them for `swarm-node stats`.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import math
import os
import socket
import statistics
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from node.config import ConfigError
from node.files import write_snapshot
from protocol import Refusal, RefusalCounter
from protocol.bounded import BoundedDict

log = logging.getLogger(__name__)


@dataclass
class PeerCounters:
    batches_received: int = 0  # decoded envelopes of kind rollout_batch, before any check of ours
    batches_accepted: int = 0
    questions_received: int = 0
    questions_used: int = 0  # sampled into one of our training batches
    claimed_rewards_disagree: int = 0  # questions whose advisory rewards differ from our re-scoring
    last_seen: float = 0.0


MAX_TRACKED_PEERS = 1024  # throwaway identities must not grow memory without bound
LOG_EVERY_S = 60.0  # one log line per (peer, reason) this often: a flood of bad values must not flood the log


class LogThrottle:
    """Says whether a line about `key` is due: at most one per key every `every_s` seconds, for the newest `cap`
    keys (a flood of bad values from throwaway peer ids must flood neither the log nor memory)."""

    def __init__(self, every_s: float = LOG_EVERY_S, cap: int = MAX_TRACKED_PEERS) -> None:
        self.every_s = every_s
        self._last: BoundedDict[tuple[str, ...], float] = BoundedDict(cap)

    def due(self, *key: str) -> bool:
        now = time.monotonic()
        if now - self._last.get(key, -math.inf) < self.every_s:
            return False
        self._last[key] = now
        return True

    def __len__(self) -> int:
        """Keys remembered (at most the cap)."""
        return len(self._last)


class RefusedOnce:
    """Digests of the values already refused, the newest `cap` of them: a bad value that stays in the DHT
    (or is retried) is counted once, however often it is read or stored again."""

    def __init__(self, cap: int = 4096) -> None:
        self.cap = cap
        self._digests: BoundedDict[bytes, None] = BoundedDict(cap)

    def first_time(self, *parts: bytes) -> bool:
        digest = hashlib.sha256(b"\x00".join(parts)).digest()[:16]
        seen = digest in self._digests
        self._digests[digest] = None  # seen again: the newest, so a value read every round stays remembered
        return not seen


class RecordRefusals:
    """Refused DHT records by reason and claimed owner, bounded; one log line per (owner, reason) a minute.

    A record is counted once however often it is refused (hivemind retries a refused store, and
    a peer holding a bad record returns it to every lookup): the validator passes its bytes as `record`."""

    def __init__(self, max_owners: int = MAX_TRACKED_PEERS) -> None:
        self.by_reason: Counter[str] = Counter()
        self.by_owner: BoundedDict[str, Counter[str]] = BoundedDict(max_owners)
        self.max_owners = max_owners
        self.once = RefusedOnce()
        self.log_throttle = LogThrottle(cap=max_owners)

    def record(self, owner: str, reason: str, detail: str, record: tuple[bytes, ...] = ()) -> None:
        if record and not self.once.first_time(*record):
            return
        self.by_reason[reason] += 1
        counts = self.by_owner.get(owner) or Counter()
        counts[reason] += 1
        self.by_owner[owner] = counts
        if self.log_throttle.due(owner, reason):
            log.info("refused a DHT record claimed by %s: %s: %s", owner[:12], reason, detail)

    def snapshot(self) -> dict:
        return {"by_reason": dict(self.by_reason), "by_owner": {owner: dict(c) for owner, c in self.by_owner.items()}}


CLOCK_WINDOW_S = 40.0  # a peer's lead is read off its messages of about this long ago at most (two halves kept)
CLOCK_WARN_S = 30.0  # an offset past this is said: the heartbeats' and the gossip's own delays stay well below it


@dataclass(frozen=True)
class ClockReading:
    offset_s: float  # this node's clock minus the swarm's (the median of its peers'): positive when it is ahead
    peers: int  # how many peers' signed times it was read off


class ClockOffsets:
    """How far this node's clock is from its peers', read off the times they sign their messages.

    A message arrives after it was signed, so (its signed time - this node's clock) is at most how far its sender's
    clock leads this node's, and nearest it for the freshest messages: a peer's lead is the largest over its messages
    of the last `window_s` (by the monotonic clock, so that a jump of the wall clock shows within one window). The
    swarm's clock is the median of its peers': peers that sign false times move it no further than the honest ones'
    spread while they are a minority. Every signed time counts, a refused one's too ("signed in the future"), except
    this node's own (`own_id`: its records come back to it through the DHT, and would pull the median to zero)."""

    def __init__(
        self,
        own_id: str | None = None,
        window_s: float = CLOCK_WINDOW_S,
        cap: int = MAX_TRACKED_PEERS,
        clock=time.monotonic,
    ) -> None:
        self.own_id = own_id
        self.half_s = window_s / 2
        self.clock = clock
        # per peer: (start of the current half, the largest lead in it, the largest lead in the half before)
        self._leads: BoundedDict[str, tuple[float, float, float]] = BoundedDict(cap)

    def observe(self, peer: str, signed_at: float, now: float) -> None:
        if peer == self.own_id:
            return
        lead, at = signed_at - now, self.clock()
        started, current, before = self._leads.get(peer, (at, -math.inf, -math.inf))
        if at - started >= 2 * self.half_s:
            started, current, before = at, -math.inf, -math.inf
        elif at - started >= self.half_s:
            started, current, before = at, -math.inf, current
        self._leads[peer] = (started, max(current, lead), before)

    def peer_leads(self) -> dict[str, float]:
        """How far each peer's clock leads this node's, in seconds, for the peers heard from within the window."""
        at = self.clock()
        leads = {}
        for peer, (started, current, before) in self._leads.items():
            if at - started < self.half_s:
                leads[peer] = max(current, before)
            elif at - started < 2 * self.half_s:
                leads[peer] = current
        return leads

    def reading(self) -> ClockReading | None:
        """This node's offset from the swarm's clock (None: no peer heard from within the window)."""
        leads = list(self.peer_leads().values())
        return ClockReading(-statistics.median(leads), len(leads)) if leads else None


def clock_advice(reading: ClockReading | None, max_batch_age_s: float, max_clock_skew_s: float) -> str | None:
    """What the operator must hear of this node's clock, with what it costs (None: within CLOCK_WARN_S of the
    swarm's, or not measured)."""
    if reading is None or abs(reading.offset_s) < CLOCK_WARN_S:
        return None
    off = abs(reading.offset_s)
    source = (
        "its one peer's signed times" if reading.peers == 1 else f"the median of {reading.peers} peers' signed times"
    )
    where = "ahead of" if reading.offset_s > 0 else "behind"
    said = f"this node's clock looks {off:.0f} s {where} the swarm's ({source}): "
    if reading.offset_s > 0:
        said += (
            f"its peers' rollouts look {off:.0f} s older to it than they are (it drops those past "
            f"swarm.max_batch_age_s={max_batch_age_s:.0f} s)"
        )
        beyond = "its peers refuse whatever it signs as signed in the future"
    else:
        said += (
            f"its rollouts look {off:.0f} s older to its peers than they are (they drop those past their "
            "swarm.max_batch_age_s)"
        )
        beyond = "it refuses whatever its peers sign as signed in the future"
    return said + f", and past {max_clock_skew_s:.0f} s {beyond}; set the system clock right (timedatectl set-ntp true)"


class SwarmStats:
    def __init__(self, own_id: str | None = None) -> None:
        """`own_id`: the node's own id, where it has one (its own records are no peer's)."""
        self.started = time.time()
        self.peers: BoundedDict[str, PeerCounters] = BoundedDict(MAX_TRACKED_PEERS)  # least recently seen first
        self.refusals = RefusalCounter(max_peers=MAX_TRACKED_PEERS)
        self.batches_published = 0
        self.questions_published = 0
        self.bytes_published = 0
        self.bytes_received = 0
        self.gossip_messages_received = 0  # pushed over gossipsub (also counted in batches once decoded)
        self.gossip_messages_dropped = 0  # lost by the gossip layer's bounded buffer between two rounds
        self.gossip_bytes_dropped = 0  # their bytes (the buffer is bounded in messages and in bytes)
        self.memory_sheds = 0  # times the process was over swarm.rss_budget_mb and dropped peers' buffers
        self.memory_bytes_shed = 0  # the bytes those sheds dropped
        self.values_read = (
            0  # rollout values that reached this node: DHT values read (again each round) and gossip messages
        )
        self.bytes_read = 0  # their bytes: what the node received for rollouts, before any check
        self.values_decoded = 0  # new values decoded and verified: at most swarm.max_batches_read_per_round a round
        self.values_left_unread = (
            0  # new values past the round's budget (swarm.max_batches_read_per_round), not decoded
        )
        self.rollout_reads_failed = (
            0  # rollout shard reads that failed or timed out (a key past p2pd's message limit fails whole)
        )
        self.swarm_size_estimate = (
            0  # live nodes, this one included, as the heartbeat shards last read show them (0: not measured)
        )
        self.swarm_connections_lost = 0  # times a part of its swarm connection died (the p2p daemon, membership, ...)
        self.swarm_rejoins = 0  # times it rejoined after one: the same identity and p2p key, a new session
        self.stalls = 0  # rounds that ran past the stall bound (swarm.stall_factor, swarm.stall_min_s)
        # the state directory's process restarts (node.state.Runs): after one that did not stop cleanly, or on a stall
        self.restarts = 0
        self.round_rejected: Counter = Counter()  # since the last metrics row
        self.heartbeat_refusals = RefusalCounter(max_peers=MAX_TRACKED_PEERS)  # peers' heartbeats refused when read
        self.heartbeats_refused_once = RefusedOnce()  # a refused heartbeat is read every beat: count it once
        # DHT records refused by the validator (node/transport/records.py), by claimed owner
        self.records = RecordRefusals()
        self.heartbeat_log_throttle = LogThrottle()
        self.clock = ClockOffsets(own_id)  # fed by every peer's record and push this node decodes

    def peer(self, peer_id: str) -> PeerCounters:
        counters = self.peers.get(peer_id) or PeerCounters()
        counters.last_seen = time.time()
        self.peers[peer_id] = counters
        return counters

    def count_shed(self, report) -> None:
        """A `ShedReport` of the node's `MemoryBudget` (node/host_memory.py)."""
        self.memory_sheds += 1
        self.memory_bytes_shed += sum(report.shed.values())

    def count_read(self, raw: object) -> None:
        self.values_read += 1
        self.bytes_read += len(raw) if isinstance(raw, bytes) else 0

    def reject(self, peer_id: str, reason: Refusal) -> None:
        self.refusals.record(peer_id, reason)
        self.round_rejected[reason.value] += 1

    def reject_heartbeat(self, peer_id: str, rejection) -> None:
        """A peer's heartbeat that failed the protocol's checks: counted, logged at most once a minute per peer and
        reason."""
        self.heartbeat_refusals.record(peer_id, rejection)
        if self.heartbeat_log_throttle.due(peer_id, rejection.reason.value):
            log.info("refused a heartbeat stored as %s: %s", peer_id[:12], rejection)

    def rejected_by(self, peer_id: str) -> dict[str, int]:
        return self.refusals.by_peer().get(peer_id, {})

    def take_round_rejections(self) -> dict[str, int]:
        rejected, self.round_rejected = dict(self.round_rejected), Counter()
        return rejected

    def totals(self) -> dict[str, Any]:
        return {
            "peers_seen": len(self.peers),
            "batches_published": self.batches_published,
            "questions_published": self.questions_published,
            "bytes_published": self.bytes_published,
            "bytes_received": self.bytes_received,
            "gossip_messages_received": self.gossip_messages_received,
            "gossip_messages_dropped": self.gossip_messages_dropped,
            "gossip_bytes_dropped": self.gossip_bytes_dropped,
            "memory_sheds": self.memory_sheds,
            "memory_bytes_shed": self.memory_bytes_shed,
            "values_read": self.values_read,
            "bytes_read": self.bytes_read,
            "values_decoded": self.values_decoded,
            "values_left_unread": self.values_left_unread,
            "rollout_reads_failed": self.rollout_reads_failed,
            "swarm_connections_lost": self.swarm_connections_lost,
            "swarm_rejoins": self.swarm_rejoins,
            "stalls": self.stalls,
            "restarts": self.restarts,
            "swarm_size_estimate": self.swarm_size_estimate,
            **self.clock_totals(),
            "batches_received": sum(c.batches_received for c in self.peers.values()),
            "batches_accepted": sum(c.batches_accepted for c in self.peers.values()),
            "questions_used": sum(c.questions_used for c in self.peers.values()),
            "claimed_rewards_disagree": sum(c.claimed_rewards_disagree for c in self.peers.values()),
            "rejected": self.refusals.by_reason(),
            "heartbeats_rejected": self.heartbeat_refusals.by_reason(),
            "dht_records_rejected": dict(self.records.by_reason),
        }

    def clock_totals(self) -> dict[str, Any]:
        reading = self.clock.reading()
        return {
            "clock_offset_s": None if reading is None else round(reading.offset_s, 1),
            "clock_peers": 0 if reading is None else reading.peers,
        }

    def snapshot(self) -> dict[str, Any]:
        rejected = self.refusals.by_peer()
        peers = {peer: {**asdict(c), "rejected": rejected.get(peer, {})} for peer, c in self.peers.items()}
        for peer, counts in rejected.items():  # peers that only ever sent refused values
            peers.setdefault(peer, {**asdict(PeerCounters()), "rejected": counts})
        return {
            "totals": self.totals(),
            "peers": peers,
            "heartbeat_refusals": self.heartbeat_refusals.by_peer(),
            "dht_record_refusals": self.records.snapshot()["by_owner"],
            # how far each peer heard from lately leads this node's clock (ClockOffsets), in s
            "clock_leads": {peer: round(lead, 1) for peer, lead in self.clock.peer_leads().items()},
        }

    def save(self, path: Path) -> None:
        write_snapshot(path, json.dumps(self.snapshot(), indent=1))  # skipped while the disk is full


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def prometheus_text(node_gauges: dict[str, float], stats: SwarmStats) -> str:
    """The Prometheus text exposition of the node's gauges and swarm counters."""
    lines = []
    for name, value in node_gauges.items():
        lines += [f"# TYPE swarm_node_{name} gauge", f"swarm_node_{name} {float(value)}"]
    totals = stats.totals()
    for name in (
        "batches_published",
        "questions_published",
        "bytes_published",
        "bytes_received",
        "values_read",
        "bytes_read",
        "values_decoded",
        "values_left_unread",
        "gossip_messages_dropped",
        "gossip_bytes_dropped",
        "rollout_reads_failed",
        "swarm_connections_lost",
        "swarm_rejoins",
        "stalls",
        "restarts",
        "memory_sheds",
        "memory_bytes_shed",
    ):
        lines += [f"# TYPE swarm_node_{name}_total counter", f"swarm_node_{name}_total {totals[name]}"]
    lines += [
        "# TYPE swarm_node_swarm_size_estimate gauge",
        f"swarm_node_swarm_size_estimate {totals['swarm_size_estimate']}",
    ]
    if totals["clock_offset_s"] is not None:  # no sample: no figure, rather than a zero that reads as "in time"
        lines += [
            "# TYPE swarm_node_clock_offset_seconds gauge",
            f"swarm_node_clock_offset_seconds {totals['clock_offset_s']}",
        ]
    lines += ["# TYPE swarm_node_clock_peers gauge", f"swarm_node_clock_peers {totals['clock_peers']}"]
    per_peer = (
        "batches_received",
        "batches_accepted",
        "questions_received",
        "questions_used",
        "claimed_rewards_disagree",
    )
    for name in per_peer:
        lines.append(f"# TYPE swarm_node_peer_{name}_total counter")
        for peer, counters in stats.peers.items():
            lines.append(f'swarm_node_peer_{name}_total{{peer="{_escape(peer)}"}} {getattr(counters, name)}')
    lines.append("# TYPE swarm_node_peer_clock_lead_seconds gauge")
    for peer, lead in stats.clock.peer_leads().items():
        lines.append(f'swarm_node_peer_clock_lead_seconds{{peer="{_escape(peer)}"}} {lead}')
    lines.append("# TYPE swarm_node_peer_rejected_total counter")
    for peer, counts in stats.refusals.by_peer().items():
        for reason, count in counts.items():
            lines.append(f'swarm_node_peer_rejected_total{{peer="{_escape(peer)}",reason="{_escape(reason)}"}} {count}')
    lines.append("# TYPE swarm_node_heartbeat_rejected_total counter")
    for peer, counts in stats.heartbeat_refusals.by_peer().items():
        for reason, count in counts.items():
            lines.append(
                f'swarm_node_heartbeat_rejected_total{{peer="{_escape(peer)}",reason="{_escape(reason)}"}} {count}'
            )
    lines.append("# TYPE swarm_node_dht_record_rejected_total counter")
    for owner, counts in stats.records.by_owner.items():
        for reason, count in counts.items():
            lines.append(
                f'swarm_node_dht_record_rejected_total{{owner="{_escape(owner)}",reason="{_escape(reason)}"}} {count}'
            )
    return "\n".join(lines) + "\n"


def listening_socket(host: str, port: int, setting: str) -> socket.socket:
    """A TCP socket listening on host:port for a server the node starts later (/metrics, the dashboard), so that a
    port another program holds is refused at once, in one line naming `setting` (ConfigError: exit status 2), and not
    once the node has loaded its policy and joined its swarm."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot listen on {host!r}: {exc.strerror or exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's servers: a restart gets its port back
        sock.bind(address)
        sock.listen(100)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be used ({exc.strerror})"
        raise ConfigError(f"{setting}: port {port} on {host} {why}: choose another port, or 0 for a free one") from None
    return sock


HTTP_FILE = "http.txt"  # the URL of a process's /metrics, /healthz and /readyz: for `swarm-node health --state-dir`


class RoundProgress:
    """Whether a loop of rounds (a node's, or a pipeline driver's steps) is making progress, for /readyz.

    Ready once the services are up and a round has completed since; not ready once the round in flight has run longer
    than the bound, max(`min_s`, `factor` x the median of the recent rounds): a round that takes a few times its usual
    time (an evaluation, a checkpoint) is no stall, one that takes ten times as long is. Times are monotonic, so a
    jump of the wall clock neither raises nor hides a stall."""

    def __init__(self, factor: float, min_s: float, clock: Callable[[], float] = time.monotonic, window: int = 32):
        self.factor, self.min_s, self.clock = factor, min_s, clock
        self.durations: deque[float] = deque(maxlen=window)
        self.round: int | None = None
        self.started_at = clock()
        self.up_at: float | None = None  # the services are up: joined, serving
        self.last_round_at: float | None = None
        self.stopping = False
        self.phase: str | None = None  # what the round in flight is doing ("generating", "training", ...)
        self.phase_at: float | None = None

    def services_up(self) -> None:
        self.up_at = self.last_round_at = self.clock()

    def enter(self, phase: str) -> None:
        """The round in flight starts `phase`: a stall is reported with the part it is blocked in."""
        self.phase, self.phase_at = phase, self.clock()

    def round_done(self, round_: int, duration_s: float) -> None:
        self.round = round_
        self.durations.append(duration_s)
        self.last_round_at = self.clock()
        self.phase = self.phase_at = None

    def bound_s(self) -> float:
        if not self.durations:
            return self.min_s
        return max(self.min_s, self.factor * statistics.median(self.durations))

    def report(self, problem: str | None = None) -> dict[str, Any]:
        """/readyz's body: `ready`, a `status` (starting, ready, stalled, stopping, or down when `problem` names a
        part that failed), a `reason` a person reads, and the figures it was decided on."""
        now = self.clock()
        body: dict[str, Any] = {"round": self.round, "uptime_s": round(now - self.started_at, 1)}
        since = None if self.last_round_at is None else now - self.last_round_at
        if since is not None:
            body["since_progress_s"] = round(since, 1)
        body["bound_s"] = round(self.bound_s(), 1)
        if self.phase is not None:
            body["phase"], body["phase_s"] = self.phase, round(now - self.phase_at, 1)
        if self.stopping:
            status, reason = "stopping", "the node is stopping"
        elif problem is not None:
            status, reason = "down", problem
        elif self.up_at is None:
            status, reason = "starting", "loading the policy and joining"
        elif self.round is None:
            status, reason = "starting", f"the first round is in flight ({since:.0f} s)"
        elif since > body["bound_s"]:
            status, reason = "stalled", f"no round completed for {since:.0f} s (bound {body['bound_s']:.0f} s)"
            if self.phase is not None:
                reason += f", {self.phase} for {body['phase_s']:.0f} s"
        else:
            status, reason = "ready", f"round {self.round} completed {since:.0f} s ago"
        return {"ready": status == "ready", "status": status, "reason": reason, **body}


def stall_restart_due(report: dict[str, Any], restart_after_s: float | None) -> bool:
    """Whether a round /readyz calls stalled (RoundProgress.report) has stayed so `restart_after_s` past its bound
    (swarm.stall_restart_s; None: never)."""
    if restart_after_s is None or report["status"] != "stalled":
        return False
    return report.get("since_progress_s", 0.0) >= report["bound_s"] + restart_after_s


def local_url(host: str, port: int) -> str:
    """The URL a process on this machine reaches a server at: a wildcard interface is reached over loopback."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class MetricsServer:
    """A minimal HTTP endpoint: GET /metrics (Prometheus text), /healthz (the process answers: 200) and /readyz (200
    when `readiness` says ready, else 503; JSON saying why)."""

    def __init__(
        self,
        host: str,
        port: int,
        render: Callable[[], str],
        sock: socket.socket | None = None,
        readiness: Callable[[], dict[str, Any]] | None = None,
        url_file: Path | None = None,
    ):
        self.host, self.port, self.render = host, port, render
        self.sock = sock  # already listening (listening_socket), or None: bound at start
        # None: ready whenever it answers (a process with no loop of rounds to watch)
        self.readiness = readiness or (lambda: {"ready": True, "status": "ready", "reason": "serving"})
        self.url_file = url_file  # where its URL is written while it serves (HTTP_FILE in the state directory)
        self.started_at = time.monotonic()
        self._server: asyncio.base_events.Server | None = None

    @property
    def url(self) -> str:
        return local_url(self.host, self.port)

    async def start(self) -> None:
        if self.sock is not None:
            self._server = await asyncio.start_server(self._handle, sock=self.sock)
        else:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        if self.url_file is not None:
            write_snapshot(self.url_file, self.url + "\n")
        log.info("serving metrics on %s/metrics, health on /healthz and /readyz", self.url)

    def respond(self, path: bytes) -> tuple[bytes, bytes, bytes]:
        """(status, content type, body) for a GET of `path`."""
        path = path.split(b"?", 1)[0]
        if path == b"/metrics":
            return b"200 OK", b"text/plain; version=0.0.4", self.render().encode()
        if path == b"/healthz":
            alive = {"alive": True, "pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started_at, 1)}
            return b"200 OK", b"application/json", json.dumps(alive).encode() + b"\n"
        if path == b"/readyz":
            report = self.readiness()
            status = b"200 OK" if report["ready"] else b"503 Service Unavailable"
            return status, b"application/json", json.dumps(report).encode() + b"\n"
        return b"404 Not Found", b"text/plain", b"not found: try /metrics, /healthz or /readyz\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
            path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b""
            status, content_type, body = self.respond(path)
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + content_type
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that does not speak HTTP gets nothing
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.url_file is not None:  # a stopped process leaves no URL that a later one's port could answer
            self.url_file.unlink(missing_ok=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def probe(url: str, timeout_s: float) -> tuple[int | None, dict[str, Any] | str]:
    """GET `url` (/healthz or /readyz): (HTTP status, its JSON body), or (None, why it could not be read)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:  # 503: not ready, and the body says why
        status, raw = exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, f"{reason.strerror if isinstance(reason, OSError) and reason.strerror else reason}"
    try:
        body = json.loads(raw)
    except ValueError:
        return status, f"not a health endpoint (HTTP {status}, {len(raw)} bytes that are not JSON)"
    return status, body if isinstance(body, dict) else f"not a health endpoint (HTTP {status})"
