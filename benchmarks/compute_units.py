"""Compute units: the CPU cost of each kind of work a round does, calibrated once on an idle machine.

A compute unit is one idle-machine CPU second (one torch thread) of a node's work (node/compute.py): the
sharing benchmark's budgets and x-axis are in units, so that two arms that did not run side by side still
did equal work, whatever the machine's load did to the CPU seconds in between. This script measures, for
one model shape, the cost of one unit of each kind of work on the workload's own shapes:

  prefill token      the sampler with max_new_tokens=1 (the prefill forward and one sampled token) over
                     8 questions x 8 completions, per prompt position (pads included)
  decode token,      the full sampler (max_new_tokens as configured) less its prefill, over 2, 4 and 8
  decode step        questions: a least-squares fit of its CPU time to rows x steps and to steps (a cost per
                     decoding forward, whatever its rows)
  forward token      a no-grad forward of the round's rows (prompt + completion), per padded position
  train token,       the trainer's step over a silo round's groups with a reward spread, less its optimizer
  train call         step, at micro-batches of 32, 8, 4, 2 and 1 rows: a least-squares fit to the positions
                     through forward and backward and to the calls (micro-batches)
  optimizer step     gradient clipping and AdamW over every parameter, once
  scored completion  grading one completion with the dataset's scorer
  record decoded     a peer's signed record of a round's 8 groups decoded and verified by the transport's receiver
  group re-derived   a peer's group taken in (node/sharing.py rescore: its question re-derived from its spec, its
                     completions re-tokenized) less the scoring of its completions

Each is the least of --repeats timings with time.process_time() on one torch thread (the median up to
the calibration of 2026-11-26 17:57 UTC: under other load the least is the steadier); the machine's load
average is recorded beside them (calibrate where it is near 0). How well the units then predict a whole
round's CPU time is measured by `benchmarks/sharing.py --round-cost`
(benchmarks/notebook/2026-11-28-sharing-compute-units.md).

    .venv/bin/python benchmarks/compute_units.py            # writes benchmarks/compute_costs.json

Each layout (node/compute.py LAYOUTS) is calibrated on its own: the default, prompts shared in the prefill and the
update, is stored under the shape's key with '-shared-prompts'; `--set rollout.share_prompt_prefill=false --set
trainer.share_prompt_forward=false` calibrates a row per completion, under the shape's key alone.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from node.compute import RoundWork, model_shape_key, round_layout
from node.config import load_config
from node.loop import Node
from node.stats import SwarmStats
from node.trainer import GRPOTrainer, TrainingBatch, completion_logprobs, padded_positions
from node.transport.inprocess import InProcessExchange, InProcessTransport
from protocol import NodeIdentity

REPO = Path(__file__).resolve().parents[1]


def fit_two_costs(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) minimising the squared error of seconds = a x first + b x second over (first, second, seconds) rows,
    each at least 0: the cost of a call and of a position, say, from timings where their ratio differs."""
    design = torch.tensor([[first, second] for first, second, _ in rows], dtype=torch.float64)
    seconds = torch.tensor([s for _, _, s in rows], dtype=torch.float64)
    a, b = torch.linalg.lstsq(design, seconds[:, None]).solution.flatten().tolist()
    if a >= 0 and b >= 0:
        return a, b
    # a negative cost means one kind explains nothing beyond the other: the better of the two one-kind fits
    alone = []
    for column in (0, 1):
        x = design[:, column]
        c = float((x @ seconds) / max(1e-12, float(x @ x)))
        alone.append((float(((seconds - c * x) ** 2).sum()), (c, 0.0) if column == 0 else (0.0, c)))
    return min(alone)[1]


def least_cpu_s(action, repeats: int) -> float:
    """The least CPU time of `repeats` runs: other processes only ever add to a run's time (caches, frequency,
    a shared core), so the least is the nearest to an idle machine's (timeit's advice)."""
    times = []
    for _ in range(repeats):
        before = time.process_time()
        action()
        times.append(time.process_time() - before)
    return min(times)


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

    def sample(max_new_tokens: int, prompt_count: int = len(prompts)) -> RoundWork:
        backend.config = backend.config.model_copy(update={"max_new_tokens": max_new_tokens})
        before = copy.copy(backend.work)
        backend.generate(prompts[:prompt_count], n, seed=1)
        done = backend.work.since(before)
        return RoundWork(
            prefill_tokens=done.prefill_tokens, decode_tokens=done.decode_tokens, decode_steps=done.decode_steps
        )

    prefill_work = sample(1)
    prefill_s = least_cpu_s(lambda: sample(1), repeats)
    prefill_token = prefill_s / prefill_work.prefill_tokens
    # the decoding forwards: the full sampler less its prefill (the same prompts, so the same prefill), at three
    # batch sizes, so that a step's cost whatever its rows separates from a row's
    decode_timings = []
    for prompt_count in (2, 4, len(prompts)):
        full_work = sample(full_steps, prompt_count)
        full_s = least_cpu_s(lambda: sample(full_steps, prompt_count), repeats)
        short_s = least_cpu_s(lambda: sample(1, prompt_count), repeats)
        decode_timings.append((full_work.decode_steps, full_work.decode_tokens, max(0.0, full_s - short_s)))
    backend.config = backend.config.model_copy(update={"max_new_tokens": full_steps})
    decode_step, decode_token = fit_two_costs(decode_timings)

    groups, _, _ = node.local.generate_and_score(questions, seed=1)
    # what a silo's update trains on: the groups with a reward spread (a round's others are dropped)
    groups = [g for g in groups if max(g.rewards) > min(g.rewards)] or groups
    rows = [(c.prompt_ids, c.completion_ids) for g in groups for c in g.completions if c.completion_ids]
    share = node.trainer.share_prompts  # the no-grad forward as the update lays it out
    positions = padded_positions(rows, share)

    def no_grad_forward():
        with torch.no_grad():
            completion_logprobs(node.model, rows, node.tokenizer.pad_token_id, config.rollout.temperature, share)

    forward_token = least_cpu_s(no_grad_forward, repeats) / positions

    def train_step(micro_batch_size: int) -> RoundWork:
        model = node.model  # the trainer steps a copy: every repeat starts from the same weights
        trainer_config = config.trainer.model_copy(update={"micro_batch_size": micro_batch_size})
        trainer = GRPOTrainer(
            trainer_config, copy.deepcopy(model), node.tokenizer.pad_token_id, config.rollout.temperature
        )
        stats = trainer.step(TrainingBatch(groups))
        return RoundWork(train_tokens=stats.train_tokens, train_calls=stats.train_calls)

    copy_s = least_cpu_s(lambda: GRPOTrainer(config.trainer, copy.deepcopy(node.model), 0, 1.0), repeats)
    stepper = GRPOTrainer(config.trainer, copy.deepcopy(node.model), 0, 1.0)
    for parameter in stepper.model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e-3

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(stepper.model.parameters(), config.trainer.max_grad_norm)
        stepper.optimizer.step()

    optimizer_step_s = least_cpu_s(optimizer_step, repeats)
    train_timings = []
    for micro_batch_size in (32, 8, 4, 2, 1):
        work = train_step(micro_batch_size)
        train_s = least_cpu_s(lambda: train_step(micro_batch_size), repeats) - copy_s - optimizer_step_s
        train_timings.append((work.train_calls, work.train_tokens, max(0.0, train_s)))
    train_call, train_token = fit_two_costs(train_timings)

    completions = [c for g in groups for c in g.completions]
    score_s = least_cpu_s(
        lambda: [node.local.score_group(q, g.completions, "local") for q, g in zip(questions, groups)], repeats
    )
    scored_completion = score_s / len(completions)
    record_decoded, group_rederived = peer_intake_costs(node, repeats, scored_completion)
    return {
        "costs": {
            "prefill_token": prefill_token,
            "decode_token": decode_token,
            "forward_token": forward_token,
            "train_token": train_token,
            "scored_completion": scored_completion,
            "record_decoded": record_decoded,
            "group_rederived": group_rederived,
            "optimizer_step": optimizer_step_s,
            "decode_step": decode_step,
            "train_call": train_call,
        },
        "shapes": {
            "sampler_rows": len(prompts) * n,
            "prefill_tokens": prefill_work.prefill_tokens,
            "update_rows": len(rows),
            "update_positions": positions,
        },
        # what each fit was made of: (calls, positions, CPU s) per batch size, so its quality can be judged
        "decode_timings_steps_rowsteps_s": decode_timings,
        "train_timings_calls_positions_s": train_timings,
        "repeats": repeats,
        "load_average_1min": os.getloadavg()[0],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "calibrated": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def peer_intake_costs(node: Node, repeats: int, scored_completion: float) -> tuple[float, float]:
    """CPU s of decoding and verifying one peer's record of a round's groups, and of taking one of its groups in
    beside scoring it: through the in-process exchange's real signer and receiver, as the sharing benchmark's nodes."""
    groups, _, _ = node.local.generate_and_score(node.tasks.batch(first_draw=8, count=8), seed=2)
    exchange = InProcessExchange()
    publisher = InProcessTransport(exchange, node.config, NodeIdentity.generate(), SwarmStats(), node.fingerprint)
    receiver = InProcessTransport(exchange, node.config, NodeIdentity.generate(), SwarmStats(), node.fingerprint)
    decode_times, received = [], []
    for round_ in range(1, repeats + 1):  # a new round each time: the receiver refuses a record it has read
        asyncio.run(publisher.publish(round_, 0, groups))
        before = time.process_time()
        received = receiver.receiver.receive(list(exchange.latest.items()), time.time())
        decode_times.append(time.process_time() - before)
    if not received:
        raise RuntimeError("the receiver took none of the published groups: nothing to calibrate the intake on")
    completions = sum(len(item.completions) for item in received)
    intake_s = least_cpu_s(lambda: [node.sharing.rescore(item) for item in received], repeats)
    group_rederived = max(0.0, intake_s - scored_completion * completions) / len(received)
    return min(decode_times), group_rederived


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
