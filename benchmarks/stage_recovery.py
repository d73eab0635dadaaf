"""Recovering lost pipeline stages: CheckFree(+) vs checkpoint-restart vs random re-initialisation.

A 4-stage pipeline of the default architecture (8 decoder layers, 2 per stage) trains
with the language-model loss on the fixed offline corpus. Every stage server is a real
`StageServer` on its own DHT node and p2p daemon, the driver a real `LMDriver` routing
over p2p streams — all in this one process (one asyncio loop), so that failures can be
injected at exact steps: a failure kills the server's p2p daemon (its peers see refused
connections, as after kill -9), stops its tasks and drops its state. A fresh server on a
fresh DHT node then takes the stage over (a warm spare: its start is counted in the
recovery time). Strategies, same seeds and the same failure schedule for each:

- none:        no failures (sets the target validation loss);
- checkfree:   the new server rebuilds the stage from its neighbours (CheckFree for
               stages 1-2, CheckFree+ for stages 0 and 3, see node/pipeline/recovery.py);
- checkpoint:  every --checkpoint-every steps every server writes its stage, optimizer state, step
               and lr scale to disk (a temporary file, fsynced, renamed over the last one, the
               folder fsynced: save_stage_checkpoint), one stage after the other on this machine's
               one disk, while the training loop waits; after a failure the new server starts
               from a random init (nothing fetched), every stage reads the last checkpoint back
               from disk and the driver goes back to its step. Saves and loads are timed and in
               the strategy's wall clock. The interval is by default Young's rule,
               sqrt(2 x checkpoint cost x the pipeline's MTBF), from the first checkpoint's
               measured cost and the failure-free run's normal step (young_interval); with
               young-with-uploads, that cost includes what the steps beside the first checkpoint's
               background uploads took beyond normal steps (cost_with_uploads); young-own-steps
               prices the same against the run's own normal step (own_normal_step) instead of the
               failure-free run's, which ran at another load. With
               --checkpoint-store-mbit R (root) a checkpoint is not done until it is also uploaded to
               a store on another host (a network namespace behind a link of R Mbit/s, which fsyncs
               it), and a replacement server downloads its stage's checkpoint from there: a
               checkpoint kept only on the host that dies is lost with it. The stages share that
               one link, one after the other, unless --checkpoint-uplinks per-stage: then each
               stage's host has an uplink of R of its own and all stages save and upload at once
               (Checkpoints). --checkpoint-uplinks per-host goes further: every run, each
               strategy's and the failure-free one's, happens in a network namespace of its own,
               whose loopback gives every host (the driver, each stage server, each store) an
               uplink of R (host_uplinks.py), so that a stage host's hidden states, gradients,
               what CheckFree reads from it and its checkpoint uploads share its one link.
               With --checkpoint-uploads background training goes on once every
               stage has written its checkpoint to its own disk; the uploads run meanwhile and the
               checkpoint is the restore point once they have all ended (a failure before that cuts
               them and rolls back to the checkpoint before);
- random:      the new server initialises the stage randomly (fresh optimizer).

Failure schedule: each stage fails independently with probability rate / steps_per_hour
at each step (the paper's 5 %, 10 %, 16 % per stage per hour, with an "hour" scaled to
--steps-per-hour steps), drawn from the seed alone. The target is the validation loss the
failure-free run of the same seed reaches at --target-fraction of its steps. Reported per
strategy and rate (mean over seeds, with min and max): steps executed and wall-clock seconds to
the target (validation time left out: the same for every strategy), recovery seconds (failure
-> first step after, less a normal step) by how the stage came back, the loss spike (the training
loss of the first step after a failure minus that of the step before it), and what a checkpoint
cost. Unlike the paper's simulation (checkpoint_simulation.py replays a failure-free run and does
not charge checkpoint I/O), checkpoint save and load times are measured and charged here.
Every run starts from scratch, as the paper's, or with --pretrained-steps N from its seed's model
after N steps of the same objective in one process (made once, kept in the model cache): failures
then hit a pipeline further into training, where a fresh stage has more to relearn.

Every run appends its row to --results (benchmarks/results/stage_recovery.jsonl) as it ends, under
a key of the settings that make runs comparable; a run already there is not run again, and
--report computes the figures from the file alone. --side-by-side runs the strategies of one
(rate, seed) at once, each in its own process, so that they share the machine's load; the
failure-free runs of all seeds go first, side by side too. With --keep-load a run that reached its
target (its row written) goes on training until every run beside it has reached its own or ended:
else the fastest strategy's end frees the CPU for the slower ones, which then run their last
minutes at a lower load than it ran under. --size takes pipeline_throughput's model sizes.

--model takes a pretrained model (e.g. smollm2-135m-instruct: SmolLM2's 30 decoder layers cut into the 4 stages)
instead of the default architecture; --failures STEP:STAGE ... replaces the seeded schedule with exactly those
failures, the same for every seed and strategy (the rate then only prices Young's rule), so that the loss spike and
the steps back (each run's `losses`, every step's training loss, replays included) compare the methods at the same
moment of training:

    .venv/bin/python benchmarks/stage_recovery.py --model smollm2-135m-instruct --lr 3e-5 --micro-batch 4 \
        --max-steps 12 --eval-every 4 --failures 6:1 --rates 0.10 --seeds 1 --plain-baselines --side-by-side \
        --run-timeout-s 1800 --set pipeline.checkfree_plus=false \
        --results benchmarks/results/stage_recovery_smollm2.jsonl

Churn mode (--churn, issue #24): no spares; before each of --churn-failures seeded steps a
random stage's only server is killed, and a newcomer joins with `--stage auto` a random 0 to
2 announce TTLs later, so that it often arrives while the dead server's announcement is still
readable. Reported per seed (`joiner_churn`): the longest stall (from when a server is
available, i.e. the later of the kill and the newcomer's arrival, to the end of the first step
after it), the announce TTL, the fraction of steps lost (from each kill to the end of the first
step after it, less a normal step, counted in normal steps, plus the steps a checkpoint rollback
replays, over all step slots), and the validation loss after the run. CheckFree and checkpoint-restart (the stage's
newcomer, then every stage, loads
the last checkpoint) on the same schedule.

    .venv/bin/python benchmarks/stage_recovery.py --seeds 3
    .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 0.16 0.05 --side-by-side
    .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --report
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 100
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 20 --checkpoint-uplinks per-stage
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 20 --checkpoint-uplinks per-stage --checkpoint-uploads background
    sudo .venv/bin/python benchmarks/stage_recovery.py --size 5M --max-steps 120 --rates 0.10 --side-by-side \
        --checkpoint-store-mbit 20 --checkpoint-uplinks per-host --checkpoint-uploads background
    .venv/bin/python benchmarks/stage_recovery.py --churn --seeds 3
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.transport.protobuf_shim import import_hivemind_isolated  # noqa: E402

import_hivemind_isolated()

import psutil  # noqa: E402
import torch  # noqa: E402

from node.aio import cancel_and_wait  # noqa: E402
from node.config import load_config  # noqa: E402
from node.files import append_json_line, fsync_dir  # noqa: E402
from node.model import (  # noqa: E402
    build_char_tokenizer,
    build_default_model,
    ensure_default_model,
    initial_policy_path,
    load_policy,
    model_fingerprint,
)
from node.pipeline.corpus import training_corpus, validation_corpus  # noqa: E402
from node.pipeline.driver import PipelineRouter  # noqa: E402
from node.pipeline.lm import LMDriver  # noqa: E402
from node.pipeline.server import StageServer  # noqa: E402
from node.pipeline.stagemap import LostReporter  # noqa: E402
from node.pipeline.recovery import tensor_bytes  # noqa: E402
from node.pipeline.stages import (  # noqa: E402
    checkfree_plus_extra_parts,
    expected_fingerprints,
    part_tensors,
    pipeline_limits,
    split_model,
)
from node.state import StateStore  # noqa: E402
from node.transport.joining import shutdown_dht  # noqa: E402
from node.transport.session import SwarmSession  # noqa: E402
from protocol import NodeIdentity  # noqa: E402

from benchmarks.checkpoint_store import CheckpointStore, LoopbackStore, store_get, store_put  # noqa: E402
from benchmarks.host_uplinks import HostUplinks, RunNamespace, in_own_namespace, port_of  # noqa: E402
from benchmarks.pipeline_throughput import SIZES, OneProcess, shape_overrides  # noqa: E402  (one set of model sizes for both)

REPO = Path(__file__).resolve().parents[1]
STAGES = 4
RESULTS = REPO / "benchmarks" / "results" / "stage_recovery.jsonl"
HOLD_POLL_S = 2.0  # --keep-load: how often the parent looks whether every run has reached its target or ended
# --pretrained-steps trains on corpus_seed + this: sequences the runs (corpus_seed = seed + 7) never see
PRETRAINING_CORPUS_OFFSET = 1_000_003
CHILD_GRACE_S = 180.0  # a side-by-side run stops itself at --run-timeout-s; this long after, it is stopped from outside


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


def save_stage_checkpoint(backend, path: Path) -> float:
    """Write one stage's weights, optimizer state, step and lr scale as a deployment would: to a temporary file that is
    flushed and fsynced, renamed over the previous checkpoint (a crash mid-write leaves that one whole), and the
    folder fsynced so that the rename survives a power cut. Returns the seconds it took."""
    started = time.perf_counter()
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        torch.save(
            {
                "stage": backend.stage.state_dict(),
                "optimizer": backend.optimizer.state_dict(),
                "step": backend.step,
                "lr_scale": backend.lr_scale,
            },
            handle,
        )
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    fsync_dir(path.parent)
    return time.perf_counter() - started


def load_stage_checkpoint(backend, path: Path) -> float:
    """Read a stage back from its checkpoint on disk: weights, a new optimizer given the saved state, step and lr scale.
    Returns the seconds it took."""
    started = time.perf_counter()
    data = torch.load(path, weights_only=True)
    backend.stage.load_state_dict(data["stage"])
    backend.lr_scale = data["lr_scale"]
    backend.optimizer = backend.new_optimizer()
    backend.optimizer.load_state_dict(data["optimizer"])
    backend.step = data["step"]
    return time.perf_counter() - started


def young_interval(checkpoint_s: float, step_s: float, rate: float, steps_per_hour: int, stages: int = STAGES) -> int:
    """Steps between checkpoints by Young's rule, sqrt(2 x checkpoint cost x mean time between failures), for the
    whole pipeline (any stage failing rolls every stage back): its MTBF is steps_per_hour / (stages x rate) steps."""
    mtbf_s = steps_per_hour / (stages * rate) * step_s
    return max(1, round(math.sqrt(2 * checkpoint_s * mtbf_s) / step_s))


class Checkpoints:
    """Checkpoint-restart's files: every stage's checkpoint in `folder` on this host, and with stores, uploaded too.

    `stores` is empty (checkpoints stay on this host's disk), one store whose link all stages share (the stages save
    and upload one after the other: a store behind one link of the rate), or one store per stage (each stage's host
    has an uplink of the rate of its own, so the stages save and upload at once). A checkpoint is a restore point only
    once every stage's upload is done: a checkpoint kept only on the host that dies is lost with it.

    With `background` uploads a save returns once every stage has its checkpoint on its own disk; the uploads go on
    while training does, and the checkpoint becomes the restore point when the last of them ends. Until then the
    restore point is the one before, whose files stay whole: checkpoints alternate between two slots, on the hosts'
    disks and in the stores. A save that finds the last checkpoint's uploads still going waits for them (a deployment
    would not start a second upload of a stage beside the first), and a lost host cuts its own upload, which leaves
    the others' uploads of that checkpoint useless (`drop_pending`)."""

    def __init__(self, folder: Path, stores: list[CheckpointStore], background: bool = False) -> None:
        if len(stores) not in (0, 1, STAGES):
            raise ValueError(f"no store, one shared, or one per stage ({STAGES}), not {len(stores)}")
        if background and not stores:
            raise ValueError("uploads in the background need a store to upload to")
        self.folder, self.stores, self.background = folder, stores, background
        self.step: int | None = None  # the restore point: the driver's step of the last whole checkpoint (None before)
        self.slot = 1  # the restore point's slot; the first checkpoint goes to slot 0
        self.paths: dict[int, Path] = {}  # the restore point's files on this host, by stage index
        self.pending: asyncio.Task | None = None  # background: the uploads of the newest checkpoint
        self.uploads_s: list[float] = []  # background: each checkpoint's uploads, from its save's end to the last's
        self.upload_waits_s: list[float] = []  # background: each save's wait for the last checkpoint's uploads
        self.uploads_dropped = 0  # background: checkpoints whose uploads a lost host cut

    def store_of(self, index: int) -> CheckpointStore | None:
        return self.stores[index % len(self.stores)] if self.stores else None

    async def for_each_stage(self, work, indices) -> list:
        """`work(index)` for every index: at once where each stage's host has its own uplink, else one after the other
        (one disk, this host's, or one link, the store's)."""
        if len(self.stores) == STAGES:
            return list(await asyncio.gather(*(work(index) for index in indices)))
        return [await work(index) for index in indices]

    async def save(self, backends: dict[int, object], step: int) -> int:
        """Write every stage's checkpoint, `backends` by stage index, and upload it (or start uploading it, in the
        background); returns the bytes written."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.pending is not None:
            waited = time.perf_counter()
            await self.pending
            self.upload_waits_s.append(time.perf_counter() - waited)
        slot = 1 - self.slot
        paths = {index: self.folder / f"stage-{index}-{slot}.pt" for index in backends}

        async def write(index: int) -> None:
            await asyncio.to_thread(save_stage_checkpoint, backends[index], paths[index])

        async def upload(index: int) -> None:
            store = self.store_of(index)
            if store is not None:
                await store_put(store.host, store.port, paths[index])

        async def upload_all() -> None:
            started = time.perf_counter()
            await self.for_each_stage(upload, paths)
            self.uploads_s.append(time.perf_counter() - started)
            self.step, self.slot, self.paths = step, slot, paths

        if self.background:
            await self.for_each_stage(write, paths)
            self.pending = asyncio.create_task(upload_all())
        else:

            async def write_and_upload(index: int) -> None:
                await write(index)
                await upload(index)

            await self.for_each_stage(write_and_upload, paths)
            self.step, self.slot, self.paths = step, slot, paths
        return sum(path.stat().st_size for path in paths.values())

    async def drop_pending(self) -> bool:
        """A host is lost: the newest checkpoint's uploads, if still going, can no longer all end (that host's is cut),
        so they are stopped and the restore point stays the one before. Returns whether there were any."""
        pending, self.pending = self.pending, None
        if pending is None or pending.done():
            if pending is not None:
                pending.result()  # an upload that failed is news
            return False
        await cancel_and_wait([pending], "checkpoint uploads cut by a lost host")
        self.uploads_dropped += 1
        return True

    async def load(self, backends: dict[int, object], replaced: list[int] = ()) -> int:
        """Every stage reads the restore point back; the `replaced` stages' new hosts first download theirs from
        their store (the dead host's disk is gone with it), each over its own link where stages have one. Returns the
        step to go back to."""
        await self.drop_pending()
        if self.step is None:
            raise RuntimeError("no checkpoint to restore yet")

        async def download(index: int) -> None:
            path = self.paths[index]
            path.unlink(missing_ok=True)
            store = self.store_of(index)
            await store_get(store.host, store.port, path)

        await self.for_each_stage(download, [index for index in replaced if self.store_of(index) is not None])
        for index, backend in backends.items():
            await asyncio.to_thread(load_stage_checkpoint, backend, self.paths[index])
        return self.step

    async def close(self) -> None:
        """Stop uploads still going when the run ends (their checkpoint is never needed)."""
        if self.pending is not None and not self.pending.done():
            await cancel_and_wait([self.pending], "checkpoint uploads at the end of a run")
        self.pending = None


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


class Bench:
    def __init__(self, args, scratch: Path, seed: int, strategy: str) -> None:
        self.args, self.scratch, self.seed, self.strategy = args, scratch, seed, strategy
        self.config = run_config(args, seed, strategy, scratch / "driver")
        self.dhts: list = []
        self.servers: dict[int, tuple[StageServer, asyncio.Task, object]] = {}
        self.dead: list[asyncio.Task] = []
        self.io_s = 0.0
        self.saves_s: list[float] = []  # each checkpoint of all stages, seconds
        self.save_cost_s = 0.0  # the last save, less any wait for the uploads before it (Young's rule prices this)
        self.loads_s: list[float] = []  # each restore of all stages, seconds
        self.last_bytes = 0
        per_host = uplink_per_host(args)
        # every host's uplink, on the loopback of this run's own namespace (main starts the run there)
        self.uplinks = HostUplinks(args.checkpoint_store_mbit) if per_host else None
        stores: list[CheckpointStore | LoopbackStore] = []
        if strategy == "checkpoint" and args.checkpoint_store_mbit:
            try:
                for index in range(STAGES if args.checkpoint_uplinks != "shared" else 1):
                    if per_host:  # a host of the run's namespace: its link is the loopback's shaping
                        stores.append(LoopbackStore(scratch, name=f"store-{index}"))
                        self.uplinks.add(f"store-{index}", sends_from=(stores[-1].port,))
                        # only stage `index`'s host uploads to this store: an upload goes over that host's uplink
                        self.uplinks.add(f"stage-{index}", sends_to=(stores[-1].port,))
                    else:
                        stores.append(CheckpointStore(args.checkpoint_store_mbit, scratch, name=f"store-{index}"))
            except BaseException:
                for store in stores:
                    store.close()
                raise
        background = args.checkpoint_uploads == "background"
        self.checkpoints = Checkpoints(scratch / "checkpoints", stores, background=background and bool(stores))

    async def start(self) -> None:
        from hivemind.dht.node import DHTNode

        for store in self.checkpoints.stores:
            await store.ready()
        # the default architecture built for this seed, or --model's pretrained weights (converted once, cached)
        self.model, self.tokenizer = load_policy(initial_policy_path(self.config))
        if self.args.pretrained_steps:  # pretrain() ran before this run started (main, or run_one)
            self.model.load_state_dict(torch.load(pretrained_path(self.args, self.seed), weights_only=True))
        self.fingerprint = model_fingerprint(self.model, self.tokenizer)
        self.bootstrap = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.addresses = [str(a) for a in await self.bootstrap.get_visible_maddrs()]
        if self.uplinks is not None:  # the bootstrap node is the driver's: the driver's host
            self.uplinks.add("driver", sends_from=(port_of(self.addresses),))
        for stage in range(STAGES):
            if self.args.churn:  # every server chooses its stage: each takes the next one left without a server
                await self.start_server("auto", key=stage)
                await self.wait_serving(stage)
            else:
                await self.start_server(stage)
        await self.wait_serving()
        limits = pipeline_limits(self.config, self.model.config, sum(p.numel() for p in self.model.parameters()))
        self.router = PipelineRouter(
            self.bootstrap,
            self.config,
            self.fingerprint,
            expected_fingerprints(self.config, self.model.config, self.fingerprint),
            limits,
            seed=self.seed,
            reporter=LostReporter(
                SwarmSession(self.config, self.bootstrap, "direct", NodeIdentity.generate()), self.fingerprint
            ),
        )
        shutil.rmtree(self.scratch / "driver", ignore_errors=True)
        self.driver = LMDriver(
            self.config,
            self.router,
            training_corpus(self.config, self.tokenizer),
            validation_corpus(self.config, self.tokenizer),
            StateStore(self.scratch / "driver"),
        )

    async def start_server(self, stage: int | str, key: int | None = None) -> StageServer:
        """A fresh server of `stage` (an index, or "auto": it chooses), kept under `key` (default: the stage)."""
        from hivemind.dht.node import DHTNode

        dht = await DHTNode.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=self.addresses)
        if self.uplinks is not None:  # a stage's host (a replacement: a new one behind a link of the same rate)
            self.uplinks.add(f"stage-{stage}", sends_from=(port_of(await dht.get_visible_maddrs()),))
        config = self.config.model_copy(update={"pipeline": self.config.pipeline.model_copy(update={"stage": stage})})
        session = SwarmSession(
            config, dht, "direct", NodeIdentity.generate(), self.scratch / f"server-{stage}-{time.time_ns()}"
        )
        server = StageServer(session, self.model, self.fingerprint)
        self.servers[stage if key is None else key] = (server, asyncio.create_task(server.run()), dht)
        return server

    async def wait_serving(self, stage: int | None = None) -> None:
        for _ in range(6000):
            servers = [self.servers[stage][0]] if stage is not None else [s for s, _, _ in self.servers.values()]
            if all(s.state == "serving" for s in servers):
                return
            await asyncio.sleep(0.01)
        raise RuntimeError("a stage server never started serving")

    async def kill(self, stage: int) -> bool:
        """Kill a stage's server as kill -9 would. Returns whether that cut checkpoint uploads still going (its host's
        among them)."""
        server, task, dht = self.servers.pop(stage)
        process = getattr(dht.p2p, "_child", None)
        if process is not None and process.returncode is None:
            process.kill()  # as kill -9: its peers' calls now fail
        # cancel_and_wait: on Python 3.11 a cancel can be swallowed (node/aio.py), and a single one left a killed
        # server's loop running and this wait hanging at a failure (2026-11-28, seed 4 at 10 %, random)
        await cancel_and_wait([task], "a killed stage server")
        # Its DHT node is cleaned up off the clock: a killed server does not wait for anything.
        self.dead.append(asyncio.create_task(shutdown_dht(dht, timeout=5)))
        return await self.checkpoints.drop_pending()

    async def save_checkpoint(self) -> None:
        """Every stage writes (and uploads, or starts uploading) its checkpoint (Checkpoints.save), off the event loop
        so that the servers keep announcing; the training loop waits for all of them, so the time is charged to this
        strategy's wall clock, a wait for the last checkpoint's uploads in the background included."""
        started = time.perf_counter()
        # servers are kept by stage, or by arrival in churn mode: one file per stage
        backends = {server.index: server.backend for server, _, _ in self.servers.values()}
        waits = len(self.checkpoints.upload_waits_s)
        self.last_bytes = await self.checkpoints.save(backends, self.driver.step)
        seconds = time.perf_counter() - started
        self.saves_s.append(seconds)
        self.io_s += seconds
        # what the save itself blocks training for, without a wait for the last checkpoint's uploads: Young's price
        self.save_cost_s = seconds - sum(self.checkpoints.upload_waits_s[waits:])

    async def load_checkpoint(self, replaced: list[int] = ()) -> None:
        """Every stage, the new one too, reads its last checkpoint back; the driver goes back to its step. With
        stores, the servers of the `replaced` stages (new hosts) first download theirs."""
        started = time.perf_counter()
        backends = {server.index: server.backend for server, _, _ in self.servers.values()}
        self.driver.step = await self.checkpoints.load(backends, replaced)
        seconds = time.perf_counter() - started
        self.loads_s.append(seconds)
        self.io_s += seconds

    def checkpoint_bytes(self) -> int:
        """Size on disk of the last checkpoint of all stages (0 before the first)."""
        return self.last_bytes

    async def stop(self) -> None:
        await self.checkpoints.close()
        for store in self.checkpoints.stores:
            store.close()
        await asyncio.gather(*self.dead, return_exceptions=True)
        for stage in list(self.servers):
            server, task, dht = self.servers.pop(stage)
            await cancel_and_wait([task], "a stage server")
            await shutdown_dht(dht, timeout=5)
        if hasattr(self, "bootstrap"):  # not when the run stopped while starting
            await shutdown_dht(self.bootstrap, timeout=5)


def quiet_killed_daemons(loop, context) -> None:
    """hivemind's control-connection tasks of a killed p2p daemon end in ConnectionResetError: expected here, not
    news."""
    if isinstance(context.get("exception"), (ConnectionResetError, BrokenPipeError)):
        return
    loop.default_exception_handler(context)


async def run(
    args,
    scratch: Path,
    seed: int,
    strategy: str,
    rate: float,
    target: float | None,
    step_s: float | None = None,
    on_result=None,
    hold: LoadHold | None = None,
) -> dict:
    """One training run to the target (or, for `none`, --max-steps steps). `step_s`, a normal step of the failure-free
    run, sets checkpoint-restart's interval under Young's rule. With `hold` (--keep-load), once it has its result it
    hands it to `on_result` and keeps training until `hold` is released; the result is what it was at the target."""
    asyncio.get_running_loop().set_exception_handler(quiet_killed_daemons)
    bench = Bench(args, scratch, seed, strategy)
    schedule = (
        failure_schedule(seed, rate, args.max_steps, args.steps_per_hour, args.failures) if strategy != "none" else {}
    )
    record = {
        "curve": [],
        "losses": [],
        "recoveries": [],
        "spikes": [],
        "normal_step_s": [],
        "eval_s": 0.0,
        "every": None,
        "retries": 0,
        "repeated_calls": 0,
    }
    timed_out = False
    result = None
    try:
        try:
            async with asyncio.timeout(args.run_timeout_s):
                await bench.start()
                started = time.perf_counter()
                await train(bench, args, strategy, schedule, target, record, started, rate, step_s)
        except (
            TimeoutError,
            RuntimeError,
        ) as exc:  # too slow, or a stage server that never came up: a missed target, said so
            timed_out = True
            print(f"seed {seed} rate {rate:.2f} {strategy}: run stopped: {type(exc).__name__}: {exc}", flush=True)
        result = run_result(bench, record, schedule, seed, strategy, rate, target, timed_out)
        if on_result is not None:
            on_result(result)
        if hold is not None:
            hold.mark_reached(seed, rate, strategy)
            if not timed_out:
                await keep_training(bench, hold, args.run_timeout_s, f"seed {seed} rate {rate:.2f} {strategy}")
    finally:
        if hold is not None:
            hold.mark_reached(seed, rate, strategy)  # ended, even by an error: nothing beside it waits for it any more
        await bench.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return result


async def keep_training(bench, hold: LoadHold, limit_s: float, name: str) -> None:
    """--keep-load: training steps (no failures, checkpoints or evaluation) until every run beside this one has
    reached its target or ended, so that they keep the load they ran under; at most `limit_s` (each of them stops
    itself at that limit too). A step that fails ends it: the row is already written."""
    steps = 0
    try:
        async with asyncio.timeout(limit_s):
            while not hold.released():
                await bench.driver.train_step()
                steps += 1
    except Exception as exc:  # noqa: BLE001 - the load it kept ends here; the figures were taken before
        print(f"{name}: stopped keeping the load after {steps} steps: {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"{name}: kept the load for {steps} steps after its target", flush=True)


class LoadHold:
    """--keep-load's signals between the runs side by side and their parent, as files in one folder (the runs may be
    in network namespaces of their own, not in mount namespaces): a run marks that it reached its target or ended;
    the parent releases them all once every run has."""

    RELEASED = "released"

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    @staticmethod
    def name(seed: int, rate: float, strategy: str) -> str:
        return f"{seed}-{rate:g}-{strategy}"

    def mark_reached(self, seed: int, rate: float, strategy: str) -> None:
        (self.folder / self.name(seed, rate, strategy)).touch()

    def reached(self, seed: int, rate: float, strategy: str) -> bool:
        return (self.folder / self.name(seed, rate, strategy)).exists()

    def release(self) -> None:
        (self.folder / self.RELEASED).touch()

    def released(self) -> bool:
        return (self.folder / self.RELEASED).exists()

    def release_when_settled(self, children: list[subprocess.Popen], runs: list[tuple[int, float, str]]) -> bool:
        """Release the runs once each has reached its target or its process has ended (True when it did)."""
        if all(child.poll() is not None or self.reached(*spec) for child, spec in zip(children, runs, strict=True)):
            self.release()
        return self.released()


def run_result(bench, record, schedule, seed, strategy, rate, target, timed_out) -> dict:
    """The run's row (less its key), as it stands now: lists are copied, so that steps taken after (--keep-load)
    change nothing in it."""
    uplink_mb = None
    if bench.uplinks is not None:
        uplink_mb = {host: round(sent / 1e6, 3) for host, sent in sorted(bench.uplinks.sent_bytes().items())}
    curve = list(record["curve"])
    reached = next((point for point in curve if target is not None and point["val_loss"] <= target), None)
    return {
        "seed": seed,
        "strategy": strategy,
        "rate": rate,
        "parameters": sum(p.numel() for p in bench.model.parameters()) if hasattr(bench, "model") else None,
        "curve": curve,
        "losses": list(record["losses"]),  # [driver step, training loss] of every step executed, replays included
        "failures": sum(len(v) for k, v in schedule.items() if k <= getattr(getattr(bench, "driver", None), "step", 0)),
        "steps_to_target": reached["executed"] if reached else None,
        "wall_s_to_target": reached["wall_s"] if reached else None,
        "eval_s": record["eval_s"],
        "retries": record["retries"],
        "repeated_calls": record["repeated_calls"],  # sent again to the same server after a broken stream (answered)
        "recovery_s": [r["seconds"] for r in record["recoveries"]],
        "recoveries": list(record["recoveries"]),
        "loss_spike": list(record["spikes"]),
        "normal_step_s": statistics.median(record["normal_step_s"]) if record["normal_step_s"] else None,
        "checkpoint_every": record["every"],
        # what the interval was priced at: the save, and with young-with-uploads the steps beside its uploads too
        "checkpoint_cost_s": record.get("checkpoint_cost_s"),
        # young-own-steps: the normal step it was priced against, the run's own
        "priced_step_s": record.get("priced_step_s"),
        "checkpoint_saves_s": list(bench.saves_s),
        "checkpoint_loads_s": list(bench.loads_s),
        "checkpoint_bytes": bench.checkpoint_bytes(),
        "checkpoint_io_s": bench.io_s,
        # uploads in the background: each checkpoint's (seconds), each save's wait for the last one's, those cut
        "checkpoint_uploads_s": list(bench.checkpoints.uploads_s),
        "checkpoint_upload_waits_s": list(bench.checkpoints.upload_waits_s),
        "checkpoint_uploads_dropped": bench.checkpoints.uploads_dropped,
        # --checkpoint-uplinks per-host: what each host sent over its uplink in the whole run (MB)
        "uplink_mb_by_host": uplink_mb,
        "timed_out": timed_out,
    }


YOUNG_RULES = ("young", "young-with-uploads", "young-own-steps")
# the rules that price the first checkpoint with what the steps beside its background uploads lost (cost_with_uploads)
PRICED_WITH_UPLOADS = ("young-with-uploads", "young-own-steps")
# young-own-steps: the normal steps a run takes (after its first) before its first priced checkpoint, whose median is
# the normal step it is priced against
OWN_STEPS = 3


def own_normal_step(normal_step_s: list[float]) -> float | None:
    """young-own-steps: the run's normal step, the median of its last OWN_STEPS normal steps once it has taken more
    than that (its first, which warms up, is left out); None before."""
    return statistics.median(normal_step_s[-OWN_STEPS:]) if len(normal_step_s) > OWN_STEPS else None


def checkpoint_every(args, first_save_s: float, step_s: float | None, rate: float) -> int:
    """--checkpoint-every: a number of steps, or one of YOUNG_RULES (Young's rule on the measured cost of the first
    checkpoint, `first_save_s`, and a normal step: the failure-free run's, or with young-own-steps this run's own)."""
    if args.checkpoint_every not in YOUNG_RULES:
        return int(args.checkpoint_every)
    if not step_s:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} needs the failure-free run's step time")
    return young_interval(first_save_s, step_s, rate, args.steps_per_hour)


async def train(bench, args, strategy, schedule, target, record, started, rate, step_s) -> None:
    """Wall seconds exclude validation (the same evaluation for every strategy, and a rollback's replayed steps would
    evaluate twice); checkpoint saves and loads, recoveries and replayed steps are all in them."""
    executed, fired, failed, last_loss = 0, set(), None, None
    normal_step_s = record["normal_step_s"]
    # young-with-uploads, young-own-steps: the steps beside the first checkpoint's uploads, until they end (None: not
    # pricing)
    beside_uploads: list[float] | None = None
    own_steps = args.checkpoint_every == "young-own-steps"
    if strategy == "checkpoint":
        await bench.save_checkpoint()  # the restore point before step 1
    while executed < args.max_steps * 3:
        step = bench.driver.step + 1
        # each scheduled failure happens once, even when a rollback replays its step
        if step in schedule and step not in fired:
            fired.add(step)
            failed = {
                "at": time.perf_counter(),
                "step": step,
                "stages": schedule[step],
                "methods": [],
                "fetched_bytes": [],
            }
            for stage in schedule[step]:
                if await bench.kill(stage):
                    failed["uploads_cut"] = True
                server = await bench.start_server(stage)
                await bench.wait_serving(stage)
                event = last_recovery(server)
                failed["methods"].append("checkpoint" if strategy == "checkpoint" else event.get("method", "unknown"))
                # what the new server read from live neighbours (here over loopback; between hosts, over their links)
                failed["fetched_bytes"].append(event.get("bytes_fetched", 0))
            if strategy == "checkpoint":
                failed["replayed"] = bench.driver.step - bench.checkpoints.step
                await bench.load_checkpoint(schedule[step])
                failed["load_s"] = bench.loads_s[-1]
            failed["to_serving_s"] = time.perf_counter() - failed["at"]
        row = await bench.driver.train_step()
        executed += 1
        record["losses"].append([bench.driver.step, row["loss"]])
        if beside_uploads is not None and failed is None:  # the first step after a failure is the recovery's
            beside_uploads.append(row["step_s"])
        # calls retried or failed under load: a step that retried may differ from the failure-free run in its last bits
        record["retries"] += row["retries"] + row["backward_failures"] + sum(row["hop_failures"].values())
        record["repeated_calls"] += sum(row["repeated_calls"].values())
        if failed is not None:
            failed.pop("at")
            failed["recovery_step_s"] = row["step_s"]
            failed["seconds"] = recovery_seconds(
                failed["to_serving_s"], row["step_s"], statistics.median(normal_step_s) if normal_step_s else 0.0
            )
            record["recoveries"].append(failed)
            if last_loss is not None:
                record["spikes"].append(row["loss"] - last_loss)
            failed = None
        else:
            normal_step_s.append(row["step_s"])
        last_loss = row["loss"]
        if beside_uploads is not None and (bench.checkpoints.pending is None or bench.checkpoints.pending.done()):
            # the first checkpoint's uploads ended (or a failure cut them: priced on the steps they had)
            record["checkpoint_cost_s"] = cost_with_uploads(bench.save_cost_s, beside_uploads, step_s or 0.0)
            record["every"] = checkpoint_every(args, record["checkpoint_cost_s"], step_s, rate)
            print(
                f"seed {bench.seed} rate {rate:.2f} checkpoint: a checkpoint costs {record['checkpoint_cost_s']:.2f}s "
                f"with the {len(beside_uploads)} steps beside its uploads; every {record['every']} steps",
                flush=True,
            )
            beside_uploads = None
        elif (
            strategy == "checkpoint"
            and record["every"] is None
            and "checkpoint_cost_s" not in record
            and (not own_steps or own_normal_step(normal_step_s) is not None)
        ):
            # The checkpoint after step 1 sets the interval: the one before it holds no AdamW moments yet (a third of
            # the bytes), this one is the size of every later one. With young-own-steps it comes after OWN_STEPS more
            # normal steps, and this run's own normal step prices it: the failure-free run's, taken at another load
            # (4.3 s alone against the run's median of 10.4 s, seed 0 at 16 %) gave 23 steps where that one gives 11.
            if own_steps:
                step_s = record["priced_step_s"] = own_normal_step(normal_step_s)
            await bench.save_checkpoint()
            record["checkpoint_cost_s"] = bench.save_cost_s
            if args.checkpoint_every in PRICED_WITH_UPLOADS and bench.checkpoints.background:
                beside_uploads = []  # priced once its uploads end; no checkpoint until then
            else:
                record["every"] = checkpoint_every(args, bench.save_cost_s, step_s, rate)
                print(
                    f"seed {bench.seed} rate {rate:.2f} checkpoint: a checkpoint costs {bench.save_cost_s:.2f}s for "
                    f"{bench.checkpoint_bytes() / 1e6:.1f} MB; every {record['every']} steps",
                    flush=True,
                )
        elif strategy == "checkpoint" and record["every"] and bench.driver.step % record["every"] == 0:
            await bench.save_checkpoint()
        if bench.driver.step % args.eval_every == 0:
            evaluated = time.perf_counter()
            val = await bench.driver.validation_loss()
            record["eval_s"] += time.perf_counter() - evaluated
            record["curve"].append(
                {
                    "step": bench.driver.step,
                    "executed": executed,
                    "wall_s": time.perf_counter() - started - record["eval_s"],
                    "val_loss": val,
                }
            )
            point = record["curve"][-1]
            print(
                f"  seed {bench.seed} rate {rate:.2f} {strategy}: step {point['step']} ({executed} executed) val loss "
                f"{val:.4f} at {point['wall_s']:.1f}s (target {target})",
                flush=True,
            )
            if target is not None and val <= target:
                break
        if bench.driver.step >= (args.max_steps if target is None else 2 * args.max_steps):
            break


def cost_with_uploads(save_s: float, steps_beside_uploads_s: list[float], normal_step_s: float) -> float:
    """What a checkpoint whose uploads run in the background costs the training: the save itself, plus what the steps
    taken while its uploads ran took beyond normal steps (where uploads share a host's uplink with the hidden states,
    those steps are slower)."""
    return save_s + max(0.0, sum(steps_beside_uploads_s) - len(steps_beside_uploads_s) * normal_step_s)


def recovery_seconds(to_serving_s: float, recovery_step_s: float, normal_step_s: float) -> float:
    """What a failure stalled training for: from the failure until its stage serves again (the replacement's start
    and weight transfer, a checkpoint's download and load), plus what the first step after it took beyond a normal
    step (the driver's failed hop, its wait for the new announcement, retries). That excess is taken as at least 0:
    on a loaded machine one step can run seconds faster than the median step, and subtracting the median from the
    whole span made recoveries of -7.5 s (benchmarks/notebook/2026-12-01-stage-recovery.md, 27M at 16 %)."""
    return to_serving_s + max(0.0, recovery_step_s - normal_step_s)


def last_recovery(server: StageServer) -> dict:
    """How a new server got its stage's weights (method: checkfree, checkfree_plus, random, ...; bytes_fetched), from
    its recovery log; {} if it wrote none."""
    log_file = server.state_dir / "recoveries.jsonl"
    lines = log_file.read_text().splitlines() if log_file.exists() else []
    return json.loads(lines[-1]) if lines else {}


def churn_schedule(seed: int, steps: int, failures: int) -> tuple[list[int], random.Random]:
    """Steps before which a server is killed (spread over the run, seeded), and the rng that picks victims and joiner
    delays."""
    rng = random.Random(f"churn:{seed}")
    return sorted(rng.sample(range(4, steps), failures)), rng


async def run_churn(args, scratch: Path, seed: int, strategy: str) -> dict:
    """Joiner churn: a server is killed (as kill -9) before each scheduled step, and a newcomer with `--stage auto`
    joins a random delay later (0 to 2 announce TTLs: often before the dead server's announcement has aged out);
    no spares, no replicas. Stalls are measured from the later of the kill and the newcomer's arrival (when a server
    is available) to the end of the first step after it. `strategy` checkpoint: every --checkpoint-every steps every
    server saves its stage (timed); after a failure, once the newcomer serves, every stage loads the last checkpoint
    and the driver goes back to its step (those steps count as lost)."""
    asyncio.get_running_loop().set_exception_handler(quiet_killed_daemons)
    bench = Bench(args, scratch, seed, strategy)
    await bench.start()
    if strategy == "checkpoint":
        await bench.save_checkpoint()
    rolled_back, timed_out = 0, False
    kills, rng = churn_schedule(seed, args.churn_steps, args.churn_failures)
    ttl = bench.config.pipeline.announce_ttl_s
    joiners, stalls, methods, step_s, normal_step_s = [], [], [], [], []
    next_key = STAGES
    fired: set[int] = set()
    pending: dict | None = None  # the failure being recovered: kill time, the newcomer's arrival time

    async def join_later(delay: float, record: dict, key: int) -> None:
        await asyncio.sleep(delay)
        record["available"] = time.perf_counter()
        server = await bench.start_server("auto", key=key)
        await bench.wait_serving(key)
        record["server"] = server

    started = time.perf_counter()
    try:
        async with asyncio.timeout(args.run_timeout_s):
            while bench.driver.step < args.churn_steps:
                due = bench.driver.step + 1 in kills and bench.driver.step + 1 not in fired and pending is None
                if due:
                    fired.add(bench.driver.step + 1)  # once, even when a rollback replays its step
                victim_stage = rng.randrange(STAGES) if due else None
                victim = next(
                    (
                        k
                        for k, (server, _, _) in bench.servers.items()
                        if server.index == victim_stage and server.state == "serving"
                    ),
                    None,
                )
                if victim is not None:
                    await bench.kill(victim)
                    pending = {"stage": victim_stage, "killed": time.perf_counter(), "delay": rng.uniform(0, 2 * ttl)}
                    joiners.append(asyncio.create_task(join_later(pending["delay"], pending, next_key)))
                    next_key += 1
                    if strategy == "checkpoint":  # the stage comes back from the checkpoint, with every other stage
                        await joiners[-1]
                        rolled_back += bench.driver.step - bench.checkpoints.step
                        await bench.load_checkpoint()
                row = await bench.driver.train_step()
                done = time.perf_counter()
                step_s.append(row["step_s"])
                if pending is not None and "available" in pending:
                    stalls.append(
                        {
                            "stage": pending["stage"],
                            "joiner_delay_s": pending["delay"],
                            "stall_s": done - max(pending["killed"], pending["available"]),
                            "outage_s": done - pending["killed"],
                        }
                    )
                    pending = None
                elif pending is None:
                    normal_step_s.append(row["step_s"])
                if strategy == "checkpoint" and bench.driver.step % int(args.checkpoint_every) == 0:
                    await bench.save_checkpoint()
        final_val = await bench.driver.validation_loss()
    except (
        TimeoutError,
        RuntimeError,
    ) as exc:  # too slow, or a newcomer that never came up: said so, and counted as not finished
        final_val, timed_out = None, True
        print(f"seed {seed} churn {strategy}: run stopped: {type(exc).__name__}: {exc}", flush=True)
    finally:
        await asyncio.gather(*joiners, return_exceptions=True)
        for server, _, _ in bench.servers.values():
            event = (
                [json.loads(line) for line in (server.state_dir / "recoveries.jsonl").read_text().splitlines()]
                if (server.state_dir / "recoveries.jsonl").exists()
                else []
            )
            methods += [(e["method"], e["stage"], e["cause"]) for e in event if e["method"] != "initial"]
        await bench.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    median = statistics.median(normal_step_s) if normal_step_s else 0.0
    # Time lost to a failure: from the kill to the end of the first step after it, less a normal step (the same for
    # both strategies, whether the driver waited inside its step or the checkpoint was loaded before it).
    lost = (sum(max(0.0, s["outage_s"] - median) for s in stalls) / median if median else 0.0) + rolled_back
    executed = len(step_s)
    return {
        "seed": seed,
        "strategy": strategy,
        "steps": bench.driver.step,
        "executed": executed,
        "wall_s": time.perf_counter() - started,
        "failures": len(stalls),
        "announce_ttl_s": ttl,
        "longest_stall_s": max((s["stall_s"] for s in stalls), default=0.0),
        "stalls": stalls,
        "steps_lost_fraction": lost / (executed + lost - rolled_back) if executed else None,
        "rolled_back_steps": rolled_back,
        "val_loss": final_val,
        "checkpoint_io_s": bench.io_s,
        "timed_out": timed_out,
        "recoveries": methods,
    }


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--only-seeds", type=int, nargs="+", help="run these seeds of the --seeds (e.g. those whose failure schedule "
        "has failures at the rate): the report still reads every row of the configuration",
    )  # fmt: skip
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.10, 0.16])
    parser.add_argument("--strategies", nargs="+", default=["checkfree", "checkpoint", "random"])
    parser.add_argument(
        "--max-steps",
        type=int,
        default=200,
        help="steps of the failure-free run (runs with failures may take up to twice as many)",
    )
    parser.add_argument(
        "--steps-per-hour", type=int, default=25, help="how many steps stand for one hour of the paper's failure rates"
    )
    parser.add_argument(
        "--checkpoint-every",
        default="young",
        help="steps between checkpoint-restart's checkpoints, or `young`: sqrt(2 x checkpoint cost x the pipeline's "
        "MTBF), from the first checkpoint's measured cost and the failure-free run's step (churn mode: a number), or "
        "`young-with-uploads` (uploads in the background): the same rule, the cost being the save plus what the steps "
        "beside the first checkpoint's uploads took beyond normal steps, no checkpoint until those uploads end, or "
        f"`young-own-steps`: the same, priced after {OWN_STEPS} normal steps of the run itself against their median "
        "(the failure-free run's step was taken at another load)",
    )
    parser.add_argument(
        "--checkpoint-store-mbit", type=float, default=None, help="checkpoint-restart uploads every checkpoint to a "
        "store on another host (a network namespace) over a link of this rate, and a replacement server downloads "
        "its stage's from there (root); default: checkpoints stay on this host's disk",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-uplinks", choices=["shared", "per-stage", "per-host"], default="shared", help="with a store: "
        "`shared`, one link of the rate to the store that the stages' uploads cross one after the other; `per-stage`, "
        "each stage's host its own uplink of the rate, so the stages upload at once (four home hosts and a store that "
        "is not the bottleneck); `per-host`, as per-stage, and every host's uplink (the driver's, each stage "
        "server's, each store's) carries all it sends: hidden states, gradients and CheckFree's reads share it with "
        "the uploads, in every strategy's runs and the failure-free ones (each run in a network namespace of its own)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-uploads", choices=["blocking", "background"], default="blocking", help="with a store: "
        "`blocking`, training waits until every stage's upload is done; `background`, training goes on once every "
        "stage has its checkpoint on its own disk, and the checkpoint is the restore point once its uploads end",
    )  # fmt: skip
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--target-fraction",
        type=float,
        default=0.8,
        help="target = the failure-free run's validation loss at this fraction of --max-steps",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of every run, after the "
        "benchmark's own (e.g. tasks.datasets=[...]: the corpus the model trains on); part of the runs' key",
    )  # fmt: skip
    parser.add_argument("--size", choices=list(SIZES), help="a model size of pipeline_throughput (else --hidden)")
    parser.add_argument("--hidden", type=int, default=64, help="8 layers of this width, MLP twice as wide")
    parser.add_argument(
        "--model", help="a pretrained model instead of the default architecture (model.name_or_path: a preset such as "
        "smollm2-135m-instruct, a .gguf file or an HF directory), cut into the 4 stages; use a pretrained model's --lr",
    )  # fmt: skip
    parser.add_argument(
        "--failures", nargs="+", metavar="STEP:STAGE", help="exactly these failures (before driver step STEP, stage "
        "STAGE's only server), the same for every seed and strategy, instead of the seeded schedule of --rates (which "
        "then only prices Young's rule)",
    )  # fmt: skip
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument(
        "--plain-baselines",
        action="store_true",
        help="checkpoint-restart and random re-initialisation train without CheckFree+ (pipeline.checkfree_plus: no "
        "swapped stage order on odd micro-batches, no embedding copies on the neighbours), as a deployment of either "
        "would; CheckFree, and the failure-free run whose loss is the target, keep it. Default: every run with it",
    )
    parser.add_argument(
        "--pretrained-steps",
        type=int,
        default=0,
        help="every run of a seed starts from its model after this many steps of the same LM objective in one process "
        "(on sequences the runs never see; made once, kept in the model cache): failures then hit a pipeline further "
        "into training, where a fresh stage has more to relearn; default: from scratch, as the paper",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--run-timeout-s",
        type=float,
        default=600.0,
        help="a run still short of the target after this long counts as missed",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="joiner churn instead: kills on a seeded schedule, newcomers with --stage auto, no spares",
    )
    parser.add_argument("--churn-steps", type=int, default=60, help="churn: driver steps per seed")
    parser.add_argument("--churn-failures", type=int, default=6, help="churn: servers killed per seed (one at a time)")
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="each run's row is appended here as it ends; runs already there "
        "with the same configuration are not run again",
    )
    parser.add_argument("--side-by-side", action="store_true", help="the strategies of one (rate, seed) in parallel")
    parser.add_argument(
        "--keep-load",
        action="store_true",
        help="side by side: a run that reached its target keeps training until every run beside it has reached its "
        "own or ended, so that the slower ones keep the load they started under",
    )
    parser.add_argument("--report", action="store_true", help="only the figures from --results, for this configuration")
    parser.add_argument("--hold-dir", type=Path, help=argparse.SUPPRESS)  # --keep-load: the parent's LoadHold folder
    parser.add_argument("--one", nargs=3, metavar=("SEED", "RATE", "STRATEGY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.churn and args.checkpoint_store_mbit:
        parser.error("--checkpoint-store-mbit is for the failure-rate mode, not --churn")
    if uplink_per_host(args) and args.one and not in_own_namespace():
        parser.error("--checkpoint-uplinks per-host: a run goes in a network namespace of its own (main starts it)")
    if args.checkpoint_uplinks != "shared" and not args.checkpoint_store_mbit:
        parser.error("--checkpoint-uplinks needs --checkpoint-store-mbit (without a store, checkpoints stay on disk)")
    if args.checkpoint_every == "young-with-uploads" and args.checkpoint_uploads != "background":
        parser.error("--checkpoint-every young-with-uploads prices uploads in the background (--checkpoint-uploads)")
    if args.checkpoint_uploads != "blocking" and not args.checkpoint_store_mbit:
        parser.error("--checkpoint-uploads needs --checkpoint-store-mbit (without a store nothing is uploaded)")
    if args.keep_load and not args.side_by_side and not args.one:
        parser.error("--keep-load keeps the load of runs side by side (--side-by-side)")
    if args.model and (args.size or args.pretrained_steps):
        parser.error("--model brings its own shape and weights: not with --size or --pretrained-steps")
    try:
        fixed_failures(args.failures or [])
    except ValueError as exc:
        parser.error(str(exc))
    if args.churn and not args.checkpoint_every.isdigit():
        parser.error("--churn needs --checkpoint-every as a number of steps")
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    os.environ.setdefault("SWARM_NODE_CACHE", str(Path(tempfile.gettempdir()) / "swarm-node-bench-cache"))
    if args.churn:
        churn = []
        for seed in range(args.seeds):
            for strategy in [s for s in args.strategies if s in ("checkfree", "checkpoint")]:
                result = asyncio.run(run_churn(args, Path(tempfile.mkdtemp(prefix="stage-churn-")), seed, strategy))
                churn.append(result)
                print(
                    f"seed {seed} churn {strategy:10s}: {result['steps']} steps ({result['executed']} executed) in "
                    f"{result['wall_s']:.1f}s, "
                    f"{result['failures']} failures, longest stall {result['longest_stall_s']:.2f}s (ttl "
                    f"{result['announce_ttl_s']}s), "
                    f"steps lost {result['steps_lost_fraction']:.3f}, val loss {result['val_loss']}, stalls "
                    f"{[round(s['stall_s'], 2) for s in result['stalls']]}, "
                    f"recoveries {result['recoveries']}",
                    flush=True,
                )
        keys = (
            "seed",
            "strategy",
            "longest_stall_s",
            "announce_ttl_s",
            "steps_lost_fraction",
            "steps",
            "executed",
            "wall_s",
            "failures",
            "val_loss",
            "checkpoint_io_s",
            "timed_out",
        )
        print(
            json.dumps(
                {
                    "benchmark": "stage_recovery",
                    "seeds": args.seeds,
                    "churn_steps": args.churn_steps,
                    "churn_failures": args.churn_failures,
                    "checkpoint_every": args.checkpoint_every,
                    "joiner_churn": [{k: r[k] for k in keys} for r in churn],
                }
            )
        )
        return
    if args.report:
        print_report(report(read_rows(args.results, config_key(args)), args.rates, args.strategies))
        return
    if args.one:
        seed, rate, strategy = int(args.one[0]), float(args.one[1]), args.one[2]
        run_one(args, seed, rate, strategy)
        return
    seeds = [seed for seed in range(args.seeds) if args.only_seeds is None or seed in args.only_seeds]
    if args.pretrained_steps:  # before any run: runs side by side all read the same file
        for seed in seeds:
            pretrain(args, seed)
    baselines = [seed for seed in seeds if none_row(read_rows(args.results, config_key(args)), seed) is None]
    launch(args, [(seed, 0.0, "none") for seed in baselines])
    for rate in args.rates:  # in the order given: the one that matters most first, in case time runs out
        for seed in seeds:
            done = {(r["seed"], r["rate"], r["strategy"]) for r in read_rows(args.results, config_key(args))}
            launch(args, [(seed, rate, strategy) for strategy in args.strategies if (seed, rate, strategy) not in done])
    print_report(report(read_rows(args.results, config_key(args)), args.rates, args.strategies))


def uplink_per_host(args) -> bool:
    return bool(args.checkpoint_store_mbit) and args.checkpoint_uplinks == "per-host"


def launch(args, runs: list[tuple[int, float, str]]) -> None:
    """The runs, each (seed, rate, strategy): with --side-by-side all at once, each in its own process (they share
    the machine's load); else one after the other, in this process, or in processes of their own where each must
    be in a network namespace of its own (per-host uplinks)."""
    if args.side_by_side:
        run_children(args, runs)
    elif uplink_per_host(args):
        for spec in runs:
            run_children(args, [spec])
    else:
        for seed, rate, strategy in runs:
            run_one(args, seed, rate, strategy)


def config_key(args) -> dict:
    """What makes two runs comparable: a report mixes only rows with the same key."""
    own_uplinks = bool(args.checkpoint_store_mbit) and args.checkpoint_uplinks != "shared"  # per stage or host
    background_uploads = bool(args.checkpoint_store_mbit) and args.checkpoint_uploads == "background"
    return {
        # rows from before --model and --failures existed have neither: absent means the default and the seeded rates
        **({"model": args.model} if args.model else {"shape": list(model_shape(args))}),
        **({"failures": list(args.failures)} if args.failures else {}),
        "max_steps": args.max_steps,
        "steps_per_hour": args.steps_per_hour,
        "checkpoint_every": str(args.checkpoint_every),
        **({"checkpoint_store_mbit": args.checkpoint_store_mbit} if args.checkpoint_store_mbit else {}),
        # only where it is not the first setting's: the rows from before it keep their key
        **({"checkpoint_uplinks": args.checkpoint_uplinks} if own_uplinks else {}),
        **({"checkpoint_uploads": args.checkpoint_uploads} if background_uploads else {}),
        **({"keep_load": True} if args.keep_load else {}),
        **({"pretrained_steps": args.pretrained_steps} if args.pretrained_steps else {}),
        **({"plain_baselines": True} if args.plain_baselines else {}),
        "target_fraction": args.target_fraction,
        "eval_every": args.eval_every,
        "micro_batch": args.micro_batch,
        "lr": args.lr,
        **({"settings": list(args.set)} if args.set else {}),
    }


def read_rows(path: Path, key: dict) -> list[dict]:
    if not Path(path).exists():
        return []
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        row
        for row in rows
        if row.get("key") == key
        or (row["strategy"] == "none" and baseline_key(row.get("key", {})) == baseline_key(key))
    ]


def baseline_key(key: dict) -> dict:
    """A failure-free run does not checkpoint: it serves every checkpoint rule of otherwise the same settings. Where
    every host has an uplink of the rate (per-host), the rate shapes its steps too: it serves only that rate's. Its
    target loss does not depend on the load it ran at, so it serves runs with --keep-load or without (its normal step
    does, which is why young-own-steps prices against the run's own)."""
    kept = ("checkpoint_store_mbit", "checkpoint_uplinks") if key.get("checkpoint_uplinks") == "per-host" else ()
    dropped = (
        "checkpoint_every",
        "checkpoint_store_mbit",
        "checkpoint_uplinks",
        "checkpoint_uploads",
        "keep_load",
        "plain_baselines",  # the failure-free run, CheckFree's config, sets the target loss of both
    )
    return {name: value for name, value in key.items() if name in kept or name not in dropped}


def none_row(rows: list[dict], seed: int) -> dict | None:
    return next((r for r in rows if r["strategy"] == "none" and r["seed"] == seed and r.get("target")), None)


def run_one(args, seed: int, rate: float, strategy: str) -> None:
    """One run; its row is appended to --results as soon as it has its result (with --keep-load, before it keeps
    training). A failure-free run (`none`) sets its seed's target and normal step time, which the runs with failures
    read back from the file."""
    key = config_key(args)
    scratch = Path(tempfile.mkdtemp(prefix="stage-bench-"))
    hold = LoadHold(args.hold_dir) if args.hold_dir else None
    base = None
    if strategy != "none":
        base = none_row(read_rows(args.results, key), seed)
        if base is None:
            raise SystemExit(f"no failure-free run of seed {seed} in {args.results} for this configuration")

    def write_row(result: dict) -> None:
        if strategy == "none":
            target_step = int(args.max_steps * args.target_fraction)
            target = next((p["val_loss"] for p in result["curve"] if p["step"] >= target_step), None)
            reached = next((p for p in result["curve"] if target is not None and p["val_loss"] <= target), None)
            result.update(
                target=target,
                steps_to_target=reached and reached["executed"],
                wall_s_to_target=reached and reached["wall_s"],
            )
        else:
            result["target"] = base["target"]
        row = {"key": key, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "load_average": os.getloadavg()}
        row.update(result)
        append_json_line(args.results, row)
        print(describe(row), flush=True)

    target, step_s = (base["target"], base["normal_step_s"]) if base else (None, None)
    if args.pretrained_steps:
        pretrain(args, seed)  # a run started alone (--one); main has already made it otherwise
    asyncio.run(run(args, scratch, seed, strategy, rate if base else 0.0, target, step_s, write_row, hold))


def describe(row: dict) -> str:
    wall = row["wall_s_to_target"]
    text = (
        f"seed {row['seed']} rate {row['rate']:.2f} {row['strategy']:10s}: failures {row['failures']}, steps "
        f"{row['steps_to_target']}, wall {wall and round(wall, 1)}s, recovery "
        f"{[(r['methods'], round(r['seconds'], 2)) for r in row['recoveries']]}, "
        f"spike {[round(s, 3) for s in row['loss_spike']]}, load {[round(x, 1) for x in row['load_average']]}"
    )
    if row["strategy"] == "checkpoint":
        text += (
            f", checkpoint every {row['checkpoint_every']} steps, {len(row['checkpoint_saves_s'])} saves "
            f"{sum(row['checkpoint_saves_s']):.2f}s, loads {[round(x, 2) for x in row['checkpoint_loads_s']]}, "
            f"{row['checkpoint_bytes'] / 1e6:.1f} MB"
        )
    if row["strategy"] == "none":
        text += f", target val loss {row['target']}, normal step {row['normal_step_s']:.3f}s"
    text += f", calls retried or failed {row.get('retries')}, repeated {row.get('repeated_calls')}"
    return text + (", TIMED OUT" if row["timed_out"] else "")


def run_children(args, runs: list[tuple[int, float, str]]) -> None:
    """Each run in its own process, all at once, and wait for them all; a child still running well past
    --run-timeout-s (it stops itself at that limit) is stopped here."""
    passthrough = [a for a in sys.argv[1:] if a != "--side-by-side"]
    namespaces: list[RunNamespace] = []
    children = []
    hold = LoadHold(tempfile.mkdtemp(prefix="stage-hold-")) if args.keep_load else None
    try:
        for seed, rate, strategy in runs:
            command = [sys.executable, str(Path(__file__).resolve()), *passthrough, "--one", str(seed), str(rate)]
            command.append(strategy)
            if hold is not None:
                command += ["--hold-dir", str(hold.folder)]
            if uplink_per_host(args):  # `ip netns exec` execs the run: the child is the run's process itself
                namespaces.append(RunNamespace())
                command = namespaces[-1].command(command)
            children.append(subprocess.Popen(command))
        deadline = time.monotonic() + args.run_timeout_s + CHILD_GRACE_S
        while hold is not None and not hold.release_when_settled(children, runs) and time.monotonic() < deadline:
            time.sleep(HOLD_POLL_S)
        for child, spec in zip(children, runs, strict=True):
            try:
                child.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"run {spec} still going {CHILD_GRACE_S:.0f}s past its limit: stopped, no row", flush=True)
                stop_child(child)
            if child.returncode != 0:
                print(f"run {spec} ended with exit status {child.returncode}", flush=True)
    finally:
        for child in children:
            if child.poll() is None:
                stop_child(child)
        for namespace in namespaces:
            namespace.close()
        if hold is not None:
            shutil.rmtree(hold.folder, ignore_errors=True)


def stop_child(child: subprocess.Popen) -> None:
    """Interrupt a run (its servers and p2p daemons shut down as after Ctrl-C); if it is still there 30 s later, kill
    it and what it started (its p2p daemons) by process id."""
    descendants = set(psutil.Process(child.pid).children(recursive=True))
    child.send_signal(signal.SIGINT)
    try:
        child.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(psutil.NoSuchProcess):
            descendants |= set(psutil.Process(child.pid).children(recursive=True))
        child.kill()
        child.wait()
    for process in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def same_rate(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def runs_of(rows: list[dict], strategy: str, rate: float | None = None) -> list[dict]:
    """The rows of `strategy` (at `rate`, where one is given)."""
    return [r for r in rows if r["strategy"] == strategy and (rate is None or same_rate(r["rate"], rate))]


def stage_kind(stages: list[int]) -> str:
    """`end` for a failure that lost the first or the last stage (the embedding or the head with its layers), else
    `middle`: the two cost random re-initialisation very differently."""
    return "end" if any(stage in (0, STAGES - 1) for stage in stages) else "middle"


def spread(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def report(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """The figures of issue #37 from the rows of --results: per strategy and rate, the mean over seeds (with min, max
    and how many seeds reached the target) of steps and wall seconds to the target; checkpoint-restart's wall seconds
    over CheckFree's per rate (of the means, and per seed); recovery seconds by how the stage came back; what a
    checkpoint cost."""

    # the rates asked for only (and the failure-free runs): recoveries, spikes and checkpoint costs are read per report
    rows = [r for r in rows if r["strategy"] == "none" or any(same_rate(r["rate"], rate) for rate in rates)]

    def rows_of(strategy: str, rate: float | None = None) -> list[dict]:
        return runs_of(rows, strategy, rate)

    steps: dict[str, dict] = {"none": {"0.00": spread([r["steps_to_target"] for r in rows_of("none")])}}
    wall: dict[str, dict] = {"none": {"0.00": spread([r["wall_s_to_target"] for r in rows_of("none")])}}
    failures: dict[str, dict] = {}
    end_failures: dict[str, dict] = {}
    for strategy in strategies:
        steps[strategy], wall[strategy], failures[strategy], end_failures[strategy] = {}, {}, {}, {}
        for rate in rates:
            runs = sorted(rows_of(strategy, rate), key=lambda r: r["seed"])
            steps[strategy][f"{rate:.2f}"] = spread([r["steps_to_target"] for r in runs])
            wall[strategy][f"{rate:.2f}"] = spread([r["wall_s_to_target"] for r in runs])
            failures[strategy][f"{rate:.2f}"] = [r["failures"] for r in runs]
            end_failures[strategy][f"{rate:.2f}"] = [
                sum(stage_kind(f["stages"]) == "end" for f in r["recoveries"]) for r in runs
            ]
    speedup, speedup_by_seed, steps_ratio = {}, {}, {}
    for rate in rates:
        name = f"{rate:.2f}"
        pairs = checkfree_checkpoint_pairs(rows, rate)
        speedup_by_seed[name] = {
            str(ours["seed"]): theirs["wall_s_to_target"] / ours["wall_s_to_target"] for ours, theirs in pairs
        }
        speedup[name] = paired_ratio_of_means(pairs, "wall_s_to_target")
        steps_ratio[name] = paired_ratio_of_means(pairs, "steps_to_target")
    by_method: dict[str, list[float]] = {}
    to_serving: dict[str, list[float]] = {}
    for row in rows:
        for recovery in row.get("recoveries", []):
            for method in recovery["methods"]:
                by_method.setdefault(method, []).append(recovery["seconds"])
                if "to_serving_s" in recovery:
                    to_serving.setdefault(method, []).append(recovery["to_serving_s"])
    baselines = [r for r in rows_of("none") if r.get("target") is not None]
    # validation loss at the step where the failure-free runs took their target: a measure that does not jump by a
    # whole evaluation interval when a curve on its plateau misses the target by a hair
    target_steps = [next((p["step"] for p in r["curve"] if p["val_loss"] <= r["target"]), None) for r in baselines]
    target_step = max((s for s in target_steps if s is not None), default=None)

    def val_at(run: dict) -> float | None:
        # the last evaluation at that step (a rollback evaluates a step again), else the run stopped before it
        return next((p["val_loss"] for p in reversed(run.get("curve", [])) if p["step"] == target_step), None)

    val_loss_at = {
        strategy: {f"{rate:.2f}": spread([val_at(r) for r in rows_of(strategy, rate)]) for rate in rates}
        for strategy in strategies
    }
    equal_wall, equal_wall_s, equal_wall_ranks, not_evaluated = val_loss_at_equal_wall_clock(rows, rates, strategies)
    checkpoints = rows_of("checkpoint")
    saves = [s for r in checkpoints for s in r["checkpoint_saves_s"]]
    loads = [s for r in checkpoints for s in r["checkpoint_loads_s"]]
    wall_means = {f"{rate:.2f}": common_seed_means(rows, rate, strategies) for rate in rates}
    wall_means_missed_counted = {
        f"{rate:.2f}": common_seed_means(rows, rate, strategies, missed_at_last_evaluation=True) for rate in rates
    }
    return {
        "benchmark": "stage_recovery",
        "parameters": next((r.get("parameters") for r in rows if r.get("parameters")), None),
        "key": next((r["key"] for r in rows if r["strategy"] != "none"), rows[0]["key"] if rows else None),
        "steps_by_strategy_and_rate": steps,
        "wall_s_by_strategy_and_rate": wall,
        "wallclock_speedup_vs_checkpoint_by_rate": speedup,
        "wallclock_speedup_vs_checkpoint_by_rate_and_seed": speedup_by_seed,
        "steps_ratio_checkpoint_vs_checkfree_by_rate": steps_ratio,
        "ordering_by_wall_s": {name: sorted(means, key=means.get) for name, means in wall_means.items()},
        # over every seed, a run that missed the target at its last evaluation: its mean a lower bound
        "wall_s_missed_counted_by_rate": wall_means_missed_counted,
        "ordering_by_wall_s_missed_counted": {
            name: sorted(means, key=means.get) for name, means in wall_means_missed_counted.items()
        },
        "val_loss_at_step": target_step,
        "val_loss_at_step_by_strategy_and_rate": val_loss_at,
        # each seed's runs compared at the wall clock where the first of them reached the target
        "val_loss_at_equal_wall_s_by_strategy_and_rate": equal_wall,
        "equal_wall_s_by_rate_and_seed": equal_wall_s,
        "mean_rank_at_equal_wall_s_by_rate": equal_wall_ranks,
        "ordering_by_rank_at_equal_wall_s": {name: sorted(r, key=r.get) for name, r in equal_wall_ranks.items()},
        "not_evaluated_by_equal_wall_s": not_evaluated,
        "failures_by_strategy_and_rate": failures,
        # of those, the failures that lost the first or the last stage (by seed, as above)
        "end_stage_failures_by_strategy_and_rate": end_failures,
        "recovery_s_by_method": {m: spread(v) for m, v in sorted(by_method.items())},
        # the part of a recovery before the first step: the replacement's start and weight transfer (rows since
        # 2026-11-28)
        "to_serving_s_by_method": {m: spread(v) for m, v in sorted(to_serving.items())},
        # training loss of the first step after a failure less that of the step before it
        "loss_spike_by_strategy": {
            s: spread([x for r in rows_of(s) for x in r.get("loss_spike", [])]) for s in strategies
        },
        "loss_spike_by_strategy_and_stage_kind": {
            s: {
                kind: spread(
                    [
                        spike
                        for r in rows_of(s)
                        for f, spike in zip(r["recoveries"], r.get("loss_spike", []))
                        if stage_kind(f["stages"]) == kind
                    ]
                )
                for kind in ("end", "middle")
            }
            for s in strategies
        },
        "checkpoint_save_s": spread(saves),
        "checkpoint_load_s": spread(loads),
        "checkpoint_bytes": max((r["checkpoint_bytes"] for r in checkpoints), default=0),
        # what a rollback threw away, and the share of checkpoint-restart's wall clock its saves and loads took
        "checkpoint_replayed_steps": spread([f["replayed"] for r in checkpoints for f in r["recoveries"]]),
        "checkpoint_io_share": spread(
            [r["checkpoint_io_s"] / r["wall_s_to_target"] for r in checkpoints if r["wall_s_to_target"]]
        ),
        "checkpoint_every_by_rate": {
            f"{rate:.2f}": sorted({r["checkpoint_every"] for r in rows_of("checkpoint", rate)}) for rate in rates
        },
        # uploads in the background (empty otherwise): how long a checkpoint took to become the restore point, what
        # saves waited for the uploads before them, and the failures that cut uploads still going
        "checkpoint_upload_s": spread([s for r in checkpoints for s in r.get("checkpoint_uploads_s", [])]),
        "checkpoint_upload_wait_s": spread([s for r in checkpoints for s in r.get("checkpoint_upload_waits_s", [])]),
        "checkpoint_failures_that_cut_uploads": [
            sum(bool(f.get("uploads_cut")) for f in r["recoveries"]) for r in checkpoints
        ],
        "missed_target": sorted(
            f"{r['strategy']}@{r['rate']:.2f} seed {r['seed']}" for r in rows if r["steps_to_target"] is None
        ),
        # a step without a failure in it (each run's median): what uploads in the background cost the steps beside them
        "normal_step_s_by_strategy_and_rate": {
            strategy: {
                f"{rate:.2f}": spread([r.get("normal_step_s") for r in rows_of(strategy, rate)]) for rate in rates
            }
            for strategy in strategies
        },
        **wall_s_split(rows, rates, strategies),
        **uplink_traffic(rows, rates, strategies),
        **neighbour_fetch_over_links(rows, rates, strategies),
    }


def uplink_traffic(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """Per-host uplinks (rows with `uplink_mb_by_host`): what a stage's host sent over its uplink per step executed,
    validation included (the mean over the four stage hosts; over seeds: spread), and the driver's."""
    shaped = [r for r in rows if r.get("uplink_mb_by_host")]
    if not shaped:
        return {}

    def per_step(row: dict, hosts: list[str]) -> float | None:
        executed = row["curve"][-1]["executed"] if row.get("curve") else 0
        sent = [row["uplink_mb_by_host"].get(host) for host in hosts]
        return statistics.mean(sent) / executed if executed and None not in sent else None

    stage_hosts = [f"stage-{index}" for index in range(STAGES)]
    by_strategy = {"none": {"0.00": runs_of(shaped, "none")}} | {
        strategy: {f"{rate:.2f}": runs_of(shaped, strategy, rate) for rate in rates} for strategy in strategies
    }
    return {
        "uplink_mb_per_step_stage_host_by_strategy_and_rate": {
            strategy: {rate: spread([per_step(r, stage_hosts) for r in runs]) for rate, runs in by_rate.items()}
            for strategy, by_rate in by_strategy.items()
        },
        "uplink_mb_per_step_driver_by_strategy_and_rate": {
            strategy: {rate: spread([per_step(r, ["driver"]) for r in runs]) for rate, runs in by_rate.items()}
            for strategy, by_rate in by_strategy.items()
        },
    }


WALL_PARTS = ("steps", "replayed_steps", "recoveries", "saves", "rest")  # replayed_steps: a part of steps


def wall_s_split(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """Where each run's wall seconds to the target went (spread over seeds, per strategy and rate): its steps executed
    at its own normal (median) step, and of those the steps a rollback replayed; its recoveries (each the time to a
    serving stage and what the next step took beyond a normal one); its checkpoint saves (what they blocked); and the
    rest (steps slower or faster than the run's median as the load moved, the first step's warm-up). A baseline is
    second or third by what it pays on every step (uploads beside the steps, a slower median) or per failure (a
    recovery, replayed steps, or the extra steps a loss spike costs, which show as more steps executed). Also the
    order by steps executed alone: the paper's account, where saves, loads and recoveries cost nothing. Both over the
    seeds where every strategy reached the target (and, for the split, recorded its normal step), as the order by wall
    seconds is."""

    def timed(run: dict) -> bool:
        return bool(run["wall_s_to_target"]) and run.get("normal_step_s") is not None

    split: dict[str, dict] = {s: {} for s in strategies}
    ordering = {}
    for rate in rates:
        steps_means = common_seed_means(rows, rate, strategies, "steps_to_target")
        ordering[f"{rate:.2f}"] = sorted(steps_means, key=steps_means.get)
        common = set.intersection(*({r["seed"] for r in runs_of(rows, s, rate) if timed(r)} for s in strategies))
        for strategy in strategies:
            parts: dict[str, list[float]] = {name: [] for name in WALL_PARTS}
            for run in runs_of(rows, strategy, rate):
                if run["seed"] not in common or not timed(run):
                    continue
                steps = run["steps_to_target"] * run["normal_step_s"]
                replayed = sum(f.get("replayed", 0) for f in run["recoveries"]) * run["normal_step_s"]
                recoveries = sum(f["seconds"] for f in run["recoveries"])
                saves = sum(run.get("checkpoint_saves_s", []))
                for name, value in (
                    ("steps", steps),
                    ("replayed_steps", replayed),
                    ("recoveries", recoveries),
                    ("saves", saves),
                    ("rest", run["wall_s_to_target"] - steps - recoveries - saves),
                ):
                    parts[name].append(value)
            split[strategy][f"{rate:.2f}"] = {name: spread(values) for name, values in parts.items()}
    return {"wall_s_split_by_strategy_and_rate": split, "ordering_by_steps": ordering}


def common_seed_means(
    rows: list[dict],
    rate: float,
    strategies: list[str],
    key: str = "wall_s_to_target",
    added_s: dict[tuple[str, int], float] | None = None,
    missed_at_last_evaluation: bool = False,
) -> dict[str, float]:
    """Each strategy's mean `key` (wall seconds or steps to the target) at `rate`, over the seeds where every strategy
    reached the target (so that each mean is of the same seeds); `added_s` {(strategy, seed): s} is added to those
    runs first. With `missed_at_last_evaluation`, over every seed that each strategy ran: a run that missed the target
    counts what it had spent at its last evaluation (`executed` for steps), which is less than it would have needed,
    so its strategy's mean is a lower bound (leaving such a run out favours it: it was the slowest of its seed)."""
    added_s = added_s or {}
    spent = {"wall_s_to_target": "wall_s", "steps_to_target": "executed"}[key]

    def value(run: dict) -> float | None:
        if run[key]:
            return run[key]
        if missed_at_last_evaluation and run.get("curve"):
            return run["curve"][-1][spent]
        return None

    reached = {
        s: {
            r["seed"]: value(r) + added_s.get((s, r["seed"]), 0.0)
            for r in runs_of(rows, s, rate)
            if value(r) is not None
        }
        for s in strategies
    }
    common = set.intersection(*(set(v) for v in reached.values())) if reached else set()
    return {s: statistics.fmean(reached[s][seed] for seed in common) for s in strategies} if common else {}


def neighbour_fetch_over_links(rows: list[dict], rates: list[float], strategies: list[str]) -> dict:
    """Where each stage's host has a link of its own (--checkpoint-uplinks per-stage), a CheckFree(+) rebuild reads
    its neighbours' weights across hosts too, but this benchmark's stages talk over loopback. So the report also
    charges each CheckFree(+) recovery its bytes at the rate the same key's checkpoint-restart replacements got for
    their downloads, and gives the ratios and the order with that charge (random re-initialisation reads nothing;
    checkpoint-restart's downloads are in its runs already). The downloads set the model: a replacement's link
    carries the rate each way, so a rebuild's bytes from both neighbours come in through it one after the other, in
    their sum / the rate; a download includes every stage's read from disk after it, so the rate is a little under
    the link's and CheckFree a little over-charged. Empty in every other setting: with one shared link the stages sit
    behind it together, and reach each other as fast as the loopback here."""
    key = next((r["key"] for r in rows if r["strategy"] != "none"), None)
    if not key or key.get("checkpoint_uplinks") != "per-stage":
        return {}
    downloads = [
        (r["checkpoint_bytes"] / STAGES, f["load_s"])
        for r in rows
        if r["strategy"] == "checkpoint"
        for f in r["recoveries"]
        if f.get("load_s")
    ]
    if not downloads:
        return {}
    mb_per_s = sum(size for size, _ in downloads) / sum(seconds for _, seconds in downloads) / 1e6
    from_model = None  # rows from before recoveries recorded their bytes: the same count, from the key's model
    charged: dict[tuple[int, float], float] = {}
    fetched: dict[str, list[int]] = {}
    for row in rows:
        if row["strategy"] != "checkfree":
            continue
        seconds = 0.0
        for recovery in row["recoveries"]:
            counts = recovery.get("fetched_bytes") or [None] * len(recovery["stages"])
            for stage, method, count in zip(recovery["stages"], recovery["methods"], counts):
                if method not in ("checkfree", "checkfree_plus"):
                    continue
                if count is None:
                    from_model = from_model or rebuild_bytes(tuple(key["shape"]))
                    count = from_model[stage]
                fetched.setdefault(method, []).append(count)
                seconds += count / 1e6 / mb_per_s
        charged[(row["seed"], row["rate"])] = seconds
    speedup, ordering = {}, {}
    for rate in rates:
        added = {("checkfree", seed): s for (seed, r), s in charged.items() if same_rate(r, rate)}
        means = common_seed_means(rows, rate, strategies, added_s=added)
        ordering[f"{rate:.2f}"] = sorted(means, key=means.get)
        pairs = checkfree_checkpoint_pairs(rows, rate)
        if pairs:
            ours = statistics.fmean(o["wall_s_to_target"] + added[("checkfree", o["seed"])] for o, _ in pairs)
            speedup[f"{rate:.2f}"] = statistics.fmean(t["wall_s_to_target"] for _, t in pairs) / ours
    return {
        "neighbour_fetch_mb_by_method": {m: spread([b / 1e6 for b in v]) for m, v in sorted(fetched.items())},
        "checkpoint_download_mb_per_s": mb_per_s,
        "neighbour_fetch_charged_s_by_rate_and_seed": {
            f"{rate:.2f}": {str(seed): s for (seed, r), s in sorted(charged.items()) if same_rate(r, rate)}
            for rate in rates
        },
        "wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged": speedup,
        "ordering_by_wall_s_neighbour_fetch_charged": ordering,
    }


def rebuild_bytes(shape: tuple[int, int, int, int]) -> dict[int, int]:
    """By stage: the bytes a CheckFree(+) rebuild of it reads (node/pipeline/recovery.py: an intermediate stage both
    neighbours' layers, an end stage its neighbour's layers and that neighbour's copy of its embedding or head), from
    a model of `shape`: the same count a recovery records, for rows written before recoveries recorded it."""
    config = load_config(
        REPO / "configs" / "pipeline.yaml", [*seeded_shape_overrides(shape, 0), f"pipeline.num_stages={STAGES}"]
    )
    tokenizer = build_char_tokenizer()
    model = build_default_model(config.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    extra = checkfree_plus_extra_parts(STAGES)
    stages = split_model(model, STAGES, extra)

    def read_from(neighbour: int) -> int:
        parts = ["layers"] + [p.value for p in extra.get(neighbour, ())]
        return tensor_bytes(part_tensors(stages[neighbour], parts))

    rebuilt = {0: read_from(1), STAGES - 1: read_from(STAGES - 2)}  # CheckFree+
    for index in range(1, STAGES - 1):  # CheckFree: the layers of both neighbours
        rebuilt[index] = sum(tensor_bytes(part_tensors(stages[n], ["layers"])) for n in (index - 1, index + 1))
    return rebuilt


def checkfree_checkpoint_pairs(rows: list[dict], rate: float) -> list[tuple[dict, dict]]:
    """(CheckFree's run, checkpoint-restart's run) of each seed at `rate` where both reached the target: the ratios of
    the means are taken over these, since a seed one of them has no row for must not enter one mean and not the
    other."""
    checkpoints = runs_of(rows, "checkpoint", rate)
    pairs = []
    for ours in runs_of(rows, "checkfree", rate):
        theirs = next((r for r in checkpoints if r["seed"] == ours["seed"]), None)
        if theirs and ours["wall_s_to_target"] and theirs["wall_s_to_target"]:
            pairs.append((ours, theirs))
    return pairs


def paired_ratio_of_means(pairs: list[tuple[dict, dict]], key: str) -> float | None:
    """The mean of `key` over the second rows of `pairs` over its mean over the first (None without pairs)."""
    if not pairs:
        return None
    return statistics.fmean(theirs[key] for _, theirs in pairs) / statistics.fmean(ours[key] for ours, _ in pairs)


def val_loss_at_equal_wall_clock(
    rows: list[dict], rates: list[float], strategies: list[str]
) -> tuple[dict[str, dict], dict[str, dict], dict[str, dict], list[str]]:
    """Each seed's strategies at one wall clock: the earliest at which one of them reached the target (the runs stop
    there, so it is the latest time every run has a curve for), and each run's last validation loss by then. Time to
    a target on a plateau turns on which curve crosses a line a thousandth away before its next failure; the loss at
    the winner's time says how far behind the others were. Returns, per strategy and rate, the spread over seeds of
    that loss, per rate and seed the wall clock used, per rate each strategy's rank among the seed's runs averaged
    over seeds (1 = lowest loss; a run with no evaluation by then, e.g. one still writing its first checkpoint, ranks
    last and is named in `not_evaluated`)."""
    losses: dict[str, dict] = {s: {} for s in strategies}
    used: dict[str, dict] = {}
    ranks: dict[str, dict] = {}
    not_evaluated: list[str] = []
    for rate in rates:
        name = f"{rate:.2f}"
        runs = [r for r in rows if r["strategy"] in strategies and same_rate(r["rate"], rate)]
        by_seed: dict[int, list[dict]] = {}
        for run in runs:
            by_seed.setdefault(run["seed"], []).append(run)
        per_strategy: dict[str, list[float]] = {s: [] for s in strategies}
        rank_lists: dict[str, list[float]] = {s: [] for s in strategies}
        used[name] = {}
        for seed, seed_runs in sorted(by_seed.items()):
            reached = [r["wall_s_to_target"] for r in seed_runs if r["wall_s_to_target"] is not None]
            # every strategy of the seed must be there to be compared; a run that missed the target ran to its end
            if not reached or {r["strategy"] for r in seed_runs} != set(strategies):
                continue
            wall = min(reached)
            used[name][str(seed)] = wall
            at_wall = {}
            for run in seed_runs:
                before = [p["val_loss"] for p in run["curve"] if p["wall_s"] <= wall + 1e-9]
                if before:
                    at_wall[run["strategy"]] = before[-1]
                    per_strategy[run["strategy"]].append(before[-1])
                else:
                    not_evaluated.append(f"{run['strategy']}@{name} seed {seed}")
            order = sorted(strategies, key=lambda s: at_wall.get(s, math.inf))
            for strategy in strategies:
                rank_lists[strategy].append(order.index(strategy) + 1.0)
        for strategy in strategies:
            losses[strategy][name] = spread(per_strategy[strategy])
        ranks[name] = {s: statistics.fmean(v) for s, v in rank_lists.items() if v}
    return losses, used, ranks, sorted(not_evaluated)


def print_report(summary: dict) -> None:
    def cell(value: dict | None, digits: int) -> str:
        if value is None:
            return "-"
        return f"{value['mean']:.{digits}f} [{value['min']:.{digits}f}-{value['max']:.{digits}f}] n={value['n']}"

    print("\nstrategy @ rate          steps to target (mean [min-max] n)   wall s to target (mean [min-max] n)")
    for strategy, by_rate in summary["steps_by_strategy_and_rate"].items():
        for rate, value in by_rate.items():
            wall = summary["wall_s_by_strategy_and_rate"][strategy][rate]
            print(f"{strategy + '@' + rate:24s} {cell(value, 1):36s} {cell(wall, 1)}")
    print(f"checkpoint-restart wall s / CheckFree's, by rate: {summary['wallclock_speedup_vs_checkpoint_by_rate']}")
    print(
        f"order by wall s {summary['ordering_by_wall_s']}; over every seed, a run that missed the target counted at "
        f"its last evaluation (a lower bound): {summary['wall_s_missed_counted_by_rate']}, order "
        f"{summary['ordering_by_wall_s_missed_counted']}"
    )
    print(
        "validation loss at each seed's first time to target: "
        f"{summary['val_loss_at_equal_wall_s_by_strategy_and_rate']}"
        f" (mean rank {summary['mean_rank_at_equal_wall_s_by_rate']}; no evaluation yet: "
        f"{summary['not_evaluated_by_equal_wall_s']})"
    )
    print(f"recovery s by method: {summary['recovery_s_by_method']}")
    print(f"of which to a serving replacement, s: {summary['to_serving_s_by_method']}")
    print(f"loss spike after a failure: {summary['loss_spike_by_strategy']}")
    print(
        "by the stages it lost (end: the first or the last): "
        f"{summary['loss_spike_by_strategy_and_stage_kind']}; end-stage failures by seed "
        f"{summary['end_stage_failures_by_strategy_and_rate']}"
    )
    print(f"checkpoint save s {summary['checkpoint_save_s']}, load s {summary['checkpoint_load_s']}")
    print(
        f"checkpoint every {summary['checkpoint_every_by_rate']} steps; steps replayed per failure "
        f"{summary['checkpoint_replayed_steps']}; share of wall s in checkpoint I/O {summary['checkpoint_io_share']}"
    )
    if summary.get("wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged"):
        print(
            "CheckFree's neighbour fetches charged at the checkpoint downloads' "
            f"{summary['checkpoint_download_mb_per_s']:.2f} MB/s: MB by method "
            f"{summary['neighbour_fetch_mb_by_method']}"
            f", s by seed {summary['neighbour_fetch_charged_s_by_rate_and_seed']}; checkpoint-restart wall s / "
            f"CheckFree's with them {summary['wallclock_speedup_vs_checkpoint_by_rate_neighbour_fetch_charged']}, "
            f"order by wall s {summary['ordering_by_wall_s_neighbour_fetch_charged']}"
        )
    if summary["checkpoint_upload_s"]:
        print(
            f"uploads in the background: s to a restore point {summary['checkpoint_upload_s']}, saves' wait for the "
            f"last uploads {summary['checkpoint_upload_wait_s']}, failures that cut uploads per run "
            f"{summary['checkpoint_failures_that_cut_uploads']}"
        )
    print(f"a step without a failure in it, s: {summary['normal_step_s_by_strategy_and_rate']}")
    print("where the wall s to the target went (means over seeds):")
    for strategy, by_rate in summary["wall_s_split_by_strategy_and_rate"].items():
        for rate, parts in by_rate.items():
            cells = ", ".join(f"{name} {part['mean']:.1f}" for name, part in parts.items() if part)
            print(f"  {strategy + '@' + rate:24s} {cells}")
    print(f"order by steps executed (saves, loads, recoveries free: the paper's count) {summary['ordering_by_steps']}")
    if summary.get("uplink_mb_per_step_stage_host_by_strategy_and_rate"):
        print(
            "sent over its uplink per step executed, MB: a stage's host "
            f"{summary['uplink_mb_per_step_stage_host_by_strategy_and_rate']}, the driver "
            f"{summary['uplink_mb_per_step_driver_by_strategy_and_rate']}"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
