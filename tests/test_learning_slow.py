"""Long end-to-end runs (`make test-slow`); the default suite keeps their short versions
(test_cli_e2e.py, test_swarm.py)."""

import asyncio

import pytest

from node.config import load_config
from node.loop import Node
from tests.helpers.common import REPO


@pytest.mark.slow
def test_default_node_learns_in_isolation(model_cache, tmp_path):
    """The real default model (warm-started) gains held-out accuracy from RL alone."""
    node = Node(
        load_config(
            REPO / "configs" / "isolated.yaml", ["eval_every=0", "checkpoint_every=100"], state_dir=str(tmp_path / "s")
        )
    )
    node.load()
    before = node.evaluator.accuracy()
    asyncio.run(node.run(400, asyncio.Event()))
    after = node.evaluator.accuracy()
    assert after >= before + 0.05, (before, after)


@pytest.mark.slow
def test_swarm_of_three_runs_for_a_while(model_cache, tmp_path):
    """Three in-process swarm nodes share rollouts for 100 rounds with no refusals."""
    from tests.helpers.swarm import SWARM_OVERRIDES

    async def scenario():
        nodes = []
        try:
            for i in range(3):
                peers = [f'swarm.initial_peers=["{nodes[0].addresses[0]}"]'] if nodes else []
                node = Node(
                    load_config(
                        REPO / "configs" / "swarm.yaml",
                        [*SWARM_OVERRIDES, *peers, f"seed={i}"],
                        state_dir=str(tmp_path / str(i)),
                    )
                )
                node.load()
                await node.start_services()
                nodes.append(node)
            for _ in range(100):
                for node in nodes:
                    await node.run_round()
            return [node.stats.totals() for node in nodes]
        finally:
            for node in nodes:
                await node.stop_services()

    for totals in asyncio.run(scenario()):
        assert totals["questions_used"] > 20 and totals["rejected"] == {}
