"""Checkpoint-restart, the baseline: a stage's checkpoint written and read back as a deployment would, every stage's
checkpoints kept on this host and uploaded to stores (Checkpoints), and how often to take them (Young's rule)."""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.checkpoint_store import CheckpointStore, store_get, store_put
from benchmarks.recovery.runs import STAGES
from node.aio import cancel_and_wait
from node.files import fsync_dir


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


def cost_with_uploads(save_s: float, steps_beside_uploads_s: list[float], normal_step_s: float) -> float:
    """What a checkpoint whose uploads run in the background costs the training: the save itself, plus what the steps
    taken while its uploads ran took beyond normal steps (where uploads share a host's uplink with the hidden states,
    those steps are slower)."""
    return save_s + max(0.0, sum(steps_beside_uploads_s) - len(steps_beside_uploads_s) * normal_step_s)
