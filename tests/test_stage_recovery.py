"""benchmarks/stage_recovery.py's parts that need no swarm: a stage's checkpoint round trip is exact, the checkpoint
store returns what was uploaded (on loopback, and from its own namespace), Young's interval, and the report's arithmetic
on hand-made rows. (The benchmark itself is timed and long: it is run by hand, see
benchmarks/notebook/2026-12-01-stage-recovery.md.)"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import struct
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from node.files import append_json_line
from benchmarks.lab import lab_unavailable
from benchmarks.checkpoint_store import (
    STORE_HEADER,
    STORE_LENGTH,
    CheckpointStore,
    LoopbackStore,
    store_get,
    store_put,
    store_serve,
    until_listening,
)
from benchmarks.recovery.bench import LoadHold, recovery_seconds
from benchmarks.recovery.campaign import baseline_key, config_key, read_rows
from benchmarks.recovery.checkpoints import (
    OWN_STEPS,
    Checkpoints,
    checkpoint_every,
    cost_with_uploads,
    load_stage_checkpoint,
    own_normal_step,
    save_stage_checkpoint,
    young_interval,
)
from benchmarks.recovery.report import rebuild_bytes, report
from benchmarks.recovery.runs import (
    STAGES,
    failure_schedule,
    fixed_failures,
    pretrain,
    pretrained_path,
    run_config,
    seeded_shape_overrides,
)
from node.config import load_config
from node.model import build_char_tokenizer, build_default_model, ensure_default_model, load_policy
from node.pipeline.corpus import validation_corpus
from benchmarks.throughput.harness import OneProcess
from node.pipeline.recovery import choose_method
from node.pipeline.stagemap import StageMap
from node.pipeline.stages import PipelineStage, StagePlan, checkfree_plus_extra_parts, split_model
from tests.helpers.common import REPO
from tests.helpers.stages import LiveStages, announce, load

needs_lab = pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))


class FakeBackend:
    """What the checkpoint helpers use of a StageBackend: the stage module, its optimizer, step and lr scale."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.stage = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        self.step, self.lr_scale = 0, 1.0
        self.optimizer = self.new_optimizer()

    def new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.stage.parameters(), lr=1e-2 * self.lr_scale, weight_decay=0.1)

    def train(self, batches: list[torch.Tensor]) -> None:
        for x in batches:
            self.stage(x).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1


def test_a_checkpoint_restores_weights_and_optimizer_state_exactly(tmp_path):
    batches = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    saved = FakeBackend(seed=0)
    saved.train(batches[:3])
    saved.lr_scale = 1.1
    path = tmp_path / "stage-1.pt"
    called = time.perf_counter()
    seconds = save_stage_checkpoint(saved, path)
    assert 0 < seconds <= time.perf_counter() - called  # the save's own time, timed inside the call
    assert path.exists() and not list(tmp_path.glob("*.partial"))  # written under another name, then renamed

    restored = FakeBackend(seed=1)  # other weights, an empty optimizer
    restored.train(batches[3:4])
    load_stage_checkpoint(restored, path)
    assert restored.step == 3 and restored.lr_scale == 1.1
    for a, b in zip(saved.stage.state_dict().values(), restored.stage.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the optimizer's moments and step counts came back too: the next steps are bit for bit the same
    saved.train(batches[4:])
    restored.train(batches[4:])
    for a, b in zip(saved.stage.parameters(), restored.stage.parameters(), strict=True):
        assert torch.equal(a, b)


def test_young_interval_is_the_square_root_rule_over_the_whole_pipeline():
    # 4 stages at 10 % per stage per hour of 25 steps: one failure every 62.5 steps; 1 s steps, 1 s checkpoints
    assert young_interval(1.0, 1.0, 0.10, 25) == round(math.sqrt(2 * 1.0 * 62.5))
    assert young_interval(0.5, 2.0, 0.16, 25) == round(math.sqrt(2 * 0.5 * 25 / (4 * 0.16) * 2.0) / 2.0)
    assert young_interval(0.0001, 1.0, 0.16, 25) == 1  # at least every step


def row(
    strategy, rate, seed, steps, wall, recoveries=(), saves=(), loads=(), every=None, curve=(), target=None, spikes=None
):
    """`recoveries`: (method, seconds), or (method, seconds, stages lost) where the test needs the stages (else [1])."""
    return {
        # a curve point: (step, loss), or (step, loss, wall s) where the test needs the clock (else wall s = step)
        "curve": [{"step": p[0], "val_loss": p[1], "wall_s": p[2] if len(p) > 2 else float(p[0])} for p in curve],
        "target": target,
        "strategy": strategy,
        "rate": rate,
        "seed": seed,
        "steps_to_target": steps,
        "wall_s_to_target": wall,
        "failures": len(recoveries),
        "recoveries": [
            {"methods": [r[0]], "seconds": r[1], "stages": list(r[2]) if len(r) > 2 else [1], "replayed": 3}
            for r in recoveries
        ],
        "checkpoint_io_s": sum(saves) + sum(loads),
        "loss_spike": [0.5] * len(recoveries) if spikes is None else list(spikes),
        "checkpoint_saves_s": list(saves),
        "checkpoint_loads_s": list(loads),
        "checkpoint_bytes": 1000 if saves else 0,
        "checkpoint_every": every,
        "parameters": 42,
        "key": {"shape": [1]},
    }


def test_the_report_averages_over_seeds_and_divides_the_means():
    rows = [
        row("none", 0.0, 0, 100, 50.0, curve=[(90, 0.6), (100, 0.5)], target=0.5),
        row("none", 0.0, 1, 90, 70.0, curve=[(90, 0.45), (100, 0.4)], target=0.5),
        row("checkfree", 0.1, 0, 110, 10.0, [("checkfree", 2.0), ("checkfree_plus", 4.0)], curve=[(100, 0.6)]),
        row("checkfree", 0.1, 1, 120, 20.0, [("checkfree", 3.0)], curve=[(100, 0.9), (90, 0.7), (100, 0.8)]),
        row("checkpoint", 0.1, 0, 130, 20.0, [("checkpoint", 5.0)], saves=[0.5, 1.5], loads=[0.25], every=7),
        row("checkpoint", 0.1, 1, 150, 25.0, [], saves=[1.0], every=8),
        row("random", 0.1, 0, 140, 30.0, [("random", 1.0)]),
        # missed the target: listed, not averaged, but counted at its last evaluation where that is asked for
        row("random", 0.1, 1, None, None, [("random", 1.0)], curve=[(90, 0.7, 40.0)]),
        # CheckFree's seed 2 has no checkpoint-restart row: in CheckFree's mean, not in the ratios
        row("checkfree", 0.1, 2, 90, 60.0),
        # another rate than the one asked for: in no figure
        row("checkfree", 0.16, 0, 50, 5.0, [("checkfree", 99.0)], curve=[(50, 0.1)]),
        row("checkpoint", 0.16, 0, 50, 5.0, [("checkpoint", 99.0)], saves=[9.0], every=3),
    ]
    summary = report(rows, [0.1], ["checkfree", "checkpoint", "random"])
    assert summary["steps_by_strategy_and_rate"]["none"]["0.00"] == {"mean": 95, "min": 90, "max": 100, "n": 2}
    assert summary["steps_by_strategy_and_rate"]["checkfree"]["0.10"]["mean"] == pytest.approx(320 / 3)
    # the later of the failure-free runs' target steps; after a rollback, the step's last evaluation
    assert summary["val_loss_at_step"] == 100
    assert summary["val_loss_at_step_by_strategy_and_rate"]["checkfree"]["0.10"]["mean"] == pytest.approx(0.7)
    assert summary["val_loss_at_step_by_strategy_and_rate"]["random"]["0.10"] is None
    assert summary["wall_s_by_strategy_and_rate"]["checkpoint"]["0.10"] == {"mean": 22.5, "min": 20, "max": 25, "n": 2}
    assert summary["wall_s_by_strategy_and_rate"]["random"]["0.10"]["n"] == 1
    assert summary["wallclock_speedup_vs_checkpoint_by_rate"]["0.10"] == pytest.approx(22.5 / 15.0)
    assert summary["wallclock_speedup_vs_checkpoint_by_rate_and_seed"]["0.10"] == {"0": 2.0, "1": 1.25}
    assert summary["steps_ratio_checkpoint_vs_checkfree_by_rate"]["0.10"] == pytest.approx(140 / 115)
    assert summary["ordering_by_wall_s"]["0.10"] == ["checkfree", "checkpoint", "random"]
    # seed 1 counted too, random's run there at its last evaluation's 40 s: CheckFree's seed 2 still out
    assert summary["wall_s_missed_counted_by_rate"]["0.10"] == {"checkfree": 15.0, "checkpoint": 22.5, "random": 35.0}
    methods = summary["recovery_s_by_method"]
    assert methods["checkfree"]["mean"] == 2.5 and methods["checkfree_plus"]["mean"] == 4.0
    assert methods["checkpoint"]["n"] == 1 and methods["random"]["n"] == 2
    assert summary["checkpoint_save_s"]["mean"] == 1.0 and summary["checkpoint_load_s"]["mean"] == 0.25
    assert summary["checkpoint_every_by_rate"] == {"0.10": [7, 8]}
    assert summary["checkpoint_replayed_steps"] == {"mean": 3, "min": 3, "max": 3, "n": 1}
    assert summary["checkpoint_io_share"]["mean"] == pytest.approx((2.25 / 20 + 1.0 / 25) / 2)
    assert summary["missed_target"] == ["random@0.10 seed 1"]
    assert summary["loss_spike_by_strategy"]["checkfree"] == {"mean": 0.5, "min": 0.5, "max": 0.5, "n": 3}
    assert summary["parameters"] == 42


def test_the_report_splits_loss_spikes_by_whether_a_failure_lost_an_end_stage():
    rows = [
        row("none", 0.0, 0, 100, 50.0, target=0.5),
        row(
            "random",
            0.16,
            0,
            150,
            30.0,
            [("random", 1.0, [0]), ("random", 1.0, [1]), ("random", 1.0, [1, 2])],
            spikes=[2.0, 0.25, 0.75],
        ),
        row("random", 0.16, 1, 120, 20.0, [("random", 1.0, [2]), ("random", 1.0, [2, 3])], spikes=[0.5, 1.0]),
        row("checkfree", 0.16, 1, 100, 15.0, [("checkfree", 1.0, [2])], spikes=[0.1]),
    ]
    summary = report(rows, [0.16], ["checkfree", "random"])
    random = summary["loss_spike_by_strategy_and_stage_kind"]["random"]
    # a failure that lost an end stage with a middle one counts as an end-stage failure
    assert random["end"] == {"mean": 1.5, "min": 1.0, "max": 2.0, "n": 2}
    assert random["middle"] == {"mean": 0.5, "min": 0.25, "max": 0.75, "n": 3}
    assert summary["loss_spike_by_strategy_and_stage_kind"]["checkfree"]["end"] is None
    assert summary["end_stage_failures_by_strategy_and_rate"] == {
        "checkfree": {"0.16": [0]},
        "random": {"0.16": [1, 1]},
    }


def test_the_report_splits_each_run_s_wall_clock_and_orders_by_steps_executed_as_the_paper_counts():
    def timed(strategy, seed, steps, wall, step_s, recoveries, saves=(), replayed=None):
        run = row(strategy, 0.16, seed, steps, wall, recoveries, saves=saves, every=10 if saves else None)
        run["normal_step_s"] = step_s
        for failure in run["recoveries"]:
            failure.pop("replayed")
            if replayed is not None:
                failure["replayed"] = replayed
        return run

    rows = [
        row("none", 0.0, 0, 100, 50.0, target=0.5),
        timed("checkfree", 0, 100, 700.0, 6.0, [("checkfree", 14.0)]),
        timed("checkpoint", 0, 120, 1000.0, 7.5, [("checkpoint", 37.0)], saves=[1.0, 2.0], replayed=4),
        timed("random", 0, 130, 900.0, 6.5, [("random", 3.0)]),
        # a seed the others have no row for: in neither the split nor the order
        timed("checkfree", 1, 500, 3000.0, 6.0, []),
        # a run from before normal steps were recorded: left out of the split
        row("checkpoint", 0.16, 2, 110, 800.0, [("checkpoint", 30.0)], every=10),
    ]
    summary = report(rows, [0.16], ["checkfree", "checkpoint", "random"])
    split = summary["wall_s_split_by_strategy_and_rate"]
    checkpoint = split["checkpoint"]["0.16"]
    assert checkpoint["steps"]["mean"] == pytest.approx(900.0) and checkpoint["steps"]["n"] == 1
    assert checkpoint["replayed_steps"]["mean"] == pytest.approx(30.0)  # 4 steps of 7.5 s, a part of the 900
    assert checkpoint["recoveries"]["mean"] == pytest.approx(37.0)
    assert checkpoint["saves"]["mean"] == pytest.approx(3.0)
    assert checkpoint["rest"]["mean"] == pytest.approx(1000.0 - 900.0 - 37.0 - 3.0)
    assert split["random"]["0.16"]["rest"]["mean"] == pytest.approx(900.0 - 845.0 - 3.0)
    assert split["checkfree"]["0.16"]["steps"] == {"mean": 600.0, "min": 600.0, "max": 600.0, "n": 1}
    # by wall clock random is second; by steps executed (saves, loads and recoveries free) checkpoint-restart is
    assert summary["ordering_by_wall_s"]["0.16"] == ["checkfree", "random", "checkpoint"]
    assert summary["ordering_by_steps"]["0.16"] == ["checkfree", "checkpoint", "random"]


def test_with_every_host_s_uplink_shaped_the_report_gives_what_each_sent_per_step_and_the_steps_beside_uploads():
    def shaped(strategy, rate, seed, executed, stage_mb, driver_mb, step_s):
        run = row(strategy, rate, seed, executed, 10.0 * executed, curve=[(executed, 0.5)])
        run["curve"][-1]["executed"] = executed
        run["uplink_mb_by_host"] = {f"stage-{i}": mb for i, mb in enumerate(stage_mb)} | {"driver": driver_mb}
        run["normal_step_s"] = step_s
        return run

    rows = [
        shaped("none", 0.0, 1, 10, [10, 10, 10, 10], 1.0, 5.0),
        shaped("checkfree", 0.1, 1, 10, [10, 12, 12, 10], 2.0, 5.0),
        shaped("checkpoint", 0.1, 1, 20, [100, 100, 100, 100], 2.0, 9.0),
        shaped("checkpoint", 0.1, 2, 10, [30, 30, 30, 30], 1.0, 7.0),
    ]
    summary = report(rows, [0.1], ["checkfree", "checkpoint"])
    stage_host = summary["uplink_mb_per_step_stage_host_by_strategy_and_rate"]
    assert stage_host["none"]["0.00"]["mean"] == pytest.approx(1.0)
    assert stage_host["checkfree"]["0.10"]["mean"] == pytest.approx(1.1)  # mean over the stages' hosts, per step
    assert stage_host["checkpoint"]["0.10"] == {"mean": pytest.approx(4.0), "min": 3.0, "max": 5.0, "n": 2}
    assert summary["uplink_mb_per_step_driver_by_strategy_and_rate"]["checkpoint"]["0.10"]["mean"] == 0.1
    assert summary["normal_step_s_by_strategy_and_rate"]["checkpoint"]["0.10"]["mean"] == 8.0
    # rows of other uplinks have no such figures
    for run in rows:
        del run["uplink_mb_by_host"]
    assert "uplink_mb_per_step_stage_host_by_strategy_and_rate" not in report(rows, [0.1], ["checkfree"])


def test_with_an_uplink_per_host_checkfree_is_charged_its_neighbours_bytes_at_the_checkpoint_downloads_rate():
    uplinks = {"shape": [64, 8, 2, 128], "checkpoint_store_mbit": 20.0, "checkpoint_uplinks": "per-stage"}

    def failed(stage, method, fetched=None, load_s=None):
        recovery = {"stages": [stage], "methods": [method], "seconds": 1.0, "replayed": 2}
        if fetched is not None:
            recovery["fetched_bytes"] = [fetched]
        if load_s is not None:
            recovery["load_s"] = load_s
        return recovery

    rows = [
        dict(
            row("checkfree", 0.1, 0, 100, 100.0),
            recoveries=[failed(1, "checkfree", 6e6), failed(0, "checkfree_plus", 2e6)],
        ),
        # a row from before recoveries recorded their bytes: counted from the key's model
        dict(row("checkfree", 0.1, 1, 100, 200.0), recoveries=[failed(2, "checkfree")]),
        # 1,000 bytes a stage's checkpoint (4,000 in all), downloaded in 0.5 s and in 1.5 s
        dict(
            row("checkpoint", 0.1, 0, 120, 150.0),
            recoveries=[failed(3, "checkpoint", load_s=0.5)],
            checkpoint_bytes=4000,
        ),
        dict(
            row("checkpoint", 0.1, 1, 120, 300.0),
            recoveries=[failed(1, "checkpoint", load_s=1.5)],
            checkpoint_bytes=4000,
        ),
    ]
    for r in rows:
        r["key"] = uplinks
    summary = report(rows, [0.1], ["checkfree", "checkpoint"])
    rate = (1000 + 1000) / (0.5 + 1.5)  # bytes per second, over every download
    assert summary["checkpoint_download_mb_per_s"] == pytest.approx(rate / 1e6)
    from_model = rebuild_bytes((64, 8, 2, 128))[2]
    charged = summary["neighbour_fetch_charged_s_by_rate_and_seed"]["0.10"]
    assert charged == pytest.approx({"0": 8e6 / rate, "1": from_model / rate})
    assert summary["neighbour_fetch_mb_by_method"]["checkfree_plus"]["mean"] == pytest.approx(2.0)
    assert summary["neighbour_fetch_mb_by_method"]["checkfree"]["n"] == 2
    expected = (150 + 300) / (100 + 8e6 / rate + 200 + from_model / rate)
    assert summary["wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged"]["0.10"] == pytest.approx(expected)
    assert summary["wallclock_speedup_vs_checkpoint_by_rate"]["0.10"] == pytest.approx(450 / 300)  # unchanged
    # thousands of seconds at these rates: the charge puts CheckFree behind checkpoint-restart
    assert summary["ordering_by_wall_s"]["0.10"] == ["checkfree", "checkpoint"]
    assert summary["ordering_by_wall_s_neighbour_fetch_charged"]["0.10"] == ["checkpoint", "checkfree"]
    # one shared link (the stages behind it together) or no store: nothing charged
    for r in rows:
        r["key"] = {"shape": [64, 8, 2, 128], "checkpoint_store_mbit": 20.0}
    assert "wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged" not in report(rows, [0.1], ["checkfree"])


def test_each_seed_is_compared_at_the_wall_clock_where_its_first_run_reached_the_target():
    target = 0.5
    rows = [
        # seed 0: random first at 100 s; by then CheckFree's last loss is 0.52 (at 90 s), checkpoint's 0.7 (at 60 s)
        row("checkfree", 0.16, 0, 30, 140.0, curve=[(10, 0.9, 30.0), (20, 0.52, 90.0), (30, 0.49, 140.0)]),
        row("checkpoint", 0.16, 0, 40, 200.0, curve=[(10, 0.7, 60.0), (20, 0.6, 120.0), (40, 0.5, 200.0)]),
        row("random", 0.16, 0, 20, 100.0, curve=[(10, 0.8, 50.0), (20, 0.45, 100.0)]),
        # seed 1: CheckFree first at 50 s; random missed the target and ran on: its loss by 50 s counts
        row("checkfree", 0.16, 1, 10, 50.0, curve=[(10, 0.48, 50.0)]),
        row("checkpoint", 0.16, 1, 20, 90.0, curve=[(10, 0.56, 45.0), (20, 0.5, 90.0)]),
        row("random", 0.16, 1, None, None, curve=[(10, 0.9, 40.0), (20, 0.6, 80.0)]),
        # seed 2 has no random run: not compared
        row("checkfree", 0.16, 2, 10, 10.0, curve=[(10, 0.1, 10.0)]),
        row("checkpoint", 0.16, 2, 10, 10.0, curve=[(10, 0.1, 10.0)]),
        # seed 3: checkpoint-restart has no evaluation by CheckFree's 20 s (its first save): it ranks last
        row("checkfree", 0.16, 3, 10, 20.0, curve=[(10, 0.4, 20.0)]),
        row("checkpoint", 0.16, 3, 10, 70.0, curve=[(10, 0.3, 70.0)]),
        row("random", 0.16, 3, None, None, curve=[(10, 0.45, 15.0)]),
    ]
    for r in rows:
        r["target"] = target
    summary = report(rows, [0.16], ["checkfree", "checkpoint", "random"])
    assert summary["equal_wall_s_by_rate_and_seed"] == {"0.16": {"0": 100.0, "1": 50.0, "3": 20.0}}
    at_equal_wall = summary["val_loss_at_equal_wall_s_by_strategy_and_rate"]
    assert at_equal_wall["checkfree"]["0.16"]["mean"] == pytest.approx((0.52 + 0.48 + 0.4) / 3)
    assert at_equal_wall["checkpoint"]["0.16"]["mean"] == pytest.approx((0.7 + 0.56) / 2)
    assert at_equal_wall["random"]["0.16"]["mean"] == pytest.approx((0.45 + 0.9 + 0.45) / 3)
    assert at_equal_wall["random"]["0.16"]["n"] == 3
    assert summary["not_evaluated_by_equal_wall_s"] == ["checkpoint@0.16 seed 3"]
    # ranks by seed: 0 random, checkfree, checkpoint; 1 checkfree, checkpoint, random; 3 checkfree, random, checkpoint
    assert summary["mean_rank_at_equal_wall_s_by_rate"]["0.16"] == pytest.approx(
        {"checkfree": 4 / 3, "checkpoint": 8 / 3, "random": 2.0}
    )
    assert summary["ordering_by_rank_at_equal_wall_s"]["0.16"] == ["checkfree", "random", "checkpoint"]


def test_a_checkpoint_uploaded_in_the_background_costs_its_save_and_what_the_steps_beside_its_uploads_lost():
    # a 1 s save; three steps of 9, 10 and 8 s while its uploads ran, where a step takes 5 s: 12 s lost
    assert cost_with_uploads(1.0, [9.0, 10.0, 8.0], 5.0) == pytest.approx(13.0)
    # steps no slower than normal (uploads that do not share the hidden states' link) leave the save's cost
    assert cost_with_uploads(1.0, [4.0, 5.0], 5.0) == 1.0
    assert cost_with_uploads(1.0, [], 5.0) == 1.0
    args = SimpleNamespace(checkpoint_every="young-with-uploads", steps_per_hour=25)
    assert checkpoint_every(args, 13.0, 5.0, 0.10) == young_interval(13.0, 5.0, 0.10, 25)
    args.checkpoint_every = "7"
    assert checkpoint_every(args, 13.0, 5.0, 0.10) == 7


def test_young_own_steps_prices_a_checkpoint_against_the_runs_own_normal_steps_after_its_first():
    # no price until the run has taken OWN_STEPS normal steps after its first (a warm-up: 30 s here)
    assert own_normal_step([30.0] + [10.0] * (OWN_STEPS - 1)) is None
    assert own_normal_step([30.0, 9.0, 11.0, 10.0][: OWN_STEPS + 1]) == pytest.approx(10.0)
    assert own_normal_step([30.0, 12.0, 12.0, 9.0, 10.0, 11.0]) == pytest.approx(10.0)  # the last OWN_STEPS
    args = SimpleNamespace(checkpoint_every="young-own-steps", steps_per_hour=25)
    assert checkpoint_every(args, 13.0, 10.0, 0.16) == young_interval(13.0, 10.0, 0.16, 25)


def test_a_recovery_is_the_time_to_a_serving_stage_plus_what_the_next_step_took_beyond_a_normal_one():
    assert recovery_seconds(3.0, 8.5, 6.0) == pytest.approx(5.5)
    # a first step faster than the median (a loaded machine that calmed down) takes nothing off the recovery
    assert recovery_seconds(3.0, 2.0, 9.5) == pytest.approx(3.0)


def test_rows_are_read_by_their_settings_and_failure_free_runs_serve_every_checkpoint_rule(tmp_path):
    young = {"shape": [256, 8, 4, 512], "max_steps": 120, "checkpoint_every": "young"}
    every_25 = dict(young, checkpoint_every="25")
    path = tmp_path / "rows.jsonl"
    other_corpus = dict(young, settings=['tasks.datasets=[{"name": "spell_backward"}]'])
    for strategy, key in [
        ("none", young),
        ("checkfree", young),
        ("checkpoint", every_25),
        ("none", {"shape": [64]}),
        ("none", other_corpus),
    ]:
        append_json_line(path, {"strategy": strategy, "key": key})
    assert [r["strategy"] for r in read_rows(path, young)] == ["none", "checkfree"]
    assert [r["strategy"] for r in read_rows(path, every_25)] == ["none", "checkpoint"]
    assert [r["key"] for r in read_rows(path, other_corpus)] == [other_corpus]
    assert read_rows(tmp_path / "absent.jsonl", young) == []


def test_the_key_names_config_overrides_and_uplinks_only_when_a_run_has_some():
    args = SimpleNamespace(
        size="27M", max_steps=120, steps_per_hour=25, checkpoint_every="young", checkpoint_store_mbit=None,
        checkpoint_uplinks="shared", checkpoint_uploads="blocking", target_fraction=0.8, eval_every=10, micro_batch=8,
        lr=1e-3, set=[], keep_load=False, pretrained_steps=0, plain_baselines=False, model=None, failures=None,
    )  # fmt: skip
    plain = config_key(args)
    assert "settings" not in plain  # the rows written before --set existed stay comparable
    args.set = ['tasks.datasets=[{"name": "spell_backward"}]']
    assert config_key(args) == dict(plain, settings=args.set)
    args.checkpoint_store_mbit = 20.0
    shared = config_key(args)
    assert "checkpoint_uplinks" not in shared  # rows from before per-stage uplinks are the shared link's
    args.checkpoint_uplinks = "per-stage"
    assert config_key(args) == dict(shared, checkpoint_uplinks="per-stage")
    args.checkpoint_uploads = "background"
    background = config_key(args)
    assert background == dict(shared, checkpoint_uplinks="per-stage", checkpoint_uploads="background")
    # one failure-free run serves every checkpoint rule, uploads in the background too
    assert baseline_key(background) == baseline_key(shared) == baseline_key(plain | {"settings": args.set})
    # where every host's uplink has the rate, the failure-free run's steps cross it too: it serves that rate only
    args.checkpoint_uplinks = "per-host"
    per_host = config_key(args)
    assert per_host == dict(shared, checkpoint_uplinks="per-host", checkpoint_uploads="background")
    assert baseline_key(per_host) == dict(
        baseline_key(shared), checkpoint_store_mbit=20.0, checkpoint_uplinks="per-host"
    )
    args.checkpoint_uploads = "blocking"
    assert baseline_key(config_key(args)) == baseline_key(per_host)
    args.checkpoint_store_mbit = 100.0
    assert baseline_key(config_key(args)) != baseline_key(per_host)
    # runs that kept the load are not mixed with those that did not; a failure-free run's target serves both
    without = config_key(args)
    args.keep_load = True
    assert config_key(args) == dict(without, keep_load=True)
    assert baseline_key(config_key(args)) == baseline_key(without)
    # baselines without CheckFree+ are apart; the failure-free run, CheckFree's config, still sets their target
    args.plain_baselines = True
    assert config_key(args) == dict(without, keep_load=True, plain_baselines=True)
    assert baseline_key(config_key(args)) == baseline_key(without)
    assert run_config(args, 0, "random", Path("/tmp")).pipeline.checkfree_plus is False
    assert run_config(args, 0, "checkpoint", Path("/tmp")).pipeline.checkfree_plus is False
    assert run_config(args, 0, "checkfree", Path("/tmp")).pipeline.checkfree_plus is True
    assert run_config(args, 0, "none", Path("/tmp")).pipeline.checkfree_plus is True
    args.plain_baselines = False
    assert run_config(args, 0, "random", Path("/tmp")).pipeline.checkfree_plus is True
    # runs from a pretrained model, and their failure-free run, are apart from those from scratch
    kept = config_key(args)
    args.pretrained_steps = 240
    assert config_key(args) == dict(kept, pretrained_steps=240)
    assert baseline_key(config_key(args)) == dict(baseline_key(kept), pretrained_steps=240)
    args.pretrained_steps, args.model, args.failures = 0, "smollm2-135m-instruct", ["6:1"]
    pretrained = config_key(args)  # a pretrained model's runs never mix with the default architecture's
    assert "shape" not in pretrained and pretrained["model"] == "smollm2-135m-instruct"
    assert pretrained["failures"] == ["6:1"]
    assert run_config(args, 0, "none", Path("/tmp")).model.name_or_path == "smollm2-135m-instruct"


def test_fixed_failures_are_the_same_for_every_seed_and_rate_and_bad_ones_are_refused():
    assert failure_schedule(0, 0.10, 12, 25, ["6:1", "9:3"]) == {6: [1], 9: [3]}
    assert failure_schedule(5, 0.16, 12, 25, ["6:1", "9:3"]) == {6: [1], 9: [3]}
    for bad in ("1:0", f"6:{STAGES}", "6", "x:1"):
        with pytest.raises(ValueError, match="STEP:STAGE"):
            fixed_failures([bad])


def test_a_pretrained_start_is_the_seed_s_model_trained_on_the_lm_objective_made_once_and_kept(tmp_path):
    args = SimpleNamespace(
        size=None, hidden=32, micro_batch=4, lr=1e-2, eval_every=5, pretrained_steps=10, plain_baselines=False,
        set=[f"model.cache_dir={tmp_path}"], model=None,
    )  # fmt: skip
    path = pretrain(args, seed=0)
    assert path.parent.parent == tmp_path and path.exists()
    config = run_config(args, 0, "none", tmp_path / "driver")
    model, tokenizer = load_policy(ensure_default_model(config, progress=False))
    validation = validation_corpus(config, tokenizer)
    before = OneProcess(config, model, validation, threads=1).validation_loss(validation)
    model.load_state_dict(torch.load(path, weights_only=True))
    assert OneProcess(config, model, validation, threads=1).validation_loss(validation) < before - 0.5  # it learnt
    made = path.stat().st_mtime_ns
    assert pretrain(args, seed=0) == path and path.stat().st_mtime_ns == made  # kept, not trained again
    assert pretrained_path(args, seed=1) != path  # each seed's model is drawn from its seed
    args.pretrained_steps = 11
    assert pretrained_path(args, seed=0) != path


def test_runs_side_by_side_are_released_once_each_reached_its_target_or_ended(tmp_path):
    """--keep-load: the parent releases the runs (which train on meanwhile) only when none is still short of its
    target: one that reached it, or whose process ended (done, or failed), waits for no other."""
    hold = LoadHold(tmp_path)
    runs = [(0, 0.1, "checkfree"), (0, 0.1, "checkpoint"), (0, 0.1, "random")]
    ended = subprocess.Popen(["true"])
    ended.wait()
    going = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        children = [going[0], going[1], ended]
        assert not hold.release_when_settled(children, runs)
        hold.mark_reached(0, 0.1, "checkfree")
        assert not hold.release_when_settled(children, runs)  # checkpoint-restart has not reached its target yet
        assert not hold.released()
        hold.mark_reached(0, 0.16, "checkpoint")  # another rate's run: not this one
        assert not hold.release_when_settled(children, runs)
        hold.mark_reached(0, 0.1, "checkpoint")
        assert hold.release_when_settled(children, runs) and hold.released()
    finally:
        for child in going:
            child.kill()
            child.wait()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def store_round_trip(host: str, port: int, tmp_path: Path, sizes: list[int]) -> None:
    """PUT each of `sizes` random bytes under one name (each over the last), GET it back after each: the same bytes."""
    local = tmp_path / "local" / "stage-2.pt"
    local.parent.mkdir()
    for size in sizes:
        data = os.urandom(size)
        local.write_bytes(data)
        await store_put(host, port, local)
        local.unlink()
        await store_get(host, port, local)
        assert local.read_bytes() == data


def test_the_checkpoint_store_keeps_the_last_upload_of_each_name_whole(tmp_path):
    """The store's wire and disk side on 127.0.0.1: what a replacement server downloads is byte for byte the last
    checkpoint uploaded under that name, written under another name and renamed (no partial file left)."""
    port = free_port()
    folder = tmp_path / "store"

    async def scenario() -> None:
        server = asyncio.create_task(store_serve(folder, "127.0.0.1", port))
        try:
            await until_listening("127.0.0.1", port, tries=100, every_s=0.05)
            await store_round_trip("127.0.0.1", port, tmp_path, [3_000_000, 10])
        finally:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)

    asyncio.run(scenario())
    assert sorted(p.name for p in folder.iterdir()) == ["stage-2.pt"]
    assert (folder / "stage-2.pt").stat().st_size == 10


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@pytest.mark.integration
@needs_lab
def test_two_checkpoint_stores_serve_side_by_side_from_their_own_namespaces_and_are_removed_after(tmp_path):
    """Each store has its own namespace, link and address: two at once (or a store beside a lab) never cross wires,
    which a store on the lab's shared host address did (a test's upload landed in a running benchmark's store)."""
    stores = []
    try:
        for i in range(2):
            (tmp_path / str(i)).mkdir()
            stores.append(CheckpointStore(mbit=50, scratch=tmp_path / str(i)))
        assert len({(store.ns, store.host) for store in stores}) == 2
        assert all(store.host != "127.0.0.1" for store in stores)  # another host: the bytes cross the shaped link
        for i, store in enumerate(stores):
            asyncio.run(store.ready())
            asyncio.run(store_round_trip(store.host, store.port, tmp_path / str(i), [1_000_000, 20]))
        # each kept its own last upload
        assert [(tmp_path / str(i) / "store" / "stage-2.pt").stat().st_size for i in range(2)] == [20, 20]
    finally:
        for store in stores:
            store.close()
    assert not {store.ns for store in stores} & set(namespaces())


def test_a_store_on_the_loopback_serves_from_a_port_of_its_own_until_closed(tmp_path):
    """Per-host uplinks put the stores on the run's namespace's loopback (its shaping is their link)."""
    stores = [LoopbackStore(tmp_path, name=f"store-{i}") for i in range(2)]
    try:
        assert len({store.port for store in stores}) == 2
        asyncio.run(stores[1].ready())
        asyncio.run(store_round_trip(stores[1].host, stores[1].port, tmp_path, [300_000, 5]))
        assert (tmp_path / "store-1" / "stage-2.pt").stat().st_size == 5
    finally:
        for store in stores:
            store.close()
    assert all(store.process.poll() is not None for store in stores)


@pytest.mark.integration
@needs_lab
def test_a_store_whose_owner_died_is_removed_by_the_next_one(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = f"ckst{gone.pid}x0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        store = CheckpointStore(mbit=50, scratch=tmp_path)
        store.close()
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


@pytest.mark.integration
@needs_lab
@pytest.mark.parametrize("links", [1, STAGES])
def test_checkpoints_go_to_the_store_of_their_stage_and_a_new_host_downloads_its_own(tmp_path, links):
    """With one shared store every stage's file lands there; with a store per stage (each host's own uplink) each
    stage's file lands in its own and nowhere else. A replaced stage's new host has no local file: it downloads its
    stage's checkpoint, and every stage is back at the saved weights and step."""
    stores = [CheckpointStore(mbit=200, scratch=tmp_path, name=f"store-{i}") for i in range(links)]
    try:
        checkpoints = Checkpoints(tmp_path / "local", stores)

        async def scenario() -> None:
            for store in stores:
                await store.ready()
            saved = {index: FakeBackend(seed=index) for index in range(STAGES)}
            for index, backend in saved.items():
                backend.train([torch.randn(3, 4) for _ in range(index + 1)])
            written = await checkpoints.save(saved, step=7)
            assert written == sum((tmp_path / "local" / f"stage-{i}-0.pt").stat().st_size for i in range(STAGES))
            at_checkpoint = {i: {k: v.clone() for k, v in b.stage.state_dict().items()} for i, b in saved.items()}
            for backend in saved.values():  # training goes on past the checkpoint
                backend.train([torch.randn(3, 4)])
            (tmp_path / "local" / "stage-2-0.pt").write_bytes(b"the dead host's disk")  # never read: it is gone
            fresh = {index: FakeBackend(seed=100 + index) for index in range(STAGES)}
            assert await checkpoints.load(fresh, replaced=[2]) == 7
            assert [fresh[i].step for i in range(STAGES)] == [1, 2, 3, 4]
            for index, backend in fresh.items():
                state = backend.stage.state_dict()
                assert all(torch.equal(state[k], v) for k, v in at_checkpoint[index].items()), index

        asyncio.run(scenario())
        held = [sorted(p.name for p in (tmp_path / f"store-{i}").iterdir()) for i in range(links)]
        if links == 1:
            assert held == [[f"stage-{i}-0.pt" for i in range(STAGES)]]
        else:
            assert held == [[f"stage-{i}-0.pt"] for i in range(STAGES)]
    finally:
        for store in stores:
            store.close()


def test_checkpoints_refuse_a_number_of_stores_that_is_neither_one_nor_one_per_stage(tmp_path):
    with pytest.raises(ValueError, match="one per stage"):
        Checkpoints(tmp_path, [object(), object()])
    with pytest.raises(RuntimeError, match="no checkpoint"):
        asyncio.run(Checkpoints(tmp_path, []).load({}))


async def gated_store(store_port: int, gate: asyncio.Event) -> asyncio.Server:
    """A store's link that the test opens and shuts: a PUT arriving while `gate` is clear is held (its bytes read, not
    passed on, no answer) until the gate opens, and dropped if the uploader goes away first, as an upload cut
    by a lost host never reaches the store. GETs pass at once."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(struct.calcsize(STORE_HEADER))
            op, size = struct.unpack(STORE_HEADER, head)
            request = head + await reader.readexactly(size)
            if op == b"P":
                length = await reader.readexactly(struct.calcsize(STORE_LENGTH))
                request += length + await reader.readexactly(struct.unpack(STORE_LENGTH, length)[0])
                uploader_gone = asyncio.create_task(reader.read(1))  # b"" once the uploader closes
                opened = asyncio.create_task(gate.wait())
                await asyncio.wait([uploader_gone, opened], return_when=asyncio.FIRST_COMPLETED)
                uploader_gone.cancel()
                opened.cancel()
                if not gate.is_set():
                    return
            store_reader, store_writer = await asyncio.open_connection("127.0.0.1", store_port)
            store_writer.write(request)
            await store_writer.drain()
            writer.write(await store_reader.read())
            await writer.drain()
            store_writer.close()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_uploads_in_the_background_make_a_restore_point_only_once_they_all_end(tmp_path):
    """`background`: a save returns with every stage's checkpoint on its own disk and the uploads still going; the
    restore point stays the checkpoint before until they all end. A host lost meanwhile cuts them, and the restore
    brings every stage, the replaced one from its store, back to the checkpoint before, whose files the newer one did
    not touch (two slots). A save waits for the uploads before it. Real stores on 127.0.0.1, one per stage, each
    behind a link the test opens and shuts."""
    checkpoints_seen: dict[str, object] = {}

    async def scenario() -> None:
        gate = asyncio.Event()
        servers, stores = [], []
        for index in range(STAGES):
            port = free_port()
            servers.append(asyncio.create_task(store_serve(tmp_path / f"store-{index}", "127.0.0.1", port)))
            await until_listening("127.0.0.1", port, tries=100, every_s=0.05)
            link = await gated_store(port, gate)
            stores.append(SimpleNamespace(host="127.0.0.1", port=link.sockets[0].getsockname()[1], link=link))
        checkpoints = Checkpoints(tmp_path / "local", stores, background=True)
        try:
            backends = {index: FakeBackend(seed=index) for index in range(STAGES)}
            for backend in backends.values():
                backend.train([torch.randn(3, 4)])
            await checkpoints.save(backends, step=3)
            assert checkpoints.step is None and not checkpoints.pending.done()  # on every disk, not yet uploaded
            assert all((tmp_path / "local" / f"stage-{i}-0.pt").exists() for i in range(STAGES))
            gate.set()
            await checkpoints.pending
            assert checkpoints.step == 3
            at_3 = {i: {k: v.clone() for k, v in b.stage.state_dict().items()} for i, b in backends.items()}

            gate.clear()
            for backend in backends.values():
                backend.train([torch.randn(3, 4)])
            await checkpoints.save(backends, step=5)
            assert checkpoints.step == 3  # its uploads are held at the link
            assert await checkpoints.drop_pending()  # a host is lost: the checkpoint of step 5 never completes
            fresh = {index: FakeBackend(seed=100 + index) for index in range(STAGES)}
            assert await checkpoints.load(fresh, replaced=[2]) == 3
            assert [fresh[i].step for i in range(STAGES)] == [1, 1, 1, 1]
            for index, backend in fresh.items():
                state = backend.stage.state_dict()
                assert all(torch.equal(state[k], v) for k, v in at_3[index].items()), index

            saving = asyncio.create_task(checkpoints.save(fresh, step=6))
            await saving
            later = asyncio.create_task(checkpoints.save(fresh, step=7))
            await asyncio.sleep(0.2)
            assert not later.done()  # it waits for step 6's uploads, held at the shut link
            gate.set()
            await later
            await checkpoints.pending
            assert checkpoints.step == 7 and checkpoints.uploads_dropped == 1
            # uploads of steps 3, 6 and 7; the saves of 5 and 7 found uploads before them (after 5 they were cut)
            assert len(checkpoints.uploads_s) == 3 and len(checkpoints.upload_waits_s) == 2
            checkpoints_seen["held"] = [
                sorted(p.name for p in (tmp_path / f"store-{i}").iterdir()) for i in range(STAGES)
            ]
        finally:
            await checkpoints.close()
            for store in stores:
                store.link.close()
            for server in servers:
                server.cancel()
            await asyncio.gather(*servers, return_exceptions=True)

    asyncio.run(scenario())
    # step 3 in slot 0, step 5 cut at the link, steps 6 and 7 in slots 1 and 0: no partial file left
    assert checkpoints_seen["held"] == [[f"stage-{i}-0.pt", f"stage-{i}-1.pt"] for i in range(STAGES)]


def test_uploads_in_the_background_need_a_store():
    with pytest.raises(ValueError, match="need a store"):
        Checkpoints(Path("unused"), [], background=True)


def test_the_stage_recovery_report_counts_a_rebuild_s_bytes_as_load_stage_reads_them():
    """benchmarks/stage_recovery.py charges CheckFree(+) its neighbours' bytes; for rows from before recoveries recorded
    them it counts them from the model (rebuild_bytes). That count must be what load_stage reads, stage by stage."""
    shape = (64, 8, 2, 128)
    config = load_config(REPO / "configs" / "pipeline.yaml", seeded_shape_overrides(shape, 0))
    tokenizer = build_char_tokenizer()
    whole = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    extra = checkfree_plus_extra_parts(STAGES)
    stages = split_model(whole, STAGES, extra)
    counted = rebuild_bytes(shape)
    for lost in range(STAGES):
        method, sources = choose_method(lost, STAGES, False, True, "checkfree", True)
        view = StageMap.from_announcements(
            STAGES, [announce(i, "abcd"[i], [p.value for p in stages[i].parts]) for i in range(STAGES) if i != lost]
        )
        target = PipelineStage.from_model(whole, StagePlan(8, STAGES), lost, extra.get(lost, ()))
        event = load(method, sources, target, view, LiveStages(stages, {}))
        assert event.method == ("checkfree" if 0 < lost < STAGES - 1 else "checkfree_plus")
        assert event.bytes_fetched == counted[lost] > 0, lost
