"""Shared fixtures: a tiny node config that builds its default model in seconds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from node.transport.protobuf_shim import import_hivemind_isolated

# hivemind and libp2p register the same protobuf names; tests import both, so hivemind's
# go into a private pool before anything imports it (as the node itself does).
import_hivemind_isolated()

REPO = Path(__file__).resolve().parents[1]
# How long a CLI subprocess may take before a test calls it hung. A hang guard, never a speed check:
# on a machine shared with other work, importing torch alone has taken minutes.
CLI_TIMEOUT_S = 900

TINY_OVERRIDES = [
    "model.default.hidden_size=32",
    "model.default.num_layers=2",
    "model.default.num_heads=2",
    "model.default.intermediate_size=64",
    "model.default.max_position_embeddings=128",
    "model.default.warmup_steps=5",
    "model.default.warmup_batch_size=8",
    "swarm.local_questions=2",
    "rollout.completions_per_question=4",
    "rollout.max_new_tokens=4",
    "tasks.heldout_size=8",
]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One default-model cache for the whole session, so the warm start runs once per shape."""
    path = tmp_path_factory.mktemp("model-cache")
    os.environ["SWARM_NODE_CACHE"] = str(path)
    return path


@pytest.fixture
def tiny_config(model_cache, tmp_path):
    from node.config import load_config

    def make(*extra: str, state_dir: Path | None = None):
        return load_config(REPO / "configs" / "isolated.yaml", [*TINY_OVERRIDES, *extra], state_dir=str(state_dir or tmp_path / "state"))

    return make


@pytest.fixture
def cli_env(model_cache) -> dict[str, str]:
    env = dict(os.environ, SWARM_NODE_CACHE=str(model_cache), PYTHONUNBUFFERED="1")
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "node.cli", *args]
