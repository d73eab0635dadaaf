"""A round's work counted (node/compute.py) and weighed in compute units; the sampler's own count of its forwards."""

import copy
import json

import pytest

from node.compute import RoundWork, UnitCosts, model_shape_key
from node.loop import Node

COSTS = UnitCosts(
    prefill_token=1e-4,
    decode_token=2e-4,
    forward_token=3e-4,
    train_token=5e-4,
    scored_completion=1e-5,
    optimizer_step=0.01,
    decode_step=1e-3,
    train_call=4e-3,
    record_decoded=1e-3,
    group_rederived=2e-4,
)


def test_units_hand_computed():
    work = RoundWork(
        prefill_tokens=1000,
        decode_tokens=200,
        forward_tokens=100,
        train_tokens=2000,
        scored_completions=64,
        optimizer_steps=1,
        decode_steps=10,
        train_calls=5,
        records_decoded=3,
        groups_rederived=8,
    )
    # 0.1 + 0.04 + 0.01 generation, 0.03 no-grad, 1.0 + 0.02 forward-backward, 0.00064 scoring, 0.003 + 0.0016 sharing,
    # 0.01 optimizer
    assert COSTS.split(work) == pytest.approx(
        {
            "generation": 0.15,
            "no_grad_forward": 0.03,
            "forward_backward": 1.02,
            "scoring": 0.00064,
            "sharing": 0.0046,
            "optimizer": 0.01,
        }
    )
    assert COSTS.units(work) == pytest.approx(1.21524)
    assert COSTS.units(work + work) == pytest.approx(2 * 1.21524)
    assert RoundWork.from_dict(work.as_dict()) == work
    assert RoundWork.from_dict({"train_tokens": 5}) == RoundWork(train_tokens=5)  # kinds a row lacks count 0


def test_costs_load_by_model_shape_and_say_what_is_missing(tmp_path):
    path = tmp_path / "costs.json"
    shape = model_shape_key(256, 4, 512, 100)
    path.write_text(json.dumps({shape: {"costs": COSTS.__dict__}}))
    assert UnitCosts.load(path, shape) == COSTS
    # a calibration from before the per-call kinds: its per-position costs carried the calls, which now weigh 0
    newer_kinds = ("decode_step", "train_call", "record_decoded", "group_rederived")
    before = {k: v for k, v in COSTS.__dict__.items() if k not in newer_kinds}
    path.write_text(json.dumps({shape: {"costs": before}}))
    old = UnitCosts.load(path, shape)
    assert [getattr(old, kind) for kind in newer_kinds] == [0.0] * 4 and old.train_token == COSTS.train_token
    with pytest.raises(KeyError, match="h64-l2"):
        UnitCosts.load(path, model_shape_key(64, 2, 128, 100))
    with pytest.raises(FileNotFoundError, match="compute_units.py"):
        UnitCosts.load(tmp_path / "none.json", shape)


def test_the_sampler_counts_the_positions_it_runs(tiny_config):
    node = Node(tiny_config("rollout.max_new_tokens=5", "rollout.generation_batch_size=6"))
    node.load()
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 3)]
    before = copy.copy(node.backend.work)
    groups = node.backend.generate(prompts, n=4, seed=1)
    done = node.backend.work.since(before)
    widths = [len(node.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    rows = [w for w in widths for _ in range(4)]
    completions = [c for g in groups for c in g]
    prefill = decode = steps = 0
    for start in range(0, 12, 6):  # two sampler batches of 6 rows, each left-padded to its longest prompt
        batch = slice(start, start + 6)
        # each distinct prompt of the batch prefilled once (rows of prompts 0,0,0,0,1,1 then 1,1,2,2,2,2)
        prefill += 2 * max(rows[batch])
        # the first token comes from the prefill; each further step runs all 6 rows until the batch's longest ends
        decode += 6 * (max(len(c.completion_ids) for c in completions[batch]) - 1)
        steps += max(len(c.completion_ids) for c in completions[batch]) - 1
    assert (done.prefill_tokens, done.decode_tokens, done.decode_steps) == (prefill, decode, steps)


def test_each_layout_has_its_own_calibration_key():
    from node.compute import round_layout

    assert model_shape_key(256, 4, 512, 100) == "h256-l4-i512-v100"
    assert model_shape_key(256, 4, 512, 100, "shared-prompts") == "h256-l4-i512-v100-shared-prompts"
    with pytest.raises(ValueError, match="layout"):
        model_shape_key(256, 4, 512, 100, "packed")
    assert round_layout(True, True) == "shared-prompts" and round_layout(False, False) == "rows"
    with pytest.raises(ValueError, match="neither"):
        round_layout(True, False)


def test_the_calibration_separates_a_calls_cost_from_a_positions():
    from benchmarks.compute_units import fit_two_costs

    # seconds = 0.004 per call + 0.0002 per position, at micro-batch sizes that trade calls for positions
    rows = [
        (calls, positions, 0.004 * calls + 0.0002 * positions) for calls, positions in [(2, 350), (7, 420), (56, 900)]
    ]
    assert fit_two_costs(rows) == pytest.approx((0.004, 0.0002))
    # timings where more calls took less time (noise): no negative call cost, the positions' fit alone,
    # c = (100 x 0.06 + 100 x 0.05 + 200 x 0.1) / (100^2 + 100^2 + 200^2)
    rows = [(2, 100, 0.06), (4, 100, 0.05), (8, 200, 0.1)]
    assert fit_two_costs(rows) == pytest.approx((0.0, 31 / 60000))
