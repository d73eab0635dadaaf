"""Worker benchmarks: one process per lab node, coordinated through files in a scratch directory."""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.lab.network import REPO, Lab

WORKER_WAIT_S = 600  # hang guard for any one wait of a worker or its parent (a loaded machine is slow, never stuck)


def wait_file(path: Path, timeout_s: float = WORKER_WAIT_S) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s")
        time.sleep(0.05)
    return path.read_text()


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def eth0_tx_bytes() -> int:
    """Bytes this network namespace's eth0 has sent (the lab gives each node one)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "eth0":
            return int(counters.split()[8])
    raise RuntimeError("no eth0 in this network namespace")


def wait_worker_file(lab: Lab, index: int, path: Path, what: str, timeout_s: float = WORKER_WAIT_S) -> str:
    """Wait for worker `index` to write `path`; fail at once, naming its log, if the worker died."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not lab.alive(index) or time.monotonic() > deadline:
            raise RuntimeError(
                f"worker {index} {'exited' if not lab.alive(index) else 'hung'} before {what}; see "
                f"{lab.processes[index].log}"
            )
        time.sleep(0.05)
    return path.read_text()


def start_workers(lab: Lab, argv_of, scratch: Path) -> None:
    """One worker per node, node 0 first: it writes addrs-0.json (its DHT addresses), which the
    others bootstrap from; returns once every worker wrote ready-<index>."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for index in range(lab.nodes):
        lab.run(index, argv_of(index), scratch / f"worker-{index}.log", env)
        if index == 0:
            wait_worker_file(lab, 0, scratch / "addrs-0.json", "writing its addresses")
    for index in range(lab.nodes):
        wait_worker_file(lab, index, scratch / f"ready-{index}", "joining")
