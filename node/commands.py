"""The node's own commands: `train` and `join` (one round loop, isolated or in a swarm), `peers`,
`identity`, `health` and `stats`. Each is a thin runner over the components that do the work, on the command
runtime (node/runtime.py: logging, signals, exit codes); node/cli.py only assembles the parsers."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from node.config import NodeConfig, load_config
from node.runtime import (
    EXIT_ERROR,
    EXIT_OK,
    error,
    leave_now,
    LoopWatchdog,
    on_stop_signals,
    restart_process,
    run_command,
    setup_logging,
    setup_viewer_logging,
    start_systemd_notifier,
    state_dir_errors,
)

if TYPE_CHECKING:
    from node.state import Runs

log = logging.getLogger("node")

STALL_POLL_S = 5.0  # how often `train`/`join` ask whether a stalled round has stayed so past swarm.stall_restart_s
# a node's event loop blocked this long is hung (nothing it serves answers): with swarm.stall_restart_s set, it restarts
LOOP_HANG_S = 300.0


# `swarm-node join` without --config: the built-in defaults turned into a swarm node.
JOIN_PRESET = [
    "swarm.transport=dht",
    "swarm.local_questions=4",
    "swarm.external_questions=4",
    "swarm.external_selection=weakness",
    "swarm.imitation=own_and_stronger_peers",
    "swarm.local_draw=balance",
    "swarm.external_gate=stronger_peer",
    "trainer.imitation_coef=4.0",
    "state_dir=~/.swarm-node/swarm",
]


def config_from_args(args: argparse.Namespace) -> NodeConfig:
    overrides = list(args.set or [])
    if args.command == "join":
        overrides = (["swarm.transport=dht"] if args.config else JOIN_PRESET) + overrides
        if args.initial_peers:
            overrides.append("swarm.initial_peers=" + json.dumps(args.initial_peers))
    return load_config(args.config, overrides, state_dir=args.state_dir, rounds=args.rounds)


# train -----------------------------------------------------------------------------------


async def _train(config: NodeConfig, fresh: bool, console: Console, runs: Runs) -> int:
    from node.display import RoundDisplay
    from node.loop import Node
    from node.state import CheckpointNotSaved, record_stop
    from node.stats import CLOCK_WARN_S

    stop = asyncio.Event()
    loading = True

    def request_stop() -> None:
        if loading:
            console.print("[yellow]stopping: the policy is still loading, nothing to save yet[/]")
        else:
            console.print("[yellow]finishing the round in flight, then saving (Ctrl-C again to quit at once)[/]")
        stop.set()

    def show_addresses(addresses: list[str]) -> None:
        console.print(
            "joined swarm " + config.swarm.swarm_id + "; others can join with --initial-peers " + " ".join(addresses),
            highlight=False,
        )

    def quit_now() -> None:
        record_stop(config.resolved_state_dir(), runs)  # the user's own stop, not a restart
        console.print("[yellow]interrupted: the round in flight is lost, the last checkpoint stands[/]")

    on_stop_signals(request_stop, on_second=quit_now)
    node = Node(config, on_addresses=show_addresses)
    node.stats.restarts = runs.restarts
    node.bind_service_ports()  # a port that is taken is refused before the policy loads
    await node.start_http()  # /healthz answers while it loads (a first start converts or builds its model)
    notifier = start_systemd_notifier(node.readiness)  # under systemd: READY=1, STATUS= and its watchdog
    try:
        if not await _until_stopped(asyncio.to_thread(node.load, fresh), stop):
            leave_now(EXIT_OK)  # the load runs on in its thread (a first run builds the default model): nothing to keep
        loading = False
        if node.identity is not None:
            console.print(f"node id {node.identity.node_id}", highlight=False)
        start = f"resuming at round {node.round}" if node.round else "fresh start"
        device = node.telemetry.device
        console.print(
            f"[bold]swarm-node[/] {config.name}: state {node.store.root}, model {config.model.name_or_path} "
            f"({config.model.dtype}) on {device}, {start}",
            highlight=False,
        )
        target = None if config.rounds is None else node.round + config.rounds
        title = (
            f"{config.name} (isolated)"
            if config.swarm.transport == "none"
            else f"{config.name} in {config.swarm.swarm_id}"
        ) + f" on {device}"
        try:
            restarts = lambda: {  # noqa: E731
                "rejoins": node.stats.swarm_rejoins,
                "stalls": node.stats.stalls,
                "restarts": node.stats.restarts,
            }
            with RoundDisplay(
                console, node.round, target, title=title, restarts=restarts, clock_warn_s=CLOCK_WARN_S
            ) as display:
                running = asyncio.ensure_future(node.run(config.rounds, stop, on_round=display.update))
                if config.swarm.stall_restart_s is not None:
                    await _restart_when_stalled(node, runs, config.swarm.stall_restart_s, stop, running, display)
                await running
        except CheckpointNotSaved as exc:  # the save on the way out: a full disk
            return error(str(exc), EXIT_ERROR)
    finally:
        if notifier is not None:
            notifier.cancel()
    console.print(
        f"saved round {node.round} (policy version {node.policy_version}) to {node.store.root}", highlight=False
    )
    return 0


async def _restart_when_stalled(node, runs: Runs, restart_after_s: float, stop, running, display) -> None:
    """Await `running` (the node's rounds) unless its round in flight stays stalled `restart_after_s` past its bound,
    or its event loop stops turning for LOOP_HANG_S: then start the process again (runtime.restart_process)."""
    from node.loop import thread_stacks
    from node.state import record_stop

    def restart(round_: int, why: str) -> None:
        display.stop()
        log.warning(
            "round %d %s: starting the process again; the round in flight is lost, the last checkpoint stands",
            round_,
            why,
        )
        record_stop(node.store.root, runs, stalled_round=round_)
        restart_process()

    def loop_hung(blocked_s: float) -> None:  # on the watchdog's thread: the loop is blocked
        in_flight, stacks = node.round + 1, thread_stacks()
        if stop.is_set():  # the user asked it to stop: a second Ctrl-C leaves at once
            log.warning("the event loop has not turned for %.0f s. Where each thread is:\n%s", blocked_s, stacks)
            return
        if runs.stall_round == in_flight:
            log.warning(
                "the event loop has not turned for %.0f s in round %d, which restarted the process once: not "
                "restarting it again. Where each thread is:\n%s",
                blocked_s,
                in_flight,
                stacks,
            )
            return
        restart(
            in_flight, f"stalled: the event loop has not turned for {blocked_s:.0f} s. Where each thread is:\n{stacks}"
        )

    loop_watchdog = LoopWatchdog(LOOP_HANG_S, loop_hung)
    loop_watchdog.start()
    stalled = asyncio.ensure_future(stalled_round_to_restart(node, runs, restart_after_s, stop))
    try:
        await asyncio.wait({running, stalled}, return_when=asyncio.FIRST_COMPLETED)
        if not running.done():
            round_, reason = stalled.result()
            restart(round_, f"stalled ({reason})")
    finally:
        stalled.cancel()
        loop_watchdog.stop()


async def stalled_round_to_restart(
    node, runs: Runs, restart_after_s: float, stop: asyncio.Event, poll_s: float = STALL_POLL_S
) -> tuple[int, str]:
    """The round in flight and /readyz's reason once that round has stayed stalled `restart_after_s` past its bound
    (swarm.stall_restart_s). A round that already restarted the process once is only reported: a round that is only
    very slow (a long evaluation) must not restart the node forever. Nor does a node asked to stop start again (a
    second Ctrl-C leaves at once)."""
    from node.stats import stall_restart_due

    said_for = None
    while True:
        await asyncio.sleep(poll_s)
        report = node.progress.report()
        if stop.is_set() or not stall_restart_due(report, restart_after_s):
            continue
        in_flight = node.round + 1
        if runs.stall_round != in_flight:
            return in_flight, report["reason"]
        if said_for != in_flight:
            said_for = in_flight
            log.warning(
                "round %d stalled again after the process restarted on it (%s): not restarting it again",
                in_flight,
                report["reason"],
            )


async def _until_stopped(work: Awaitable[Any], stop: asyncio.Event) -> bool:
    """Await `work` unless `stop` is set first: True once it is done, False when a stop came first (it is left
    running)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not task.done():
        return False
    task.result()  # its exception, if it failed
    return True


def cmd_train(args: argparse.Namespace, console: Console) -> int:
    from node.state import lock_state_dir, record_start, record_stop

    config = config_from_args(args)
    state_dir = config.resolved_state_dir()
    with state_dir_errors(state_dir):
        lock_state_dir(state_dir)  # before anything, --fresh's wipe too, touches the directory
        setup_logging(state_dir, args.verbose, console)
        runs = record_start(state_dir)
    if runs.after_unclean_end or runs.stall_restarts:
        log.info(
            "start %d of this state directory: %d after a process that did not stop cleanly, %d on a stalled round",
            runs.starts,
            runs.after_unclean_end,
            runs.stall_restarts,
        )
    code = run_command(
        _train(config, args.fresh, console, runs),
        on_interrupt=lambda: console.print(
            "[yellow]interrupted: the round in flight is lost, the last checkpoint stands[/]"
        ),
    )
    record_stop(state_dir, runs)
    return code


# peers and identity ------------------------------------------------------------------------


async def _peers(config: NodeConfig, as_json: bool, watch: bool, console: Console, stages: bool = False) -> int:
    from node.dashboard.sources import read_peer_rows
    from node.dashboard.tables import peers_table, stage_tables
    from node.pipeline.stagemap import read_stage_maps
    from node.transport.session import watch_swarm

    session = await watch_swarm(config)
    dht = session.dht
    try:
        while True:
            stage_maps = await read_stage_maps(dht, config)
            if as_json and stages:
                print(
                    json.dumps({fingerprint: stage_map.rows() for fingerprint, stage_map in stage_maps.items()}),
                    flush=True,
                )
            elif as_json:
                print(json.dumps(await read_peer_rows(dht, config)), flush=True)
            else:
                rows = await read_peer_rows(dht, config)
                if watch:
                    console.clear()
                console.print(peers_table(rows, config.swarm.swarm_id, console.width))
                for table in stage_tables(stage_maps):
                    console.print(table)
            if not watch:
                return 0
            await asyncio.sleep(2.0)
    finally:
        await session.close()


def cmd_peers(args: argparse.Namespace, console: Console) -> int:
    overrides = [
        "swarm.transport=dht",
        "swarm.host_maddrs=" + json.dumps(["/ip4/127.0.0.1/tcp/0"]),
        f"swarm.bootstrap_attempts={args.join_attempts}",
    ]
    overrides.append("swarm.initial_peers=" + json.dumps(args.initial_peers))
    if args.swarm_id:
        overrides.append(f"swarm.swarm_id={args.swarm_id}")
    config = load_config(None, overrides)
    setup_viewer_logging()
    # Ctrl-C ends --watch
    return run_command(_peers(config, args.json, args.watch, console, stages=args.stages), interrupted=EXIT_OK)


def cmd_identity(args: argparse.Namespace, console: Console) -> int:
    from node.transport.p2p_key import P2P_KEY_FILE, load_or_create_p2p_key
    from protocol import NodeIdentity

    state_dir = Path(args.state_dir or "~/.swarm-node/swarm").expanduser()
    with state_dir_errors(state_dir):  # keys that exist are only read: a read-only directory that holds them is fine
        identity = NodeIdentity.load_or_create(state_dir / "identity.key")
        peer_id = load_or_create_p2p_key(state_dir / P2P_KEY_FILE)
    if args.json:
        print(
            json.dumps(
                {
                    "node_id": identity.node_id,
                    "public_key": identity.public_key_bytes.hex(),
                    "key_file": str(state_dir / "identity.key"),
                    "peer_id": peer_id,
                    "p2p_key_file": str(state_dir / P2P_KEY_FILE),
                }
            )
        )
    else:
        print(f"node id (signs records):       {identity.node_id}")
        print(f"peer id (the /p2p/ addresses): {peer_id}")
    return 0


# health ----------------------------------------------------------------------------------


def cmd_health(args: argparse.Namespace, console: Console) -> int:
    """Exit 0 when the node answers ready (or, with --live, answers at all), 1 otherwise, with one line saying why:
    for a container's healthcheck, a supervisor or a person. Loads no model library: it runs every few seconds."""
    from node.stats import HTTP_FILE, probe

    path = "/healthz" if args.live else "/readyz"
    if args.url:
        base = args.url.rstrip("/")
    else:
        state_dir = Path(args.state_dir or NodeConfig().state_dir).expanduser()
        url_file = state_dir / HTTP_FILE
        try:
            base = url_file.read_text().strip()
        except OSError:
            print(
                f"not running: no {url_file} (a node writes it while it serves swarm.metrics_port; is it running, "
                "with swarm.metrics_port set?)"
            )
            return EXIT_ERROR
    status, body = probe(base + path, args.timeout)
    if args.json:
        answer = body if isinstance(body, dict) else {"ready": False, "reason": body}
        print(json.dumps({"url": base + path, "http_status": status, **answer}))
    if status is None or not isinstance(body, dict):
        if not args.json:
            print(f"unreachable: {base + path}: {body}")
        return EXIT_ERROR
    healthy = status == 200 and (args.live or body.get("ready") is True)
    if not args.json:
        if args.live:
            print(
                f"alive: pid {body.get('pid')}, up {body.get('uptime_s')} s ({base + path})"
                if healthy
                else f"not alive: HTTP {status} ({base + path})"
            )
        else:
            print(f"{'ready' if healthy else 'not ready'} ({body.get('status')}): {body.get('reason')}")
            if body.get("warning"):
                print(f"warning: {body['warning']}")
    return EXIT_OK if healthy else EXIT_ERROR


# stats -----------------------------------------------------------------------------------


def _pipeline_stats(state_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A pipeline driver's rows (they count steps, not rounds) or a stage server's stage.json; None for a node."""
    from node.pipeline.step_metrics import summarize_steps

    if rows and "round" not in rows[0]:
        return summarize_steps(rows)
    stage_file = state_dir / "stage.json"
    if not rows and stage_file.exists():
        recoveries = state_dir / "recoveries.jsonl"
        events = [json.loads(line) for line in recoveries.read_text().splitlines()] if recoveries.exists() else []
        return {"stage_server": json.loads(stage_file.read_text()), "weights_acquired": events}
    return None


def cmd_stats(args: argparse.Namespace, console: Console) -> int:
    # the metrics file, not node.state: reading it must not load torch (tests/test_viewing_imports.py)
    from node.metrics import METRICS_FILE, MetricsFile

    state_dir = Path(args.state_dir or NodeConfig().state_dir).expanduser()
    rows = MetricsFile(state_dir / METRICS_FILE).read()
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
                table.add_row(
                    key,
                    f"{value:.4g}"
                    if isinstance(value, float)
                    else json.dumps(value)
                    if isinstance(value, (dict, list))
                    else str(value),
                )
            console.print(table)
        return 0
    if not rows:
        console.print(f"swarm-node: error: no metrics in {state_dir} (has a node trained there?)", highlight=False)
        return 1
    from node.telemetry import summarize_metrics

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
            per_peer.add_row(
                peer[:12],
                str(counters["batches_received"]),
                str(counters["batches_accepted"]),
                str(counters["questions_used"]),
                str(counters["claimed_rewards_disagree"]),
                rejected,
            )
        console.print(per_peer)
    return 0
