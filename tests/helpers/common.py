"""What every kind of test needs: the repository's path, the CLI as a subprocess, a tiny model's config."""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from benchmarks.lab.presets import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]
# How long a CLI subprocess may take before a test calls it hung. A hang guard, never a speed check:
# on a machine shared with other work, importing torch alone has taken minutes.
CLI_TIMEOUT_S = 900

TINY_OVERRIDES = [
    *TINY_MODEL,
    "swarm.local_questions=2",
    "rollout.completions_per_question=4",
    "rollout.max_new_tokens=4",
    "tasks.heldout_size=8",
    # a tiny random model knows nothing, and neither do its peers: the shipped gate (peers' groups only from a peer
    # measurably stronger) would turn every group away, and these tests are about groups travelling and being used
    "swarm.external_gate=none",
]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "node.cli", *args]


def get_json(url: str):
    """A JSON answer of an HTTP endpoint (the dashboard's API)."""
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def reporting_child(argv: list[str], env: dict, errors: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A child that reports one line on stdout, then waits on stdin (a lock's holder, a process restarting itself):
    yields it and that line once printed (its stderr, in `errors`, says why not); SIGKILLed, to this one process,
    and reaped at the end."""
    with open(errors, "w") as stderr:
        child = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO
        )
    try:
        ready, _, _ = select.select([child.stdout], [], [], CLI_TIMEOUT_S)
        assert ready, errors.read_text()
        line = child.stdout.readline()
        assert line, errors.read_text()
        yield child, line
    finally:
        child.kill()
        child.wait(timeout=60)
        child.stdout.close()
        child.stdin.close()
