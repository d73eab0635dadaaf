"""A round's work, counted, and what it costs in compute units: an axis the machine's load cannot move.

CPU seconds of one process swing with the other load on a shared machine (the same silo round took 0.44 to
0.79 CPU s at different hours of one day: benchmarks/notebook/2026-11-26-sharing-cpu-seconds.md), so budgets and
curves that compare ways of training are drawn against the work a node does instead: token positions through the
sampler's prefill and decoding forwards, through no-grad forwards and through forward + backward, and
completions scored. Each kind is weighed by its CPU cost per unit for the model's shape, calibrated once on
an idle machine (benchmarks/compute_units.py writes benchmarks/compute_costs.json); a compute unit is then
one idle-machine CPU second of that work.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass
class RoundWork:
    """What one round did (the held-out evaluation excluded)."""

    prefill_tokens: int = 0
    """Prompt positions through the sampler's prefill forwards, pads included."""
    decode_tokens: int = 0
    """Rows through the sampler's decoding forwards, one per row and step."""
    decode_steps: int = 0
    """The sampler's decoding forwards, one per step of a batch, whatever its rows: a node that samples half the rows
    runs as many steps, so a cost per row-step alone undercounts it."""
    forward_tokens: int = 0
    """Positions through no-grad forwards of the update (pi_old with several epochs, the KL reference)."""
    train_tokens: int = 0
    """Positions through the update's forward and backward, pads included."""
    train_calls: int = 0
    """Forward-and-backward calls of the update, one per micro-batch: with each prompt once in the update's forward a
    micro-batch holds few positions, and what a call costs beside them is a large part of it."""
    scored_completions: int = 0
    """Completions graded: the node's own, and peers' re-scored here."""
    records_decoded: int = 0
    """Peers' signed rollout records decoded and their signatures verified (a node that takes peers' groups)."""
    groups_rederived: int = 0
    """Peers' groups whose questions were re-derived from their specs and completions re-tokenized here, before
    scoring (node/sharing.py PeerRollouts.rescore)."""
    optimizer_steps: int = 0
    """Optimizer steps (gradient clipping and AdamW over every parameter: a cost per step, not per token)."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, int]) -> RoundWork:
        return cls(**{f.name: int(values.get(f.name, 0)) for f in fields(cls)})

    def __add__(self, other: RoundWork) -> RoundWork:
        return RoundWork(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class UnitCosts:
    """Idle-machine CPU seconds (one torch thread) of one unit of each kind of work, for one model shape."""

    prefill_token: float
    decode_token: float
    forward_token: float
    train_token: float
    scored_completion: float
    optimizer_step: float
    decode_step: float = 0.0
    """0 in calibrations from before the per-call kinds: their per-position costs carry the calls' share."""
    train_call: float = 0.0
    record_decoded: float = 0.0
    """0 in calibrations from before the sharing kinds (they did not count what taking peers' groups costs)."""
    group_rederived: float = 0.0

    def units(self, work: RoundWork) -> float:
        return sum(self.split(work).values())

    def split(self, work: RoundWork) -> dict[str, float]:
        """The units of each kind of work."""
        return {
            "generation": self.prefill_token * work.prefill_tokens
            + self.decode_token * work.decode_tokens
            + self.decode_step * work.decode_steps,
            "no_grad_forward": self.forward_token * work.forward_tokens,
            "forward_backward": self.train_token * work.train_tokens + self.train_call * work.train_calls,
            "scoring": self.scored_completion * work.scored_completions,
            "sharing": self.record_decoded * work.records_decoded + self.group_rederived * work.groups_rederived,
            "optimizer": self.optimizer_step * work.optimizer_steps,
        }

    @classmethod
    def load(cls, path: Path, shape: str) -> UnitCosts:
        """The costs calibrated for `shape` (model_shape_key) in the calibration file."""
        try:
            table = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no compute-unit calibration at {path}: run benchmarks/compute_units.py") from None
        if shape not in table:
            raise KeyError(f"{path} has no calibration for model shape {shape!r} (calibrated: {sorted(table)})")
        costs = table[shape]["costs"]
        return cls(**{f.name: float(costs[f.name]) for f in fields(cls) if f.name in costs})


LAYOUTS = ("rows", "shared-prompts")
"""How a round lays its sequences out: a row per completion, its prompt repeated in it ('rows'), or each prompt once
in the sampler's prefill and the update's forward (rollout.share_prompt_prefill and trainer.share_prompt_forward):
a position costs differently in each, so each is calibrated on its own."""


def model_shape_key(
    hidden_size: int, num_layers: int, intermediate_size: int, vocab_size: int, layout: str = "rows"
) -> str:
    """The calibration file's key for a model and a layout: costs per token depend on these."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: one of {LAYOUTS}")
    shape = f"h{hidden_size}-l{num_layers}-i{intermediate_size}-v{vocab_size}"
    return shape if layout == "rows" else f"{shape}-{layout}"


def round_layout(prefill_shares_prompts: bool, update_shares_prompts: bool) -> str:
    """The layout of a node's rounds; one that shares prompts in one of the two places only has no calibration."""
    if prefill_shares_prompts != update_shares_prompts:
        raise ValueError(
            "compute units are calibrated for prompts shared in both the sampler's prefill and the update's forward, "
            f"or in neither (prefill {prefill_shares_prompts}, update {update_shares_prompts})"
        )
    return "shared-prompts" if update_shares_prompts else "rows"
