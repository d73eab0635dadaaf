"""Shared fixtures: a tiny node config that builds its default model in seconds, swarm and pipeline
configs, and the processes a test starts (stopped when it ends). Helpers live in tests/helpers/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.config import dump_config, load_config
from node.transport.protobuf_shim import import_hivemind_isolated

# hivemind and libp2p register the same protobuf names; tests import both, so hivemind's
# go into a private pool before anything imports it (as the node itself does).
import_hivemind_isolated()

from tests.helpers.common import REPO, TINY_OVERRIDES  # noqa: E402 - after the protobuf isolation
from tests.helpers.pipeline import PIPELINE_OVERRIDES  # noqa: E402
from tests.helpers.swarm import SWARM_OVERRIDES, SwarmProcess  # noqa: E402


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One default-model cache for the whole session, so the warm start runs once per shape."""
    path = tmp_path_factory.mktemp("model-cache")
    os.environ["SWARM_NODE_CACHE"] = str(path)
    return path


@pytest.fixture
def tiny_config(model_cache, tmp_path):

    def make(*extra: str, state_dir: Path | None = None):
        return load_config(
            REPO / "configs" / "isolated.yaml",
            [*TINY_OVERRIDES, *extra],
            state_dir=str(state_dir or tmp_path / "state"),
        )

    return make


@pytest.fixture
def cli_env(model_cache) -> dict[str, str]:
    env = dict(os.environ, SWARM_NODE_CACHE=str(model_cache), PYTHONUNBUFFERED="1")
    return env


# swarms of real processes on 127.0.0.1 ---------------------------------------------------


def config_file(tmp_path: Path, name: str, overrides: list[str]) -> Path:
    """configs/<name> with `overrides`, its default model built, written to tmp_path for processes to load."""
    from node.model import ensure_default_model

    config = load_config(REPO / "configs" / name, overrides)
    ensure_default_model(config, progress=False)  # build once, before several processes race to
    path = tmp_path / name
    path.write_text(dump_config(config))
    return path


def started_processes():
    """The processes a test starts (it appends them), closed when it ends."""
    started: list[SwarmProcess] = []
    yield started
    for process in started:
        process.close()


@pytest.fixture
def swarm_yaml(model_cache, tmp_path):
    return config_file(tmp_path, "swarm.yaml", SWARM_OVERRIDES)


@pytest.fixture
def evaluating_swarm_yaml(model_cache, tmp_path):
    """The swarm config, evaluating held-out every 2 rounds: what the dashboard's curves show."""
    return config_file(tmp_path, "swarm.yaml", [*SWARM_OVERRIDES, "eval_every=2"])


@pytest.fixture
def nodes():
    yield from started_processes()


@pytest.fixture
def pipeline_yaml(model_cache, tmp_path):
    return config_file(tmp_path, "pipeline.yaml", PIPELINE_OVERRIDES)


@pytest.fixture
def procs():
    yield from started_processes()
