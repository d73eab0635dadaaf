"""The web dashboard: a plain page served by a node (`swarm.dashboard_port`) or by a viewer.

`sources.py` gathers what the page shows (peers' heartbeats and their history, this node's
metrics rows, its swarm counters, the pipelines' stage maps); `server.py` serves it as a
small JSON API plus the static page in `static/` (hand-written JS drawing SVG, no build
step, nothing fetched from the internet).
"""

from node.dashboard.server import DashboardServer
from node.dashboard.sources import DashboardSources, peer_rows, read_peer_rows

__all__ = ["DashboardServer", "DashboardSources", "peer_rows", "read_peer_rows"]
