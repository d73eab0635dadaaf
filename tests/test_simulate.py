"""`swarm-node simulate`: N local nodes joined to each other, node 0's dashboard, Ctrl-C stops them all cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest

from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli, get_json
from tests.helpers.swarm import read_rows, wait_for


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.integration
def test_simulate_starts_a_joined_swarm_with_a_dashboard_and_ctrl_c_stops_every_node(
    evaluating_swarm_yaml, tmp_path, cli_env
):
    root = tmp_path / "sim"
    out = tmp_path / "simulate.out"
    log = open(out, "w")
    process = subprocess.Popen(
        cli(
            "simulate",
            "--nodes",
            "3",
            "--dashboard-port",
            "0",
            "--state-dir",
            str(root),
            "--config",
            str(evaluating_swarm_yaml),
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=cli_env,
        cwd=REPO,
        start_new_session=True,
    )
    pids: list[int] = []
    try:

        def printed(pattern: str):
            assert process.poll() is None, out.read_text()[-3000:]
            return re.findall(pattern, out.read_text())

        url = wait_for(lambda: printed(r"dashboard: (http://\S+)"), 300, "the dashboard URL")[0]
        pids = [int(pid) for pid in printed(r"node-\d: pid (\d+)")]
        assert len(pids) == 3
        wait_for(
            lambda: printed("") is not None and len(get_json(url + "api/peers")) == 3,
            300,
            "three peers on the dashboard",
            interval=1,
        )
        assert sorted(r["display_name"] for r in get_json(url + "api/peers")) == ["node-0", "node-1", "node-2"]
        wait_for(lambda: all(read_rows(root / f"node-{i}") for i in range(3)), 300, "a round of every node")

        # what Ctrl-C in its terminal does; the nodes live in their own process groups
        os.kill(process.pid, signal.SIGINT)
        assert process.wait(timeout=CLI_TIMEOUT_S) == 0, out.read_text()[-3000:]
        assert not any(alive(pid) for pid in pids)
        for i in range(3):
            state = root / f"node-{i}"
            saved = int((state / "checkpoints" / "LATEST").read_text().strip().removeprefix("round-"))
            assert saved == read_rows(state)[-1]["round"]  # each node saved its last round on the way out
        assert "stopped; state under" in out.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        for pid in pids:  # the nodes' own process groups, if simulate could not stop them
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
        log.close()


def test_node_set_overrides_one_node_over_the_shared_set(tmp_path):
    from node.dashboard.simulate import LocalSwarm, parse_node_overrides

    per_node = parse_node_overrides(['1:model.default.warmup_labels=["add"]', "1:seed=7", "0:name=first"], nodes=2)
    assert per_node == {1: ['model.default.warmup_labels=["add"]', "seed=7"], 0: ["name=first"]}
    swarm = LocalSwarm(tmp_path, 2, 0, overrides=["seed=3"], node_overrides=per_node)
    second = swarm.command(1, ["/ip4/127.0.0.1/tcp/1/p2p/x"])
    sets = [second[i + 1] for i, arg in enumerate(second) if arg == "--set"]
    # the shared --set first, then this node's: the last one wins in the CLI
    assert sets[-3:] == ["seed=3", 'model.default.warmup_labels=["add"]', "seed=7"]
    first = swarm.command(0, [])
    assert [first[i + 1] for i, arg in enumerate(first) if arg == "--set"][-2:] == ["seed=3", "name=first"]


@pytest.mark.integration
def test_node_set_refuses_what_it_cannot_place(tmp_path):
    from node.dashboard.simulate import parse_node_overrides

    with pytest.raises(ValueError, match="node 4 does not exist"):
        parse_node_overrides(["4:seed=1"], nodes=4)
    with pytest.raises(ValueError, match="expected N:KEY=VALUE"):
        parse_node_overrides(["seed=1"], nodes=4)
    result = subprocess.run(
        cli("simulate", "--nodes", "2", "--state-dir", str(tmp_path), "--node-set", "x:seed=1"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode != 0 and "expected N:KEY=VALUE" in result.stderr + result.stdout
