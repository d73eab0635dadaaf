"""Chained calls (pipeline.direct_hops, protocol/pipeline.py "Chained calls"): three real stage servers in process on
127.0.0.1, each on its own DHT node and p2p daemon, driven by a real `PipelineRouter`. A chain passes each hidden state
from server to server, and must give the driver the same logits and leave every stage the same gradients as the same
route hop by hop; a chain that breaks is sent hop by hop, blames the right server, and a route naming a server nobody
announced is refused without a dial."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
import torch

from node.config import load_config
from node.pipeline.client import HopFailed, call_stage
from node.pipeline.driver import ONWARD_FAILED, PipelineRouter, route_hops, route_order
from node.pipeline.lm import full_masks
from node.pipeline.server import StageServer
from node.pipeline.stages import expected_fingerprints
from node.pipeline.tensors import to_wire
from node.transport.session import SwarmSession
from protocol import NodeIdentity
from protocol.pipeline import PIPELINE_VERSION, RouteHop, StageCall
from tests.helpers.averaging import swarm
from tests.helpers.common import REPO

pytestmark = pytest.mark.integration

STAGES = 3
OVERRIDES = [
    "model.default.hidden_size=32",
    "model.default.num_layers=3",
    "model.default.num_heads=2",
    "model.default.intermediate_size=64",
    "model.default.max_position_embeddings=64",
    "model.default.warmup_steps=0",
    "swarm.swarm_id=test-chained",
    f"pipeline.num_stages={STAGES}",
    "pipeline.announce_interval_s=0.3",
    "pipeline.announce_ttl_s=10",
    "pipeline.max_batch_size=8",
    "pipeline.rebalance=false",
    "pipeline.call_timeout_s=60",  # a loaded machine's calls are slow, not lost
]


def config(tmp_path, name: str, *settings: str):
    return load_config(REPO / "configs" / "pipeline.yaml", [*OVERRIDES, *settings], state_dir=str(tmp_path / name))


@pytest.fixture
def model(model_cache, tmp_path):
    from node.model import model_fingerprint, resolve_initial_policy

    model, tokenizer = resolve_initial_policy(config(tmp_path, "probe"))
    return model, model_fingerprint(model, tokenizer)


@contextlib.asynccontextmanager
async def pipeline(tmp_path, model):
    """One server per stage, serving, and two routers of a driver on a DHT node of its own: direct_hops on (chained)
    and off (hop by hop)."""
    model, fingerprint = model
    async with swarm(STAGES + 1) as (*server_nodes, driver_node):
        servers = []
        for stage, node in enumerate(server_nodes):
            cfg = config(tmp_path, f"server-{stage}", f"pipeline.stage={stage}")
            session = SwarmSession(cfg, node, "direct", NodeIdentity.generate(), cfg.resolved_state_dir())
            servers.append(StageServer(session, model, fingerprint))
        running = [asyncio.create_task(server.run()) for server in servers]
        try:
            for _ in range(600):
                if all(server.state == "serving" for server in servers):
                    break
                await asyncio.sleep(0.1)
            assert [server.index for server in servers if server.state == "serving"] == list(range(STAGES))
            routers = []
            for direct in (True, False):
                cfg = config(tmp_path, "driver", f"pipeline.direct_hops={str(direct).lower()}")
                stage_fps = expected_fingerprints(cfg, model.config, fingerprint)
                routers.append(PipelineRouter(driver_node, cfg, fingerprint, stage_fps, servers[0].limits))
            for _ in range(200):  # every server's announcement read
                if not (await routers[0].refresh(force=True)).empty_stages():
                    break
                await asyncio.sleep(0.1)
            yield servers, *routers
        finally:
            for server in servers:
                await server.stop()
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)


def gradients(servers) -> list[torch.Tensor]:
    """Every stage's accumulated gradients, flattened, and then dropped (as a step of scale 0 drops them)."""
    grads = []
    for server in servers:
        params = list(server.backend.stage.parameters())
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params]))
        server.backend.optimizer.zero_grad(set_to_none=True)
    return grads


def test_a_chain_gives_the_logits_and_gradients_of_the_same_route_hop_by_hop(tmp_path, model):
    input_ids = torch.randint(0, model[0].config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    positions, mask = full_masks(input_ids)

    async def scenario():
        async with pipeline(tmp_path, model) as (servers, router, hop_router):
            # micro-batch 1 swaps stages (CheckFree+): stage 0 is called twice in one pass, embedding then layers
            for index in (0, 1):
                hops = route_hops(STAGES, route_order(STAGES, index, swap=True))
                route = await router.pick_route(hops)
                passes = {}
                for chained, way in ((True, router), (False, hop_router)):
                    logits = await way.forward(route, hops, f"m{index}", input_ids, positions, mask, train=True)
                    await way.backward(route, hops, f"m{index}", torch.ones_like(logits) / logits.numel())
                    passes[chained] = logits, gradients(servers)
                (chain_logits, chain_grads), (hop_logits, hop_grads) = passes[True], passes[False]
                assert torch.equal(chain_logits, hop_logits)
                for stage, (a, b) in enumerate(zip(chain_grads, hop_grads)):
                    assert b.abs().sum() > 0, f"stage {stage} got no gradient"
                    assert torch.allclose(a, b, atol=1e-6), f"stage {stage}: the chain's gradient differs"
            # the chain went from server to server: the last stage's output was collected, and the middle stage
            # waited for the rest of the chain
            assert router.chain_fallbacks == 0 and not router.chained, "every chained forward had its backward"
            assert servers[-1].handler.calls["collect"] == 2
            assert servers[1].handler.call_seconds["forward"]["onward"] > 0

    asyncio.run(scenario())


def test_a_broken_chain_is_sent_hop_by_hop_and_paused_when_servers_cannot_reach_each_other(tmp_path, model):
    input_ids = torch.randint(0, model[0].config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    positions, mask = full_masks(input_ids)

    async def scenario():
        async with pipeline(tmp_path, model) as (servers, router, _):
            hops = route_hops(STAGES, route_order(STAGES, 0, swap=True))
            route = await router.pick_route(hops)

            async def unreachable(hop: RouteHop, call: StageCall):
                raise HopFailed(route[hop.stage], "unreachable", "test: this server cannot dial the next one")

            servers[1].handler.onward = unreachable  # stage 1 cannot reach stage 2; the driver reaches all three
            for attempt in range(2):
                logits = await router.forward(route, hops, f"a{attempt}", input_ids, positions, mask, train=False)
                assert logits.shape[:2] == input_ids.shape
            assert router.chain_fallbacks == 2
            assert not router.chaining(), "two chains broke where hop by hop went through: chaining pauses"
            assert not router.avoided(), "no server is blamed for a chain that broke between two live ones"
            # nobody was refused anything: not the driver for a chain another server broke, nor the middle stage
            # refreshing its CheckFree+ copies of both end stages' parts (with three stages it holds both)
            assert [server.handler.stats.refusals.by_reason() for server in servers] == [{}] * STAGES

            # a dead server: the chain and hop by hop both fail, and the failure names the dead server
            router.chain_paused_until = 0.0
            servers[1].handler.onward = servers[1].call_onward
            await servers[2].stop()
            with pytest.raises(HopFailed) as failure:
                await router.forward(route, hops, "dead", input_ids, positions, mask, train=False)
            assert failure.value.server.stage == 2
            assert failure.value.reason != ONWARD_FAILED

    asyncio.run(scenario())


def chained_forward(router, stage_fps, hops, route, call_ids: list[str], tensors: dict, origin: str) -> StageCall:
    """The first call of a chained forward along `hops`, built here from the protocol alone."""
    onward = [
        RouteHop(
            stage=stage,
            stage_fingerprint=stage_fps[stage],
            peer_id=route[stage].p2p_peer_id,
            call_id=call_id,
            parts=parts,
        )
        for (stage, parts), call_id in list(zip(hops, call_ids))[1:]
    ]
    return StageCall(
        v=PIPELINE_VERSION,
        op="forward",
        stage=hops[0][0],
        stage_fingerprint=stage_fps[hops[0][0]],
        call_id=call_ids[0],
        parts=list(hops[0][1]),
        train=False,
        tensors={k: to_wire(v) for k, v in tensors.items()},
        scale=1.0,
        origin=origin,
        route=onward,
    )


def test_a_route_naming_an_unannounced_server_is_refused_and_collect_answers_only_the_origin(tmp_path, model):
    async def scenario():
        async with pipeline(tmp_path, model) as (servers, router, _):
            fps = router.fingerprints
            origin = router.dht.peer_id.to_base58()
            input_ids = torch.randint(0, 50, (1, 6))
            positions, mask = full_masks(input_ids)
            tensors = {"input_ids": input_ids, "position_ids": positions, "attention_mask": mask}
            hops = route_hops(STAGES, list(range(STAGES)))
            route = await router.pick_route(hops)

            # a hop whose peer id no announcement carries: refused, and nothing dialed
            nowhere = dict(route)
            nowhere[1] = dataclasses.replace(route[1], p2p_peer_id="Qm" + "x" * 44)
            with pytest.raises(HopFailed) as failure:
                await router.call(
                    route[0], chained_forward(router, fps, hops, nowhere, ["h0", "h1", "h2"], tensors, origin)
                )
            assert failure.value.reason == ONWARD_FAILED and "not among the announcements" in failure.value.detail

            # a chain's last hop keeps its output for the origin the chain names, not for whoever asks first
            await router.call(route[0], chained_forward(router, fps, hops, route, ["k0", "k1", "k2"], tensors, origin))
            collect = StageCall(
                v=PIPELINE_VERSION,
                op="collect",
                stage=STAGES - 1,
                stage_fingerprint=fps[-1],
                call_id="k2",
                parts=[],
                train=False,
                tensors={},
                scale=1.0,
            )
            last = route[STAGES - 1]
            other = servers[0].dht.p2p  # a peer other than the chain's origin
            with pytest.raises(HopFailed) as failure:
                await call_stage(other, router.handler, last, collect, servers[0].limits, 60)
            assert failure.value.reason == "refused:unknown_call"
            result = await router.call(last, collect)
            assert result.tensors["output"].shape[:2] == [1, 6]

    asyncio.run(scenario())
