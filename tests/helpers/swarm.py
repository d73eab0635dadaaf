"""Start real swarm nodes on 127.0.0.1 and stop exactly the processes a test started."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from benchmarks.lab.network import p2p_daemon_of
from tests.helpers.common import CLI_TIMEOUT_S, REPO, TINY_OVERRIDES, cli

SWARM_OVERRIDES = [
    *TINY_OVERRIDES,
    "swarm.transport=dht",
    'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "swarm.local_questions=2",
    "swarm.external_questions=2",
    "swarm.window_s=2",
    "swarm.heartbeat_interval_s=1",
    "swarm.heartbeat_ttl_s=10",
    "swarm.bootstrap_backoff_s=0.5",
    "swarm.swarm_id=test-swarm",
    # Tiny random models score 0 everywhere; a format bonus gives groups a reward spread.
    "tasks.format_reward=0.1",
    "checkpoint_keep=1",
    "eval_every=0",
]


def peers_listed(
    bootstrap: str, swarm_id: str, env, netns: str | None = None, must_succeed: bool = False
) -> list[dict]:
    """The rows of `swarm-node peers --json` joined through `bootstrap`, run inside network namespace `netns` if
    given. A failed command gives [] (a caller polls until the rows it waits for appear), or fails the test with its
    stderr when `must_succeed`."""
    inside = ["ip", "netns", "exec", netns] if netns else []
    result = subprocess.run(
        [*inside, *cli("peers", "--initial-peers", bootstrap, "--swarm-id", swarm_id, "--json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0 or not must_succeed, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]) if result.returncode == 0 else []


# Every wait below is a hang guard, never a speed check: it returns as soon as its condition holds,
# so a generous bound costs a passing test nothing, while a tight one fails a loaded machine.
WAIT_SCALE = 3.0


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it is truthy (its value is returned); fail after WAIT_SCALE x `timeout` seconds."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


async def wait_for_async(predicate, timeout: float, what: str, interval: float = 0.01):
    """wait_for inside an event loop: it sleeps with asyncio, so the tasks it waits on run between polls."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def read_rows(state_dir: Path) -> list[dict]:
    path = state_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def daemon_of(node: "SwarmProcess") -> int:
    """The pid of the p2p daemon a node process started (its child, in a session of its own)."""
    daemon = p2p_daemon_of(node.process.pid)
    assert daemon is not None, f"no p2p daemon under pid {node.process.pid}"
    return daemon


class SwarmProcess:
    """One `swarm-node join` (or `serve`, `drive`: `command`) subprocess in its own process group."""

    def __init__(
        self,
        config_path: Path,
        state_dir: Path,
        env: dict,
        initial_peers: list[str] = (),
        command: str = "join",
        extra: list[str] = (),
    ):
        self.state_dir = state_dir
        args = [command, "--config", str(config_path), "--state-dir", str(state_dir), *extra]
        if initial_peers:
            args += ["--initial-peers", *initial_peers]
        self.log = open(state_dir.parent / f"{state_dir.name}.out", "w")
        self.process = subprocess.Popen(
            cli(*args), stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )

    def addresses(self, timeout: float = 90) -> list[str]:
        path = self.state_dir / "addresses.txt"
        self.assert_running()
        return wait_for(lambda: path.exists() and path.read_text().split(), timeout, f"{path}")

    def assert_running(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"node exited with {self.process.returncode}: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        return (self.state_dir.parent / f"{self.state_dir.name}.out").read_text()[-3000:]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # the node and its p2pd child, nothing else
        self.process.wait(timeout=30)

    def interrupt(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def close(self) -> None:
        self.kill()
        self.log.close()
