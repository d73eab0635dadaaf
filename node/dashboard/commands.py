"""`swarm-node dashboard` (a viewer: the page without training) and `swarm-node simulate` (a local swarm to watch)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from node.runtime import EXIT_ERROR, error, on_stop_signals, run_command, setup_viewer_logging

DEFAULT_DASHBOARD_PORT = 8765


def add_dashboard_commands(sub) -> None:
    dashboard = sub.add_parser(
        "dashboard",
        help="serve the web dashboard of a swarm without training (a client-only viewer)",
        description="Join a swarm as a client-only DHT peer and serve the dashboard: peers' heartbeats and their "
        "curves, "
        "and with --state-dir a node's own metrics and counters.",
    )
    dashboard.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of any running peer"
    )
    dashboard.add_argument("--swarm-id", help="swarm name (default: swarm-node-public)")
    dashboard.add_argument(
        "--port",
        type=int,
        default=DEFAULT_DASHBOARD_PORT,
        help=f"port to serve on (default: {DEFAULT_DASHBOARD_PORT}; 0: any free port)",
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="interface to serve on (default: 127.0.0.1)")
    dashboard.add_argument("--state-dir", help="a node's state directory: show its metrics.jsonl and swarm.json too")
    dashboard.set_defaults(handler=cmd_dashboard)

    simulate = sub.add_parser(
        "simulate",
        help="start a local swarm of N nodes on 127.0.0.1 and a dashboard to watch it learn",
        description="Start N `swarm-node join` processes on 127.0.0.1 (node 0 first, the others joined to it) with "
        "their state directories under one folder, and node 0's dashboard. Ctrl-C stops them all.",
    )
    simulate.add_argument("--nodes", type=int, default=4, help="how many nodes (default: 4)")
    simulate.add_argument(
        "--state-dir", help="folder holding node-0/, node-1/, ... and their logs (default: ~/.swarm-node/simulate)"
    )
    simulate.add_argument(
        "--dashboard-port",
        type=int,
        default=DEFAULT_DASHBOARD_PORT,
        help=f"node 0's dashboard port (default: {DEFAULT_DASHBOARD_PORT}; 0: any free port)",
    )
    simulate.add_argument("--rounds", type=int, help="each node runs N more rounds, then exits (default: until Ctrl-C)")
    simulate.add_argument("--config", type=Path, help="YAML config for every node (default: the join defaults)")
    simulate.add_argument(
        "--fresh", action="store_true", help="start every node over (default: resume where the last simulation stopped)"
    )
    simulate.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field of every node (repeatable)"
    )
    simulate.add_argument(
        "--node-set",
        action="append",
        metavar="N:KEY=VALUE",
        help="override a config field of node N only, over --set (repeatable): e.g. nodes that know different "
        "things, 0:model.default.warmup_labels=[\"add\"]",
    )
    simulate.set_defaults(handler=cmd_simulate)


# dashboard -----------------------------------------------------------------------------------


async def _serve_viewer(config, host: str, port: int, state_dir: Path | None, console: Console) -> int:
    from node.dashboard.server import DashboardServer
    from node.dashboard.sources import DashboardSources, SwarmWatcher
    from node.stats import SwarmStats
    from node.transport.session import watch_swarm

    stats = SwarmStats()  # the viewer's own refusals: heartbeats and records it refused while reading
    session = await watch_swarm(config, refusals=stats.records)

    def swarm() -> dict[str, Any]:
        swarm_file = state_dir / "swarm.json" if state_dir else None
        counters = json.loads(swarm_file.read_text()) if swarm_file and swarm_file.exists() else stats.snapshot()
        return {
            "node": {
                "viewer": True,
                "swarm_id": config.swarm.swarm_id,
                "state_dir": str(state_dir) if state_dir else None,
            },
            "stats": counters,
            "averaging": None,
        }

    server = DashboardServer(
        host,
        port,
        DashboardSources(
            SwarmWatcher(lambda: session.dht, config, stats), state_dir / "metrics.jsonl" if state_dir else None, swarm
        ),
    )
    stop = asyncio.Event()
    on_stop_signals(stop.set)
    try:
        await server.start()
        console.print(f"dashboard of swarm {config.swarm.swarm_id}: {server.url} (Ctrl-C to stop)", highlight=False)
        await stop.wait()
    finally:
        await server.stop()
        await session.close()
    return 0


def cmd_dashboard(args: argparse.Namespace, console: Console) -> int:
    from node.config import load_config

    overrides = [
        "swarm.transport=dht",
        "swarm.host_maddrs=" + json.dumps(["/ip4/127.0.0.1/tcp/0"]),
        "swarm.initial_peers=" + json.dumps(args.initial_peers),
    ]
    if args.swarm_id:
        overrides.append(f"swarm.swarm_id={args.swarm_id}")
    config = load_config(None, overrides)
    setup_viewer_logging()
    state_dir = Path(args.state_dir).expanduser() if args.state_dir else None
    try:
        return run_command(_serve_viewer(config, args.host, args.port, state_dir, console))
    except OSError as exc:  # the port is taken, most likely
        return error(f"cannot serve on {args.host}:{args.port}: {exc}", EXIT_ERROR)


# simulate -------------------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    from node.dashboard.simulate import LocalSwarm, parse_node_overrides

    if args.nodes < 1:
        return error("--nodes must be at least 1")
    try:
        node_overrides = parse_node_overrides(args.node_set or [], args.nodes)
    except ValueError as exc:
        return error(str(exc))
    root = Path(args.state_dir or "~/.swarm-node/simulate").expanduser()
    swarm = LocalSwarm(
        root,
        args.nodes,
        args.dashboard_port,
        rounds=args.rounds,
        config=args.config,
        overrides=list(args.set or []),
        node_overrides=node_overrides,
        fresh=args.fresh,
        console=console,
    )
    return swarm.run()
