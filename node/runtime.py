"""What every `swarm-node` command shares: logging, stop signals, errors as exit codes."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

EXIT_OK = 0
EXIT_ERROR = 1  # the command could not do its job: no peer answered, the port is taken
EXIT_USAGE = 2  # the command line or the config is wrong
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def setup_logging(state_dir: Path, verbose: bool, console: Console) -> None:
    """A command that keeps state: everything to <state_dir>/node.log, warnings (everything with --verbose) to the
    console."""
    state_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(state_dir / "node.log")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    screen = RichHandler(console=console, show_path=False, level=logging.INFO if verbose else logging.WARNING)
    # py-libp2p logs remote peers' comings and goings as warnings and errors (a failed dial to a peer
    # that left, "GRAFT flood detected" while meshes form on a busy machine): for the log file, not
    # the console; the node reports what matters to it (a dead gossip service) under its own name
    screen.addFilter(
        lambda record: verbose or record.levelno >= logging.CRITICAL or not record.name.startswith("libp2p")
    )
    root.handlers[:] = [file_handler, screen]
    import transformers

    transformers.utils.logging.disable_progress_bar()  # its per-save bars would drown the round display
    transformers.utils.logging.set_verbosity_error()


def setup_viewer_logging() -> None:
    """A command that only looks (peers, dashboard): warnings to stderr, stdout left to its output."""
    logging.basicConfig(level=logging.WARNING, handlers=[RichHandler(console=Console(stderr=True), show_path=False)])


def on_stop_signals(request_stop: Callable[[], None]) -> None:
    """Call `request_stop` on SIGINT and SIGTERM (from inside the running event loop)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, request_stop)


def error(message: str, code: int = EXIT_USAGE) -> int:
    print(f"swarm-node: error: {message}", file=sys.stderr)
    return code


def run_command(
    main: Coroutine[Any, Any, int], on_interrupt: Callable[[], None] | None = None, interrupted: int = EXIT_INTERRUPTED
) -> int:
    """Run a command's coroutine to its exit code: a swarm it cannot join is an error message and EXIT_ERROR,
    an interrupt that reaches here (a second Ctrl-C) `interrupted`, after `on_interrupt` says what was kept."""
    from node.transport.joining import SwarmJoinError

    try:
        return asyncio.run(main)
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        return interrupted
    except SwarmJoinError as exc:
        return error(str(exc), EXIT_ERROR)
