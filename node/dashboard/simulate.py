"""A local swarm to watch: N `swarm-node join` processes on 127.0.0.1 and node 0's dashboard.

Node 0 starts first (it builds the default model once, if no cache has it, and starts a
new swarm); the others join it through its `addresses.txt`, so no port is guessed. Each
node runs in its own process group (its p2pd children with it), logs to `<root>/node-i.out`,
and keeps its state in `<root>/node-i/`. Ctrl-C (or SIGTERM) is passed to each node's
process group, which finishes its round in flight, saves and exits; a node still running
after STOP_TIMEOUT_S, or a second Ctrl-C, gets SIGKILL. Nothing else is signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

START_TIMEOUT_S = 900.0  # node 0 may first build the default model (30-40 s alone, minutes on a busy machine)
STOP_TIMEOUT_S = 120.0
POLL_S = 0.5


def parse_node_overrides(items: list[str], nodes: int) -> dict[int, list[str]]:
    """`N:KEY=VALUE` items (simulate's --node-set) as {node index: [KEY=VALUE, ...]}, in the order given."""
    out: dict[int, list[str]] = {}
    for item in items:
        index, colon, override = item.partition(":")
        if not colon or not index.isdigit() or "=" not in override:
            raise ValueError(f"--node-set {item!r}: expected N:KEY=VALUE, e.g. 1:model.default.warmup_labels=[\"add\"]")
        if int(index) >= nodes:
            raise ValueError(f"--node-set {item!r}: node {index} does not exist (nodes 0 to {nodes - 1})")
        out.setdefault(int(index), []).append(override)
    return out


class LocalSwarm:
    def __init__(
        self,
        root: Path,
        nodes: int,
        dashboard_port: int,
        rounds: int | None = None,
        config: Path | None = None,
        overrides: list[str] = (),
        node_overrides: dict[int, list[str]] | None = None,
        fresh: bool = False,
        console: Console | None = None,
    ) -> None:
        self.root, self.count, self.dashboard_port = root, nodes, dashboard_port
        self.rounds, self.config, self.overrides, self.fresh = rounds, config, list(overrides), fresh
        self.node_overrides = node_overrides or {}
        self.console = console or Console()
        self.processes: list[subprocess.Popen] = []
        self._logs: list = []
        self._interrupts = 0

    def state_dir(self, i: int) -> Path:
        return self.root / f"node-{i}"

    def command(self, i: int, initial_peers: list[str]) -> list[str]:
        """Node i's `swarm-node join` command line."""
        args = [sys.executable, "-m", "node.cli", "join", "--state-dir", str(self.state_dir(i))]
        if self.config:
            args += ["--config", str(self.config)]
        if self.rounds:
            args += ["--rounds", str(self.rounds)]
        if self.fresh:
            args += ["--fresh"]
        if initial_peers:
            args += ["--initial-peers", *initial_peers]
        # Ours first, so that the user's --set wins (and a --node-set over that); one torch thread each: N nodes share
        # the machine's cores.
        sets = [f"name=node-{i}", "swarm.host_maddrs=" + json.dumps(["/ip4/127.0.0.1/tcp/0"]), "torch_threads=1"]
        if i == 0:
            sets.append(f"swarm.dashboard_port={self.dashboard_port}")
        for item in sets + self.overrides + self.node_overrides.get(i, []):
            args += ["--set", item]
        return args

    def _start(self, i: int, initial_peers: list[str]) -> subprocess.Popen:
        state = self.state_dir(i)
        state.mkdir(parents=True, exist_ok=True)
        for stale in ("addresses.txt", "dashboard.txt"):  # a previous simulation's, which would point nowhere
            (state / stale).unlink(missing_ok=True)
        log = open(self.root / f"node-{i}.out", "w")
        self._logs.append(log)
        process = subprocess.Popen(
            self.command(i, initial_peers),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
        self.processes.append(process)
        self.console.print(
            f"node-{i}: pid {process.pid}, state {state}, log {self.root / f'node-{i}.out'}", highlight=False
        )
        return process

    def _tail(self, i: int) -> str:
        lines = (self.root / f"node-{i}.out").read_text(errors="replace").splitlines()
        return "\n".join(lines[-15:])

    def _wait_for_file(self, path: Path, process: subprocess.Popen, i: int) -> str | None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and not self._interrupts:
            if path.exists() and path.read_text().strip():
                return path.read_text().strip()
            if process.poll() is not None:
                self.console.print(
                    f"[red]node-{i} exited with {process.returncode} before writing {path.name}:[/]\n{self._tail(i)}",
                    highlight=False,
                )
                return None
            time.sleep(POLL_S)
        if not self._interrupts:
            self.console.print(
                f"[red]node-{i} wrote no {path.name} within {START_TIMEOUT_S:.0f} s; see "
                f"{self.root / f'node-{i}.out'}[/]",
                highlight=False,
            )
        return None

    def _on_signal(self, signum, frame) -> None:
        self._interrupts += 1
        if self._interrupts == 1:
            self.console.print(
                "[yellow]stopping every node: each finishes its round in flight and saves (Ctrl-C again to kill them "
                "at once)[/]"
            )
        else:
            self._signal_all(signal.SIGKILL)

    def _signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signum)  # the node's own group, nothing else (its p2pd follows it)
                except ProcessLookupError:
                    pass

    def _stop(self) -> bool:
        """Stop every node still running; True when all of them exited cleanly."""
        self._signal_all(signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        stuck = [p for p in self.processes if p.poll() is None]
        if stuck:
            self.console.print(f"[red]{len(stuck)} node(s) still running after {STOP_TIMEOUT_S:.0f} s: killed[/]")
            self._signal_all(signal.SIGKILL)
            for process in stuck:
                process.wait(timeout=30)
        return not stuck and all(p.returncode in (0, 130) for p in self.processes)

    def run(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            return self._run()
        finally:
            for log in self._logs:
                log.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _run(self) -> int:
        self.console.print(
            f"starting {self.count} node(s) under {self.root} (the first run builds the default model: about a minute)",
            highlight=False,
        )
        first = self._start(0, [])
        addresses = self._wait_for_file(self.state_dir(0) / "addresses.txt", first, 0)
        if addresses is None:
            return self._interrupted() if self._interrupts else self._failed()
        bootstrap = addresses.split()
        for i in range(1, self.count):
            self._start(i, bootstrap)
        url = self._wait_for_file(self.state_dir(0) / "dashboard.txt", first, 0)
        if url is None:
            return self._interrupted() if self._interrupts else self._failed()
        self.console.print(f"dashboard: {url}", highlight=False)
        self.console.print(f"peers: swarm-node peers --initial-peers {bootstrap[0]}", highlight=False)
        self.console.print("Ctrl-C stops every node (each saves its state first)", highlight=False)
        while not self._interrupts:
            codes = [p.poll() for p in self.processes]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                for i in failed:
                    self.console.print(f"[red]node-{i} exited with {codes[i]}:[/]\n{self._tail(i)}", highlight=False)
                return self._failed()
            if all(code == 0 for code in codes):
                self.console.print(
                    f"every node finished its {self.rounds} round(s); state under {self.root}", highlight=False
                )
                return 0
            time.sleep(POLL_S)
        return self._interrupted()

    def _failed(self) -> int:
        self._stop()
        return 1

    def _interrupted(self) -> int:
        clean = self._stop()
        self.console.print(
            f"stopped; state under {self.root} (the same command resumes)"
            if clean
            else "stopped, not cleanly: see the node logs",
            highlight=False,
        )
        return 0 if clean else 1
