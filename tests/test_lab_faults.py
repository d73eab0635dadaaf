"""Faults in the swarm lab, the long runs (`make test-slow`): churn, a partition, a lossy node. Each node is its own
`swarm-node join` process in its own network namespace
(benchmarks/lab/); the short version is tests/test_lab.py in the default suite."""

from __future__ import annotations

import time

import pytest

from benchmarks.lab import Lab, Link, lab_unavailable, node_summary, start_swarm
from tests.helpers.common import CLI_TIMEOUT_S, REPO, TINY_OVERRIDES
from tests.helpers.swarm import peers_listed, read_rows, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))]
SWARM_ID = "lab-faults"
SETS = [
    *TINY_OVERRIDES,
    "swarm.transport=dht",
    f"swarm.swarm_id={SWARM_ID}",
    "swarm.window_s=2",
    "swarm.heartbeat_interval_s=1",
    "swarm.heartbeat_ttl_s=10",
    "swarm.external_questions=2",
    "checkpoint_every=1",
    "torch_threads=1",
]


@pytest.fixture
def prebuilt(model_cache):
    from node.config import load_config
    from node.model import ensure_default_model

    ensure_default_model(load_config(REPO / "configs" / "swarm.yaml", SETS))


def listed_by(lab: Lab, index: int, bootstrap: str, env) -> set[str]:
    """Display names of the live peers, as `swarm-node peers` run inside node `index`'s namespace lists them."""
    return {row["display_name"] for row in peers_listed(bootstrap, SWARM_ID, env, netns=lab.ns(index))}


def last_round(state_dir) -> int:
    rows = read_rows(state_dir)
    return rows[-1]["round"] if rows else 0


def assert_resumed(state_dir) -> None:
    rounds = [r["round"] for r in read_rows(state_dir)]
    # no round counted twice, none restarted from 1
    assert rounds == sorted(set(rounds)) and rounds[0] == 1, rounds[:20]


# ten minutes of churn by design, plus start-up and convergence: the suite's 600 s hang guard would always fire
@pytest.mark.timeout(2400)
def test_churn_one_node_killed_every_30s_for_10_minutes(prebuilt, tmp_path, cli_env):
    nodes = 8
    with Lab(nodes, host_link=False) as lab:
        bootstrap = start_swarm(lab, tmp_path, SETS, env=cli_env, start_timeout_s=CLI_TIMEOUT_S)
        wait_for(
            lambda: all(last_round(tmp_path / f"n{i}") > 0 for i in range(nodes)),
            600,
            "every node's first round",
            interval=2,
        )
        started, victim, killed = time.monotonic(), 0, []
        while time.monotonic() - started < 600:
            victim = 1 + (victim % (nodes - 1))
            lab.kill(victim)
            killed.append(victim)
            time.sleep(5)
            lab.restart(victim, env=cli_env)
            time.sleep(25)
            for index in range(nodes):
                assert lab.alive(index) or index == victim, (
                    f"node {index} died on its own; see {tmp_path / f'n{index}.out'}"
                )
        marks = {i: last_round(tmp_path / f"n{i}") for i in range(nodes)}
        wait_for(
            lambda: all(last_round(tmp_path / f"n{i}") > marks[i] for i in range(nodes)),
            300,
            "every node to keep training",
            interval=2,
        )
        for index in set(killed):
            assert_resumed(tmp_path / f"n{index}")
        wait_for(
            lambda: listed_by(lab, 0, bootstrap, cli_env) == {f"lab-{i}" for i in range(nodes)},
            120,
            "peers to converge on all nodes",
            interval=3,
        )


def test_a_partition_is_survived_and_healed(prebuilt, tmp_path, cli_env):
    nodes = 6
    with Lab(nodes, host_link=False) as lab:
        bootstrap = start_swarm(lab, tmp_path, SETS, env=cli_env, start_timeout_s=CLI_TIMEOUT_S)
        everyone = {f"lab-{i}" for i in range(nodes)}
        wait_for(
            lambda: all(node_summary(tmp_path / f"n{i}")["external_questions"] > 0 for i in range(nodes)),
            600,
            "every node to use peers' rollouts",
            interval=2,
        )
        cut = set(range(nodes // 2, nodes))
        marks = {i: last_round(tmp_path / f"n{i}") for i in range(nodes)}
        lab.partition(cut)
        time.sleep(60)
        assert all(lab.alive(i) for i in range(nodes))
        assert all(last_round(tmp_path / f"n{i}") > marks[i] for i in range(nodes)), (
            "a half stopped training while cut off"
        )
        lab.heal()
        # every node sees every live peer again (the bound is a hang guard, x3 by wait_for)
        for index in (0, nodes - 1):
            wait_for(
                lambda: listed_by(lab, index, bootstrap, cli_env) == everyone,
                30,
                f"node {index} to see every peer after the heal",
                interval=2,
            )


def test_a_lossy_node_and_its_peers_keep_training(prebuilt, tmp_path, cli_env):
    nodes = 4
    with Lab(nodes, host_link=False) as lab:
        for index in range(nodes):
            lab.shape(index, Link(mbit=20, loss=0.05 if index == nodes - 1 else 0.0))
        start_swarm(lab, tmp_path, SETS, env=cli_env, start_timeout_s=CLI_TIMEOUT_S)
        wait_for(
            lambda: all(node_summary(tmp_path / f"n{i}")["external_questions"] > 0 for i in range(nodes)),
            600,
            "every node to use peers' rollouts",
            interval=2,
        )
        marks = {i: last_round(tmp_path / f"n{i}") for i in range(nodes)}
        wait_for(
            lambda: all(last_round(tmp_path / f"n{i}") >= marks[i] + 20 for i in range(nodes)),
            600,
            "20 more rounds on every node",
            interval=2,
        )
        assert all(lab.alive(i) for i in range(nodes))
