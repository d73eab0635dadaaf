"""Rollout throughput: our transformers backend vs a plain `model.generate`, side by side,
and the split of a round's time into generation / scoring / update.

Same model (the config's; the default), same prompts, same batch, temperature, top-p and max_new_tokens;
tokens counted up to and including the end-of-sequence token. Our sampler runs twice: as the node runs it (rows that
ended leave the batch) and keeping every row to the batch's end, as model.generate does. Alternates the engines
over --repeats runs and reports medians. Then the trainer's update on one round's groups with each
prompt once against each completion with its prompt (--update-repeats). Ends with one JSON line.

    .venv/bin/python benchmarks/rollout_throughput.py
    .venv/bin/python benchmarks/rollout_throughput.py --config configs/smollm2.yaml --repeats 3 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from node.config import load_config  # noqa: E402
from benchmarks.common import print_result_line  # noqa: E402
from node.loop import Node  # noqa: E402
from node.rollouts.transformers_backend import TransformersBackend, left_pad  # noqa: E402
from node.trainer import GRPOTrainer, TrainingBatch  # noqa: E402


def generate_tokens_hf(model, tokenizer, prompts, n, max_new_tokens, temperature, top_p, seed) -> tuple[int, int]:
    """`model.generate` on the same rows: (tokens up to and including each row's end of sequence, decoding steps)."""
    torch.manual_seed(seed)
    rows = [tokenizer.encode(p, add_special_tokens=False) for p in prompts for _ in range(n)]
    input_ids, attention_mask = left_pad(rows, tokenizer.pad_token_id)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    new = out[:, input_ids.shape[1] :]
    tokens = 0
    for row in new.tolist():
        for token in row:
            tokens += 1
            if token == tokenizer.eos_token_id:
                break
        # rows padded after eos are not counted
    return tokens, new.shape[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "isolated.yaml"))
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument(
        "--update-repeats", type=int, default=3, help="steps of each update kind on one round's groups (0: none)"
    )
    parser.add_argument("--results", type=Path, default=None, help="also append the JSON line here")
    args = parser.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as scratch:
        config = load_config(args.config, [*args.set, "eval_every=0"], state_dir=scratch)
        node = Node(config)
        node.load(fresh=True)
        rollout = config.rollout
        questions = node.tasks.batch(0, config.swarm.local_questions)
        prompts = [node.tasks.prompt(q) for q in questions]
        ours, theirs, kept = [], [], []  # kept: our sampler with every row in the batch to its end
        keep_rows = rollout.model_copy(update={"drop_finished_rows": False})
        keeping = TransformersBackend(keep_rows, node.model, node.tokenizer)
        node.backend.generate(prompts, rollout.completions_per_question, seed=-1 % 2**31)  # warm-up, untimed
        with torch.no_grad():
            generate_tokens_hf(
                node.model,
                node.tokenizer,
                prompts,
                rollout.completions_per_question,
                rollout.max_new_tokens,
                rollout.temperature,
                rollout.top_p,
                0,
            )
        rows_per_batch = len(prompts) * rollout.completions_per_question
        ours_steps, theirs_steps = [], []  # rows x decoding steps a second: the pace whatever the lengths sampled
        for repeat in range(args.repeats):
            before = copy.copy(node.backend.work)
            start = time.perf_counter()
            groups = node.backend.generate(prompts, rollout.completions_per_question, seed=repeat)
            seconds = time.perf_counter() - start
            ours.append(sum(len(c.completion_ids) for g in groups for c in g) / seconds)
            # each row's first token comes from the prefill's logits, every later one from a decoding forward's row
            ours_steps.append((node.backend.work.since(before).decode_tokens + rows_per_batch) / seconds)
            start = time.perf_counter()
            groups = keeping.generate(prompts, rollout.completions_per_question, seed=repeat)
            kept.append(sum(len(c.completion_ids) for g in groups for c in g) / (time.perf_counter() - start))
            start = time.perf_counter()
            with torch.no_grad():
                tokens, steps = generate_tokens_hf(
                    node.model,
                    node.tokenizer,
                    prompts,
                    rollout.completions_per_question,
                    rollout.max_new_tokens,
                    rollout.temperature,
                    rollout.top_p,
                    repeat,
                )
            seconds = time.perf_counter() - start
            theirs.append(tokens / seconds)
            theirs_steps.append(rows_per_batch * steps / seconds)
        ours_tps, hf_tps, kept_tps = statistics.median(ours), statistics.median(theirs), statistics.median(kept)
        ours_sps, hf_sps = statistics.median(ours_steps), statistics.median(theirs_steps)
        print(
            f"backend tokens/s {ours_tps:.0f}, model.generate tokens/s {hf_tps:.0f}, ratio {ours_tps / hf_tps:.2f} "
            f"(batch {len(prompts)}x{rollout.completions_per_question}, max_new_tokens {rollout.max_new_tokens}); "
            f"row-steps/s {ours_sps:.0f} vs {hf_sps:.0f}, ratio {ours_sps / hf_sps:.2f}; "
            f"keeping every row to the batch's end {kept_tps:.0f} tokens/s (ratio {kept_tps / hf_tps:.2f})"
        )

        update = update_cost(node, questions, args.update_repeats) if args.update_repeats else None
        if update:
            print(
                f"update on one round's groups (median CPU s): each prompt once {update['shared_prompt_cpu_s']:.2f}, "
                f"each completion with its prompt {update['prompt_per_completion_cpu_s']:.2f}, ratio "
                f"{update['ratio']:.2f}"
            )
        rows = [asyncio.run(node.run_round()) for _ in range(args.rounds)]
        split = None
        if rows:
            keys = ("generation_s", "scoring_s", "update_s", "step_s")
            split = {key: statistics.median(r[key] for r in rows) for key in keys}
            split["other_s"] = split["step_s"] - split["generation_s"] - split["scoring_s"] - split["update_s"]
            print("round time split (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    line = {
        "benchmark": "rollout_throughput",
        "model": config.model.name_or_path,
        "config": Path(args.config).name,
        "overrides": args.set,
        "backend_tokens_per_s": ours_tps,
        "generate_tokens_per_s": hf_tps,
        "ratio_backend_vs_generate": ours_tps / hf_tps,
        "backend_keeping_rows_tokens_per_s": kept_tps,
        "ratio_keeping_rows_vs_generate": kept_tps / hf_tps,
        # a batch decodes until its longest row ends: rows x steps a second compares the engines' pace when the two
        # sample different lengths (tokens/s counts only the tokens before each row's end)
        "backend_row_steps_per_s": ours_sps,
        "generate_row_steps_per_s": hf_sps,
        "ratio_row_steps": ours_sps / hf_sps,
        "sequences_per_batch": len(prompts) * rollout.completions_per_question,
        "max_new_tokens": rollout.max_new_tokens,
        "round_split_s": split,
        "update": update,
    }
    print_result_line(line, args.results)


def update_cost(node: Node, questions, repeats: int) -> dict:
    """The trainer's step on one round's groups, with each prompt through the forward once (a group's completions
    share it: trainer.share_prompt_forward) and with every completion carrying its prompt, alternating, from the same
    weights each time; CPU seconds of this process (the policy-gradient term: these groups carry no demonstrations)."""
    groups, _, _ = node.local.generate_and_score(questions, seed=12345)
    saved = {name: tensor.clone() for name, tensor in node.model.state_dict().items()}
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for shared in (True, False):
            node.model.load_state_dict(saved)
            settings = node.config.trainer.model_copy(update={"share_prompt_forward": shared})
            trainer = GRPOTrainer(settings, node.model, node.tokenizer.pad_token_id, node.config.rollout.temperature)
            start = time.process_time()
            trainer.step(TrainingBatch(groups))
            seconds[shared].append(time.process_time() - start)
    node.model.load_state_dict(saved)
    once, per_completion = statistics.median(seconds[True]), statistics.median(seconds[False])
    return {
        "shared_prompt_cpu_s": once,
        "prompt_per_completion_cpu_s": per_completion,
        "ratio": per_completion / once,
        "groups": len(groups),
        "repeats": repeats,
    }


if __name__ == "__main__":
    main()
