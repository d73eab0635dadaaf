"""Compute units: the CPU cost of each kind of work a round does, calibrated once on an idle machine.

A compute unit is one idle-machine CPU second (one torch thread) of a node's work (node/compute.py): the
sharing benchmark's budgets and x-axis are in units, so that two arms that did not run side by side still
did equal work, whatever the machine's load did to the CPU seconds in between. This script measures, for
one model shape, the cost of one unit of each kind of work on the workload's own shapes:

  prefill token      the sampler with max_new_tokens=1 (the prefill forward and one sampled token) over
                     8 questions x 8 completions, per prompt position (pads included)
  decode token       the full sampler (max_new_tokens as configured) less its prefill, per row and step
  forward token      a no-grad forward of the round's rows (prompt + completion), per padded position
  train token        the trainer's step over a silo round's groups with a reward spread, less its optimizer
                     step, per padded position through forward and backward
  optimizer step     gradient clipping and AdamW over every parameter, once
  scored completion  grading one completion with the dataset's scorer

Each is the median of --repeats timings with time.process_time() on one torch thread; the machine's load
average is recorded beside them (calibrate where it is near 0). How well the units then predict a whole
round's CPU time is measured by `benchmarks/sharing.py --round-cost` (RESULTS "sharing").

    .venv/bin/python benchmarks/compute_units.py            # writes benchmarks/compute_costs.json

Each layout (node/compute.py LAYOUTS) is calibrated on its own: the default, prompts shared in the prefill and the
update, is stored under the shape's key with '-shared-prompts'; `--set rollout.share_prompt_prefill=false --set
trainer.share_prompt_forward=false` calibrates a row per completion, under the shape's key alone.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.compute import RoundWork, model_shape_key, round_layout  # noqa: E402
from node.config import load_config  # noqa: E402
from node.loop import Node  # noqa: E402
from node.trainer import GRPOTrainer, completion_logprobs, padded_positions  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def median_cpu_s(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        before = time.process_time()
        action()
        times.append(time.process_time() - before)
    return statistics.median(times)


def shape_of(node: Node) -> str:
    config = node.model.config
    layout = round_layout(node.config.rollout.share_prompt_prefill, node.trainer.share_prompts)
    return model_shape_key(
        config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size, layout
    )


def calibrate(node: Node, repeats: int) -> dict:
    torch.set_num_threads(1)
    config = node.config
    questions = node.tasks.batch(first_draw=0, count=8)
    prompts = [node.tasks.prompt(q) for q in questions]
    n = config.rollout.completions_per_question
    backend = node.backend
    full_steps = config.rollout.max_new_tokens

    def sample(max_new_tokens: int) -> RoundWork:
        backend.config = backend.config.model_copy(update={"max_new_tokens": max_new_tokens})
        before = copy.copy(backend.work)
        backend.generate(prompts, n, seed=1)
        done = backend.work.since(before)
        return RoundWork(prefill_tokens=done.prefill_tokens, decode_tokens=done.decode_tokens)

    prefill_work = sample(1)
    prefill_s = median_cpu_s(lambda: sample(1), repeats)
    full_work = sample(full_steps)
    full_s = median_cpu_s(lambda: sample(full_steps), repeats)
    backend.config = backend.config.model_copy(update={"max_new_tokens": full_steps})
    prefill_token = prefill_s / prefill_work.prefill_tokens
    # the decoding forwards: the full sampler less its prefill (the same prompts, so the same prefill)
    decode_token = (full_s - prefill_s) / max(1, full_work.decode_tokens)

    groups, _, _ = node.local.generate_and_score(questions, seed=1)
    # what a silo's update trains on: the groups with a reward spread (a round's others are dropped)
    groups = [g for g in groups if max(g.rewards) > min(g.rewards)] or groups
    rows = [(c.prompt_ids, c.completion_ids) for g in groups for c in g.completions if c.completion_ids]
    share = node.trainer.share_prompts  # the no-grad forward as the update lays it out
    positions = padded_positions(rows, share)

    def no_grad_forward():
        with torch.no_grad():
            completion_logprobs(node.model, rows, node.tokenizer.pad_token_id, config.rollout.temperature, share)

    forward_token = median_cpu_s(no_grad_forward, repeats) / positions

    train_tokens = []

    def train_step():
        model = node.model  # the trainer steps a copy: every repeat starts from the same weights
        trainer = GRPOTrainer(
            config.trainer, copy.deepcopy(model), node.tokenizer.pad_token_id, config.rollout.temperature
        )
        stats = trainer.step(groups)
        train_tokens.append(stats.train_tokens)

    copy_s = median_cpu_s(lambda: GRPOTrainer(config.trainer, copy.deepcopy(node.model), 0, 1.0), repeats)
    stepper = GRPOTrainer(config.trainer, copy.deepcopy(node.model), 0, 1.0)
    for parameter in stepper.model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e-3

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(stepper.model.parameters(), config.trainer.max_grad_norm)
        stepper.optimizer.step()

    optimizer_step_s = median_cpu_s(optimizer_step, repeats)
    train_s = median_cpu_s(train_step, repeats) - copy_s - optimizer_step_s
    train_token = max(0.0, train_s) / max(1, statistics.median(train_tokens))

    completions = [c for g in groups for c in g.completions]
    score_s = median_cpu_s(
        lambda: [node.local.score_group(q, g.completions, "local") for q, g in zip(questions, groups)], repeats
    )
    return {
        "costs": {
            "prefill_token": prefill_token,
            "decode_token": decode_token,
            "forward_token": forward_token,
            "train_token": train_token,
            "scored_completion": score_s / len(completions),
            "optimizer_step": optimizer_step_s,
        },
        "shapes": {
            "sampler_rows": len(prompts) * n,
            "prefill_tokens": prefill_work.prefill_tokens,
            "decode_tokens": full_work.decode_tokens,
            "update_rows": len(rows),
            "update_positions": positions,
        },
        "repeats": repeats,
        "load_average_1min": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "calibrated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "specialists.yaml")
    parser.add_argument("--set", action="append", default=[], help="a config override (e.g. a model shape)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "compute_costs.json")
    args = parser.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(
            str(args.config),
            [*args.set, "swarm.transport=none", "swarm.external_questions=0", "torch_threads=1"],
            state_dir=scratch,
        )
        node = Node(config)
        node.load(fresh=True, progress=False)
        shape = shape_of(node)
        result = calibrate(node, args.repeats)
    table = json.loads(args.out.read_text()) if args.out.exists() else {}
    table[shape] = result
    args.out.write_text(json.dumps(table, indent=2) + "\n")
    print(json.dumps({"benchmark": "compute_units", "shape": shape, **result}))


if __name__ == "__main__":
    main()
