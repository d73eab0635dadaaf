"""Where a lost stage's weights come from (node/pipeline/recovery.py), without a network: the method for each case,
CheckFree's weighted average, and loading from stand-in sources."""

from __future__ import annotations


import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from node.pipeline.recovery import (
    MissingSource,
    RecoveryImpossible,
    checkfree_weights,
    choose_method,
    tensor_bytes,
)
from node.pipeline.stagemap import StageMap
from node.pipeline.stages import (
    PipelineStage,
    StagePart,
    StagePlan,
    checkfree_plus_extra_parts,
    part_tensors,
    split_model,
)
from tests.helpers.stages import LiveStages, announce, load


@pytest.mark.parametrize(
    "args, expected",
    [
        ((1, 4, True, True, "checkfree", True), ("replica_copy", [1])),  # a live replica beats everything
        ((1, 4, False, False, "checkfree", True), ("initial", [])),  # nothing trained yet: the initial model
        ((1, 4, False, True, "random", True), ("random", [])),  # the benchmark's baseline
        ((2, 4, False, True, "checkfree", True), ("checkfree", [1, 3])),
        ((0, 4, False, True, "checkfree", True), ("checkfree_plus", [1])),
        ((3, 4, False, True, "checkfree", True), ("checkfree_plus", [2])),
        ((1, 2, False, True, "checkfree", True), ("checkfree_plus", [0])),
    ],
)
def test_choose_method(args, expected):
    assert choose_method(*args) == expected


def test_two_adjacent_lost_stages_are_rebuilt_from_the_nearest_live_stages():
    assert choose_method(1, 5, False, True, "checkfree", True, live_stages={0, 3, 4}) == ("checkfree", [0, 3])
    assert choose_method(2, 5, False, True, "checkfree", True, live_stages={0, 3, 4}) == ("checkfree", [0, 3])
    # once 1 is back
    assert choose_method(2, 5, False, True, "checkfree", True, live_stages={0, 1, 3, 4}) == (
        "checkfree",
        [1, 3],
    )


@pytest.mark.parametrize(
    "args, live, why",
    [
        ((0, 1, False, True, "checkfree", True), None, "one-stage"),
        ((0, 4, False, True, "checkfree", False), None, "only CheckFree+"),
        (
            (1, 4, False, True, "checkfree", True),
            {2, 3},
            "none is live below",
        ),  # stages 0 and 1 lost: stage 1 has nothing below
        (
            (0, 4, False, True, "checkfree", True),
            {2, 3},
            "stage 1, which has no live server",
        ),  # its CheckFree+ partner is lost too
    ],
)
def test_choose_method_says_why_it_cannot(args, live, why):
    with pytest.raises(RecoveryImpossible, match=why):
        choose_method(*args, live_stages=live)


def test_checkfree_weights_favour_the_neighbour_with_the_larger_gradient():
    prev, nxt = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    merged, a, b = checkfree_weights(prev, nxt, prev_grad_norm=0.25, next_grad_norm=0.75)
    assert a == pytest.approx(0.75 + 1e-4) and b == pytest.approx(0.25 + 1e-4)
    torch.testing.assert_close(merged["w"], torch.full((3,), a / (a + b)))
    merged, _, _ = checkfree_weights(prev, nxt, 0.0, 0.0)  # no gradient yet: the plain mean
    torch.testing.assert_close(merged["w"], torch.full((3,), 0.5))
    merged, _, _ = checkfree_weights(
        {"w": torch.zeros(2, dtype=torch.bfloat16)}, {"w": torch.ones(2, dtype=torch.bfloat16)}, 1.0, 1.0
    )
    assert merged["w"].dtype is torch.bfloat16


def test_checkfree_rebuilds_a_stage_deeper_than_one_neighbour_from_its_last_layer():
    """30 layers in 4 stages are 8, 8, 7 and 7 (SmolLM2's split): stage 1 rebuilt from stages 0 (8 layers) and 2 (7)
    takes the average at each of its 8 positions, stage 2's last layer standing in at the eighth; a 7-layer stage
    from an 8-layer and a 7-layer neighbour leaves the deeper one's last layer out."""
    prev = {f"{j}.w": torch.full((2,), float(j)) for j in range(8)}
    nxt = {f"{j}.w": torch.full((2,), 10.0 + j) for j in range(7)}
    merged, a, b = checkfree_weights(prev, nxt, 1.0, 1.0, depth=8)
    assert sorted(merged, key=lambda n: int(n.split(".")[0])) == [f"{j}.w" for j in range(8)]
    for j in range(7):
        torch.testing.assert_close(merged[f"{j}.w"], torch.full((2,), (j + 10.0 + j) / 2))
    torch.testing.assert_close(merged["7.w"], torch.full((2,), (7 + 16.0) / 2))  # stage 2's layer 6 stands in
    shallower, _, _ = checkfree_weights(prev, nxt, 1.0, 1.0, depth=7)
    assert set(shallower) == {f"{j}.w" for j in range(7)}
    torch.testing.assert_close(shallower["6.w"], torch.full((2,), (6 + 16.0) / 2))
    with pytest.raises(ValueError, match="different tensor names"):  # without a depth, equal depths only
        checkfree_weights(prev, nxt, 1.0, 1.0)


def test_checkfree_weights_refuse_neighbours_of_another_shape():
    with pytest.raises(ValueError, match="different tensor names"):
        checkfree_weights({"w": torch.zeros(2)}, {"v": torch.zeros(2)}, 1.0, 1.0)
    with pytest.raises(ValueError, match="shapes differ"):
        checkfree_weights({"w": torch.zeros(2)}, {"w": torch.zeros(3)}, 1.0, 1.0)


def model():
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_load_stage_by_checkfree_averages_the_nearest_live_neighbours():
    stages = split_model(model(), 4, checkfree_plus_extra_parts(4))
    live = LiveStages(stages, {0: 0.2, 3: 0.6})
    view = StageMap.from_announcements(4, [announce(0, "a", ["embed", "layers"]), announce(3, "d", ["layers", "head"])])
    target = PipelineStage.from_model(model(), StagePlan(4, 4), 1, (StagePart.EMBED,))
    event = load("checkfree", [0, 3], target, view, live)  # stages 1 and 2 lost together
    expected, a, b = checkfree_weights(
        stages[0].part_state_dict(StagePart.LAYERS), stages[3].part_state_dict(StagePart.LAYERS), 0.2, 0.6
    )
    for name, tensor in target.part_state_dict(StagePart.LAYERS).items():
        torch.testing.assert_close(tensor, expected[name])
    assert [s["stage"] for s in event.sources] == [0, 3] and event.lr_scale == 1.1 and event.step == 7
    assert sum(s["weight"] for s in event.sources) == pytest.approx(1.0)
    assert live.calls == [(0, ["layers"]), (3, ["layers"])]
    assert live.most_in_flight == 2  # both neighbours at once, each from its own host
    layer_bytes = [tensor_bytes(stages[i].part_state_dict(StagePart.LAYERS)) for i in (0, 3)]
    assert event.bytes_fetched == sum(layer_bytes) > 0


def test_load_stage_rebuilds_a_stage_of_an_uneven_split_and_checks_what_a_neighbour_sends():
    """6 layers in 4 stages are 2, 2, 1 and 1: stage 1 rebuilt from stages 0 and 2 holds two layers, its second
    averaged with stage 2's only one; a fetch checks a neighbour's LAYERS against that neighbour's depth."""
    config = Qwen2Config(**{**model().config.to_dict(), "num_hidden_layers": 6, "layer_types": None})
    torch.manual_seed(0)
    six = Qwen2ForCausalLM(config).eval()
    stages = split_model(six, 4, checkfree_plus_extra_parts(4))
    assert [len(StagePlan(6, 4).layer_range(i)) for i in range(4)] == [2, 2, 1, 1]
    live = LiveStages(stages, {0: 0.5, 2: 0.5})
    view = StageMap.from_announcements(4, [announce(0, "a", ["embed", "layers"]), announce(2, "c", ["layers"])])
    target = PipelineStage.from_config(stages[0].config, StagePlan(6, 4), 1)
    load("checkfree", [0, 2], target, view, live)
    rebuilt = target.part_state_dict(StagePart.LAYERS)
    prev, nxt = stages[0].part_state_dict(StagePart.LAYERS), stages[2].part_state_dict(StagePart.LAYERS)
    assert {name.split(".", 1)[0] for name in rebuilt} == {"0", "1"}
    for name, tensor in rebuilt.items():
        rest = name.split(".", 1)[1]  # both positions average with stage 2's only layer
        torch.testing.assert_close(tensor, (prev[name] + nxt[f"0.{rest}"]) / 2)
    expected = part_tensors(target, ["layers"], depth=1)
    assert set(expected) == set(part_tensors(stages[2], ["layers"]))
    assert all(expected[n].shape == t.shape for n, t in part_tensors(stages[2], ["layers"]).items())


def test_load_stage_by_checkfree_plus_copies_the_partner_and_its_embedding_copy():
    stages = split_model(model(), 4, checkfree_plus_extra_parts(4))
    live = LiveStages(stages, {1: 0.3})
    view = StageMap.from_announcements(4, [announce(1, "b", ["embed", "layers"])])
    target = PipelineStage.from_config(stages[0].config, StagePlan(4, 4), 0)
    event = load("checkfree_plus", [1], target, view, live)
    torch.testing.assert_close(
        target.part_state_dict(StagePart.EMBED)["weight"], stages[1].part_state_dict(StagePart.EMBED)["weight"]
    )
    for name, tensor in target.part_state_dict(StagePart.LAYERS).items():
        torch.testing.assert_close(tensor, stages[1].part_state_dict(StagePart.LAYERS)[name])
    assert event.method == "checkfree_plus" and [s["stage"] for s in event.sources] == [1]
    assert event.bytes_fetched == tensor_bytes(part_tensors(stages[1], ["layers", "embed"]))


def test_load_stage_waits_for_a_source_that_is_not_live():
    stages = split_model(model(), 4, checkfree_plus_extra_parts(4))
    view = StageMap.from_announcements(4, [announce(0, "a", ["embed", "layers"])])
    live = LiveStages(stages, {})
    with pytest.raises(MissingSource, match="neighbour stage 3"):
        load("checkfree", [0, 3], PipelineStage.from_model(model(), StagePlan(4, 4), 2), view, live)
    assert live.calls == []  # found missing before anything was read
