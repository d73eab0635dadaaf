"""`swarm-node serve` (a stage server or spare) and `swarm-node drive` (the pipeline's driver).

Both join the swarm's DHT like `join` does (the first node of a swarm prints the address
the others pass as --initial-peers and writes it to <state-dir>/addresses.txt), build the
initial model only to know its architecture and fingerprint (and, for a server of a
pipeline that has not trained yet, its first weights), and stop cleanly on Ctrl-C/SIGTERM.
Their session's membership keeps them joined (node/transport/membership.py), as it does a
training node: it learns where its peers are from the stage announcements, since neither
role reads heartbeats. A connection that dies (the p2p daemon exits or stops answering, a
membership service dies) is rejoined with backoff and the same identity, as a training node's
is: a server takes its stage up again over the new session, a driver takes its step again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path

from rich.console import Console

from node.runtime import error, on_stop_signals, run_command, setup_logging, start_systemd_notifier, state_dir_errors

log = logging.getLogger(__name__)

PIPELINE_PRESET = ["swarm.transport=dht", "state_dir=~/.swarm-node/pipeline"]


def add_pipeline_commands(sub) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve one pipeline stage of a model split across nodes (CheckFree recovery)",
        description="Serve a pipeline stage: an index, 'auto' (the least-served stage) or 'spare' (take over a stage "
        "whose last server died).",
    )
    add_common(serve)
    serve.add_argument("--stage", help="stage index, 'auto' or 'spare' (default: pipeline.stage, 'auto')")
    serve.set_defaults(handler=cmd_serve)
    drive = sub.add_parser(
        "drive",
        help="train a model split across stage servers (language-model loss on the offline corpus)",
        description="Send micro-batches through random routes of live stage servers, step them, and record loss and "
        "recoveries.",
    )
    add_common(drive)
    drive.add_argument("--steps", type=int, help="run N more steps (default: until interrupted)")
    drive.set_defaults(handler=cmd_drive)


def add_common(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--config", type=Path, help="YAML config (default: built-in defaults; see configs/pipeline.yaml)"
    )
    command.add_argument(
        "--state-dir", help="where logs, metrics and the identity live (default: ~/.swarm-node/pipeline)"
    )
    command.add_argument(
        "--initial-peers", nargs="+", metavar="MADDR", help="multiaddrs of running peers (none: start a new swarm)"
    )
    command.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)")
    command.add_argument(
        "-v", "--verbose", action="store_true", help="show info logs on the console (they always go to node.log)"
    )


def _config(args):
    from node.config import load_config

    overrides = ["swarm.transport=dht"] if args.config else list(PIPELINE_PRESET)
    overrides += list(args.set or [])
    if args.initial_peers:
        overrides.append("swarm.initial_peers=" + json.dumps(args.initial_peers))
    if getattr(args, "stage", None) is not None:
        overrides.append(f"pipeline.stage={args.stage}")
    return load_config(args.config, overrides, state_dir=args.state_dir)


async def _join(config, console: Console, role: str):
    """The swarm session and initial model: what both roles need first."""
    import torch

    from node.device import HOST
    from node.host_memory import keep_freed_memory
    from node.model import model_fingerprint, resolve_initial_policy
    from protocol import NodeIdentity

    if config.pipeline.keep_freed_memory:  # before the worker threads start: the arena limit binds only new arenas
        keep_freed_memory()
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    state_dir = config.resolved_state_dir()
    identity = NodeIdentity.load_or_create(state_dir / "identity.key")
    torch.manual_seed(config.seed)
    # on the CPU: a stage server copies its stage out of it, and moves only that to model.device (pipeline/server.py)
    model, tokenizer = await asyncio.to_thread(resolve_initial_policy, config, None, HOST)
    fingerprint = model_fingerprint(model, tokenizer)
    session = await _open_session(config, identity)
    console.print(
        f"{role} {identity.node_id} ({session.reachability}) in swarm {config.swarm.swarm_id}, model {fingerprint} in "
        f"{config.pipeline.num_stages} stages; others can join with --initial-peers {' '.join(session.addresses)}",
        highlight=False,
    )
    return session, model, tokenizer, fingerprint


async def _open_session(config, identity):
    """Join the swarm (the same p2p key and so the same peer id each time: it is kept in the state directory); the
    membership learns where the pipeline's peers are from their stage announcements."""
    from node.pipeline.stagemap import announced_addresses
    from node.transport.session import join_swarm

    session = await join_swarm(config, identity, config.resolved_state_dir())
    session.membership.add_source(lambda: announced_addresses(session.dht, config))
    return session


async def _while_joined(work, session, what: str) -> str | None:
    """Await `work` while `session` stays joined: None once it is done, or why the connection died (`work` cancelled
    then: the caller rejoins and starts it again)."""
    from node.aio import ServiceDied, cancel_and_wait, run_supervised
    from node.transport.session import watch_joined

    watcher = asyncio.create_task(watch_joined(session), name="session-watch")
    try:
        await run_supervised(work, [watcher, *session.membership.tasks], what)
        return None
    except ServiceDied as died:
        return str(died.__cause__ or died)
    finally:
        await cancel_and_wait([watcher], "session watch")


async def _rejoin(config, session, reason: str, stop: asyncio.Event | None = None):
    """Leave what is left of a session whose connection died (`reason`) and join again until it works, with the same
    identity: the new session. Raises StopRequested when `stop` is set first (a driver asked to stop while it rejoins;
    a stage server's stop cancels its task instead)."""
    from node.aio import StopRequested, cancel_and_wait
    from node.transport.session import rejoin

    log.warning("lost the swarm connection (%s): rejoining with the same identity", reason)
    try:
        await session.close()
    except Exception as exc:  # noqa: BLE001 - a dead daemon's session leaves what it can; the rejoin starts anew
        log.info("closing the lost session: %s: %s", type(exc).__name__, exc)
    joining = asyncio.ensure_future(rejoin(lambda: _open_session(config, session.identity)))
    if stop is not None:
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({joining, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait([stopping, *([] if joining.done() else [joining])], "rejoin")
        if joining.cancelled():
            raise StopRequested("stopped while rejoining the swarm")
    session, attempts = await joining
    log.warning("rejoined the swarm as %s after %d attempt(s)", session.peer_id, attempts)
    return session


def _rejoins_metric(rejoins: int) -> str:
    return f"# TYPE swarm_node_swarm_rejoins_total counter\nswarm_node_swarm_rejoins_total {rejoins}\n"


async def _serve(config, console: Console) -> int:
    from node.pipeline.server import StageServer

    session, model, _, fingerprint = await _join(config, console, "stage server")
    server = StageServer(session, model, fingerprint)
    lost: str | None = None  # why the swarm connection is down while it rejoins
    rejoins = 0
    task = asyncio.current_task()
    on_stop_signals(task.cancel)

    def readiness() -> dict:
        """Ready while it serves a stage, or waits as a spare, and its membership runs; loading a stage is not."""
        try:
            if lost is not None:
                raise RuntimeError(f"rejoining the swarm: {lost}")
            session.membership.check_alive()
        except RuntimeError as exc:
            return {"ready": False, "status": "down", "reason": str(exc), "stage": server.index}
        ready = server.state in ("serving", "spare")
        if server.state == "spare":
            reason = "a spare, waiting for a stage that loses its last server"
        else:
            reason = f"{server.state} stage {server.index} at step {server.step}"
        return {"ready": ready, "status": "ready" if ready else "starting", "reason": reason, "stage": server.index}

    metrics = await _http_server(config, lambda: server.prometheus() + _rejoins_metric(rejoins), readiness)
    notifier = start_systemd_notifier(readiness)
    try:
        # a connection that dies (its p2p daemon, the membership) is rejoined and the stage taken up again over it: its
        # weights come from the swarm (replicas, or its neighbours' recovery), as for a server that restarted
        while (lost := await _while_joined(server.run(), session, "stage server")) is not None:
            session = await _rejoin(config, session, lost)
            server, lost = StageServer(session, model, fingerprint), None
            rejoins += 1
    except asyncio.CancelledError:
        console.print(f"stopped serving stage {server.index} at step {server.step}", highlight=False)
    finally:
        if notifier is not None:
            notifier.cancel()
        await server.stop()
        if metrics is not None:
            await metrics.stop()
        await session.close()
    return 0


async def _drive(config, console: Console, steps: int | None) -> int:
    from node.aio import StopRequested
    from node.pipeline.corpus import training_corpus, validation_corpus
    from node.pipeline.driver import PipelineRouter
    from node.pipeline.lm import LMDriver
    from node.pipeline.stagemap import LostReporter
    from node.pipeline.stages import expected_fingerprints, pipeline_limits
    from node.state import StateStore
    from node.stats import RoundProgress

    if config.pipeline.objective != "lm":
        return error(
            "`drive` trains the lm objective; GRPO through the pipeline runs with `join` and pipeline.objective=grpo"
        )
    session, model, tokenizer, fingerprint = await _join(config, console, "driver")
    fingerprints = expected_fingerprints(config, model.config, fingerprint)
    limits = pipeline_limits(config, model.config, sum(p.numel() for p in model.parameters()))
    del model
    stop = asyncio.Event()  # ends the step loop, and a wait for a lost stage at once
    router = PipelineRouter(
        session.dht,
        config,
        fingerprint,
        fingerprints,
        limits,
        seed=int(session.identity.node_id[:8], 16),
        reporter=LostReporter(session, fingerprint),
        stop=stop,
    )
    store = StateStore(config.resolved_state_dir())
    corpus, validation = training_corpus(config, tokenizer), validation_corpus(config, tokenizer)
    driver = LMDriver(config, router, corpus, validation, store)

    def request_stop() -> None:
        console.print("[yellow]stopping after the step in flight (Ctrl-C again to quit at once)[/]")
        stop.set()

    on_stop_signals(request_stop)

    def show(row: dict) -> None:
        val = f", validation loss {row['val_loss']:.4f}" if "val_loss" in row else ""
        recovery = "".join(f"; stage {r['stage']} back after {r['recovery_s']:.1f}s" for r in row.get("recovery", []))
        console.print(
            f"step {row['step']}: loss {row['loss']:.4f}{val}, {row['step_s']:.2f}s, retries "
            f"{row['retries']}{recovery}",
            highlight=False,
        )

    progress = RoundProgress(config.swarm.stall_factor, config.swarm.stall_min_s)

    lost: str | None = None  # why the swarm connection is down while it rejoins
    rejoins = 0

    def readiness() -> dict:
        try:
            if lost is not None:
                raise RuntimeError(f"rejoining the swarm: {lost}")
            session.membership.check_alive()
        except RuntimeError as exc:
            return progress.report(str(exc))
        return progress.report()

    def prometheus() -> str:
        return f"# TYPE swarm_node_driver_step gauge\nswarm_node_driver_step {driver.step}\n" + _rejoins_metric(rejoins)

    def on_step(row: dict) -> None:
        progress.round_done(row["step"], row["step_s"])
        show(row)

    metrics = await _http_server(config, prometheus, readiness)
    notifier = start_systemd_notifier(readiness)
    progress.services_up()
    target = None if steps is None else driver.step + steps
    try:
        # a connection that dies (its p2p daemon, the membership) is rejoined, and the step in flight taken again over
        # the new one: a step counts only once every stage has taken its update
        while (
            lost := await _while_joined(
                driver.run(None if target is None else target - driver.step, stop, on_step=on_step), session, "driver"
            )
        ) is not None:
            session = await _rejoin(config, session, lost, stop)
            router.rebind(session.dht, LostReporter(session, fingerprint))
            lost = None
            rejoins += 1
    except StopRequested as stopped:
        console.print(f"{stopped}", highlight=False)
    finally:
        progress.stopping = True
        if notifier is not None:
            notifier.cancel()
        if metrics is not None:
            await metrics.stop()
        await session.close()
    console.print(f"stopped at step {driver.step}; metrics in {store.root / 'metrics.jsonl'}", highlight=False)
    return 0


async def _http_server(config, render, readiness):
    """/metrics, /healthz and /readyz when swarm.metrics_port is set (its URL in the state directory), else None."""
    if config.swarm.metrics_port is None:
        return None
    from node.stats import HTTP_FILE, MetricsServer, listening_socket

    host, port = config.swarm.metrics_host, config.swarm.metrics_port
    sock = listening_socket(host, port, "swarm.metrics_port")  # a port that is taken: one line, exit status 2
    url_file = config.resolved_state_dir() / HTTP_FILE
    metrics = MetricsServer(host, port, render, sock, readiness=readiness, url_file=url_file)
    await metrics.start()
    return metrics


def _run(args, console: Console, coro_factory) -> int:
    from node.state import lock_state_dir

    config = _config(args)
    state_dir = config.resolved_state_dir()
    with state_dir_errors(state_dir):
        # two processes on one directory would share its identity and p2p key, and a driver's metrics
        lock_state_dir(state_dir)
        setup_logging(state_dir, args.verbose, console)
    return run_command(coro_factory(config))


def cmd_serve(args, console: Console) -> int:
    return _run(args, console, lambda config: _serve(config, console))


def cmd_drive(args, console: Console) -> int:
    if args.steps is not None and args.steps < 1:
        return error("--steps must be at least 1")
    return _run(args, console, lambda config: _drive(config, console, args.steps))
