"""A model split into 4 stages served by real `swarm-node serve` processes on 127.0.0.1, trained by
a real `swarm-node drive`; stage servers are killed with SIGKILL and their state dirs deleted, and
the stage comes back from its neighbours (CheckFree, CheckFree+) or from a live replica, taken up
by a spare, a newcomer (`--stage auto`) or a replica of another stage that moves to it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest

from node.config import dump_config, load_config
from tests.conftest import CLI_TIMEOUT_S, REPO, cli
from tests.swarm_helpers import SwarmProcess, read_rows, wait_for

PIPELINE_OVERRIDES = [
    "model.default.hidden_size=32",
    "model.default.num_layers=4",
    "model.default.num_heads=2",
    "model.default.intermediate_size=64",
    "model.default.max_position_embeddings=128",
    "model.default.warmup_steps=0",
    'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "swarm.swarm_id=test-pipeline",
    "swarm.bootstrap_backoff_s=0.5",
    "pipeline.num_stages=4",
    "pipeline.micro_batch_size=4",
    "pipeline.micro_batches=2",
    "pipeline.sequence_length=32",
    "pipeline.corpus_sequences=64",
    "pipeline.validation_sequences=8",
    "pipeline.eval_every=0",
    "pipeline.announce_interval_s=0.5",
    "pipeline.announce_ttl_s=10",  # generous: a server starved by a neighbour's start must not look dead; a killed one is reported by the driver
    "pipeline.avoid_s=6",
    "pipeline.replica_sync_every=1",
    "pipeline.rebalance_grace_s=3",
    "pipeline.balance_quality=0.2",  # throughput moves (unit-tested) only for a 5x gain: a loaded machine's samples/s is noisy
    "torch_threads=1",
]
START_S = 180  # a process imports torch and hivemind and starts p2pd: generous on a loaded 2-core machine


@pytest.fixture
def pipeline_yaml(model_cache, tmp_path):
    from node.model import ensure_default_model

    config = load_config(REPO / "configs" / "pipeline.yaml", PIPELINE_OVERRIDES)
    ensure_default_model(config, progress=False)
    path = tmp_path / "pipeline.yaml"
    path.write_text(dump_config(config))
    return path


@pytest.fixture
def procs():
    started: list[SwarmProcess] = []
    yield started
    for proc in started:
        proc.close()


def recoveries(state_dir) -> list[dict]:
    path = state_dir / "recoveries.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Pipeline:
    def __init__(self, config_path, tmp_path, env, procs, settings: list[str] = ()):
        self.config_path, self.tmp_path, self.env, self.procs = config_path, tmp_path, env, procs
        self.settings = [arg for setting in settings for arg in ("--set", setting)]  # config overrides for every process
        self.count = 0

    def live_peers(self) -> list[str]:
        """Addresses of two running processes: a newcomer must not bootstrap from a killed one."""
        running = [p for p in self.procs if p.process.poll() is None and (p.state_dir / "addresses.txt").exists()]
        return [a for p in running[:2] for a in p.addresses()]

    def serve(self, stage: str) -> SwarmProcess:
        self.count += 1
        proc = SwarmProcess(self.config_path, self.tmp_path / f"server-{self.count}", self.env, self.live_peers(), command="serve",
                            extra=["--stage", stage, *self.settings])
        self.procs.append(proc)
        proc.addresses()  # joined: later processes may bootstrap from it
        return proc

    def serve_every_stage(self) -> tuple[list[SwarmProcess], list[dict]]:
        """One server per stage of the 4, each waited for until it serves: the servers, and how each got its weights."""
        servers = [self.serve(str(i)) for i in range(4)]
        return servers, [self.serving(server) for server in servers]

    def drive(self) -> SwarmProcess:
        proc = SwarmProcess(self.config_path, self.tmp_path / "driver", self.env, self.live_peers(), command="drive", extra=self.settings)
        self.procs.append(proc)
        return proc

    def serving(self, proc: SwarmProcess) -> dict:
        """The server's latest acquisition of weights, once it serves."""
        return wait_for(lambda: proc.assert_running() or (recoveries(proc.state_dir) or [None])[-1], START_S, f"{proc.state_dir.name} to serve")

    def steps(self, driver: SwarmProcess, more: int) -> list[dict]:
        """Wait for `more` steps after the current ones; all rows."""
        target = len(read_rows(driver.state_dir)) + more
        return wait_for(lambda: driver.assert_running() or (rows if len(rows := read_rows(driver.state_dir)) >= target else None), START_S, f"driver step {target}", interval=0.5)

    def recovered(self, driver: SwarmProcess, stage: int) -> dict:
        """The driver's record of `stage` coming back, once it has one."""
        def record():
            driver.assert_running()
            events = [e for row in read_rows(driver.state_dir) for e in row.get("recovery", []) if e["stage"] == stage and e["replaced"]]
            return events[-1] if events else None

        return wait_for(record, START_S, f"the driver to record stage {stage}'s recovery", interval=0.5)

    def kill(self, proc: SwarmProcess) -> None:
        proc.kill()
        shutil.rmtree(proc.state_dir)  # no file the dead server wrote can be read by the recovery

    def stage_rows(self, ready) -> list[dict]:
        """`peers --stages --json`'s rows of our pipeline, once `ready(rows)` holds."""
        def rows():
            result = subprocess.run(cli("peers", "--initial-peers", *self.live_peers()[:1], "--swarm-id", "test-pipeline", "--json", "--stages"),
                                    capture_output=True, text=True, env=self.env, cwd=REPO, timeout=CLI_TIMEOUT_S)
            assert result.returncode == 0, result.stderr
            maps = json.loads(result.stdout.strip().splitlines()[-1])
            return next(iter(maps.values())) if len(maps) == 1 and ready(next(iter(maps.values()))) else None

        return wait_for(rows, START_S, "peers --stages to show the expected stages", interval=1)


def assert_trains(rows: list[dict]) -> None:
    assert rows and all(math.isfinite(row["loss"]) for row in rows)


def test_lost_stages_are_rebuilt_from_their_neighbours(pipeline_yaml, tmp_path, cli_env, procs):
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs)
    servers, acquired = pipe.serve_every_stage()
    assert [event["method"] for event in acquired] == ["initial"] * 4
    spare = pipe.serve("spare")
    driver = pipe.drive()
    rows = pipe.steps(driver, 3)
    first_loss = rows[0]["loss"]

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
    replacement = pipe.serve("auto")  # the least-served stage is the dead one
    event = pipe.serving(replacement)
    assert (event["method"], event["stage"]) == ("checkfree_plus", 0)
    assert [s["stage"] for s in event["sources"]] == [1]
    assert pipe.recovered(driver, 0)["recovery_s"] > 0
    rows = pipe.steps(driver, 2)
    assert_trains(rows)
    assert rows[-1]["loss"] < first_loss  # it kept learning through two losses


def test_last_stage_and_replicas(pipeline_yaml, tmp_path, cli_env, procs):
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs)
    servers, _ = pipe.serve_every_stage()
    second_of_1 = pipe.serve("1")  # a second replica of stage 1 copies the first
    driver = pipe.drive()
    pipe.steps(driver, 2)
    assert pipe.serving(second_of_1)["method"] in ("replica_copy", "initial")  # before the first step there is nothing to copy but the start

    rows = pipe.stage_rows(lambda rows: [len(row["servers"]) for row in rows] == [1, 2, 1, 1])
    assert [row["layers"] for row in rows] == ["0-0", "1-1", "2-2", "3-3"] and all(row["step"] >= 1 for row in rows)

    # One of two replicas dies: the other carries stage 1 on without any recovery, and a restarted server copies it.
    pipe.kill(servers[1])
    rows = pipe.steps(driver, 3)
    assert_trains(rows)
    assert not any(e["stage"] == 1 and e["replaced"] for row in rows for e in row.get("recovery", []))  # nobody had to rebuild it
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
    summary = json.loads(subprocess.run(cli("stats", "--state-dir", str(driver.state_dir), "--json"), capture_output=True, text=True, env=cli_env, cwd=REPO,
                                        timeout=CLI_TIMEOUT_S).stdout)
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
    assert rows[len(before)]["step"] == before[-1]["step"] + 1  # metrics.jsonl continues where the stopped driver left off


def test_two_adjacent_stages_lost_at_once(pipeline_yaml, tmp_path, cli_env, procs):
    """Stages 1 and 2 die together. Defined behaviour: the driver waits and says for which stages, publishes them lost
    (`peers --stages` shows the hole); a newcomer rebuilds stage 1 from the nearest live stages on each side (0 and 3,
    CheckFree from a neighbour's neighbour, with a warning), the next rebuilds stage 2 from 1 and 3, and training goes on."""
    pipe = Pipeline(pipeline_yaml, tmp_path, cli_env, procs)
    servers, _ = pipe.serve_every_stage()
    driver = pipe.drive()
    pipe.steps(driver, 2)

    pipe.kill(servers[1])
    pipe.kill(servers[2])
    wait_for(lambda: driver.assert_running() or "for stage(s) 1, 2" in (driver.state_dir / "node.log").read_text(), START_S,
             "the driver to say it waits for stages 1 and 2", interval=0.5)
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
    pipe.recovered(driver, 1)
    assert_trains(pipe.steps(driver, 2))
