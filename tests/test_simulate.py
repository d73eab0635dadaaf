"""`swarm-node simulate`: N local nodes joined to each other, node 0's dashboard, Ctrl-C stops them all cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess

from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli, get_json
from tests.helpers.swarm import read_rows, wait_for


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
