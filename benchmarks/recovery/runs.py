"""What one run of benchmarks/stage_recovery.py is: the pipeline's shape and config, its failure schedule, and
the model it starts from (--pretrained-steps)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import REPO
from benchmarks.throughput.harness import SIZES, OneProcess, shape_overrides  # one set of model sizes for both
from node.config import load_config
from node.model import ensure_default_model, load_policy
from node.pipeline.corpus import training_corpus, validation_corpus

STAGES = 4
# --pretrained-steps trains on corpus_seed + this: sequences the runs (corpus_seed = seed + 7) never see
PRETRAINING_CORPUS_OFFSET = 1_000_003


def model_shape(args) -> tuple[int, int, int, int]:
    """(hidden, decoder layers, heads, MLP width): a --size preset of pipeline_throughput, else --hidden, 8 layers."""
    if args.size:
        return SIZES[args.size]
    return args.hidden, 8, max(2, args.hidden // 32), args.hidden * 2


def seeded_shape_overrides(shape: tuple[int, int, int, int], seed: int) -> list[str]:
    """pipeline_throughput's model at `shape`, drawn from `seed`, for the 64-token sequences of these runs."""
    return [*shape_overrides(shape), "model.default.max_position_embeddings=128", f"model.default.seed={seed}"]


def fixed_failures(items: list[str]) -> dict[int, list[int]]:
    """--failures' STEP:STAGE items as a schedule; ValueError on one that is not a step >= 2 and a stage index."""
    schedule: dict[int, list[int]] = {}
    for item in items:
        step, _, stage = item.partition(":")
        if not (step.isdigit() and stage.isdigit() and int(step) >= 2 and int(stage) < STAGES):
            raise ValueError(f"--failures takes STEP:STAGE with STEP >= 2 and STAGE < {STAGES}, not {item!r}")
        schedule[int(step)] = [int(stage)]
    return schedule


def failure_schedule(
    seed: int, rate: float, steps: int, steps_per_hour: int, fixed: list[str] | None = None
) -> dict[int, list[int]]:
    """{step: [stages that fail before it]}; depends on the seed and rate only, or with `fixed` (--failures) is
    exactly those failures for every seed and strategy."""
    if fixed:
        return fixed_failures(fixed)
    rng = random.Random(f"failures:{seed}:{rate}")
    p = rate / steps_per_hour
    schedule: dict[int, list[int]] = {}
    for step in range(2, steps + 1):
        failed = [stage for stage in range(STAGES) if rng.random() < p]
        if failed:
            # one stage at a time: two neighbours lost together would need the paper's multi-failure rules
            schedule[step] = failed[:1]
    return schedule


def run_config(args, seed: int, strategy: str, state_dir: Path):
    """The config of one run's driver and servers (and of --pretrained-steps' training of its seed's model)."""
    model = [f"model.name_or_path={args.model}"] if args.model else seeded_shape_overrides(model_shape(args), seed)
    overrides = [
        *model,
        'swarm.host_maddrs=["/ip4/127.0.0.1/tcp/0"]',
        "swarm.swarm_id=stage-bench",
        f"pipeline.num_stages={STAGES}",
        f"pipeline.micro_batch_size={args.micro_batch}",
        "pipeline.micro_batches=2",
        "pipeline.sequence_length=64",
        "pipeline.corpus_sequences=2048",
        "pipeline.validation_sequences=32",
        "pipeline.eval_every=0",
        "pipeline.announce_interval_s=0.5",
        "pipeline.announce_ttl_s=3",
        "pipeline.avoid_s=5",
        "pipeline.call_timeout_s=20",
        f"pipeline.lr={args.lr}",
        # checkpoint-restart's new server starts from a random init (nothing fetched) and then reads the checkpoint
        f"pipeline.recovery={'checkfree' if strategy in ('checkfree', 'none') else 'random'}",
        "pipeline.replica_sync_every=2",
        f"pipeline.corpus_seed={seed + 7}",
        "pipeline.rebalance_grace_s=3",
        "torch_threads=1",
        # CheckFree+'s swapped stage order on odd micro-batches and its (de)embedding copies on the neighbours serve
        # CheckFree alone: a deployment of either baseline would not pay for them (a step learns less with the swaps)
        *(["pipeline.checkfree_plus=false"] if args.plain_baselines and strategy in ("checkpoint", "random") else []),
        *args.set,
    ]
    return load_config(REPO / "configs" / "pipeline.yaml", overrides, state_dir=str(state_dir))


def pretrained_path(args, seed: int) -> Path:
    """Where --pretrained-steps keeps seed `seed`'s model after those steps: in the model cache, under everything that
    changes its weights."""
    config = run_config(args, seed, "none", Path(tempfile.gettempdir()))
    recipe = {
        "shape": list(model_shape(args)),
        "seed": seed,
        "steps": args.pretrained_steps,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        "settings": list(args.set),
        "corpus_offset": PRETRAINING_CORPUS_OFFSET,
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return config.model.resolved_cache_dir() / "stage-recovery-pretrained" / f"{digest}.pt"


def pretrain(args, seed: int) -> Path:
    """--pretrained-steps: seed `seed`'s model trained that many steps on the runs' LM objective in one process (AdamW
    at the runs' rate and micro-batches, on a corpus of its own: the runs then see sequences it never saw), once, and
    kept; every run of the seed starts from it, so that failures hit a pipeline further into training. Returns its
    path."""
    path = pretrained_path(args, seed)
    if path.exists():
        return path
    config = run_config(args, seed, "none", Path(tempfile.gettempdir()))
    model, tokenizer = load_policy(ensure_default_model(config, progress=False))
    own_corpus = config.model_copy(
        update={
            "pipeline": config.pipeline.model_copy(
                update={"corpus_seed": config.pipeline.corpus_seed + PRETRAINING_CORPUS_OFFSET}
            )
        }
    )
    # one thread: two threads on two cores beside any other work wait on each other (13 s a step against 1.1 s alone)
    trainer = OneProcess(config, model, training_corpus(own_corpus, tokenizer), threads=1)
    validation = validation_corpus(config, tokenizer)
    print(f"seed {seed}: pretraining its model for {args.pretrained_steps} steps in one process", flush=True)
    started = time.perf_counter()
    for step in range(1, args.pretrained_steps + 1):
        loss = trainer.train_step()["loss"]
        if step % args.eval_every == 0 or step == args.pretrained_steps:
            print(
                f"  seed {seed} pretraining: step {step}/{args.pretrained_steps} loss {loss:.4f} val loss "
                f"{trainer.validation_loss(validation):.4f} at "
                f"{time.perf_counter() - started:.0f}s",
                flush=True,
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(model.state_dict(), staging)
    os.replace(staging, path)  # atomic: a run never reads half a file
    return path


def uplink_per_host(args) -> bool:
    """--checkpoint-uplinks per-host: each run in a network namespace of its own, every host with an uplink of the
    rate."""
    return bool(args.checkpoint_store_mbit) and args.checkpoint_uplinks == "per-host"
