"""A model split into stages computes exactly what the whole model computes: logits, gradients, KV-cached decoding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from node.pipeline.driver import route_order
from node.pipeline.stages import (
    PipelineStage,
    StagePart,
    StagePlan,
    cache_keyword,
    checkfree_plus_extra_parts,
    layers_shape_signature,
    run_stages,
    split_model,
    stage_fingerprint,
)

VOCAB, B, T = 100, 3, 10


def qwen(layers: int = 6) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    ).eval()


def llama() -> LlamaForCausalLM:
    torch.manual_seed(1)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    ).eval()


def right_padded():
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask, torch.arange(T).expand(B, T)  # as node/trainer/scoring.py completion_logprobs calls the model


def left_padded():
    ids, _, _ = right_padded()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :5] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)  # as the sampler does


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("padding", [right_padded, left_padded])
def test_split_logits_equal_the_whole_model(num_stages, padding):
    model = qwen()
    ids, mask, positions = padding()
    whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    split = run_stages(split_model(model, num_stages), ids, mask, positions)
    torch.testing.assert_close(split[mask.bool()], whole[mask.bool()], atol=1e-5, rtol=1e-5)


def test_llama_splits_too():
    model = llama()
    ids, mask, positions = right_padded()
    whole = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(
        run_stages(split_model(model, 2), ids, mask, positions)[mask.bool()], whole[mask.bool()], atol=1e-5, rtol=1e-5
    )


def test_split_gradients_equal_the_whole_model():
    model = qwen()
    ids, mask, positions = right_padded()
    stages = split_model(model, 3)
    targets = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits[mask.bool()], targets[mask.bool()])

    loss_of(model(input_ids=ids, attention_mask=mask, position_ids=positions).logits).backward()
    loss_of(run_stages(stages, ids, mask, positions)).backward()
    whole = dict(model.named_parameters())
    # Tied embedding: its whole-model gradient is the sum of the untied copies' gradients.
    torch.testing.assert_close(
        stages[0].embed_tokens.weight.grad + stages[-1].lm_head.weight.grad,
        whole["model.embed_tokens.weight"].grad,
        atol=1e-6,
        rtol=1e-5,
    )
    torch.testing.assert_close(stages[-1].norm.weight.grad, whole["model.norm.weight"].grad, atol=1e-6, rtol=1e-5)
    for stage in stages:
        for local, layer in zip(stage.plan.layer_range(stage.index), stage.layers):
            for name, param in layer.named_parameters():
                torch.testing.assert_close(param.grad, whole[f"model.layers.{local}.{name}"].grad, atol=1e-6, rtol=1e-5)


def test_kv_cached_decoding_equals_the_whole_model():
    model = qwen()
    ids, mask, positions = left_padded()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    stages = split_model(model, 3)
    caches = [s.new_cache() for s in stages]
    split = run_stages(stages, ids, mask, positions, caches=caches)
    torch.testing.assert_close(split[:, -1], out.logits[:, -1], atol=1e-5, rtol=1e-5)
    # `cache` in current transformers, `past_key_values` before (the output field alike)
    keyword = cache_keyword(type(model).forward)
    past, next_position = getattr(out, keyword), positions[:, -1:] + 1
    for step in range(4):
        tokens = torch.randint(0, VOCAB, (B, 1), generator=torch.Generator().manual_seed(10 + step))
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        out = model(
            input_ids=tokens, attention_mask=mask, position_ids=next_position, use_cache=True, **{keyword: past}
        )
        past = getattr(out, keyword)
        split = run_stages(stages, tokens, mask, next_position, caches=caches)
        torch.testing.assert_close(split, out.logits, atol=1e-5, rtol=1e-5)
        next_position = next_position + 1
    assert all(cache.seq_len == T + 4 for cache in caches)


def test_stages_never_share_storage_with_the_model():
    model = qwen()
    stage = split_model(model, 2)[0]
    with torch.no_grad():
        stage.layers[0].mlp.up_proj.weight.add_(1.0)
    assert not torch.equal(stage.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)


def test_parts_round_trip_and_refuse_mismatches():
    model = qwen()
    stages = split_model(model, 3, checkfree_plus_extra_parts(3))
    assert stages[1].parts == (StagePart.LAYERS, StagePart.EMBED, StagePart.HEAD)  # S = 3: stage 1 is both neighbours
    assert layers_shape_signature(stages[0]) == layers_shape_signature(stages[2])
    # CheckFree+: a neighbour's layers fit
    stages[1].load_part_state_dict(StagePart.LAYERS, stages[0].part_state_dict(StagePart.LAYERS))
    torch.testing.assert_close(stages[1].layers[0].mlp.up_proj.weight, stages[0].layers[0].mlp.up_proj.weight)
    stages[1].load_part_state_dict(StagePart.EMBED, stages[0].part_state_dict(StagePart.EMBED))
    bad = stages[0].part_state_dict(StagePart.LAYERS)
    bad["0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="up_proj"):
        stages[2].load_part_state_dict(StagePart.LAYERS, bad)
    with pytest.raises(ValueError, match="missing"):
        stages[2].load_part_state_dict(StagePart.LAYERS, {})
    with pytest.raises(ValueError, match="does not hold"):
        stages[2].part_state_dict(StagePart.EMBED)


def test_swapped_order_runs_and_differs():
    model = qwen(4)
    stages = split_model(model, 4)
    ids, mask, positions = right_padded()
    normal = run_stages(stages, ids, mask, positions)
    swapped = run_stages(stages, ids, mask, positions, order=[1, 0, 3, 2])
    assert torch.isfinite(swapped).all() and not torch.allclose(normal, swapped)


def test_route_order_swaps_the_end_pairs_on_one_micro_batch_in_every():
    assert [route_order(4, i, swap=True) for i in range(2)] == [[0, 1, 2, 3], [1, 0, 3, 2]]
    assert [route_order(4, i, swap=True, every=4) for i in range(4)] == [[0, 1, 2, 3]] * 3 + [[1, 0, 3, 2]]
    assert route_order(5, 1, swap=True, last_pair=False) == [1, 0, 2, 3, 4]
    assert [route_order(3, i, swap=True) for i in (1, 3)] == [[1, 0, 2], [0, 2, 1]]  # the pairs overlap: in turn
    assert [route_order(3, i, swap=True, last_pair=False) for i in (1, 3)] == [[1, 0, 2]] * 2
    assert route_order(2, 1, swap=True, last_pair=False) == [1, 0]  # the first pair is the last
    assert route_order(4, 1, swap=False) == [0, 1, 2, 3]


def test_plan_edges_and_fingerprints():
    assert [list(StagePlan(8, 4).layer_range(i)) for i in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(StagePlan(7, 3).layer_range(i)) for i in range(3)] == [3, 2, 2]
    assert StagePlan(3, 1).parts(0) == (StagePart.EMBED, StagePart.LAYERS, StagePart.HEAD)
    assert StagePlan(3, 3).parts(1) == (StagePart.LAYERS,)
    with pytest.raises(ValueError):
        StagePlan(3, 4)
    with pytest.raises(ValueError):
        StagePlan(4, 2).layer_range(2)
    model = qwen(4)
    plan = StagePlan(4, 2)
    from_model = PipelineStage.from_model(model, plan, 1)
    from_config = PipelineStage.from_config(model.config, plan, 1)
    # what drivers check servers against
    assert stage_fingerprint("m", plan, 1, from_model) == stage_fingerprint("m", plan, 1, from_config)
    assert stage_fingerprint("m", plan, 1, from_model) != stage_fingerprint(
        "m", plan, 0, PipelineStage.from_model(model, plan, 0)
    )
