"""The dashboard's HTTP server: the static page and a JSON API, on asyncio streams (stdlib only).

Routes (GET or HEAD only; anything else is 405, an unknown path 404):

    /                the page (static/index.html)
    /static/NAME     app.js, style.css: the files shipped in static/, nothing else
    /api/peers       live peers' heartbeats, exactly as `swarm-node peers --json` prints them
    /api/history     per-peer points from the heartbeats seen since the dashboard started
    /api/metrics     this node's metrics.jsonl rows (the most recent, bounded)
    /api/swarm       this node's identity, swarm counters and refusals, averaging counters
    /api/stages      the pipelines' stage maps (empty without stage servers)

Bounds: a request head of at most MAX_REQUEST_BYTES read within REQUEST_TIMEOUT_S, at most
MAX_CONNECTIONS handled at once (the next ones get 503), one request per connection. The
server binds 127.0.0.1 unless told otherwise: the page shows peers' ids and addresses.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from node.dashboard.sources import DashboardSources, SwarmWatcher, finite

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 32
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


class DashboardServer:
    def __init__(self, host: str, port: int, sources: DashboardSources, sock: socket.socket | None = None) -> None:
        self.host, self.port, self.sources = host, port, sources
        self.sock = sock  # already listening (node.stats.listening_socket), or None: bound at start
        self._server: asyncio.base_events.Server | None = None
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        # Only the files shipped beside this module can be served: no path from a request reaches the filesystem.
        self._static = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in CONTENT_TYPES}
        self._api: dict[str, Callable[[], Any]] = {
            "/api/peers": sources.peers,
            "/api/history": sources.history,
            "/api/metrics": sources.metric_rows,
            "/api/swarm": sources.swarm,
            "/api/stages": sources.stages,
        }

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/"

    async def start(self) -> None:
        if self.sources.watcher is not None:
            self.sources.watcher.start()
        where = {"sock": self.sock} if self.sock is not None else {"host": self.host, "port": self.port}
        self._server = await asyncio.start_server(self._handle, limit=MAX_REQUEST_BYTES, **where)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("serving the dashboard on %s", self.url)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        if self.sources.watcher is not None:
            await self.sources.watcher.stop()

    def route(self, method: str, target: str) -> tuple[str, str, bytes]:
        """(status, content type, body) of a request."""
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"only GET\n"
        path = urlsplit(target).path
        if path in self._api:
            body = json.dumps(finite(self._api[path]()), separators=(",", ":"), allow_nan=False).encode()
            return "200 OK", "application/json", body
        name = (
            "index.html"
            if path in ("/", "/index.html")
            else path.removeprefix("/static/")
            if path.startswith("/static/")
            else None
        )
        if name in self._static:
            file = self._static[name]
            return "200 OK", CONTENT_TYPES[file.suffix], file.read_bytes()
        return (
            "404 Not Found",
            "text/plain",
            b"not found: try / or /api/peers, /api/history, /api/metrics, /api/swarm, /api/stages\n",
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            await self._reply(writer, "GET", "503 Service Unavailable", "text/plain", b"busy\n")
            return
        async with self._slots:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=REQUEST_TIMEOUT_S)
                parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
                if len(parts) != 3:
                    await self._reply(writer, "GET", "400 Bad Request", "text/plain", b"bad request\n")
                    return
                method, target, _ = parts
                try:
                    status, content_type, body = self.route(method, target)
                except Exception:  # noqa: BLE001 - a bug in one view must not take the node down; it is logged in full
                    log.exception("dashboard: %s %s failed", method, target)
                    status, content_type, body = (
                        "500 Internal Server Error",
                        "text/plain",
                        b"internal error (see node.log)\n",
                    )
                await self._reply(writer, method, status, content_type, body)
            except (
                asyncio.TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ConnectionError,
                UnicodeDecodeError,
            ):
                writer.close()  # a client that does not speak HTTP, or too much of it, gets nothing

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, method: str, status: str, content_type: str, body: bytes) -> None:
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode() + (b"" if method == "HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass  # the page went away
        finally:
            writer.close()


def node_sources(node) -> DashboardSources:
    """What a training node shows: its own metrics and counters, and the peers its DHT sees."""
    watcher = (
        SwarmWatcher(lambda: node.session.dht if node.session is not None else None, node.config)
        if node.session is not None
        else None
    )

    def swarm() -> dict[str, Any]:
        return {
            "node": {
                "node_id": node.identity.node_id if node.identity else None,
                "name": node.config.name,
                "swarm_id": node.config.swarm.swarm_id,
                "isolated": node.config.swarm.transport == "none",
                "round": node.round,
                "policy_version": node.policy_version,
                "model": node.config.model.name_or_path,
                "addresses": node.addresses,
            },
            "stats": node.stats.snapshot(),
            "averaging": node.averaging.counters() if node.averaging else None,
        }

    return DashboardSources(watcher, node.store.metrics_path, swarm)


async def start_node_dashboard(node, sock: socket.socket | None = None) -> DashboardServer:
    """Serve the dashboard of a running node, on `sock` if it is given one already listening; its URL goes to
    <state-dir>/dashboard.txt (port 0 picks a free one)."""
    from node.files import atomic_write_text

    swarm = node.config.swarm
    server = DashboardServer(swarm.dashboard_host, swarm.dashboard_port, node_sources(node), sock)
    await server.start()
    atomic_write_text(node.store.root / "dashboard.txt", server.url + "\n")
    return server
