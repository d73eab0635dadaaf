"""What every kind of test needs: the repository's path, the CLI as a subprocess, a tiny model's config."""

from __future__ import annotations

import json
import sys
import urllib.request
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
