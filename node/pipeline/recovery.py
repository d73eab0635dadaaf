"""Where a stage's weights come from when a server takes it up — never from a checkpoint.

The order (../shared/papers/ALGORITHMS.md §4, as SWARM/Petals and CheckFree do it):

1. `replica_copy`  a live server of the same stage exists: copy its weights (every part).
2. `checkfree`     no replica left, intermediate stage i: the neighbours' LAYERS averaged,
                   weighted by their last gradient norms (after clipping):
                       theta_i = (a * theta_{i+1} + b * theta_{i-1}) / (a + b)
                       a = ||g_{i+1}|| + 1e-4,  b = ||g_{i-1}|| + 1e-4
                   with a fresh optimizer and the learning rate x `recovered_lr_scale` (1.1).
3. `checkfree_plus` no replica left, first or last stage: its neighbour (stage 1, or S-2) has
                   been trained to stand in for it by out-of-order pipelining, and holds a
                   copy of the embedding (or of the final norm + head): copy both.
4. `random`        the benchmark's baseline (pipeline.recovery = random): fresh initialisation.
5. `initial`       the pipeline has not taken a step yet: the stage of the initial model.

Every source is a live server reached over a pipeline `weights` call. Nothing the dead
server wrote, and no store outside the live nodes, is read: the tests delete the dead
server's state directory before the recovery to prove it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

GRAD_NORM_EPS = 1e-4

Named = dict[str, torch.Tensor]


@dataclass
class RecoveryEvent:
    """One acquisition of a stage's weights, as logged (recoveries.jsonl) and counted."""

    stage: int
    method: str  # replica_copy | checkfree | checkfree_plus | random | initial
    cause: str  # why the stage needed weights: "joined", "no live server", ...
    sources: list[dict] = field(default_factory=list)  # [{"stage", "node_id", "step", "grad_norm", "weight"}]
    step: int = 0  # the step count the stage continues from
    lr_scale: float = 1.0
    seconds: float = 0.0  # from the decision to the weights loaded
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return asdict(self)


def checkfree_weights(prev_layers: Named, next_layers: Named, prev_grad_norm: float, next_grad_norm: float) -> tuple[Named, float, float]:
    """CheckFree's neighbour average for a lost intermediate stage: (weights, a, b).

    a weighs the next stage and b the previous one, each by its last gradient norm: the
    neighbour that was still learning harder is assumed closer to what the stage did.
    """
    if set(prev_layers) != set(next_layers):
        raise ValueError("the neighbours' LAYERS parts have different tensor names; CheckFree needs stages of equal depth")
    a, b = next_grad_norm + GRAD_NORM_EPS, prev_grad_norm + GRAD_NORM_EPS
    merged = {}
    for name, prev in prev_layers.items():
        nxt = next_layers[name]
        if prev.shape != nxt.shape:
            raise ValueError(f"{name}: neighbour shapes differ ({list(prev.shape)} vs {list(nxt.shape)})")
        merged[name] = ((a * nxt.to(torch.float32) + b * prev.to(torch.float32)) / (a + b)).to(prev.dtype)
    return merged, a, b


def choose_method(stage: int, num_stages: int, has_replica: bool, trained: bool, recovery: str, checkfree_plus: bool) -> tuple[str, list[int]]:
    """(method, the stages to read from) for a server taking up `stage`."""
    if has_replica:
        return "replica_copy", [stage]
    if not trained:
        return "initial", []
    if recovery == "random":
        return "random", []
    if num_stages == 1:
        raise RecoveryImpossible("a one-stage pipeline that lost its only server has no neighbour to recover from")
    if 0 < stage < num_stages - 1:
        return "checkfree", [stage - 1, stage + 1]
    if not checkfree_plus:
        raise RecoveryImpossible(f"stage {stage} is an end stage: only CheckFree+ (pipeline.checkfree_plus) can rebuild it")
    return "checkfree_plus", [1 if stage == 0 else num_stages - 2]


class RecoveryImpossible(RuntimeError):
    """No live source can rebuild the stage (the server says why and keeps waiting)."""
