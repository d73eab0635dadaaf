import subprocess

import pytest

from node.config import ConfigError, NodeConfig, dump_config, load_config
from tests.helpers.common import CLI_TIMEOUT_S, REPO, cli


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert isinstance(config, NodeConfig)


def test_isolated_yaml_is_the_built_in_default():
    assert load_config(REPO / "configs" / "isolated.yaml").model_dump(exclude={"state_dir"}) == NodeConfig().model_dump(
        exclude={"state_dir"}
    )


def test_overrides_are_typed_and_nested():
    config = load_config(None, ["trainer.lr=2e-5", "rollout.top_p=0.9", "swarm.local_questions=3", "name=alpha"])
    assert config.trainer.lr == 2e-5 and config.rollout.top_p == 0.9
    assert config.swarm.local_questions == 3 and config.name == "alpha"


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["trainer.lr=3e-5"])
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_config(config))
    assert load_config(saved) == config


@pytest.mark.parametrize(
    "override, field",
    [
        ("trainer.lr=-1", "trainer.lr"),
        ("trainer.lrr=1", "trainer.lrr"),
        ("rollout.completions_per_question=1", "rollout.completions_per_question"),
        ("tasks.prompt_template=no placeholder", "tasks.prompt_template"),
        ("swarm.external_questions=4", "config"),
        ("model.default.num_heads=3", "model.default"),
    ],
)
def test_invalid_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"invalid config: {field}")


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(REPO / "configs" / "nope.yaml")


@pytest.mark.integration
@pytest.mark.parametrize(
    "args",
    [
        ["train", "--set", "trainer.lr=abc"],
        ["train", "--set", "tasks.datasets=[{name: no_such_dataset}]"],
        ["train", "--config", "does-not-exist.yaml"],
    ],
)
def test_cli_bad_config_exits_2_with_one_line(args, tmp_path, cli_env):
    result = subprocess.run(
        cli(*args, "--state-dir", str(tmp_path / "s")),
        capture_output=True,
        text=True,
        env=cli_env,
        cwd=REPO,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("swarm-node: error:"), result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_join_without_a_config_runs_what_configs_swarm_yaml_says():
    """`swarm-node join` with no --config and `--config configs/swarm.yaml` are the same node (but the state dir)."""
    from node.commands import JOIN_PRESET

    preset = load_config(None, JOIN_PRESET).model_dump()
    shipped = load_config(REPO / "configs" / "swarm.yaml", []).model_dump()
    assert preset == shipped


@pytest.mark.parametrize(
    "sets, in_effect",
    [
        ([], "own_and_stronger_peers"),
        (["swarm.external_questions=0"], "own"),  # no peers' groups: its own right answers only
        (["swarm.transport=none", "swarm.external_questions=0"], "own"),  # isolated: the best silo
        (["swarm.imitation=own", "swarm.external_questions=0"], "own"),
    ],
)
def test_learning_from_stronger_peers_is_off_where_no_peer_groups_come(sets, in_effect):
    from node.sharing import RoundPlan

    config = load_config(REPO / "configs" / "swarm.yaml", sets)
    assert RoundPlan.of(config.swarm).imitation == in_effect
