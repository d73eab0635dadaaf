"""A state directory keeps what was learned: a resume passes over a LATEST or a checkpoint that is damaged to the
newest checkpoint that loads and says so, refuses to start fresh over checkpoints or metrics none of which it can
resume from (until --fresh), and one process at a time holds the directory."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys

import pytest

from node.config import ConfigError, dump_config
from node.loop import Node
from node.state import StateStore, lock_state_dir
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli, reporting_child


def run_cli(env, *args):
    return subprocess.run(cli(*args), capture_output=True, text=True, env=env, cwd=REPO, timeout=CLI_TIMEOUT_S)


def rounds_recorded(store: StateStore) -> list[int]:
    return [row["round"] for row in store.read_metrics()]


@pytest.fixture
def trained(tiny_config):
    """A node's state after 3 rounds: the checkpoints of rounds 2 and 3 (checkpoint_keep 2) and 3 metrics rows."""
    config = tiny_config()
    node = Node(config)
    node.load()
    asyncio.run(node.run(3, asyncio.Event()))
    store = node.store
    assert sorted(p.name for p in store.checkpoints.glob("round-*")) == ["round-00000002", "round-00000003"]
    assert rounds_recorded(store) == [1, 2, 3]
    return config, store


def resumed(config, caplog) -> Node:
    node = Node(config)
    with caplog.at_level(logging.WARNING, logger="node.state"):
        node.load()
    return node


def cut(path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def test_an_empty_latest_resumes_the_newest_checkpoint_kept(trained, caplog):
    config, store = trained
    (store.checkpoints / "LATEST").write_text("")
    node = resumed(config, caplog)
    assert node.round == 3 and rounds_recorded(store) == [1, 2, 3]
    assert "checkpoints/LATEST is empty: resuming from round-00000003" in caplog.text


def test_a_latest_naming_a_folder_that_is_gone_resumes_the_one_before(trained, caplog):
    config, store = trained
    shutil.rmtree(store.checkpoints / "round-00000003")
    node = resumed(config, caplog)
    assert node.round == 2
    assert rounds_recorded(store) == [1, 2]  # round 3 runs again: its weights are gone
    assert "checkpoints/LATEST names round-00000003, which is gone: resuming from round-00000002" in caplog.text


def test_a_cut_policy_falls_back_to_the_checkpoint_before_and_says_why(trained, caplog):
    config, store = trained
    cut(store.checkpoints / "round-00000003" / "model.safetensors", 4096)
    node = resumed(config, caplog)
    assert node.round == 2 and rounds_recorded(store) == [1, 2]
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1, warning
    assert warning[0].startswith("round-00000003's policy does not load (")
    assert warning[0].endswith("): resuming from round-00000002")


def test_metrics_past_the_first_checkpoint_without_one_are_not_started_over(tiny_config, caplog):
    """A kill before the first checkpoint leaves that round's row alone: a fresh start drops it. Rows past it mean
    checkpoints were lost, and the directory is refused."""
    config = tiny_config()  # checkpoint_every 1
    store = StateStore(config.resolved_state_dir())
    store.append_metrics({"round": 1})
    assert resumed(config, caplog).round == 0 and rounds_recorded(store) == []
    assert "no checkpoint holds the 1 round in metrics.jsonl: starting fresh" in caplog.text
    shutil.rmtree(store.root)
    for round_ in (1, 2):
        store.append_metrics({"round": round_})
    with pytest.raises(ConfigError, match="holds the metrics of 2 rounds but no checkpoint that loads: add --fresh"):
        Node(config).load()
    assert rounds_recorded(store) == [1, 2]


@pytest.mark.integration
def test_no_checkpoint_that_loads_is_refused_until_fresh(trained, cli_env, tmp_path):
    config, store = trained
    cut(store.checkpoints / "round-00000003" / "model.safetensors", 4096)
    cut(store.checkpoints / "round-00000002" / "trainer.pt", 1000)
    metrics = store.metrics_path.read_bytes()
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(config))
    args = ["train", "--config", str(path), "--state-dir", str(store.root), "--rounds", "1"]

    refused = run_cli(cli_env, *args)
    assert refused.returncode == 2, refused.stderr
    assert "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert f"the state directory {store.root} holds 2 checkpoints and the metrics of 3 rounds" in line
    assert "round-00000003's policy does not load (" in line
    assert "round-00000002's trainer.pt does not load (PytorchStreamReader failed reading zip archive" in line
    assert line.endswith(
        ": add --fresh to start over there (its checkpoints and metrics are removed), or use another --state-dir"
    )
    assert store.metrics_path.read_bytes() == metrics
    assert len(list(store.checkpoints.glob("round-*"))) == 2

    fresh = run_cli(cli_env, *args, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert "fresh start" in fresh.stdout
    assert rounds_recorded(store) == [1]
    assert sorted(p.name for p in store.checkpoints.glob("round-*")) == ["round-00000001"]


HOLDER = (
    "import sys; from pathlib import Path; from node.state import lock_state_dir; "
    "lock_state_dir(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"
)


@pytest.mark.integration
def test_a_second_process_on_a_state_directory_is_refused_naming_the_holder(tiny_config, cli_env, tmp_path):
    state = tmp_path / "state"
    holding = reporting_child([sys.executable, "-c", HOLDER, str(state)], cli_env, tmp_path / "holder.err")
    with holding as (holder, line):  # SIGKILLed at the end, to this one process: the OS releases its lock
        assert line == "held\n"
        assert (state / "lock").read_text().strip() == str(holder.pid)
        path = tmp_path / "tiny.yaml"
        path.write_text(dump_config(tiny_config()))

        refused = run_cli(cli_env, "train", "--config", str(path), "--state-dir", str(state), "--rounds", "1")
        assert refused.returncode == 2, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert line == (
            f"swarm-node: error: the state directory {state} is in use by process {holder.pid} (it holds "
            f"{state / 'lock'}): stop it, or use another --state-dir"
        )
        assert not (state / "metrics.jsonl").exists() and not (state / "node.log").exists()
        served = run_cli(cli_env, "serve", "--state-dir", str(state), "--stage", "0")  # a stage server too
        assert served.returncode == 2, served.stderr
        assert f"is in use by process {holder.pid} " in served.stderr.strip().splitlines()[-1]
    lock_state_dir(state)  # free again once its holder died (this test process holds it until the session ends)
    assert (state / "lock").read_text().strip() == str(os.getpid())
