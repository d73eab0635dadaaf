"""The real CLI as a subprocess: train, resume, kill -9, Ctrl-C, stats."""

import json
import os
import signal
import subprocess
import time

import pytest

from node.config import dump_config
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli

pytestmark = pytest.mark.integration

REQUIRED_KEYS = {"round", "reward_mean", "accuracy", "tokens_per_s", "step_s", "policy_version"}


@pytest.fixture
def tiny_yaml(tiny_config, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config("eval_every=2")))
    return path


def run_cli(env, *args, timeout=CLI_TIMEOUT_S):
    return subprocess.run(cli(*args), capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)


def read_rows(state_dir):
    path = state_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def latest_round(state_dir):
    name = (state_dir / "checkpoints" / "LATEST").read_text().strip()
    return int(name.removeprefix("round-"))


def test_train_three_rounds_then_resume(tiny_yaml, tmp_path, cli_env):
    state = tmp_path / "state"
    result = run_cli(cli_env, "train", "--config", str(tiny_yaml), "--state-dir", str(state), "--rounds", "3")
    assert result.returncode == 0, result.stderr
    rows = read_rows(state)
    assert [r["round"] for r in rows] == [1, 2, 3]
    assert all(REQUIRED_KEYS <= set(r) for r in rows)
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["tokens_per_s"] > 0 for r in rows)
    assert "heldout_accuracy" in rows[0] and "heldout_accuracy" in rows[1]
    assert latest_round(state) == 3
    assert (state / "config.yaml").exists() and (state / "node.log").stat().st_size > 0
    assert (state / "checkpoints" / "round-00000003" / "model.safetensors").exists()

    result = run_cli(cli_env, "train", "--config", str(tiny_yaml), "--state-dir", str(state), "--rounds", "2")
    assert result.returncode == 0, result.stderr
    rows = read_rows(state)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5]
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions)  # resumed, not restarted
    assert "resuming at round 3" in result.stdout

    stats = run_cli(cli_env, "stats", "--state-dir", str(state), "--json")
    assert stats.returncode == 0, stats.stderr
    summary = json.loads(stats.stdout)
    assert summary["rounds"] == 5 and summary["policy_version"] == versions[-1]

    fresh = run_cli(cli_env, "train", "--config", str(tiny_yaml), "--state-dir", str(state), "--rounds", "1", "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    assert [r["round"] for r in read_rows(state)] == [1]


def _start_and_wait(env, tiny_yaml, state, rows_needed, deadline_s=240):
    process = subprocess.Popen(
        cli("train", "--config", str(tiny_yaml), "--state-dir", str(state)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    deadline = time.monotonic() + deadline_s
    while len(read_rows(state)) < rows_needed:
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "node made no progress"
        time.sleep(0.05)
    return process


def test_kill_9_mid_run_loses_at_most_the_round_in_flight(tiny_yaml, tmp_path, cli_env):
    state = tmp_path / "state"
    process = _start_and_wait(cli_env, tiny_yaml, state, rows_needed=3)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    process.stderr.close()
    rows_before = read_rows(state)
    # the newest checkpoint folder on disk, which a resume takes: a kill between its rename into place and the write
    # of LATEST leaves LATEST one behind it (node/state.py renames a checkpoint only once its files are complete)
    checkpointed = max(
        int(folder.name.removeprefix("round-")) for folder in (state / "checkpoints").glob("round-*") if folder.is_dir()
    )
    assert latest_round(state) in (checkpointed, checkpointed - 1)
    assert checkpointed >= len(rows_before) - 1  # at most the round in flight is lost

    result = run_cli(cli_env, "train", "--config", str(tiny_yaml), "--state-dir", str(state), "--rounds", "2")
    assert result.returncode == 0, result.stderr
    rounds = [r["round"] for r in read_rows(state)]
    assert rounds == list(range(1, checkpointed + 3))  # no gap, no duplicate
    assert latest_round(state) == checkpointed + 2


def test_ctrl_c_saves_and_exits_cleanly(tiny_yaml, tmp_path, cli_env):
    state = tmp_path / "state"
    process = _start_and_wait(cli_env, tiny_yaml, state, rows_needed=2)
    os.kill(process.pid, signal.SIGINT)
    try:
        assert process.wait(timeout=CLI_TIMEOUT_S) == 0, process.stderr.read().decode()
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.stderr.close()
    assert latest_round(state) == read_rows(state)[-1]["round"]


def test_help_everywhere(cli_env):
    for args in (["--help"], ["train", "--help"], ["stats", "--help"]):
        result = run_cli(cli_env, *args)
        assert result.returncode == 0 and "usage: swarm-node" in result.stdout
