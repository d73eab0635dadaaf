"""The node's local state: checkpoints and metrics that survive kill -9.

Layout of a state directory:
    config.yaml              resolved config of the latest run
    metrics.jsonl            one JSON object per completed round
    node.log                 the log
    checkpoints/LATEST       name of the newest complete checkpoint
    checkpoints/round-000042/{config.json, model.safetensors, tokenizer/, trainer.pt}

A checkpoint is written into a temporary folder, fsynced, renamed into place, and only then
named in LATEST (itself replaced atomically). A kill at any moment leaves LATEST naming a
complete checkpoint. Metrics rows are fsynced before the checkpoint of their round, and on
resume rows newer than the checkpoint are dropped, so a round counts once or not at all.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from node.device import HOST
from node.files import atomic_write_text, fsync_dir, fsync_tree
from node.metrics import METRICS_FILE, MetricsFile
from node.model import save_policy

CHECKPOINT_PREFIX = "round-"


@dataclass
class TrainerState:
    round: int  # rounds completed
    policy_version: int
    optimizer: dict[str, Any]
    rng: dict[str, Any]
    outer: dict[str, Any] | None  # averaging's slow weights and outer momentum (None: no averaging)
    node: dict[str, Any] | None  # the round loop's own state beyond the policy (Node.node_state; None: nothing)


class StateStore:
    def __init__(self, root: Path):
        self.root = root
        self.checkpoints = root / "checkpoints"
        self.metrics = MetricsFile(root / METRICS_FILE)
        self.metrics_path = self.metrics.path

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
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.checkpoints))
        try:
            save_policy(model, tokenizer, staging)
            torch.save(
                {
                    "round": round_,
                    "policy_version": policy_version,
                    "optimizer": optimizer.state_dict(),
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                    "outer": outer,
                    "node": node,
                },
                staging / "trainer.pt",
            )
            fsync_tree(staging)
            final = self.checkpoints / f"{CHECKPOINT_PREFIX}{round_:08d}"
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            fsync_dir(self.checkpoints)
            atomic_write_text(self.checkpoints / "LATEST", final.name + "\n")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
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

    def append_metrics(self, row: dict[str, Any]) -> None:
        self.metrics.append(row)

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


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
