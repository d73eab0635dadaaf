"""What the policy update costs before and after it was made one forward per micro-batch, side by side.

Before (commit ea1a190, loaded from git into its own module): pi_old of every micro-batch that holds a
peer's sample came from an extra no-grad forward, and the imitation term ran its own forward and
backward over demonstrations already in the batch. After (node/trainer/): one forward and backward per
micro-batch carries both terms, and with one epoch pi_old is that forward, detached.

Rounds are real: the 4 specialist nodes of benchmarks/sharing.py run --rounds rounds of an arm in
lockstep; each round's trainer input (its TrainingBatch) is recorded, then both
trainers step a copy of the same weights on each recorded round, alternating, one torch thread;
CPU seconds of this process (time.process_time), the median over rounds. The gradients they apply are
checked to agree (the same update, computed once instead of twice).

    .venv/bin/python benchmarks/update_cost.py --arms silo sapo_balance

`--before COMMIT` compares today's trainer with another commit's instead: `--before 0a775a7` is the update before
trainer.share_prompt_forward (each completion its own row, its prompt repeated in it).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.rollouts.base import RolloutGroup, TrainingBatch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BEFORE = "ea1a190"


def trainer_module_at(commit: str):
    source = subprocess.run(
        ["git", "show", f"{commit}:node/trainer.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"trainer_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"trainer_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class LegacyGroup:
    """A rollout group as trainers before the typed TrainingBatch took it: demonstrations and the knobs since removed
    were fields set on the group (`imitation_weight`, `baseline_scale`, `loss_scale`, `teacher`)."""

    group: RolloutGroup
    imitation_weight: float = 0.0
    marked: tuple = ()
    baseline_scale: float = 1.0
    loss_scale: float = 1.0
    teacher: object = None

    def __getattr__(self, name: str):
        return getattr(self.group, name)

    def demonstrations(self) -> list:
        return list(self.marked)


def legacy_config(config):
    """Today's trainer settings with the fields trainers of before read and that have since left the schema, at the
    values that meant today's behaviour (per-token importance weights)."""
    return SimpleNamespace(**config.model_dump(), importance_level="token", importance_alpha=1.0)


def legacy_inputs(batch: TrainingBatch) -> tuple[list[LegacyGroup], list[LegacyGroup]]:
    """(groups, demonstration groups) for a trainer of before the typed batch: the batch's groups unmarked, and each
    demonstration a group of its own with its weight, in the batch's order (so the heaviest are the same ones)."""
    groups = [LegacyGroup(group) for group in batch.groups]
    demonstrations = [
        LegacyGroup(RolloutGroup(None, [d.completion], [1.0], correct=[True]), d.weight, (d.completion,))
        for d in batch.demonstrations
    ]
    return groups, demonstrations


async def record_rounds(arm: str, rounds: int, args) -> tuple[list, object]:
    from benchmarks.arms.lockstep import make_nodes

    recorded = []
    with tempfile.TemporaryDirectory() as scratch:
        nodes = await make_nodes("specialists", arm, 0, scratch, args)
        learner = nodes[0]
        step = learner.trainer.step

        def recording_step(batch: TrainingBatch):
            recorded.append(copy.deepcopy(batch))
            return step(batch)

        learner.trainer.step = recording_step
        try:
            for _ in range(rounds):
                for node in nodes:
                    await node.run_round()
        finally:
            for node in nodes:
                await node.stop_services()
                node.backend.close()
        return recorded, learner


def time_step(trainer_class, config, model, tokenizer, temperature, inputs: tuple, version):
    trainer = trainer_class(config, copy.deepcopy(model), tokenizer.pad_token_id, temperature, policy_version=version)
    before = time.process_time()
    trainer.step(*inputs)
    elapsed = time.process_time() - before
    return elapsed, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["silo", "sapo_balance"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup-steps", nargs="+", default=["add=125", "subtract=230", "both=260"])
    parser.add_argument(
        "--before",
        default=BEFORE,
        help="the commit whose node/trainer.py is 'before' (one from before node/trainer/ was a package)",
    )
    args = parser.parse_args()
    import transformers

    from benchmarks.arms.catalog import CONFIG, parse_warmup_steps

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    args.warmup_steps = parse_warmup_steps(args.warmup_steps)
    args.transport, args.set, args.config, args.sparse_warmup_steps = "inprocess", [], CONFIG, 60
    old = trainer_module_at(args.before)
    from node.trainer import GRPOTrainer

    summary = {"benchmark": "update_cost", "before_commit": args.before, "arms": {}}
    for arm in args.arms:
        recorded, learner = asyncio.run(record_rounds(arm, args.rounds, args))
        config, model, tokenizer = learner.config, learner.model, learner.tokenizer
        temperature = config.rollout.temperature
        before_s, after_s, drift = [], [], []
        for batch in recorded:
            # the policy version the groups were sampled at: the node's own count them on-policy, as in the round
            version = max((c.policy_version for g in batch.groups for c in g.completions), default=0)
            t_old, w_old = time_step(
                old.GRPOTrainer,
                legacy_config(config.trainer),
                model,
                tokenizer,
                temperature,
                legacy_inputs(batch),
                version,
            )
            t_new, w_new = time_step(GRPOTrainer, config.trainer, model, tokenizer, temperature, (batch,), version)
            before_s.append(t_old)
            after_s.append(t_new)
            drift.append(float((w_old - w_new).abs().max()))
        row = {
            "updates": len(recorded),
            "before_cpu_s_median": statistics.median(before_s),
            "after_cpu_s_median": statistics.median(after_s),
            "after_over_before": statistics.median(a / b for a, b in zip(after_s, before_s)),
            "max_weight_difference": max(drift),
        }
        summary["arms"][arm] = row
        print(
            f"{arm:14s} update {row['before_cpu_s_median']:.3f} -> {row['after_cpu_s_median']:.3f} CPU s "
            f"({row['after_over_before']:.2f}x), weights after the step differ by at most "
            f"{row['max_weight_difference']:.1e}",
            flush=True,
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
