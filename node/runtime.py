"""What every `swarm-node` command shares: its state directory, logging, stop signals, errors as exit codes.

Stopping: the first SIGINT or SIGTERM asks the command to stop (a training node finishes the round in flight and
saves; every wait, a pipeline driver's for a lost stage too, looks at the request), and a second one leaves at once
(`leave_now`: no clean-up runs, what is on disk was written to survive kill -9). The p2p daemon has a session of its
own (node/transport/hivemind_p2p.py), so a terminal's Ctrl-C reaches the node alone and the node stops its daemon
after it has saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.logging import RichHandler

EXIT_OK = 0
EXIT_ERROR = 1  # the command could not do its job: no peer answered, the port is taken
EXIT_USAGE = 2  # the command line or the config is wrong
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


@contextlib.contextmanager
def state_dir_errors(state_dir: Path) -> Iterator[None]:
    """Opening `state_dir` (creating it, its lock, its log): a directory the command cannot write to (under a file,
    on a read-only file system, a full disk) is one line naming it and why (node.config.ConfigError: exit status 2),
    not a traceback from deep inside the first write."""
    from node.config import ConfigError
    from node.files import os_error_reason

    try:
        yield
    except OSError as exc:
        raise ConfigError(
            f"cannot use the state directory {state_dir}: {os_error_reason(exc)}; use another --state-dir"
        ) from None


class StateLogHandler(logging.FileHandler):
    """node.log. A write the disk has no space for drops the line and says so once on stderr (logging would print a
    traceback for every line); a node whose disk is full trains on and says what it could not save."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.dropping = False  # the disk had no space for the last line
        self._failed = False  # the line being written did not fit

    def emit(self, record: logging.LogRecord) -> None:
        dropping, self._failed = self.dropping, False
        super().emit(record)
        if dropping and not self._failed:
            self.dropping = False
            note = "node.log: the lines logged while the disk was full were dropped"
            super().emit(logging.LogRecord(__name__, logging.WARNING, __file__, 0, note, None, None))

    def handleError(self, record: logging.LogRecord) -> None:
        from node.files import no_space

        if not no_space(sys.exc_info()[1]):
            super().handleError(record)
            return
        self._failed = True
        if not self.dropping:
            self.dropping = True
            print(
                f"swarm-node: warning: no space left on device for {self.baseFilename}: its lines are dropped until "
                "there is",
                file=sys.stderr,
            )


def setup_logging(state_dir: Path, verbose: bool, console: Console) -> None:
    """A command that keeps state: everything to <state_dir>/node.log, warnings (everything with --verbose) to the
    console."""
    state_dir.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    file_handler = StateLogHandler(state_dir / "node.log")
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


_SIGNALS_WHILE_STARTING: list[int] = []


def take_startup_signals() -> None:
    """Until a command's event loop takes them (on_stop_signals), a Ctrl-C or SIGTERM stops the command where it
    stands, as a KeyboardInterrupt, and is remembered: one that lands inside an import (torch, transformers and
    hivemind take seconds to import) leaves that module half made, and whatever then fails is that stop, not a fault
    to print a traceback for (`stopped_while_starting`)."""

    def handle(signum: int, frame) -> None:
        _SIGNALS_WHILE_STARTING.append(signum)
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handle)


def stopped_while_starting() -> bool:
    return bool(_SIGNALS_WHILE_STARTING)


def on_stop_signals(request_stop: Callable[[], None], on_second: Callable[[], None] | None = None) -> None:
    """Call `request_stop` on the first SIGINT or SIGTERM (from inside the running event loop); on a second, leave at
    once with EXIT_INTERRUPTED, after `on_second` says what was kept."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def handle(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            request_stop()
            return
        if on_second is not None:
            on_second()
        leave_now(EXIT_INTERRUPTED)

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, handle, signum)


def start_systemd_notifier(readiness: Callable[[], dict[str, Any]]) -> asyncio.Task | None:
    """Under systemd (a `Type=notify` unit: NOTIFY_SOCKET set), a task that tells it how the node is: READY=1 once
    `readiness` first says ready, STATUS= its reason, and WATCHDOG=1 every half WatchdogSec while the node is not
    "stalled" or "down", so that systemd restarts a node whose round hangs, not only one that exits
    (docs/commands.md has a unit). None elsewhere."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return None
    watchdog_pid = os.environ.get("WATCHDOG_PID")
    watchdog_usec = os.environ.get("WATCHDOG_USEC") if watchdog_pid in (None, str(os.getpid())) else None
    interval_s = int(watchdog_usec) / 2e6 if watchdog_usec else 10.0
    target = "\0" + address[1:] if address.startswith("@") else address  # "@": an abstract socket
    return asyncio.get_running_loop().create_task(_notify_systemd(target, readiness, interval_s, bool(watchdog_usec)))


async def _notify_systemd(
    target: str, readiness: Callable[[], dict[str, Any]], interval_s: float, watchdog: bool
) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def tell(lines: list[str]) -> None:
        try:
            sock.sendto("\n".join(lines).encode(), target)
        except OSError as exc:  # systemd restarting, or a socket gone: told again next time
            logging.getLogger(__name__).debug("could not notify systemd: %s", exc)

    told_ready = stopping = False
    try:
        while True:
            report = readiness()
            lines = [f"STATUS={report['status']}: {report['reason']}"]
            if report["ready"] and not told_ready:
                lines.append("READY=1")
                told_ready = True
            if report["status"] == "stopping":
                lines.append("STOPPING=1")
                stopping = True
            elif watchdog and report["status"] not in ("stalled", "down"):
                lines.append("WATCHDOG=1")
            tell(lines)
            await asyncio.sleep(interval_s)
    finally:
        if not stopping:  # the command ended between two reports: a clean stop all the same
            tell(["STATUS=stopping: the node is stopping", "STOPPING=1"])
        sock.close()


def leave_now(code: int) -> None:
    """End the process now: no task's clean-up runs and no worker thread is waited for (a round in flight, a model
    still loading). What the node keeps on disk is written to survive this (node/state.py); its p2p daemon gets
    SIGTERM from the kernel as the process ends (node/transport/hivemind_p2p.py)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken stream must not keep the process alive
            stream.flush()
    logging.shutdown()
    os._exit(code)


class LoopWatchdog:
    """Whether the event loop itself still turns: a task on it ticks every `tick_s`, and a thread of its own calls
    `on_hang(seconds)` once no tick has come for `hang_s`. Everything a node serves (its rounds' bookkeeping, /healthz,
    the dashboard, its swarm session) runs on that loop, so a call that blocks it stops them all, and no task on the
    loop can notice; the round watchdog only sees rounds whose work hangs in a thread."""

    def __init__(self, hang_s: float, on_hang: Callable[[float], None], tick_s: float = 1.0) -> None:
        self.hang_s, self.on_hang, self.tick_s = hang_s, on_hang, tick_s
        self.last_tick = time.monotonic()
        self._ticking: asyncio.Task | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)

    def start(self) -> None:
        self.last_tick = time.monotonic()
        self._ticking = asyncio.get_running_loop().create_task(self._tick(), name="loop-watchdog-tick")
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._ticking is not None:
            self._ticking.cancel()

    async def _tick(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(self.tick_s)

    def _watch(self) -> None:
        while not self._stopped.wait(min(self.tick_s, self.hang_s / 4)):
            blocked = time.monotonic() - self.last_tick
            if blocked >= self.hang_s:
                self.on_hang(blocked)
                return


def restart_process() -> NoReturn:
    """Run this command again in this process (execve: the same PID, arguments and environment, less `--fresh`, which
    the first start has done): every thread ends, a hung one too, and the new image resumes from what is on disk.
    The process's children go first (the p2p daemon, the DHT's process): a forked one holds the state directory's
    lock, and the new image takes it again."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(children, timeout=30)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    argv = [arg for arg in sys.orig_argv[1:] if arg != "--fresh"]
    os.execv(sys.executable, [sys.executable, *argv])


def error(message: str, code: int = EXIT_USAGE) -> int:
    print(f"swarm-node: error: {message}", file=sys.stderr)
    return code


def run_command(
    main: Coroutine[Any, Any, int], on_interrupt: Callable[[], None] | None = None, interrupted: int = EXIT_INTERRUPTED
) -> int:
    """Run a command's coroutine to its exit code: a swarm it cannot join is an error message and EXIT_ERROR,
    a Ctrl-C that reaches here (one before the command took the stop signals: on_stop_signals) `interrupted`, after
    `on_interrupt` says what was kept."""
    from node.transport.joining import SwarmJoinError

    try:
        return asyncio.run(main)
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        return interrupted
    except SwarmJoinError as exc:
        return error(str(exc), EXIT_ERROR)
