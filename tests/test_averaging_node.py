"""NoLoCo inside the node loop: two real nodes on 127.0.0.1 exchange weights in the
background, then each applies the outer step rule to its own weights."""

from __future__ import annotations

import asyncio
import json

import torch

from node.averaging.outer import float_parameters
from node.config import load_config
from node.loop import Node
from tests.conftest import REPO
from tests.swarm_helpers import SWARM_OVERRIDES


def test_two_nodes_apply_the_noloco_rule(model_cache, tmp_path):
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path):
    overrides = [*SWARM_OVERRIDES, "averaging.method=noloco", "averaging.every_steps=2", "averaging.transfer_dtype=fp32", "averaging.window_s=600", "averaging.timeout_s=20", "trainer.drop_uniform_groups=false", "trainer.lr=1e-3"]
    pair: list[Node] = []
    try:
        for i in range(2):
            peers = [f"swarm.initial_peers={json.dumps(pair[0].transport.addresses)}"] if pair else []
            node = Node(load_config(REPO / "configs" / "swarm.yaml", [*overrides, *peers, f"seed={i}"], state_dir=str(tmp_path / str(i))))
            node.load()
            await node.start_services()
            pair.append(node)
        phi0 = {k: v.detach().clone() for k, v in float_parameters(pair[0].model).items()}
        assert all(torch.equal(phi0[k], v) for k, v in float_parameters(pair[1].model).items())  # same initial model
        while not all(node.averaging._task for node in pair):
            for node in pair:
                if node.averaging._task is None:
                    await node.run_round()
        sent = [node.averaging._theta_sent for node in pair]
        assert not all(torch.equal(sent[0][k], sent[1][k]) for k in phi0)  # they trained apart
        await asyncio.gather(*(node.averaging._task for node in pair))
        outcomes = [node.averaging.apply_if_done() for node in pair]
        assert [o["outcome"] for o in outcomes] == ["averaged", "averaged"]
        mean = {k: (sent[0][k] + sent[1][k]) / 2 for k in phi0}
        for node in pair:  # m = 0.7 * (mean - phi0); phi = phi0 + m; theta = phi (no steps taken meanwhile)
            for name, param in float_parameters(node.model).items():
                assert torch.allclose(param, phi0[name] + 0.7 * (mean[name] - phi0[name]), atol=1e-5), name
        assert pair[0].averaging.stats.bytes_sent > 0 and pair[0].averaging.counters()["succeeded"] == 1
        row = await pair[0].run_round()
        assert all(torch.isfinite(p).all() for p in pair[0].model.parameters()) and row["round"] > 0
        assert "swarm_node_averaging_succeeded 1.0" in pair[0].prometheus()
        assert (pair[0].peer_stats().outer_steps, pair[0].peer_stats().outer_steps_skipped) == (1, 0)  # the heartbeat says so
    finally:
        for node in pair:
            await node.stop_services()
