"""A node on a GPU beside the same node on that machine's CPU (issue #34): prepared for a lent GPU machine.

The default model at a larger shape (about 34M parameters: hidden 512, 8 layers, 8 heads, MLP 2048; `--set` changes
it), warm-started once on the first device, trains isolated for the same number of rounds on each device in turn
(`--device`, default cuda then cpu; `DEVICE@DTYPE`, e.g. `cuda@bfloat16`, trains in that `model.dtype`), from the
same weights. Per arm: rounds/s, generated tokens/s, update seconds per round, peak GPU memory, held-out accuracy
before and after, and the sampler's behaviour log-probs against the trainer's recomputation (judged at the
tolerance the CPU tests use, tests/test_rollouts.py::test_behaviour_logprobs_match_the_trainer, in float32 only: in a
half dtype the two differ by the dtype's rounding, and the figure is reported, not judged). One JSON line goes to
`--out` (default `$OUT/gpu_round.json`, else stdout only); progress goes to stdout. A device's rounds stop early, and
say so, when its share of `--budget-s` is spent, so the command ends inside the lent machine's 10 minutes.

On the lent machine (Python 3.12, CUDA torch 2.11, transformers 5.17, no network): what the node imports beyond the
machine's packages travels in .whl/ (ignored by git, about 17 MiB): the wheels benchmarks/gpu_wheels.txt lists, and
three source archives pip builds there offline, downloaded here by `make gpu-wheels`. The device tool's call, from the
repository's root (about 1 minute of installs and the warm start, 8 of rounds; $OUT/gpu_round.json comes back):

    run(kind left out, carry=[".whl"], timeout_s=600, command=
        "python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade
         --target /tmp/site .whl/*.whl .whl/*.tar.gz && export PYTHONPATH=/tmp/site:$PWD || exit;
         PYTHONUNBUFFERED=1 python3 benchmarks/gpu_round.py")

Here, on the CPU, it is tested in its tiny mode (tests/test_gpu_round.py):

    .venv/bin/python benchmarks/gpu_round.py --device cpu --device cpu@bfloat16 --tiny --out /tmp/gpu_round.json

`--profile-rounds N` prints torch.profiler's tables for each arm (how the bfloat16 slowdown of
benchmarks/notebook/2026-11-27-gpu.md, "bfloat16 on a GPU", was found).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from node.config import load_config  # noqa: E402
from node.device import describe_device, model_device  # noqa: E402
from node.loop import Node  # noqa: E402
from node.model import ensure_default_model  # noqa: E402
from node.trainer import completion_logprobs  # noqa: E402
from tests.helpers.common import TINY_OVERRIDES  # noqa: E402 - the tests' tiny model: this script's CPU test

LOGPROB_ATOL = 1e-4  # tests/test_rollouts.py: the sampler's behaviour log-probs against the trainer's, float32
LARGER = [  # about 34M parameters: tens of millions, a few seconds a round on a GPU
    "model.default.hidden_size=512",
    "model.default.num_layers=8",
    "model.default.num_heads=8",
    "model.default.intermediate_size=2048",
]


def check_behaviour_logprobs(node: Node) -> dict:
    """Sample with the node's backend and recompute with the trainer's function, on the policy's device; `ok` is
    judged in float32 only (None in a half dtype, whose rounding the tolerance is not for)."""
    temperature = node.config.rollout.temperature
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, 4)]
    flat = [c for group in node.backend.generate(prompts, n=4, seed=1) for c in group]
    recomputed, _ = completion_logprobs(
        node.model, [(c.prompt_ids, c.completion_ids) for c in flat], node.tokenizer.pad_token_id, temperature
    )
    worst = max(
        (recomputed[i, : len(c.logprobs)].cpu() - torch.tensor(c.logprobs)).abs().max().item()
        for i, c in enumerate(flat)
    )
    judged = node.config.model.dtype == "float32"
    return {
        "max_abs_diff": worst,
        "atol": LOGPROB_ATOL,
        "ok": worst <= LOGPROB_ATOL if judged else None,
        "sequences": len(flat),
    }


async def run_arm(node: Node, rounds: int, budget_s: float) -> list[dict]:
    rows, start = [], time.monotonic()
    while len(rows) < rounds and time.monotonic() - start < budget_s:
        rows.append(await node.run_round())
        print(
            f"  round {node.round:3d} reward {rows[-1]['reward_mean']:.3f} tokens/s {rows[-1]['tokens_per_s']:.0f} "
            f"update {rows[-1]['update_s']:.2f}s step {rows[-1]['step_s']:.2f}s",
            flush=True,
        )
    return rows


def arm_overrides(spec: str) -> list[str]:
    """`cuda`, `cuda:1`, `cpu@bfloat16`: the device and, after '@', the dtype an arm trains in."""
    device, _, dtype = spec.partition("@")
    return [f"model.device={device}", *([f"model.dtype={dtype}"] if dtype else [])]


def print_profile(node: Node, rounds: int, where: torch.device) -> None:
    """Where the time goes on this arm: torch.profiler over a round's sampling (I x G completions) and a forward and
    backward of the trainer's log-probs on them, `rounds` times, in this thread (the round loop runs its torch work in
    worker threads, which the profiler does not follow). Operators by their own CPU time (launch-bound work shows there)
    and, on a GPU, by their CUDA time; to stdout."""
    from torch.profiler import ProfilerActivity, profile

    temperature = node.config.rollout.temperature
    prompts = [node.tasks.prompt(q) for q in node.tasks.batch(0, node.config.swarm.local_questions)]
    n = node.config.rollout.completions_per_question
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if where.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for r in range(rounds):
            flat = [c for group in node.backend.generate(prompts, n=n, seed=100 + r) for c in group]
            logprobs, _ = completion_logprobs(
                node.model, [(c.prompt_ids, c.completion_ids) for c in flat], node.tokenizer.pad_token_id, temperature
            )
            logprobs.sum().backward()
            node.model.zero_grad(set_to_none=True)
        if where.type == "cuda":
            torch.cuda.synchronize(where)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=20), flush=True)
    if where.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=15), flush=True)


def arm(
    config_args: list[str], spec: str, rounds: int, budget_s: float, state_dir: str, profile_rounds: int = 0
) -> dict:
    config = load_config(REPO / "configs" / "isolated.yaml", [*config_args, *arm_overrides(spec)], state_dir=state_dir)
    node = Node(config)
    node.load(fresh=True, progress=False)
    where = model_device(node.model)
    print(f"{describe_device(where)}: {node.model_parameters / 1e6:.1f}M parameters, {config.model.dtype}", flush=True)
    result: dict = {"device": describe_device(where), "dtype": config.model.dtype}
    result["behaviour_logprobs"] = check_behaviour_logprobs(node)
    print(f"  behaviour log-probs against the trainer's: {result['behaviour_logprobs']}", flush=True)
    if where.type == "cuda":
        torch.cuda.synchronize(where)
        torch.cuda.reset_peak_memory_stats(where)
    result["heldout_before"] = node.evaluator.accuracy()
    start = time.monotonic()
    rows = asyncio.run(run_arm(node, rounds, budget_s))
    wall = time.monotonic() - start
    if len(rows) < rounds:
        print(f"  stopped after {len(rows)} of {rounds} rounds: this device's {budget_s:.0f}s are spent", flush=True)
    result["heldout_after"] = node.evaluator.accuracy()
    peak_mib = torch.cuda.max_memory_allocated(where) / 2**20 if where.type == "cuda" else None
    if profile_rounds:  # after the figures: the profiler's own overhead and memory are not in them
        print_profile(node, profile_rounds, where)
    tokens = sum(r["tokens"] for r in rows)
    result |= {
        "rounds": len(rows),
        "rounds_asked": rounds,
        "wall_s": wall,
        "rounds_per_s": len(rows) / wall,
        "generated_tokens_per_s": tokens / max(sum(r["generation_s"] for r in rows), 1e-9),
        "update_s_mean": statistics.fmean(r["update_s"] for r in rows),
        "step_s_mean": statistics.fmean(r["step_s"] for r in rows),
        "policy_version": node.policy_version,
        "peak_gpu_memory_mib": peak_mib,
    }
    print(f"  {json.dumps(result)}", flush=True)
    del node, rows  # the next arm's peak GPU memory is its own: this arm's weights and optimizer state are freed first
    gc.collect()
    if where.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        action="append",
        help="an arm: a device to train on, DEVICE or DEVICE@DTYPE (e.g. cuda@bfloat16), in order (default: cuda, cpu)",
    )
    parser.add_argument("--rounds", type=int, default=20, help="rounds on each device")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for all devices' rounds together")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model and 2 rounds (a CPU check)")
    parser.add_argument("--set", action="append", default=[], help="config overrides, as for swarm-node train")
    parser.add_argument(
        "--profile-rounds", type=int, default=0, help="after each arm's timed rounds, this many under torch.profiler"
    )
    parser.add_argument("--out", default=None, help="where the JSON line goes (default: $OUT/gpu_round.json)")
    args = parser.parse_args()

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    devices = args.device or ["cuda", "cpu"]
    rounds = 2 if args.tiny else args.rounds
    config_args = [*(TINY_OVERRIDES if args.tiny else LARGER), "eval_every=0", "checkpoint_every=1000", *args.set]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        os.environ.setdefault("SWARM_NODE_CACHE", f"{scratch}/cache")
        first = load_config(
            REPO / "configs" / "isolated.yaml",
            [*config_args, f"model.device={devices[0].partition('@')[0]}"],
            state_dir=scratch,
        )
        ensure_default_model(first, progress=False)  # the warm start, once, on the first device, in float32
        warm_start_s = time.monotonic() - started
        print(f"default model built in {warm_start_s:.0f}s", flush=True)
        arms = []
        for i, spec in enumerate(devices):
            share = (args.budget_s - (time.monotonic() - started)) / (len(devices) - i)
            arms.append(arm(config_args, spec, rounds, share, f"{scratch}/arm{i}", args.profile_rounds))
    line = {
        "benchmark": "gpu_round",
        "tiny": args.tiny,
        "overrides": config_args,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "warm_start_s": warm_start_s,
        "arms": arms,
        "speedup_rounds_per_s": arms[0]["rounds_per_s"] / arms[-1]["rounds_per_s"] if len(arms) > 1 else None,
        # each arm's rounds a second against the last arm's (the CPU, in the default order)
        "rounds_per_s_vs_last": [a["rounds_per_s"] / arms[-1]["rounds_per_s"] for a in arms],
        "wall_s": time.monotonic() - started,
    }
    text = json.dumps(line)
    print(text, flush=True)
    out = args.out or (os.environ.get("OUT") and str(Path(os.environ["OUT"]) / "gpu_round.json"))
    if out:
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
