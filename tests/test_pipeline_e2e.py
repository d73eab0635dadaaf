"""A model split into 4 stages served by real `swarm-node serve` processes on 127.0.0.1, trained by
a real `swarm-node drive`; stage servers are killed with SIGKILL and their state dirs deleted, and
the stage comes back from its neighbours (CheckFree, CheckFree+) or from a live replica, taken up
by a spare, a newcomer (`--stage auto`) or a replica of another stage that moves to it."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli
from tests.helpers.pipeline import START_S, Pipeline, assert_trains, recoveries
from tests.helpers.swarm import read_rows, wait_for

pytestmark = pytest.mark.integration


def readiness(proc) -> dict:
    """A process's /readyz answer, read from the URL it wrote to its state directory."""
    from node.stats import HTTP_FILE, probe

    status, body = probe((proc.state_dir / HTTP_FILE).read_text().strip() + "/readyz", 30)
    assert status in (200, 503) and isinstance(body, dict), body
    return body


def test_lost_stages_are_rebuilt_from_their_neighbours(pipeline_yaml, tmp_path, cli_env, procs):
    """With chained calls (pipeline.direct_hops): the servers pass hidden states to each other, and a chain through a
    killed server goes hop by hop, which finds it."""
    settings = ["pipeline.direct_hops=true", "swarm.metrics_port=0"]
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs, settings=settings)
    servers, acquired = pipe.serve_every_stage()
    assert [event["method"] for event in acquired] == ["initial"] * 4
    spare = pipe.serve("spare")
    driver = pipe.drive()
    rows = pipe.steps(driver, 3)
    first_loss = rows[0]["loss"]
    # every role answers /readyz: a server serving its stage, the spare waiting, the driver stepping
    assert readiness(servers[1])["reason"].startswith("serving stage 1 at step ")
    wait_for(lambda: readiness(spare)["ready"], START_S, "the spare to be ready")
    assert readiness(spare)["reason"] == "a spare, waiting for a stage that loses its last server"
    assert readiness(driver)["ready"] and readiness(driver)["round"] >= 3

    # Intermediate stage, only server: the spare rebuilds it by CheckFree from stages 1 and 3.
    pipe.kill(servers[2])
    event = pipe.serving(spare)
    assert event["method"] == "checkfree" and event["stage"] == 2
    assert sorted(s["stage"] for s in event["sources"]) == [1, 3]
    assert math.isclose(sum(s["weight"] for s in event["sources"]), 1.0, rel_tol=1e-6)
    assert event["lr_scale"] == pytest.approx(1.1) and event["step"] >= 3
    pipe.recovered(driver, 2)
    rows = pipe.steps(driver, 2)
    assert_trains(rows)

    # First stage: CheckFree+ copies stage 1's layers and its copy of the embedding.
    pipe.kill(servers[0])
    # the newcomer reads the stage map when it starts: wait until the map shows the loss (and the spare on stage 2),
    # as it would on a machine that is not starved
    pipe.stage_rows(lambda rows: not rows[0]["servers"] and all(row["servers"] for row in rows[1:]))
    replacement = pipe.serve("auto")  # the least-served stage is the dead one
    event = pipe.serving(replacement)
    assert (event["method"], event["stage"]) == ("checkfree_plus", 0), event  # its cause says what it saw
    assert [s["stage"] for s in event["sources"]] == [1]
    recovered = pipe.recovered(driver, 0)
    # the wait ends when the stage is served again, before the first step after it ends
    assert 0 < recovered["waited_s"] <= recovered["recovery_s"], recovered
    rows = pipe.steps(driver, 2)
    assert_trains(rows)
    assert rows[-1]["loss"] < first_loss  # it kept learning through two losses
    # the last stage's server, alive throughout, gave the driver the chains' outputs
    last = json.loads((servers[3].state_dir / "stage.json").read_text())
    assert last["calls"].get("collect", 0) >= len(rows), last["calls"]
    assert sum(row["chain_fallbacks"] for row in read_rows(driver.state_dir)) >= 1  # the chains through a dead server


def test_last_stage_and_replicas(pipeline_yaml, tmp_path, cli_env, procs):
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs)
    servers, _ = pipe.serve_every_stage()
    second_of_1 = pipe.serve("1")  # a second replica of stage 1 copies the first
    driver = pipe.drive()
    pipe.steps(driver, 2)
    # before the first step there is nothing to copy but the start
    assert pipe.serving(second_of_1)["method"] in (
        "replica_copy",
        "initial",
    )

    rows = pipe.stage_rows(lambda rows: [len(row["servers"]) for row in rows] == [1, 2, 1, 1])
    assert [row["layers"] for row in rows] == ["0-0", "1-1", "2-2", "3-3"] and all(row["step"] >= 1 for row in rows)

    # One of two replicas dies: the other carries stage 1 on without any recovery, and a restarted server copies it.
    pipe.kill(servers[1])
    rows = pipe.steps(driver, 3)
    assert_trains(rows)
    # nobody had to rebuild it
    assert not any(e["stage"] == 1 and e["replaced"] for row in rows for e in row.get("recovery", []))
    restarted = pipe.serve("1")
    event = pipe.serving(restarted)
    assert (event["method"], event["stage"]) == ("replica_copy", 1)
    assert event["sources"][0]["step"] >= 5
    assert_trains(pipe.steps(driver, 2))

    # Last stage, only server, and no newcomer: after rebalance_grace_s one of stage 1's two replicas moves to it and
    # rebuilds it by CheckFree+ from stage 2's layers and its copy of the head.
    pipe.kill(servers[3])

    def moved():
        for proc in (second_of_1, restarted):
            proc.assert_running()
            events = [e for e in recoveries(proc.state_dir) if e["cause"].startswith("moved")]
            if events:
                return events[-1]
        return None

    event = wait_for(moved, START_S, "a replica of stage 1 to move to stage 3", interval=0.5)
    assert (event["method"], event["stage"]) == ("checkfree_plus", 3) and "no live server" in event["cause"]
    assert [s["stage"] for s in event["sources"]] == [2]
    pipe.recovered(driver, 3)
    assert_trains(pipe.steps(driver, 2))
    summary = json.loads(
        subprocess.run(
            cli("stats", "--state-dir", str(driver.state_dir), "--json"),
            capture_output=True,
            text=True,
            env=cli_env,
            cwd=REPO,
            timeout=CLI_TIMEOUT_S,
        ).stdout
    )
    assert summary["stages_recovered"] >= 1 and summary["steps"] >= 12


def test_a_newcomer_rebuilds_the_stage_that_died_and_the_driver_resumes(pipeline_yaml, tmp_path, cli_env, procs):
    """Issue #24's scenario: the only server of a middle stage is killed and a `serve --stage auto` starts at once, well
    within the dead server's announcement TTL (60 s here): it must see the stage as dead (its announcement is no longer
    refreshed, and the driver reports the stage lost), rebuild it by CheckFree, and the driver must step again. Then the
    driver itself is stopped with Ctrl-C and restarted: it resumes its step count."""
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs, settings=["pipeline.announce_ttl_s=60"])
    servers, _ = pipe.serve_every_stage()
    driver = pipe.drive()
    pipe.steps(driver, 3)

    pipe.kill(servers[2])
    newcomer = pipe.serve("auto")
    event = pipe.serving(newcomer)
    assert (event["method"], event["stage"]) == ("checkfree", 2), event
    assert event["cause"] in ("auto: no live server", "auto: lost (a driver reported it)")
    assert sorted(s["stage"] for s in event["sources"]) == [1, 3]
    pipe.recovered(driver, 2)
    rows = pipe.steps(driver, 2)
    assert_trains(rows)

    assert driver.interrupt() == 0
    before = read_rows(driver.state_dir)
    assert f"stopped at step {before[-1]['step']}" in driver.output()
    restarted = pipe.drive()
    rows = pipe.steps(restarted, 1)
    # metrics.jsonl continues where the stopped driver left off
    assert rows[len(before)]["step"] == before[-1]["step"] + 1


def test_two_adjacent_stages_lost_at_once(pipeline_yaml, tmp_path, cli_env, procs):
    """Stages 1 and 2 die together. Defined behaviour: the driver waits and says for which stages, publishes them lost
    (`peers --stages` shows the hole); a newcomer rebuilds stage 1 from the nearest live stages on each side (0 and 3,
    CheckFree from a neighbour's neighbour, with a warning), the next rebuilds stage 2 from 1 and 3, and training goes
    on."""
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs)
    servers, _ = pipe.serve_every_stage()
    driver = pipe.drive()
    pipe.steps(driver, 2)

    pipe.kill(servers[1])
    pipe.kill(servers[2])
    wait_for(
        lambda: driver.assert_running() or "for stage(s) 1, 2" in (driver.state_dir / "node.log").read_text(),
        START_S,
        "the driver to say it waits for stages 1 and 2",
        interval=0.5,
    )
    rows = pipe.stage_rows(lambda rows: not rows[1]["servers"] and not rows[2]["servers"])
    assert [row["lost"] for row in rows] == [False, True, True, False]
    assert rows[0]["servers"] and rows[3]["servers"]

    first = pipe.serve("auto")
    event = pipe.serving(first)
    assert (event["method"], event["stage"]) == ("checkfree", 1)
    assert sorted(s["stage"] for s in event["sources"]) == [0, 3]  # its neighbour 2 is lost too
    assert "nearest live stages 0 and 3" in (first.state_dir / "node.log").read_text()
    second = pipe.serve("auto")
    event = pipe.serving(second)
    assert (event["method"], event["stage"]) == ("checkfree", 2)
    assert sorted(s["stage"] for s in event["sources"]) == [1, 3]
    # whichever of the two the driver found lost first, it records both coming back
    assert pipe.recovered(driver, 1)["recovery_s"] > 0
    assert pipe.recovered(driver, 2)["recovery_s"] > 0
    assert_trains(pipe.steps(driver, 2))
