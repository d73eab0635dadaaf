"""What does the supervised warm start teach the default model? Held-out greedy accuracy and
distinct answers per specialty along the warm start, without caching the model.

RL needs a policy that computes answers, if badly: one that gives a single answer per kind of
question has learned the answers' prior, and RL then only shifts that prior
(benchmarks/notebook/2026-11-24-warm-start-probe.md, the mix's warm start). This traces when, in steps, each
specialty stops being a constant.

    .venv/bin/python benchmarks/warm_start_probe.py --config configs/mix.yaml --steps 3000 --eval-every 500
    .venv/bin/python benchmarks/warm_start_probe.py --config configs/mix.yaml --set model.default.hidden_size=384 ...

The evaluations sit on one run's schedule (linear warm-up, cosine decay over --steps), so step
1000 of a 3000-step probe is not a 1000-step warm start. Prints a line per evaluation and ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from node.config import load_config
from node.model import build_char_tokenizer, build_default_model
from node.rollouts.transformers_backend import TransformersBackend
from node.tasks import TaskSource
from node.warmstart import warm_start


def evaluate(backend: TransformersBackend, source: TaskSource, questions) -> dict:
    """Greedy held-out accuracy, overall and per specialty, and distinct answers given / right."""
    completions = backend.generate([source.prompt(q) for q in questions], n=1, seed=0, greedy=True)
    overall, scores = source.score_answers(questions, [c[0].text for c in completions])
    return {
        "heldout_accuracy": overall,
        "by_specialty": {label: dataclasses.asdict(score) for label, score in scores.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "mix.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config overrides, as for swarm-node train")
    parser.add_argument("--steps", type=int, default=3000, help="warm-start steps (model.default.warmup_steps)")
    parser.add_argument("--eval-every", type=int, default=500)
    args = parser.parse_args()
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be positive")

    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(args.config, [*args.set, f"model.default.warmup_steps={args.steps}"], state_dir=scratch)
    torch.set_num_threads(config.torch_threads or torch.get_num_threads())
    tokenizer = build_char_tokenizer()
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    source = TaskSource(config.tasks, seed=config.seed)
    questions = source.heldout()
    backend = TransformersBackend(config.rollout, model, tokenizer)
    shape = config.model.default
    print(
        f"default model {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters (hidden "
        f"{shape.hidden_size}, layers {shape.num_layers}), "
        f"{args.steps} warm-start steps of {shape.warmup_batch_size}, lr {shape.warmup_lr}",
        flush=True,
    )
    curve = []
    started = time.monotonic()

    def after_step(step: int) -> None:
        if step % args.eval_every and step != args.steps:
            return
        model.eval()
        with torch.no_grad():
            point = {"step": step, "seconds": round(time.monotonic() - started), **evaluate(backend, source, questions)}
        curve.append(point)
        specialties = ", ".join(
            f"{label} {v['accuracy']:.2f} ({v['distinct_given']}/{v['distinct_right']})"
            for label, v in point["by_specialty"].items()
        )
        print(
            f"step {step:5d} ({point['seconds']:5d}s): held-out {point['heldout_accuracy']:.3f}; accuracy (distinct "
            f"answers given/right): {specialties}",
            flush=True,
        )

    warm_start(model, tokenizer, config, progress=False, after_step=after_step)
    print(
        json.dumps(
            {
                "benchmark": "warm_start_probe",
                "config": Path(args.config).name,
                "overrides": args.set,
                "steps": args.steps,
                "parameters": sum(p.numel() for p in model.parameters()),
                "curve": curve,
            }
        )
    )


if __name__ == "__main__":
    main()
