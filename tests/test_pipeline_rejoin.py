"""A stage server, a pipeline driver and a `join` node whose policy the stage servers hold (pipeline.objective=grpo),
whose p2p daemon dies under them, rejoin the swarm in the same process, with the same peer id, and the pipeline trains
on: the server takes its stage up again over the new session, the driver takes its step again, the join node's round
goes on over the new session."""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest

from node.config import dump_config, load_config
from node.model import ensure_default_model
from tests.helpers.common import CLI_TIMEOUT_S, REPO
from tests.helpers.pipeline import GRPO_OVERRIDES, START_S, Pipeline, assert_trains, recoveries
from tests.helpers.swarm import SwarmProcess, daemon_of, read_rows, wait_for

pytestmark = pytest.mark.integration


def rejoined(proc, peer_id: str) -> None:
    """Wait until `proc` logged its rejoin over a new daemon with the same peer id, after saying why it left."""
    log = proc.state_dir / "node.log"
    wait_for(
        lambda: proc.assert_running() or "rejoined the swarm as" in log.read_text(),
        START_S,
        f"{proc.state_dir.name} to rejoin",
        interval=0.5,
    )
    text = log.read_text()
    assert "lost the swarm connection (the p2p daemon exited (status -9))" in text, text[-3000:]
    assert f"rejoined the swarm as {peer_id} " in text  # its p2p key, kept in the state directory


def metrics(proc) -> str:
    from node.stats import HTTP_FILE

    base = (proc.state_dir / HTTP_FILE).read_text().strip()
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        return response.read().decode()


def test_a_server_and_a_driver_whose_p2p_daemon_dies_rejoin_and_the_pipeline_trains_on(
    pipeline_yaml, tmp_path, cli_env, procs
):
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs, settings=["pipeline.num_stages=2", "swarm.metrics_port=0"])
    first = pipe.serve("0")
    servers = [pipe.serve("1"), pipe.serve("1")]  # the second a replica: the rejoined server loads the stage from it
    for server in (first, *servers):
        pipe.serving(server)
    driver = pipe.drive()
    pipe.steps(driver, 2)

    server = servers[0]
    peer_id = server.addresses()[0].split("/p2p/")[1]
    daemon = daemon_of(server)
    os.kill(daemon, signal.SIGKILL)
    rejoined(server, peer_id)
    assert daemon_of(server) != daemon  # a new daemon under the same process
    wait_for(
        lambda: server.assert_running() or len(recoveries(server.state_dir)) >= 2,
        START_S,
        "the rejoined server to take up its stage again",
        interval=0.5,
    )
    again = recoveries(server.state_dir)[-1]
    assert again["stage"] == 1 and again["step"] >= 1, again  # from the swarm, not the initial weights of step 0
    assert "swarm_node_swarm_rejoins_total 1" in metrics(server)
    rows = pipe.steps(driver, 2)

    driver_peer = driver.addresses()[0].split("/p2p/")[1]
    os.kill(daemon_of(driver), signal.SIGKILL)
    rejoined(driver, driver_peer)
    rows = pipe.steps(driver, 3)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # no step lost, none twice
    assert_trains(rows)
    assert "swarm_node_swarm_rejoins_total 1" in metrics(driver)

    # and both stop as processes that never lost their daemon do
    for proc in (driver, server):
        assert proc.interrupt(timeout=CLI_TIMEOUT_S) == 0
        out = proc.output()
        assert "Traceback" not in out and "never retrieved" not in out, out[-3000:]
    assert read_rows(driver.state_dir)


def grpo_join(pipe: Pipeline, config_path, tmp_path, cli_env, procs) -> SwarmProcess:
    """A `join` node whose policy is split over the pipeline's stage servers (pipeline.objective=grpo)."""
    proc = SwarmProcess(
        config_path,
        tmp_path / "grpo-driver",
        cli_env,
        pipe.live_peers(),
        extra=["--set", "pipeline.objective=grpo", "--set", "swarm.metrics_port=0"],
    )
    procs.append(proc)
    return proc


def rounds(proc, more: int, after: int) -> list[dict]:
    """Wait until `proc` has `more` rounds after its first `after`; all rows."""
    return wait_for(
        lambda: proc.assert_running() or (rows if len(rows := read_rows(proc.state_dir)) >= after + more else None),
        START_S,
        f"{proc.state_dir.name} to finish round {after + more}",
        interval=0.5,
    )


def test_a_grpo_join_node_whose_policy_the_stage_servers_hold_rejoins_when_its_p2p_daemon_dies(
    model_cache, tmp_path, cli_env, procs
):
    """The round in flight is blocked on pipeline calls while the daemon is gone: the watchdog leaves and rejoins
    under it, the router is rebound to the new session, and the round goes on over it; no round is lost or taken
    twice, and the policy version only moves forward."""
    config = load_config(
        REPO / "configs" / "pipeline.yaml", [*GRPO_OVERRIDES, "swarm.swarm_id=test-pipeline-grpo-rejoin"]
    )
    ensure_default_model(config, progress=False)
    path = tmp_path / "grpo.yaml"
    path.write_text(dump_config(config))
    pipe = Pipeline(path, tmp_path, cli_env, procs)
    for server in [pipe.serve("0"), pipe.serve("1")]:
        pipe.serving(server)
    node = grpo_join(pipe, path, tmp_path, cli_env, procs)
    peer_id = node.addresses()[0].split("/p2p/")[1]
    before = rounds(node, 2, 0)

    daemon = daemon_of(node)
    os.kill(daemon, signal.SIGKILL)
    rejoined(node, peer_id)
    assert daemon_of(node) != daemon  # a new daemon under the same process
    rows = rounds(node, 2, len(before) + 1)  # the round in flight, then two over the new session

    assert [r["round"] for r in rows] == list(range(1, len(rows) + 1))  # no round lost, none twice
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > 0, versions
    assert "swarm_node_swarm_rejoins_total 1" in metrics(node)
    os.killpg(node.process.pid, signal.SIGTERM)  # the node only: its daemon runs in a session of its own
    assert node.process.wait(timeout=CLI_TIMEOUT_S) == 0
    out = node.output()
    assert "Traceback" not in out and "never retrieved" not in out, out[-3000:]
    after = read_rows(node.state_dir)
    assert [r["round"] for r in after] == list(range(1, len(after) + 1))


def test_readiness_of_a_pipeline_node_that_rejoins_says_its_rounds_wait_for_the_swarm(tmp_path):
    """A node whose policy is split over stage servers cannot train on its own questions while it rejoins."""
    from node.loop import Node

    config = load_config(
        REPO / "configs" / "pipeline.yaml", ["pipeline.objective=grpo"], state_dir=str(tmp_path / "node")
    )
    node = Node(config)
    node.swarm_lost = "the p2p daemon exited (status -9)"
    reason = node.readiness()["reason"]
    assert "waits for the swarm" in reason and "own questions" not in reason, reason
    assert reason.endswith("the p2p daemon exited (status -9)")
