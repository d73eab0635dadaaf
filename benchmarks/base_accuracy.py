"""A model's greedy accuracy before any training, per reasoning-gym task: where RL post-training has room to show.

The policy a config names (default: configs/smollm2.yaml, SmolLM2-135M-Instruct), prompted and graded exactly as
the node prompts and grades (tasks.prompt_format, user_template, answer_extraction), answers --questions
questions of each task below greedily, drawn from the held-out seed no training stream uses. Per task: accuracy,
and the completions' lengths in tokens (median, 90th percentile, longest) with the share cut at max_new_tokens
(a long tail is what partial rollouts work on). A task suits the shipped mix when the model starts between 10 and
50 %. Ends with one JSON line (appended to --results too).

    .venv/bin/python benchmarks/base_accuracy.py --questions 50
    .venv/bin/python benchmarks/base_accuracy.py --set tasks.user_template='{question}'   # the bare question
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.config import DatasetConfig, load_config  # noqa: E402
from benchmarks.common import print_result_line  # noqa: E402
from node.model import resolve_initial_policy  # noqa: E402
from node.rollouts.transformers_backend import TransformersBackend  # noqa: E402
from node.tasks import TaskSource  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def arithmetic(min_digits: int, max_digits: int, terms: int, operators: list[str]) -> dict:
    return {
        "min_terms": terms,
        "max_terms": terms,
        "min_digits": min_digits,
        "max_digits": max_digits,
        "operators": operators,
        "allow_negation": False,
        "allow_parentheses": False,
        "format_style": "simple",
    }


TASKS = [
    DatasetConfig(name="basic_arithmetic", label="add_sub_1d", config=arithmetic(1, 1, 2, ["+", "-"])),
    DatasetConfig(name="basic_arithmetic", label="add_sub_2d", config=arithmetic(2, 2, 2, ["+", "-"])),
    DatasetConfig(name="basic_arithmetic", label="add_sub_3d", config=arithmetic(3, 3, 2, ["+", "-"])),
    DatasetConfig(name="basic_arithmetic", label="mixed_1d_3terms", config=arithmetic(1, 1, 3, ["+", "-", "*"])),
    DatasetConfig(name="chain_sum", label="chain_sum", config={"min_terms": 2, "max_terms": 3, "max_digits": 2}),
    DatasetConfig(name="leg_counting", label="leg_counting", config={"min_animals": 1, "max_animals": 2}),
    DatasetConfig(name="gsm_symbolic", label="gsm_symbolic"),
]


def percentile(values: list[int], share: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2.yaml"))
    parser.add_argument("--set", action="append", default=[], help="config overrides, as for swarm-node train")
    parser.add_argument("--questions", type=int, default=50, help="per task")
    parser.add_argument("--tasks", nargs="+", default=[t.display_label for t in TASKS], help="labels of TASKS")
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args()

    config = load_config(args.config, args.set)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    model, tokenizer = resolve_initial_policy(config)
    backend = TransformersBackend(config.rollout, model, tokenizer)
    by_label = {task.display_label: task for task in TASKS}
    report = {}
    for label in args.tasks:
        tasks = config.tasks.model_copy(update={"datasets": [by_label[label]]})
        source = TaskSource(tasks, seed=tasks.heldout_seed).for_tokenizer(tokenizer)
        questions = source.batch(0, args.questions)
        start = time.perf_counter()
        completions = [c[0] for c in backend.generate([source.prompt(q) for q in questions], 1, seed=0, greedy=True)]
        seconds = time.perf_counter() - start
        accuracy, _ = source.score_answers(questions, [c.text for c in completions])
        lengths = [len(c.completion_ids) for c in completions]
        report[label] = {
            "accuracy": round(accuracy, 3),
            "length_median": statistics.median(lengths),
            "length_p90": percentile(lengths, 0.9),
            "length_max": max(lengths),
            "cut_at_max_new_tokens": round(sum(c.finish_reason == "length" for c in completions) / len(lengths), 3),
            "generation_s": round(seconds, 1),
        }
        print(f"{label}: {json.dumps(report[label])}", flush=True)
    line = {
        "benchmark": "base_accuracy",
        "model": config.model.name_or_path,
        "config": Path(args.config).name,
        "overrides": args.set,
        "questions_per_task": args.questions,
        "max_new_tokens": config.rollout.max_new_tokens,
        "prompt_format": config.tasks.prompt_format,
        "user_template": config.tasks.user_template,
        "answer_extraction": config.tasks.answer_extraction,
        "tasks": report,
    }
    print_result_line(line, args.results)


if __name__ == "__main__":
    main()
