"""A stage server and a pipeline driver whose p2p daemon dies under them rejoin the swarm in the same process, with
the same peer id, and the pipeline trains on: the server takes its stage up again over the new session, the driver
takes its step again."""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest

from tests.helpers.common import CLI_TIMEOUT_S
from tests.helpers.pipeline import START_S, Pipeline, assert_trains, recoveries
from tests.helpers.swarm import daemon_of, read_rows, wait_for

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
