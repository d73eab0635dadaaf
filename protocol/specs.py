"""Task specs: the compact, re-derivable identity of a question.

Peers exchange specs, never answers: a receiver re-generates the question and its ground
truth from the spec and scores completions itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_DATASET_NAME = 64
MAX_CONFIG_BYTES = 4096
MAX_INDEX = 2**62


class SpecError(ValueError):
    """A task spec that is malformed or out of bounds."""


def _canonical_config(config: dict[str, Any]) -> str:
    try:
        text = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"dataset config is not plain JSON data: {exc}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise SpecError(f"dataset config is {len(text)} bytes, limit {MAX_CONFIG_BYTES}")
    return text


@dataclass(frozen=True)
class TaskSpec:
    """Everything needed to re-generate one question and its ground truth."""

    dataset: str  # reasoning-gym dataset name
    config: dict[str, Any] = field(default_factory=dict, hash=False)  # dataset kwargs besides seed/size
    seed: int = 0  # dataset seed
    index: int = 0  # item index within the seeded dataset

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not 0 < len(self.dataset) <= MAX_DATASET_NAME:
            raise SpecError(f"dataset name must be a string of 1..{MAX_DATASET_NAME} characters")
        if not isinstance(self.config, dict):
            raise SpecError("dataset config must be a mapping")
        for name, value in (("seed", self.seed), ("index", self.index)):
            if type(value) is not int or not 0 <= value < MAX_INDEX:
                raise SpecError(f"{name} must be an integer in [0, 2^62)")
        _canonical_config(self.config)

    @property
    def config_key(self) -> str:
        """Canonical text of the config: equal configs give equal keys."""
        return _canonical_config(self.config)

    @property
    def key(self) -> str:
        """A unique, stable identifier of the question (distinct specs never merge)."""
        return f"{self.dataset}:{self.config_key}:{self.seed}:{self.index}"

    def to_wire(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "config": self.config, "seed": self.seed, "index": self.index}

    @classmethod
    def from_wire(cls, data: Any) -> "TaskSpec":
        if not isinstance(data, dict) or set(data) != {"dataset", "config", "seed", "index"}:
            raise SpecError("a task spec is a mapping with exactly dataset, config, seed, index")
        return cls(dataset=data["dataset"], config=data["config"], seed=data["seed"], index=data["index"])
