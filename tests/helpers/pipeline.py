"""A pipeline of `swarm-node serve` processes and a `drive` on 127.0.0.1, for tests: its config, fixtures,
and a `Pipeline` that starts, waits for, kills and inspects its processes."""

from __future__ import annotations

import json
import math
import shutil
import subprocess

from benchmarks.lab.presets import PIPELINE_TIMINGS
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli
from tests.helpers.swarm import SwarmProcess, read_rows, wait_for

PIPELINE_OVERRIDES = [
    *PIPELINE_TIMINGS,
    "model.default.num_layers=4",
    'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "swarm.swarm_id=test-pipeline",
    "pipeline.num_stages=4",
]
# A `join` node whose policy the stage servers hold (pipeline.objective=grpo): a model warmed up enough for its
# rounds to have reward spreads (and so updates), rounds of a few short rollouts, 2 stages. Each test names its swarm.
GRPO_OVERRIDES = [
    "model.default.hidden_size=32",
    "model.default.num_layers=2",
    "model.default.num_heads=2",
    "model.default.intermediate_size=64",
    "model.default.max_position_embeddings=128",
    "model.default.warmup_steps=60",
    "model.default.warmup_batch_size=8",
    'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
    "swarm.local_questions=2",
    "swarm.external_questions=0",
    "swarm.gossip=dht",
    "swarm.bootstrap_backoff_s=0.5",
    "rollout.completions_per_question=4",
    "rollout.max_new_tokens=6",
    "tasks.format_reward=0.1",
    "tasks.heldout_size=8",
    "eval_every=2",
    "pipeline.num_stages=2",
    "pipeline.announce_interval_s=0.5",
    "pipeline.announce_ttl_s=4",
    "torch_threads=1",
]
START_S = 180  # a process imports torch and hivemind and starts p2pd: generous on a loaded 2-core machine


def recoveries(state_dir) -> list[dict]:
    path = state_dir / "recoveries.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Pipeline:
    def __init__(self, config_path, tmp_path, env, procs, settings: list[str] = ()):
        self.config_path, self.tmp_path, self.env, self.procs = config_path, tmp_path, env, procs
        # config overrides for every process
        self.settings = [arg for setting in settings for arg in ("--set", setting)]
        self.count = 0

    def live_peers(self) -> list[str]:
        """Addresses of two running processes: a newcomer must not bootstrap from a killed one."""
        running = [p for p in self.procs if p.process.poll() is None and (p.state_dir / "addresses.txt").exists()]
        return [a for p in running[:2] for a in p.addresses()]

    def serve(self, stage: str) -> SwarmProcess:
        self.count += 1
        proc = SwarmProcess(
            self.config_path,
            self.tmp_path / f"server-{self.count}",
            self.env,
            self.live_peers(),
            command="serve",
            extra=["--stage", stage, *self.settings],
        )
        self.procs.append(proc)
        proc.addresses()  # joined: later processes may bootstrap from it
        return proc

    def serve_every_stage(self) -> tuple[list[SwarmProcess], list[dict]]:
        """One server per stage of the 4, each waited for until it serves: the servers, and how each got its weights."""
        servers = [self.serve(str(i)) for i in range(4)]
        return servers, [self.serving(server) for server in servers]

    def drive(self) -> SwarmProcess:
        proc = SwarmProcess(
            self.config_path,
            self.tmp_path / "driver",
            self.env,
            self.live_peers(),
            command="drive",
            extra=self.settings,
        )
        self.procs.append(proc)
        return proc

    def serving(self, proc: SwarmProcess) -> dict:
        """The server's latest acquisition of weights, once it serves."""
        return wait_for(
            lambda: proc.assert_running() or (recoveries(proc.state_dir) or [None])[-1],
            START_S,
            f"{proc.state_dir.name} to serve",
        )

    def steps(self, driver: SwarmProcess, more: int) -> list[dict]:
        """Wait for `more` steps after the current ones; all rows."""
        target = len(read_rows(driver.state_dir)) + more
        return wait_for(
            lambda: driver.assert_running() or (rows if len(rows := read_rows(driver.state_dir)) >= target else None),
            START_S,
            f"driver step {target}",
            interval=0.5,
        )

    def recovered(self, driver: SwarmProcess, stage: int) -> dict:
        """The driver's record of `stage` coming back, once it has one."""

        def record():
            driver.assert_running()
            events = [
                e
                for row in read_rows(driver.state_dir)
                for e in row.get("recovery", [])
                if e["stage"] == stage and e["replaced"]
            ]
            return events[-1] if events else None

        return wait_for(record, START_S, f"the driver to record stage {stage}'s recovery", interval=0.5)

    def kill(self, proc: SwarmProcess) -> None:
        proc.kill()
        shutil.rmtree(proc.state_dir)  # no file the dead server wrote can be read by the recovery

    def stage_rows(self, ready) -> list[dict]:
        """`peers --stages --json`'s rows of our pipeline, once `ready(rows)` holds."""

        def rows():
            result = subprocess.run(
                cli(
                    "peers",
                    "--initial-peers",
                    *self.live_peers()[:1],
                    "--swarm-id",
                    "test-pipeline",
                    "--json",
                    "--stages",
                ),
                capture_output=True,
                text=True,
                env=self.env,
                cwd=REPO,
                timeout=CLI_TIMEOUT_S,
            )
            assert result.returncode == 0, result.stderr
            maps = json.loads(result.stdout.strip().splitlines()[-1])
            return next(iter(maps.values())) if len(maps) == 1 and ready(next(iter(maps.values()))) else None

        return wait_for(rows, START_S, "peers --stages to show the expected stages", interval=1)


def assert_trains(rows: list[dict]) -> None:
    assert rows and all(math.isfinite(row["loss"]) for row in rows)
