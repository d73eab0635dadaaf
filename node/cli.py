"""`swarm-node`: the command line of the node."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from node.config import ConfigError, NodeConfig, load_config

EXIT_USAGE = 2
log = logging.getLogger("node")


def _setup_logging(state_dir: Path, verbose: bool, console: Console) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(state_dir / "node.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    screen = RichHandler(console=console, show_path=False, level=logging.INFO if verbose else logging.WARNING)
    root.handlers[:] = [file_handler, screen]
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its per-save bars would drown the round display
    transformers.utils.logging.set_verbosity_error()


def _config_from_args(args: argparse.Namespace) -> NodeConfig:
    return load_config(args.config, args.set or [], state_dir=args.state_dir, rounds=args.rounds)


# train -----------------------------------------------------------------------------------


async def _train(config: NodeConfig, fresh: bool, console: Console) -> int:
    from node.display import RoundDisplay
    from node.loop import Node

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def request_stop() -> None:
        if stop.is_set():  # second interrupt: leave now, the last checkpoint stands
            raise KeyboardInterrupt
        console.print("[yellow]finishing the round in flight, then saving (Ctrl-C again to quit at once)[/]")
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop)

    node = Node(config)
    await asyncio.to_thread(node.load, fresh)
    console.print(
        f"[bold]swarm-node[/] {config.name}: state {node.store.root}, model {config.model.name_or_path}, "
        f"resuming at round {node.round}" if node.round else f"[bold]swarm-node[/] {config.name}: state {node.store.root}, model {config.model.name_or_path}, fresh start",
        highlight=False,
    )
    target = None if config.rounds is None else node.round + config.rounds
    with RoundDisplay(console, node.round, target, title=f"{config.name} (isolated)" if config.swarm.transport == "none" else config.name) as display:
        await node.run(config.rounds, stop, on_round=display.update)
    console.print(f"saved round {node.round} (policy version {node.policy_version}) to {node.store.root}", highlight=False)
    return 0


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    config = _config_from_args(args)
    _setup_logging(config.resolved_state_dir(), args.verbose, console)
    try:
        return asyncio.run(_train(config, args.fresh, console))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: the round in flight is lost, the last checkpoint stands[/]")
        return 130


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
    }


def cmd_stats(args: argparse.Namespace, console: Console) -> int:
    from node.state import StateStore

    state_dir = Path(args.state_dir or NodeConfig().state_dir).expanduser()
    store = StateStore(state_dir)
    if not store.metrics_path.exists():
        console.print(f"swarm-node: error: no metrics in {state_dir} (has a node trained there?)", highlight=False)
        return 1
    summary = {"state_dir": str(state_dir), **summarize_metrics(store.read_metrics())}
    if args.json:
        print(json.dumps(summary))
        return 0
    table = Table(title=f"node statistics: {state_dir}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in summary.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    console.print(table)
    return 0


# parser ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-node", description="A peer-to-peer node for RL post-training of language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser("train", help="train in isolation (no network), resuming from the state directory", description="Run the node's round loop alone: rollouts, local scoring, GRPO updates, checkpoints.")
    train.add_argument("--config", type=Path, help="YAML config (default: built-in defaults, as configs/isolated.yaml)")
    train.add_argument("--state-dir", help="where the policy, optimizer, metrics and logs live (default: ~/.swarm-node/state)")
    train.add_argument("--rounds", type=int, help="run N more rounds from wherever the state stands (default: until interrupted)")
    train.add_argument("--fresh", action="store_true", help="discard the checkpoints and metrics in the state directory and start over")
    train.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set trainer.lr=2e-5 (repeatable)")
    train.add_argument("-v", "--verbose", action="store_true", help="show info logs on the console (they always go to node.log)")
    train.set_defaults(handler=cmd_train)

    stats = sub.add_parser("stats", help="summarize a node's metrics", description="Summarize metrics.jsonl of a state directory.")
    stats.add_argument("--state-dir", help="state directory to read (default: ~/.swarm-node/state)")
    stats.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    stats.set_defaults(handler=cmd_stats)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console(stderr=False)
    if getattr(args, "rounds", None) is not None and args.rounds < 1:
        print("swarm-node: error: --rounds must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.handler(args, console)
    except ConfigError as exc:
        print(f"swarm-node: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
