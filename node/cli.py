"""`swarm-node`: the command line of the node."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.table import Table

from node.config import ConfigError, NodeConfig, load_config
from node.runtime import EXIT_OK, error, on_stop_signals, run_command, setup_logging, setup_viewer_logging

log = logging.getLogger("node")


# `swarm-node join` without --config: the built-in defaults turned into a swarm node.
JOIN_PRESET = ["swarm.transport=dht", "swarm.local_questions=4", "swarm.external_questions=4", "state_dir=~/.swarm-node/swarm"]


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    overrides = list(args.set or [])
    if args.command == "join":
        overrides = (["swarm.transport=dht"] if args.config else JOIN_PRESET) + overrides
        if args.initial_peers:
            overrides.append("swarm.initial_peers=" + json.dumps(args.initial_peers))
    return load_config(args.config, overrides, state_dir=args.state_dir, rounds=args.rounds)


# train -----------------------------------------------------------------------------------


async def _train(config: NodeConfig, fresh: bool, console: Console) -> int:
    from node.display import RoundDisplay
    from node.loop import Node

    stop = asyncio.Event()

    def request_stop() -> None:
        if stop.is_set():  # second interrupt: leave now, the last checkpoint stands
            raise KeyboardInterrupt
        console.print("[yellow]finishing the round in flight, then saving (Ctrl-C again to quit at once)[/]")
        stop.set()

    on_stop_signals(request_stop)
    node = Node(config)
    await asyncio.to_thread(node.load, fresh)
    if node.identity is not None:
        console.print(f"node id {node.identity.node_id}", highlight=False)
    start = f"resuming at round {node.round}" if node.round else "fresh start"
    console.print(f"[bold]swarm-node[/] {config.name}: state {node.store.root}, model {config.model.name_or_path}, {start}", highlight=False)
    target = None if config.rounds is None else node.round + config.rounds
    def show_addresses(addresses: list[str]) -> None:
        node._announce(addresses)
        console.print("joined swarm " + config.swarm.swarm_id + "; others can join with --initial-peers " + " ".join(addresses), highlight=False)

    if node.identity is not None:
        node.transport.announce = show_addresses
    title = f"{config.name} (isolated)" if config.swarm.transport == "none" else f"{config.name} in {config.swarm.swarm_id}"
    with RoundDisplay(console, node.round, target, title=title) as display:
        await node.run(config.rounds, stop, on_round=display.update)
    console.print(f"saved round {node.round} (policy version {node.policy_version}) to {node.store.root}", highlight=False)
    return 0


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    config = config_from_args(args)
    setup_logging(config.resolved_state_dir(), args.verbose, console)
    return run_command(_train(config, args.fresh, console),
                       on_interrupt=lambda: console.print("[yellow]interrupted: the round in flight is lost, the last checkpoint stands[/]"))


# peers and identity ------------------------------------------------------------------------


# (header, cell, priority): the table keeps the columns that fit the terminal, dropping the
# highest priority number first; `--json` always has every field.
PEER_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any], float], str], int], ...] = (
    ("node", lambda r, now: r["node_id"][:12], -1),
    ("name", lambda r, now: r["display_name"][:16], 1),
    ("reach", lambda r, now: r.get("reachability") or "-", 2),  # direct / relayed / outbound-only (behind NAT)
    ("round", lambda r, now: str(r["round"]), 0),
    ("policy", lambda r, now: str(r["policy_version"]), 3),
    ("reward", lambda r, now: f"{r['reward_mean']:.3f}", 0),
    ("accuracy", lambda r, now: f"{r['accuracy']:.1%}", 0),
    ("published", lambda r, now: str(r["rollouts_published"]), 5),
    ("received", lambda r, now: str(r["rollouts_received"]), 4),
    ("accepted", lambda r, now: str(r["rollouts_accepted"]), 2),
    ("rejected", lambda r, now: str(r["rollouts_rejected"]), 2),
    ("averaged", lambda r, now: f"{r['outer_steps']}/{r['outer_steps'] + r['outer_steps_skipped']}", 3),
    ("weakest", lambda r, now: _weakest_specialty(r.get("accuracy_by_dataset") or {}), 5),
    ("tokens/s", lambda r, now: f"{r['tokens_per_s']:.0f}", 4),
    ("up", lambda r, now: f"{r['uptime_s'] / 60:.1f}m", 5),
    ("seen", lambda r, now: f"{max(0.0, now - r['last_seen']):.0f}s ago", 1),
)


def _weakest_specialty(by_dataset: dict[str, float]) -> str:
    """The specialty of the node's task mix it answers worst (a peer that solves it is worth sampling), or '-'."""
    if len(by_dataset) < 2:
        return "-"
    label = min(by_dataset, key=by_dataset.get)
    return f"{label[:14]} {by_dataset[label]:.0%}"


def _peers_table(rows: list[dict[str, Any]], swarm_id: str, width: int = 200) -> Table:
    """The peers as a table no wider than `width`: columns that do not fit are left out (and named in the caption)."""
    import time

    now = time.time()
    cells = {header: [cell(row, now) for row in rows] for header, cell, _ in PEER_COLUMNS}
    column_width = {header: max([len(header), *map(len, cells[header])]) for header in cells}
    shown = [header for header, _, _ in PEER_COLUMNS]
    table_width = lambda headers: sum(column_width[h] + 3 for h in headers) + 1  # noqa: E731 - padding 1+1 and a border per column
    for header, _, _ in sorted(PEER_COLUMNS, key=lambda column: -column[2]):
        if table_width(shown) <= width or len(shown) == 1:
            break
        shown.remove(header)
    hidden = [header for header, _, _ in PEER_COLUMNS if header not in shown]
    table = Table(title=f"swarm {swarm_id}: {len(rows)} live peer(s)", caption=f"not shown for width: {', '.join(hidden)} (see --json)" if hidden else None)
    for header in shown:
        table.add_column(header, justify="left" if header in ("node", "name") else "right", no_wrap=True, min_width=len(header))
    for i in range(len(rows)):
        table.add_row(*(cells[header][i] for header in shown))
    return table


def _stage_tables(stage_maps) -> list[Table]:
    """The stage map of each pipeline in the swarm: stage -> servers, throughput, steps, recoveries."""
    tables = []
    for fingerprint, stage_map in stage_maps.items():
        table = Table(title=f"pipeline of model {fingerprint}: {stage_map.num_stages} stages, {len(stage_map.spares)} spare(s)")
        for column in ("stage", "layers", "servers", "loading", "samples/s", "step", "grad norm", "recoveries"):
            table.add_column(column, justify="left" if column in ("servers", "loading") else "right")
        for row in stage_map.rows():
            table.add_row(str(row["stage"]), row["layers"], " ".join(n[:8] for n in row["servers"]) or "[red]none[/]", " ".join(n[:8] for n in row["loading"]),
                          f"{row['samples_per_s']:.1f}", str(row["step"]), f"{row['grad_norm']:.3f}", str(row["recoveries"]))
        tables.append(table)
    return tables


async def _peers(config: NodeConfig, as_json: bool, watch: bool, console: Console, stages: bool = False) -> int:
    from node.dashboard.sources import read_peer_rows
    from node.pipeline.stagemap import read_stage_maps
    from node.transport.dht import create_dht_node, shutdown_dht

    dht = await create_dht_node(config, client_mode=True)
    try:
        while True:
            stage_maps = await read_stage_maps(dht, config)
            if as_json and stages:
                print(json.dumps({fingerprint: stage_map.rows() for fingerprint, stage_map in stage_maps.items()}), flush=True)
            elif as_json:
                print(json.dumps(await read_peer_rows(dht, config)), flush=True)
            else:
                rows = await read_peer_rows(dht, config)
                if watch:
                    console.clear()
                console.print(_peers_table(rows, config.swarm.swarm_id, console.width))
                for table in _stage_tables(stage_maps):
                    console.print(table)
            if not watch:
                return 0
            await asyncio.sleep(2.0)
    finally:
        await shutdown_dht(dht)


def cmd_peers(args: argparse.Namespace, console: Console) -> int:
    overrides = ["swarm.transport=dht", "swarm.host_maddrs=" + json.dumps(["/ip4/127.0.0.1/tcp/0"]), f"swarm.bootstrap_attempts={args.join_attempts}"]
    overrides.append("swarm.initial_peers=" + json.dumps(args.initial_peers))
    if args.swarm_id:
        overrides.append(f"swarm.swarm_id={args.swarm_id}")
    config = load_config(None, overrides)
    setup_viewer_logging()
    return run_command(_peers(config, args.json, args.watch, console, stages=args.stages), interrupted=EXIT_OK)  # Ctrl-C ends --watch


def cmd_identity(args: argparse.Namespace, console: Console) -> int:
    from node.transport.p2p_key import P2P_KEY_FILE, load_or_create_p2p_key
    from protocol import NodeIdentity

    state_dir = Path(args.state_dir or "~/.swarm-node/swarm").expanduser()
    identity = NodeIdentity.load_or_create(state_dir / "identity.key")
    peer_id = load_or_create_p2p_key(state_dir / P2P_KEY_FILE)
    if args.json:
        print(json.dumps({"node_id": identity.node_id, "public_key": identity.public_key_bytes.hex(), "key_file": str(state_dir / "identity.key"),
                          "peer_id": peer_id, "p2p_key_file": str(state_dir / P2P_KEY_FILE)}))
    else:
        print(f"node id (signs records):       {identity.node_id}")
        print(f"peer id (the /p2p/ addresses): {peer_id}")
    return 0


# stats -----------------------------------------------------------------------------------


def summarize_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"rounds": 0}
    tenth = max(1, len(rows) // 10)
    heldout = [(r["round"], r["heldout_accuracy"]) for r in rows if "heldout_accuracy" in r]
    return {
        "rounds": rows[-1]["round"],
        "policy_version": rows[-1]["policy_version"],
        "reward_mean_first_10pct": statistics.fmean(r["reward_mean"] for r in rows[:tenth]),
        "reward_mean_last_10pct": statistics.fmean(r["reward_mean"] for r in rows[-tenth:]),
        "accuracy_first_10pct": statistics.fmean(r["accuracy"] for r in rows[:tenth]),
        "accuracy_last_10pct": statistics.fmean(r["accuracy"] for r in rows[-tenth:]),
        "heldout_accuracy_first": heldout[0][1] if heldout else None,
        "heldout_accuracy_last": heldout[-1][1] if heldout else None,
        "tokens_per_s_mean": statistics.fmean(r["tokens_per_s"] for r in rows),
        "step_s_mean": statistics.fmean(r["step_s"] for r in rows),
        "external_questions_total": sum(r.get("external_questions", 0) for r in rows),
        "wall_s": rows[-1]["time"] - rows[0]["time"] + rows[0]["step_s"],
        "by_dataset": _by_dataset(rows, tenth),
    }


def _by_dataset(rows: list[dict[str, Any]], tenth: int) -> dict[str, dict[str, float | None]]:
    """Per specialty of the task mix: reward of the node's own completions early and late, held-out accuracy first and last."""
    labels = sorted({label for r in rows for label in r.get("reward_by_dataset", {})} | {label for r in rows for label in r.get("heldout_by_dataset", {})})

    def mean_reward(part: list[dict[str, Any]], label: str) -> float | None:
        values = [r["reward_by_dataset"][label] for r in part if label in r.get("reward_by_dataset", {})]
        return statistics.fmean(values) if values else None

    summary = {}
    for label in labels:
        heldout = [r["heldout_by_dataset"][label] for r in rows if label in r.get("heldout_by_dataset", {})]
        summary[label] = {"reward_first_10pct": mean_reward(rows[:tenth], label), "reward_last_10pct": mean_reward(rows[-tenth:], label),
                          "heldout_first": heldout[0] if heldout else None, "heldout_last": heldout[-1] if heldout else None}
    return summary


def _pipeline_stats(state_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A pipeline driver's rows (they count steps, not rounds) or a stage server's stage.json; None for a node."""
    from node.pipeline.lm import summarize_steps

    if rows and "round" not in rows[0]:
        return summarize_steps(rows)
    stage_file = state_dir / "stage.json"
    if not rows and stage_file.exists():
        recoveries = state_dir / "recoveries.jsonl"
        events = [json.loads(line) for line in recoveries.read_text().splitlines()] if recoveries.exists() else []
        return {"stage_server": json.loads(stage_file.read_text()), "weights_acquired": events}
    return None


def cmd_stats(args: argparse.Namespace, console: Console) -> int:
    from node.state import StateStore

    state_dir = Path(args.state_dir or NodeConfig().state_dir).expanduser()
    store = StateStore(state_dir)
    rows = store.read_metrics() if store.metrics_path.exists() else []
    pipeline = _pipeline_stats(state_dir, rows)
    if pipeline is not None:
        summary = {"state_dir": str(state_dir), **pipeline}
        if args.json:
            print(json.dumps(summary))
        else:
            table = Table(title=f"pipeline statistics: {state_dir}", show_header=False)
            table.add_column("metric")
            table.add_column("value", justify="right")
            for key, value in summary.items():
                table.add_row(key, f"{value:.4g}" if isinstance(value, float) else json.dumps(value) if isinstance(value, (dict, list)) else str(value))
            console.print(table)
        return 0
    if not rows:
        console.print(f"swarm-node: error: no metrics in {state_dir} (has a node trained there?)", highlight=False)
        return 1
    summary = {"state_dir": str(state_dir), **summarize_metrics(rows)}
    swarm_file = state_dir / "swarm.json"
    if swarm_file.exists():
        summary["swarm"] = json.loads(swarm_file.read_text())
    if args.json:
        print(json.dumps(summary))
        return 0
    table = Table(title=f"node statistics: {state_dir}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        if key not in ("swarm", "by_dataset"):
            table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    for key, value in summary.get("swarm", {}).get("totals", {}).items():
        table.add_row(f"swarm.{key}", str(value))
    console.print(table)
    if summary["by_dataset"]:
        specialties = Table(title="by specialty (reward of own completions; greedy held-out accuracy)")
        columns = ("reward_first_10pct", "reward_last_10pct", "heldout_first", "heldout_last")
        specialties.add_column("dataset")
        for column in columns:
            specialties.add_column(column.replace("_", " "), justify="right")
        for label, values in summary["by_dataset"].items():
            specialties.add_row(label, *("-" if values[c] is None else f"{values[c]:.3f}" for c in columns))
        console.print(specialties)
    peers = summary.get("swarm", {}).get("peers", {})
    if peers:
        per_peer = Table(title="rollouts received per peer")
        for column in ("peer", "received", "accepted", "questions used", "rewards disagree", "rejected"):
            per_peer.add_column(column)
        for peer, counters in sorted(peers.items()):
            rejected = ", ".join(f"{reason}={count}" for reason, count in counters["rejected"].items()) or "-"
            per_peer.add_row(peer[:12], str(counters["batches_received"]), str(counters["batches_accepted"]), str(counters["questions_used"]), str(counters["claimed_rewards_disagree"]), rejected)
        console.print(per_peer)
    return 0


# parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-node", description="A peer-to-peer node for RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_training_arguments(command: argparse.ArgumentParser, default_config: str, default_state: str) -> None:
        command.add_argument("--config", type=Path, help=f"YAML config (default: {default_config})")
        command.add_argument("--state-dir", help=f"where the policy, optimizer, metrics and logs live (default: {default_state})")
        command.add_argument("--rounds", type=int, help="run N more rounds from wherever the state stands (default: until interrupted)")
        command.add_argument("--fresh", action="store_true", help="discard the checkpoints and metrics in the state directory and start over")
        command.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set trainer.lr=2e-5 (repeatable)")
        command.add_argument("-v", "--verbose", action="store_true", help="show info logs on the console (they always go to node.log)")
        command.set_defaults(handler=cmd_train)

    train = sub.add_parser("train", help="train in isolation (no network), resuming from the state directory", description="Run the node's round loop alone: rollouts, local scoring, GRPO updates, checkpoints.")
    add_training_arguments(train, "built-in defaults, as configs/isolated.yaml", "~/.swarm-node/state")
    join = sub.add_parser("join", help="join a swarm over the DHT and train on own and peers' rollouts (SAPO)", description="The same loop as train, publishing rollouts to peers found over a hivemind DHT and mixing theirs into each batch.")
    add_training_arguments(join, "built-in defaults with 4 local + 4 external questions, as configs/swarm.yaml", "~/.swarm-node/swarm")
    join.add_argument("--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of running peers (none: start a new swarm)")

    peers = sub.add_parser("peers", help="list the live peers of a swarm and their statistics", description="Join a swarm as a client-only DHT peer and print every live node's signed heartbeat.")
    peers.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR", help="multiaddrs of any running peer")
    peers.add_argument("--swarm-id", help="swarm name (default: swarm-node-public)")
    # A starved machine's p2pd can miss its first dial to the bootstrap peer; the backoff between
    # attempts (2, 4, 8 s) lets it through, and a dead address still fails in well under a minute.
    peers.add_argument("--join-attempts", type=int, default=4, metavar="N", help="tries to reach --initial-peers, with doubling backoff (default: 4)")
    peers.add_argument("--json", action="store_true", help="print a JSON list, one object per peer")
    peers.add_argument("--watch", action="store_true", help="refresh every 2 s until Ctrl-C")
    peers.add_argument("--stages", action="store_true", help="with --json: print the pipelines' stage maps (stage -> servers, throughput, recoveries) instead")
    peers.set_defaults(handler=cmd_peers)

    identity = sub.add_parser("identity", help="print this node's ids (creating its keys on first use)", description="Print the node id (from the Ed25519 key that signs its records) and the peer id of its p2p daemon (the /p2p/ part of its addresses), both kept in the state directory.")
    identity.add_argument("--state-dir", help="state directory holding identity.key (default: ~/.swarm-node/swarm)")
    identity.add_argument("--json", action="store_true", help="print node id, public key, peer id and key files as JSON")
    identity.set_defaults(handler=cmd_identity)

    stats = sub.add_parser("stats", help="summarize a node's metrics", description="Summarize metrics.jsonl of a state directory.")
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
    console = Console(stderr=False, soft_wrap=True)  # a line per message: logs and tests must not find words split by wrapping
    if getattr(args, "rounds", None) is not None and args.rounds < 1:
        return error("--rounds must be at least 1")
    try:
        return args.handler(args, console)
    except ConfigError as exc:
        return error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
