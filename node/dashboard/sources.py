"""What the dashboard shows, gathered and bounded.

- peers: every live peer's verified heartbeat, as the rows `swarm-node peers --json`
  prints (`read_peer_rows` is that command's function too);
- peer history: the heartbeats this dashboard has seen since it started, per peer
  (MAX_HISTORY_PER_PEER points of MAX_PEERS_KEPT peers, least recently seen dropped first):
  peers' reward and accuracy curves come from here, since a heartbeat carries only the
  present;
- metrics: this node's rows of `metrics.jsonl`, read incrementally (the last
  MAX_METRIC_ROWS);
- swarm: refusals and counters (`SwarmStats.snapshot()`), averaging counters;
- stages: the pipelines' stage maps, one entry per model (empty when no stage server runs).

A `SwarmWatcher` polls the DHT every `poll_s` seconds in the background, so an HTTP
request never waits on the network and many open pages cost the swarm nothing more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from node.aio import cancel_and_wait
from protocol.bounded import BoundedDict

log = logging.getLogger(__name__)

MAX_PEERS_KEPT = 256  # peers whose history is kept (throwaway identities must not grow memory)
MAX_HISTORY_PER_PEER = 720  # heartbeat points per peer: an hour at one poll per 5 s
MAX_METRIC_ROWS = 2000  # this node's most recent rows served under /api/metrics
MAX_LINE_BYTES = 1 << 20  # a metrics line longer than this is skipped, not parsed
HISTORY_FIELDS = (
    "round",
    "policy_version",
    "reward_mean",
    "accuracy",
    "tokens_per_s",
    "outer_steps",
    "outer_steps_skipped",
)


def peer_rows(peers) -> list[dict[str, Any]]:
    """Heartbeats (as `read_peer_stats` returns them) as JSON rows sorted by node id."""
    return sorted((asdict(stats) for stats, _ in peers), key=lambda row: row["node_id"])


async def read_peer_rows(dht, config, stats=None) -> list[dict[str, Any]]:
    """Every live peer's verified heartbeat, from every heartbeat shard (the listing is the one read that grows
    with the swarm): what `swarm-node peers --json` prints and `/api/peers` serves (the page shows 256 of them)."""
    from node.transport.peers import read_peer_stats

    return peer_rows(await read_peer_stats(dht, config, stats, limit=None))


async def read_stage_list(dht, config) -> list[dict[str, Any]]:
    """The pipelines of the swarm for `/api/stages`: one entry per model, its stages as `StageMap.rows()`."""
    from node.pipeline.stagemap import read_stage_maps

    return [
        {
            "model_fingerprint": fingerprint,
            "num_stages": stage_map.num_stages,
            "spares": [s.node_id for s in stage_map.spares],
            "stages": stage_map.rows(),
        }
        for fingerprint, stage_map in (await read_stage_maps(dht, config)).items()
    ]


def finite(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None: JSON has no such numbers and browsers refuse them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class PeerHistory:
    """Per-peer points from the heartbeats seen, bounded in peers and in points per peer."""

    def __init__(self, max_peers: int = MAX_PEERS_KEPT, max_points: int = MAX_HISTORY_PER_PEER) -> None:
        self.max_peers, self.max_points = max_peers, max_points
        self._points: BoundedDict[str, deque] = BoundedDict(self.max_peers)  # least recently seen first

    def add(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            node_id = row["node_id"]
            points = self._points.get(node_id) or deque(maxlen=self.max_points)
            # The same heartbeat read twice (polls are faster than heartbeats) is one point.
            if not points or points[-1]["time"] != row["last_seen"]:
                point = {"time": row["last_seen"], **{k: row[k] for k in HISTORY_FIELDS if k in row}}
                point.update({k: v for k, v in row.items() if k.endswith("_by_dataset") and isinstance(v, dict)})
                points.append(point)
            self._points[node_id] = points

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        return {node_id: list(points) for node_id, points in self._points.items()}


class MetricsTail:
    """The last `max_rows` complete rows of a metrics.jsonl, read incrementally.

    A file that shrank (rows newer than the checkpoint dropped on resume, or --fresh) is
    read again from the start; a line cut by a kill is left until its newline arrives.
    """

    def __init__(self, path: Path, max_rows: int = MAX_METRIC_ROWS) -> None:
        self.path = path
        self.rows: deque[dict[str, Any]] = deque(maxlen=max_rows)
        self._offset = 0
        self._inode: int | None = None

    def read(self) -> list[dict[str, Any]]:
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self.rows.clear()
            self._offset, self._inode = 0, None
            return []
        if stat.st_ino != self._inode or stat.st_size < self._offset:  # replaced (atomic rewrite) or truncated
            self.rows.clear()
            self._offset, self._inode = 0, stat.st_ino
        if stat.st_size > self._offset:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read(stat.st_size - self._offset)
            complete = data[: data.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.splitlines():
                if len(line) > MAX_LINE_BYTES:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict):
                    self.rows.append(row)
        return list(self.rows)


class SwarmWatcher:
    """Polls the DHT for peers' heartbeats and the stage maps, keeping the latest and a history. `dht_of` gives the DHT
    node to read at each poll (a node that lost its swarm connection rejoins over a new one; None meanwhile: the last
    poll stands)."""

    def __init__(self, dht_of: Callable[[], Any], config, stats=None, poll_s: float = 2.0) -> None:
        self.dht_of, self.config, self.stats, self.poll_s = dht_of, config, stats, poll_s
        self.peers: list[dict[str, Any]] = []
        self.stages: list[dict[str, Any]] = []
        self.history = PeerHistory()
        self.last_poll: float | None = None
        self._task: asyncio.Task | None = None

    async def poll(self) -> None:
        dht = self.dht_of()
        if dht is None:
            return
        self.peers = await read_peer_rows(dht, self.config, self.stats)
        self.history.add(self.peers)
        self.stages = await read_stage_list(dht, self.config)
        self.last_poll = time.time()

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception as exc:  # noqa: BLE001 - a DHT hiccup must not end the dashboard; the page shows the last poll's age
                log.warning("dashboard: reading the swarm failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.poll_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dashboard-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task], "dashboard watcher")
            self._task = None


class DashboardSources:
    """Everything the API serves. `swarm` returns this node's counters (or a viewer's); `watcher` is None without a
    DHT."""

    def __init__(
        self, watcher: SwarmWatcher | None, metrics_path: Path | None, swarm: Callable[[], dict[str, Any]]
    ) -> None:
        self.watcher = watcher
        self.metrics = MetricsTail(metrics_path) if metrics_path is not None else None
        self.swarm_view = swarm
        self.started = time.time()

    def peers(self) -> list[dict[str, Any]]:
        return self.watcher.peers if self.watcher else []

    def history(self) -> dict[str, list[dict[str, Any]]]:
        return self.watcher.history.snapshot() if self.watcher else {}

    def metric_rows(self) -> list[dict[str, Any]]:
        return self.metrics.read() if self.metrics else []

    def stages(self) -> list[dict[str, Any]]:
        """Hook for the stage map section of the page: one entry per pipeline (model) of the swarm."""
        return self.watcher.stages if self.watcher else []

    def swarm(self) -> dict[str, Any]:
        view = dict(self.swarm_view())
        view["dashboard"] = {
            "started": self.started,
            "last_poll": self.watcher.last_poll if self.watcher else None,
            "poll_s": self.watcher.poll_s if self.watcher else None,
            "now": time.time(),
        }
        return view
