"""`swarm-node`: the command line of the node. This module only assembles the parsers; each command
lives with what it runs (node/commands.py, node/pipeline/commands.py, node/dashboard/commands.py)."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from pathlib import Path

from rich.console import Console

from node.commands import cmd_health, cmd_identity, cmd_peers, cmd_stats, cmd_train
from node.config import ConfigError
from node.runtime import EXIT_INTERRUPTED, error, stopped_while_starting, take_startup_signals


# parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm-node", description="A peer-to-peer node for RL post-training of language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_training_arguments(command: argparse.ArgumentParser, default_config: str, default_state: str) -> None:
        command.add_argument("--config", type=Path, help=f"YAML config (default: {default_config})")
        command.add_argument(
            "--state-dir", help=f"where the policy, optimizer, metrics and logs live (default: {default_state})"
        )
        command.add_argument(
            "--rounds", type=int, help="run N more rounds from wherever the state stands (default: until interrupted)"
        )
        command.add_argument(
            "--fresh",
            action="store_true",
            help="discard the checkpoints and metrics in the state directory and start over",
        )
        command.add_argument(
            "--set",
            action="append",
            metavar="KEY=VALUE",
            help="override a config field, e.g. --set trainer.lr=2e-5 (repeatable)",
        )
        command.add_argument(
            "-v", "--verbose", action="store_true", help="show info logs on the console (they always go to node.log)"
        )
        command.set_defaults(handler=cmd_train)

    train = sub.add_parser(
        "train",
        help="train in isolation (no network), resuming from the state directory",
        description="Run the node's round loop alone: rollouts, local scoring, GRPO updates, checkpoints.",
    )
    add_training_arguments(train, "built-in defaults, as configs/isolated.yaml", "~/.swarm-node/state")
    join = sub.add_parser(
        "join",
        help="join a swarm over the DHT and train on own and peers' rollouts (SAPO)",
        description="The same loop as train, publishing rollouts to peers found over a hivemind DHT and mixing theirs "
        "into each batch.",
    )
    add_training_arguments(
        join, "built-in defaults with 4 local + 4 external questions, as configs/swarm.yaml", "~/.swarm-node/swarm"
    )
    join.add_argument(
        "--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of running peers (none: start a new swarm)"
    )

    peers = sub.add_parser(
        "peers",
        help="list the live peers of a swarm and their statistics",
        description="Join a swarm as a client-only DHT peer and print every live node's signed heartbeat.",
    )
    peers.add_argument(
        "--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of any running peer"
    )
    peers.add_argument("--swarm-id", help="swarm name (default: swarm-node-public)")
    # A starved machine's p2pd can miss its first dial to the bootstrap peer; the backoff between
    # attempts (2, 4, 8 s) lets it through, and a dead address still fails in well under a minute.
    peers.add_argument(
        "--join-attempts",
        type=int,
        default=4,
        metavar="N",
        help="tries to reach --initial-peers, with doubling backoff (default: 4)",
    )
    peers.add_argument("--json", action="store_true", help="print a JSON list, one object per peer")
    peers.add_argument("--watch", action="store_true", help="refresh every 2 s until Ctrl-C")
    peers.add_argument(
        "--stages",
        action="store_true",
        help="with --json: print the pipelines' stage maps (stage -> servers, throughput, recoveries) instead",
    )
    peers.set_defaults(handler=cmd_peers)

    identity = sub.add_parser(
        "identity",
        help="print this node's ids (creating its keys on first use)",
        description="Print the node id (from the Ed25519 key that signs its records) and the peer id of its p2p daemon "
        "(the /p2p/ part of its addresses), both kept in the state directory.",
    )
    identity.add_argument("--state-dir", help="state directory holding identity.key (default: ~/.swarm-node/swarm)")
    identity.add_argument(
        "--json", action="store_true", help="print node id, public key, peer id and key files as JSON"
    )
    identity.set_defaults(handler=cmd_identity)

    health = sub.add_parser(
        "health",
        help="ask a running node whether it is ready (exit 0) or not (exit 1)",
        description="Read a running node's /readyz (joined, training, its last round within the stall bound; "
        "swarm.stall_factor, swarm.stall_min_s) or, with --live, /healthz (the process answers). The node serves "
        "them beside /metrics when swarm.metrics_port is set, and writes their URL to <state-dir>/http.txt.",
    )
    where = health.add_mutually_exclusive_group()
    where.add_argument("--state-dir", help="the node's state directory (default: ~/.swarm-node/state)")
    where.add_argument("--url", help="the node's HTTP server instead, e.g. http://127.0.0.1:9100")
    health.add_argument("--live", action="store_true", help="only whether the process answers (/healthz)")
    health.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for an answer")
    health.add_argument("--json", action="store_true", help="print the endpoint's JSON answer")
    health.set_defaults(handler=cmd_health)

    stats = sub.add_parser(
        "stats", help="summarize a node's metrics", description="Summarize metrics.jsonl of a state directory."
    )
    stats.add_argument("--state-dir", help="state directory to read (default: ~/.swarm-node/state)")
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    stats.set_defaults(handler=cmd_stats)

    from node.pipeline.commands import add_pipeline_commands

    add_pipeline_commands(sub)
    from node.dashboard.commands import add_dashboard_commands

    add_dashboard_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack: for hung nodes
    args = build_parser().parse_args(argv)
    # a line per message: logs and tests must not find words split by wrapping
    console = Console(stderr=False, soft_wrap=True)
    if getattr(args, "rounds", None) is not None and args.rounds < 1:
        return error("--rounds must be at least 1")
    take_startup_signals()
    try:
        return args.handler(args, console)
    except ConfigError as exc:
        return error(str(exc))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception:
        if not stopped_while_starting():
            raise
        print("swarm-node: stopped while starting", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
