"""In-process averaging (node/averaging/inprocess.py): what the sharing benchmark's NoLoCo arms rely on. A member's
exchange meets its partner's, takes the partner's weights as the wire would carry them, and skips as the network
would; nodes given such a service average through their own loop."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from node.averaging.inprocess import InProcessAverager, InProcessBoard
from node.averaging.matchmaking import pair_partner
from node.averaging.service import OuterStepService
from tests.helpers.inprocess import in_process_nodes


def weights(value: float) -> dict[str, torch.Tensor]:
    """Two tensors; values a little apart (a partner more than half our norm away is refused, as on the wire)."""
    return {"w": torch.full((3, 2), value), "b": torch.tensor([value, 2 * value])}


def exchange_all(averagers, thetas, timeout=30.0):
    async def run():
        return await asyncio.gather(*(a.average(t, round_id=0, timeout=timeout) for a, t in zip(averagers, thetas)))

    return asyncio.run(run())


def test_a_pair_takes_the_exact_mean_of_both_snapshots_in_fp32():
    board = InProcessBoard()
    a, b = InProcessAverager(board, "a"), InProcessAverager(board, "b")
    ra, rb = exchange_all([a, b], [weights(4.0), weights(5.0)])
    for result, partner in ((ra, "b"), (rb, "a")):
        assert result.partner_ids == [partner] and result.round_id == 0
        assert torch.equal(result.mean_theta["w"], torch.full((3, 2), 4.5))
        assert torch.equal(result.mean_theta["b"], torch.tensor([4.5, 9.0]))
    assert ra.bytes_sent == rb.bytes_received > 6 * 4  # the encoded snapshot: 8 floats and the codec's framing


def test_a_partners_weights_arrive_rounded_as_the_transfer_mode_sends_them():
    """fp16 on the wire: 1 + 2**-12 is not a float16, so that partner's value arrives as 1.0; our own stays exact."""
    board = InProcessBoard()
    a, b = InProcessAverager(board, "a", mode="fp16"), InProcessAverager(board, "b", mode="fp16")
    fine = 1.0 + 2**-12
    ra, rb = exchange_all([a, b], [weights(1.0), weights(fine)])
    assert torch.equal(ra.mean_theta["w"], torch.full((3, 2), 1.0))  # (1 + 1) / 2: the partner's rounded value
    assert torch.equal(rb.mean_theta["w"], torch.full((3, 2), (fine + 1.0) / 2))  # its own, exact


def test_four_members_pair_as_the_matchmaking_orders_them_and_diloco_takes_everyone():
    board = InProcessBoard()
    averagers = [InProcessAverager(board, name) for name in "abcd"]
    thetas = [weights(float(8 + i)) for i in range(4)]
    for exchange in range(2):  # the pairs change with the exchange, as with the DHT's round ids
        results = exchange_all(averagers, thetas)
        for name, result in zip("abcd", results):
            partner = pair_partner(list("abcd"), name, exchange)
            assert result.partner_ids == [partner] and result.round_id == exchange
            expected = (thetas["abcd".index(name)]["w"] + thetas["abcd".index(partner)]["w"]) / 2
            assert torch.equal(result.mean_theta["w"], expected)
    everyone = InProcessBoard(group_size=None)
    results = exchange_all([InProcessAverager(everyone, name) for name in "abc"], thetas[:3])
    assert all(torch.equal(r.mean_theta["w"], torch.full((3, 2), 9.0)) for r in results)
    assert sorted(results[0].partner_ids) == ["b", "c"]


def test_a_partner_that_never_comes_or_sends_the_wrong_shapes_is_a_skipped_exchange():
    board = InProcessBoard()
    a, b = InProcessAverager(board, "a"), InProcessAverager(board, "b")
    assert asyncio.run(a.average(weights(1.0), round_id=0, timeout=0.05)) is None  # b never averaged
    b.exchanges = 1  # b's next exchange is a's next one
    wrong = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    ra, rb = exchange_all([a, b], [weights(1.0), wrong])
    assert ra is None and a.refusals == {"wrong_shape": 1}
    assert rb is None and b.refusals == {"wrong_shape": 1}
    with pytest.raises(ValueError, match="already on the board"):
        InProcessAverager(board, "a")
    with pytest.raises(ValueError, match="unknown mode"):
        InProcessAverager(board, "c", mode="fp8")


def test_nodes_given_in_process_averaging_average_through_their_own_loop(tiny_config, tmp_path):
    """Two nodes, NoLoCo after every update: each round applies the last exchange, and the outer step moves both
    models to the same place (the pair's mean, both nodes' slow weights and momenta agree)."""
    common = [
        f"tasks.datasets={json.dumps([{'name': 'basic_arithmetic', 'weight': 1.0}])}",
        "swarm.transport=dht",
        "swarm.external_questions=4",
        "averaging.method=noloco",
        "averaging.every_steps=1",
        "averaging.window_s=0.001",  # one exchange per update
        # a node waits for its partner while the partner runs its round: on a loaded machine that took more than the
        # default 20 s, the waiting node skipped its last exchange and kept its own weights while its partner averaged
        "averaging.timeout_s=300",
        "averaging.outer_lr=1.0",
        "averaging.outer_momentum=0.0",
        "trainer.drop_uniform_groups=false",  # an update every round, so an exchange every round
    ]
    nodes = in_process_nodes(tiny_config, tmp_path, {"a": [*common, "seed=0"], "b": [*common, "seed=1"]})
    board = InProcessBoard()
    for name, node in zip("ab", nodes):
        node.averaging = OuterStepService(node.config, node.model, InProcessAverager(board, name))

    async def run():
        for node in nodes:
            await node.start_services()
        try:
            for _ in range(3):
                for node in nodes:
                    await node.run_round()
                # lockstep: both exchanges of a round end before the next round starts, so that each round applies
                # the last one. Without it, a node whose exchange was still running when its next round began could
                # start none in that round (one at a time): the board pairs the k-th exchanges, the two nodes' counts
                # drifted apart, and the last one waited out its timeout for a partner that never came (a skip, seen
                # under load)
                for node in nodes:
                    await node.averaging.wait_exchange()
            for node in nodes:
                node.averaging.apply_if_done()
        finally:
            for node in nodes:
                await node.stop_services()

    asyncio.run(run())
    a, b = nodes
    assert (a.averaging.stats.succeeded, b.averaging.stats.succeeded) == (3, 3)  # one exchange a round
    assert (a.averaging.stats.skipped, b.averaging.stats.skipped) == (0, 0)
    assert a.averaging.stats.last_partners == ["b"] and b.averaging.stats.last_partners == ["a"]
    # outer lr 1 without momentum: the last step set both models to the pair's mean, and no update came after it
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6), name
