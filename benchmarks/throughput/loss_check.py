"""--loss-check: a variant's training loss against the plain split in process, and the whole model in one process."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import REPO
from benchmarks.throughput.harness import (
    Calls,
    LocalRouter,
    OneProcess,
    copy_model,
    lm_driver,
    local_handlers,
    overrides,
)
from node.config import load_config
from node.device import HOST
from node.model import model_fingerprint, resolve_initial_policy
from node.pipeline.corpus import training_corpus, validation_corpus
from node.pipeline.lm import LMDriver
from node.pipeline.stages import (
    StagePart,
    expected_fingerprints,
)

# --loss-check's one-process ways: name -> (the head untied from the embedding, each stage's gradient clipped apart)
ONE_PROCESS_WAYS = {"tied": (False, False), "untied": (True, False), "untied-stage-clip": (True, True)}


def loss_check(
    name: str,
    shape,
    stages: int,
    settings: list[str],
    variants: dict[str, list[str]],
    steps: int,
    one_process_ways: tuple[str, ...] = ("tied",),
) -> dict:
    """The training loss of `local S` against each variant's and against the whole model in one process (each of
    `one_process_ways`, with the plain settings), over `steps` steps from the same initial weights on the same
    micro-batches (in this process: the variants that change numbers act in the backends, not on the wire); and each
    one's validation loss after the last step."""
    losses, validation, end_copied = {}, {}, {}
    for variant, more in {"": [], **variants}.items():
        config = load_config(
            REPO / "configs" / "pipeline.yaml",
            overrides(shape, stages, "loss-check", ["pipeline.validation_sequences=64", *settings, *more]),
        )
        torch.manual_seed(config.seed)
        model, tokenizer = resolve_initial_policy(config, None, HOST)
        corpus, held_out = training_corpus(config, tokenizer), validation_corpus(config, tokenizer)
        for way in one_process_ways if not variant else ():  # the micro-batches LMDriver walks: micro_batch(step, i)
            untied, stage_clip = ONE_PROCESS_WAYS[way]
            trainer = OneProcess(
                config, copy_model(model), corpus, 1, untied=untied, clip_stages=stages if stage_clip else 0
            )
            key = "one_process" + ("" if way == "tied" else f" {way}")
            losses[key] = [trainer.train_step()["loss"] for _ in range(steps)]
            validation[key] = trainer.validation_loss(held_out)
        fingerprints = expected_fingerprints(config, model.config, model_fingerprint(model, tokenizer))
        router = LocalRouter(config, local_handlers(config, model, fingerprints), fingerprints, Calls())
        with tempfile.TemporaryDirectory() as scratch:
            driver = lm_driver(config, router, corpus, Path(scratch), held_out)
            way = variant or "plain"
            losses[way] = [asyncio.run(driver.train_step())["loss"] for _ in range(steps)]
            validation[way] = asyncio.run(driver.validation_loss())
            if stages >= 2:
                end_copied[way] = end_stages_copied(router, driver, validation[way])
    tail = max(1, steps // 10)
    # the mean loss over each tenth of the steps (a tenth of fewer than 10 steps is the step it starts at)
    tenths = [slice(steps * k // 10, max(steps * (k + 1) // 10, steps * k // 10 + 1)) for k in range(10)]

    return {
        "size": name,
        "stages": stages,
        "steps": steps,
        "loss_last_tenth": {v: statistics.fmean(curve[-tail:]) for v, curve in losses.items()},
        "loss_first": {v: curve[0] for v, curve in losses.items()},
        "loss_tenths": {v: [statistics.fmean(curve[t]) for t in tenths] for v, curve in losses.items()},
        # after the last step, on pipeline.validation_sequences held-out sequences (64 unless --set)
        "val_loss": validation,
        # the same with the first (then the last) stage's layers replaced by its neighbour's, as CheckFree+ rebuilds it
        "val_loss_end_stage_copied": end_copied,
    }


def end_stages_copied(router: LocalRouter, driver: LMDriver, validation_loss: float) -> dict[str, float]:
    """The validation loss with stage 0's layers replaced by stage 1's, then stage S-1's by stage S-2's, each put back
    after: how good a stand-in CheckFree+'s swaps made the neighbour, at the moment a first or last stage is lost
    (its embedding or head kept, as the neighbour's fresh copy of it would give them back)."""
    stages = [handler.backend.stage for handler in router.handlers]
    out = {}
    for lost, partner in ((0, 1), (len(stages) - 1, len(stages) - 2)):
        own = stages[lost].part_state_dict(StagePart.LAYERS)
        stages[lost].load_part_state_dict(StagePart.LAYERS, stages[partner].part_state_dict(StagePart.LAYERS))
        out[f"stage {lost}"] = asyncio.run(driver.validation_loss())
        stages[lost].load_part_state_dict(StagePart.LAYERS, own)
    if asyncio.run(driver.validation_loss()) != validation_loss:
        raise RuntimeError("the end stages' own layers were not put back")
    return out
