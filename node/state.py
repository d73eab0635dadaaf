"""The node's local state: checkpoints and metrics that survive kill -9.

Layout of a state directory:
    config.yaml              resolved config of the latest run
    metrics.jsonl            one JSON object per completed round
    node.log                 the log
    lock                     the PID of the process that holds the directory (lock_state_dir)
    runs.json                its processes counted across restarts (Runs: starts, unclean ends, stall restarts)
    checkpoints/LATEST       name of the newest complete checkpoint
    checkpoints/round-000042/{config.json, model.safetensors, tokenizer/, trainer.pt}

A checkpoint is written into a temporary folder, fsynced, renamed into place, and only then
named in LATEST (itself replaced atomically). A kill at any moment leaves LATEST naming a
complete checkpoint. Metrics rows are fsynced before the checkpoint of their round, and on
resume rows newer than the checkpoint are dropped, so a round counts once or not at all.

A resume does not trust LATEST alone: a disk can damage it or the newest checkpoint, so it takes
the newest checkpoint that loads, says which it skipped, and refuses (rather than starts fresh
over) a directory whose checkpoints all fail to load, or whose metrics go past the first
checkpoint's round without one.

A full disk stops neither training nor the checkpoints already written: a save it has no space for removes what it
wrote and raises CheckpointNotSaved (one line, naming the directory; the round loop says it and trains on, and the
next save tries again), and metrics rows it has no space for are held in memory and written, in order, at the first
append that fits.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pickle
import random
import shutil
import tempfile
from collections import deque
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError

from node.config import ConfigError
from node.device import HOST
from node.files import atomic_write_text, fsync_dir, fsync_tree, no_space, write_snapshot
from node.metrics import METRICS_FILE, MetricsFile
from node.model import load_policy, save_policy

log = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "round-"
LOCK_FILE = "lock"
RUNS_FILE = "runs.json"
_HELD: set[Path] = set()  # the lock files this process holds (lock_state_dir)
HELD_ROWS = 10_000  # metrics rows held in memory while the disk is full (the oldest go first beyond)
# what reading a damaged checkpoint raises: a safetensors file its header does not cover, a trainer.pt torch cannot
# unzip or unpickle, a cut JSON file (the model's config, the tokenizer), a file that is gone
DAMAGE = (OSError, ValueError, RuntimeError, EOFError, KeyError, pickle.UnpicklingError, SafetensorError)


@dataclass
class TrainerState:
    round: int  # rounds completed
    policy_version: int
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    outer: dict[str, Any] | None  # averaging's slow weights and outer momentum (None: no averaging)
    node: dict[str, Any] | None  # the round loop's own state beyond the policy (Node.node_state; None: nothing)


@dataclass
class Checkpoint:
    """A checkpoint read whole: its policy on the host, and the trainer's state."""

    path: Path
    model: torch.nn.Module
    tokenizer: Any
    state: TrainerState


class StateStore:
    def __init__(self, root: Path):
        self.root = root
        self.checkpoints = root / "checkpoints"
        self.metrics = MetricsFile(root / METRICS_FILE)
        self.metrics_path = self.metrics.path
        self.unwritten: deque[dict[str, Any]] = deque(maxlen=HELD_ROWS)  # rows the disk had no space for, in order

    def exists(self) -> bool:
        return self.latest() is not None

    def latest(self) -> Path | None:
        pointer = self.checkpoints / "LATEST"
        try:
            name = pointer.read_text().strip()
        except FileNotFoundError:
            return None
        path = self.checkpoints / name
        return path if (path / "trainer.pt").exists() else None

    def kept_checkpoints(self) -> list[Path]:
        """The checkpoint folders on disk, newest round first: save renames one into place only once its files are
        fsynced, so each was whole when written, whatever LATEST says now."""
        if not self.checkpoints.is_dir():
            return []
        return sorted((p for p in self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir()), reverse=True)

    def resume(self, dtype: str, checkpoint_every: int) -> Checkpoint | None:
        """The newest kept checkpoint that loads (its policy on the host, in `dtype`), after one warning naming those
        skipped and why; None where there is nothing to resume and nothing to lose (a fresh start). A directory that
        holds checkpoints, or metrics past the first checkpoint's round, but no checkpoint that loads is refused:
        starting fresh there would drop its metrics and, a few saves later, prune the checkpoints a repair could
        still bring back."""
        kept = self.kept_checkpoints()
        problems = self._latest_problems(kept)
        for path in kept:
            try:
                checkpoint = self._read(path, dtype)
            except CheckpointDamaged as damage:
                problems.append(str(damage))
                continue
            if problems:
                log.warning("%s: resuming from %s", "; ".join(problems), path.name)
            return checkpoint
        rounds = len(rows := self.read_metrics())
        # rows of rounds before the first checkpoint are what a kill before it leaves (they are fsynced first): a
        # fresh start drops them as a resume drops the rows newer than its checkpoint
        if not kept and all(row.get("round", 0) <= checkpoint_every for row in rows):
            if rows:
                problems.append(f"no checkpoint holds the {rounds} round{'s' * (rounds != 1)} in metrics.jsonl")
            if problems:
                log.warning("%s: starting fresh", "; ".join(problems))
            return None
        held = [f"{len(kept)} checkpoint{'s' * (len(kept) != 1)}"] if kept else []
        held += [f"the metrics of {rounds} round{'s' * (rounds != 1)}"] if rounds else []
        why = f" ({'; '.join(problems)})" if problems else ""
        raise ConfigError(
            f"the state directory {self.root} holds {' and '.join(held)} but no checkpoint that loads{why}: add "
            "--fresh to start over there (its checkpoints and metrics are removed), or use another --state-dir"
        )

    def _latest_problems(self, kept: list[Path]) -> list[str]:
        try:
            name = (self.checkpoints / "LATEST").read_bytes().decode(errors="replace").strip()
        except FileNotFoundError:
            return ["checkpoints/LATEST is missing"] if kept else []
        if not name:
            return ["checkpoints/LATEST is empty"]
        if self.checkpoints / name not in kept:
            return [f"checkpoints/LATEST names {name}, which is gone"]
        return []

    def damage(self, path: Path, dtype: str = "float32") -> str | None:
        """Why the checkpoint at `path` would not load (None: it loads whole, as a resume would read it)."""
        try:
            self._read(path, dtype)
        except CheckpointDamaged as damage:
            return str(damage)
        return None

    def _read(self, path: Path, dtype: str) -> Checkpoint:
        # trainer.pt first: a damaged one is found before the policy's weights are read for nothing
        try:
            state = self.load_trainer_state(path)
        except DAMAGE as exc:
            raise CheckpointDamaged(f"{path.name}'s trainer.pt does not load ({_first_sentence(exc)})") from exc
        try:
            model, tokenizer = load_policy(path, dtype, HOST)
        except DAMAGE as exc:
            raise CheckpointDamaged(f"{path.name}'s policy does not load ({_first_sentence(exc)})") from exc
        return Checkpoint(path, model, tokenizer, state)

    def save(
        self,
        round_: int,
        model: torch.nn.Module,
        tokenizer,
        optimizer: torch.optim.Optimizer,
        policy_version: int,
        keep: int,
        outer: dict | None = None,
        node: dict | None = None,
    ) -> Path:
        staging = None
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.checkpoints))
            save_policy(model, tokenizer, staging)
            with open(staging / "trainer.pt", "wb") as handle:  # a file of ours: torch then keeps the OSError
                torch.save(
                    {
                        "round": round_,
                        "policy_version": policy_version,
                        "optimizer": optimizer.state_dict(),
                        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                        "outer": outer,
                        "node": node,
                    },
                    handle,
                )
            fsync_tree(staging)
            final = self.checkpoints / f"{CHECKPOINT_PREFIX}{round_:08d}"
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            fsync_dir(self.checkpoints)
            atomic_write_text(self.checkpoints / "LATEST", final.name + "\n")
        except BaseException as exc:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            if no_space(exc):
                raise CheckpointNotSaved(f"could not save round {round_}: {self.no_space_left()}") from exc
            raise
        self._prune(keep, final)
        return final

    def _prune(self, keep: int, newest: Path) -> None:
        complete = sorted(p for p in self.checkpoints.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())
        for old in complete[:-keep]:
            if old != newest:
                shutil.rmtree(old, ignore_errors=True)
        for leftover in self.checkpoints.glob(".staging-*"):  # from a killed save
            shutil.rmtree(leftover, ignore_errors=True)

    def load_round(self, checkpoint: Path) -> int:
        return int(checkpoint.name.removeprefix(CHECKPOINT_PREFIX))

    def load_trainer_state(self, checkpoint: Path) -> TrainerState:
        """Read on the CPU: a checkpoint a GPU wrote loads on a machine without one (the optimizer's state moves to
        the parameters' device in load_state_dict)."""
        data = torch.load(checkpoint / "trainer.pt", map_location=HOST, weights_only=False)
        return TrainerState(
            round=data["round"],
            policy_version=data["policy_version"],
            optimizer=data["optimizer"],
            rng=data["rng"],
            outer=data.get("outer"),
            node=data.get("node"),
        )

    # metrics: the file's own code is torch-free (node/metrics.py), for `swarm-node stats`

    def no_space_left(self) -> str:
        """What a save the disk had no space for leaves, in words."""
        latest = self.latest()
        standing = f"the checkpoint of round {self.load_round(latest)} stands" if latest else "no checkpoint yet"
        return f"no space left on device in {self.checkpoints} ({standing})"

    def append_metrics(self, row: dict[str, Any]) -> None:
        """Append `row`, after any the disk had no space for: a full disk holds them in memory (one warning), and the
        first append that fits writes them all, in order."""
        self.unwritten.append(row)
        try:
            while self.unwritten:
                self.metrics.append(self.unwritten[0])
                self.unwritten.popleft()
        except OSError as exc:
            if not no_space(exc):
                raise
            if len(self.unwritten) == 1:
                log.warning(
                    "no space left on device for %s: its rows are held in memory until there is", self.metrics_path
                )

    def read_metrics(self) -> list[dict[str, Any]]:
        return self.metrics.read()

    def truncate_metrics(self, last_round: int) -> None:
        self.metrics.truncate(last_round)

    def recorded_model(self) -> str | None:
        """The `model.name_or_path` of the run that last used this directory (its config.yaml), None when unknown."""
        try:
            recorded = yaml.safe_load((self.root / "config.yaml").read_text())
        except (OSError, yaml.YAMLError):
            return None
        model = recorded.get("model") if isinstance(recorded, dict) else None
        name = model.get("name_or_path") if isinstance(model, dict) else None
        return name if isinstance(name, str) else None

    def wipe(self) -> None:
        """--fresh: forget checkpoints and metrics, keep the identity and logs."""
        shutil.rmtree(self.checkpoints, ignore_errors=True)
        self.metrics_path.unlink(missing_ok=True)
        (self.root / "pipeline_state.json").unlink(missing_ok=True)  # a pipeline driver's round (node/loop.py)


class CheckpointNotSaved(Exception):
    """A checkpoint the disk had no space for: nothing of it is left behind, the one before stands. The message is
    one line: the round, the directory, and what stands."""


class CheckpointDamaged(Exception):
    """A kept checkpoint that does not load; the message names it and says why."""


def _first_sentence(exc: BaseException) -> str:
    """Enough of an error to say why: torch's reader adds a paragraph of advice after its first sentence."""
    text = str(exc).strip()
    return text.splitlines()[0].split(". ")[0].rstrip(".") if text else type(exc).__name__


def lock_state_dir(root: Path) -> None:
    """Hold `root` for this process until it ends: two processes on one state directory would resume the same
    checkpoint and write over each other's rounds. The OS releases the lock of a process that dies (kill -9 too), so
    nothing is left to clean up; the lock file names the holder's PID for the refusal. Called again by the holder, it
    returns at once. The PID alone does not say who holds it: a process that restarted itself (execve, the same PID)
    is refused while a child of its old image still holds the lock."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    if path.resolve() in _HELD:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        # a holder that has not written its PID yet is named without one
        by = f"process {holder}" if holder.isdigit() else "another process"
        raise ConfigError(
            f"the state directory {root} is in use by {by} (it holds {path}): stop it, or use another --state-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _HELD.add(path.resolve())  # fd stays open, the lock with it, until the process ends


@dataclass
class Runs:
    """The processes a state directory has had, counted across restarts (runs.json): a start after a process that
    did not stop cleanly (killed, crashed, its machine lost power) is a restart, and so is one the node made itself
    because a round stalled (swarm.stall_restart_s). A user's own stop and start is neither."""

    starts: int = 0
    after_unclean_end: int = 0
    stall_restarts: int = 0
    running: bool = False  # a process holds the directory; still true at the next start: that one did not stop cleanly
    stall_round: int | None = None  # the round in flight at the last stall restart: one round restarts a node once

    @property
    def restarts(self) -> int:
        return self.after_unclean_end + self.stall_restarts


def read_runs(root: Path) -> Runs:
    """runs.json; a missing one is a directory's first start, and a damaged one starts the count again (said once):
    the count is for people to read, and no bad file stops a node."""
    path = root / RUNS_FILE
    try:
        saved = json.loads(path.read_text())
        known = {f.name for f in fields(Runs)}
        runs = Runs(**{key: value for key, value in saved.items() if key in known})
        counts = (runs.starts, runs.after_unclean_end, runs.stall_restarts)
        if not all(type(n) is int and n >= 0 for n in counts) or type(runs.running) is not bool:
            raise ValueError(f"not counts: {saved}")
        if runs.stall_round is not None and type(runs.stall_round) is not int:
            raise ValueError(f"stall_round is not a round: {runs.stall_round!r}")
        return runs
    except FileNotFoundError:
        return Runs()
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("%s is damaged (%s): counting this state directory's restarts from now", path, exc)
        return Runs()


def record_start(root: Path) -> Runs:
    """Count this process's start (its caller holds the directory's lock): a restart when the last one did not stop
    cleanly."""
    runs = read_runs(root)
    if runs.running:
        runs.after_unclean_end += 1
    runs.starts += 1
    runs.running = True
    write_snapshot(root / RUNS_FILE, json.dumps(asdict(runs)))  # a full disk skips it: a count, not a state
    return runs


def record_stop(root: Path, runs: Runs, stalled_round: int | None = None) -> None:
    """This process ends cleanly, or (`stalled_round`) restarts itself because that round stalled. A directory that
    can no longer be written to costs the count, never the stop."""
    runs.running = False
    if stalled_round is not None:
        runs.stall_restarts += 1
        runs.stall_round = stalled_round
    try:
        write_snapshot(root / RUNS_FILE, json.dumps(asdict(runs)))
    except OSError as exc:
        log.warning("could not count this stop in %s: %s", root / RUNS_FILE, exc)


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
