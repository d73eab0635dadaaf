"""What stops a node before it starts is one readable line and exit status 2, never a traceback: a state directory it
cannot write to (under a file, on a read-only file system, on a full disk) for `train`, `join` and `identity`, and a
dashboard or /metrics port another program holds, refused before the node loads its policy or joins anybody."""

from __future__ import annotations

import socket
import subprocess

import pytest

from node.config import dump_config
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli
from tests.helpers.mounts import fill, tmpfs

pytestmark = pytest.mark.integration

COMMANDS = ["train", "join", "identity"]


def refusal(env, command: str, state_dir, *extra: str) -> str:
    """The one line `command` prints on stderr, after checking it exits 2 with that line alone."""
    result = subprocess.run(
        cli(command, "--state-dir", str(state_dir), *extra),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture
def tiny_yaml(tiny_config, tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(dump_config(tiny_config()))
    return path


def options(command: str, tiny_yaml) -> list[str]:
    return [] if command == "identity" else ["--config", str(tiny_yaml)]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_state_directory_under_a_file_is_one_line(command, tiny_yaml, tmp_path, cli_env):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    for state_dir in (blocker / "state", blocker):
        line = refusal(cli_env, command, state_dir, *options(command, tiny_yaml))
        assert line == (
            f"swarm-node: error: cannot use the state directory {state_dir}: {blocker} is a file, not a directory; "
            "use another --state-dir"
        )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_state_directory_on_a_read_only_file_system_is_one_line(command, tiny_yaml, tmp_path, cli_env):
    with tmpfs(tmp_path / "read-only", 1, read_only=True) as mount:
        for state_dir in (mount / "state", mount):
            line = refusal(cli_env, command, state_dir, *options(command, tiny_yaml))
            assert line == (
                f"swarm-node: error: cannot use the state directory {state_dir}: read-only file system; use another "
                "--state-dir"
            )


@pytest.mark.parametrize("command", COMMANDS)
def test_a_state_directory_on_a_full_disk_is_one_line(command, tiny_yaml, tmp_path, cli_env):
    with tmpfs(tmp_path / "full", 1) as mount:
        fill(mount)
        line = refusal(cli_env, command, mount / "state", *options(command, tiny_yaml))
        assert line == (
            f"swarm-node: error: cannot use the state directory {mount / 'state'}: no space left on device; use "
            "another --state-dir"
        )


@pytest.mark.parametrize("setting", ["swarm.dashboard_port", "swarm.metrics_port"])
def test_a_port_another_program_holds_is_refused_before_the_node_joins(setting, swarm_yaml, tmp_path, cli_env):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        state = tmp_path / "state"
        line = refusal(cli_env, "join", state, "--config", str(swarm_yaml), "--set", f"{setting}={port}")
    assert line == (
        f"swarm-node: error: {setting}: port {port} on 127.0.0.1 is in use: choose another port, or 0 for a free one"
    )
    assert not (state / "addresses.txt").exists()  # it joined nobody
    assert not (state / "config.yaml").exists()  # nor loaded its policy
