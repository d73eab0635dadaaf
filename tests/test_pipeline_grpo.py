"""The node's RL loop with its policy split across stage servers: rollouts generated through per-session
KV caches on the stages, the GRPO update through the pipeline, the rest of the loop unchanged."""

from __future__ import annotations

import json
import subprocess

import pytest

from node.config import dump_config, load_config
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli
from tests.helpers.swarm import read_rows, wait_for
from tests.helpers.pipeline import GRPO_OVERRIDES, START_S, Pipeline

pytestmark = pytest.mark.integration


def stage_json(server) -> dict | None:
    path = server.state_dir / "stage.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_grpo_rounds_run_through_the_pipeline(model_cache, tmp_path, cli_env):
    from node.model import ensure_default_model

    config = load_config(REPO / "configs" / "pipeline.yaml", [*GRPO_OVERRIDES, "swarm.swarm_id=test-pipeline-grpo"])
    ensure_default_model(config, progress=False)
    path = tmp_path / "grpo.yaml"
    path.write_text(dump_config(config))
    procs = []
    try:
        pipe = Pipeline(path, tmp_path, cli_env, procs)
        servers = [pipe.serve(str(i)) for i in range(2)]
        for server in servers:
            pipe.serving(server)
        driver_dir = tmp_path / "grpo-driver"
        result = subprocess.run(
            cli(
                "join",
                "--config",
                str(path),
                "--state-dir",
                str(driver_dir),
                "--rounds",
                "6",
                "--initial-peers",
                *pipe.live_peers(),
                "--set",
                "pipeline.objective=grpo",
            ),
            capture_output=True,
            text=True,
            env=cli_env,
            cwd=REPO,
            timeout=START_S * 2,
        )
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        rows = read_rows(driver_dir)
        assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
        assert rows[-1]["policy_version"] > 0  # some rounds had a reward spread and updated the split policy
        assert any(set(r.get("stage_grad_norms", {})) == {"0", "1"} and r["grad_norm"] > 0 for r in rows)
        assert "heldout_accuracy" in rows[1]  # greedy evaluation through the pipeline too
        assert not (driver_dir / "checkpoints").exists()  # no policy weights on the driver: the stages hold them
        for server in servers:
            stage = wait_for(
                lambda: (state := stage_json(server)) and state["step"] == rows[-1]["policy_version"] and state,
                30,
                "the stage to report its last step",
            )
            assert {"infer", "forward", "backward", "step"} <= set(stage["calls"])
        stats = subprocess.run(
            cli("stats", "--state-dir", str(driver_dir), "--json"),
            capture_output=True,
            text=True,
            env=cli_env,
            cwd=REPO,
            timeout=CLI_TIMEOUT_S,
        )
        assert stats.returncode == 0 and json.loads(stats.stdout)["rounds"] == 6
    finally:
        for proc in procs:
            proc.close()
