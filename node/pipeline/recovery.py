"""Where a stage's weights come from when a server takes it up — never from a checkpoint.

The order (../shared/papers/ALGORITHMS.md §4, as SWARM/Petals and CheckFree do it):

1. `replica_copy`  a live server of the same stage exists: copy its weights (every part).
2. `checkfree`     no replica left, intermediate stage i: the neighbours' LAYERS averaged,
                   weighted by their last gradient norms (after clipping):
                       theta_i = (a * theta_{i+1} + b * theta_{i-1}) / (a + b)
                       a = ||g_{i+1}|| + 1e-4,  b = ||g_{i-1}|| + 1e-4
                   with a fresh optimizer and the learning rate x `recovered_lr_scale` (1.1).
                   Two adjacent stages lost together (i and i+1): each is rebuilt from the
                   nearest live stage on each side (stage i from i-1 and i+2), a warning says
                   so; the one rebuilt first then serves as the other's neighbour if it is
                   live by then. A stage with no live stage on one side waits.
3. `checkfree_plus` no replica left, first or last stage: its neighbour (stage 1, or S-2) has
                   been trained to stand in for it by out-of-order pipelining, and holds a
                   copy of the embedding (or of the final norm + head): copy both.
4. `random`        the benchmark's baseline (pipeline.recovery = random): fresh initialisation.
5. `initial`       the pipeline has not taken a step yet: the stage of the initial model.

Every source is a live server reached over a pipeline `weights` call (`load_stage` takes
the call as `fetch`, so the loading is tested without a network). Nothing the dead server
wrote, and no store outside the live nodes, is read: the tests delete the dead server's
state directory before the recovery to prove it.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable

import torch

from node.aio import gather_or_cancel
from node.pipeline.stagemap import StageMap
from node.pipeline.stages import PipelineStage, StagePart, split_parts
from protocol import StageAnnouncement
from protocol.pipeline import StageResult

log = logging.getLogger(__name__)

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
    bytes_fetched: int = 0  # the tensors read from live servers (what crossed their uplinks)
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        return asdict(self)


def tensor_bytes(tensors: Named) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def layer_depth(layers: Named) -> int:
    """Decoder layers in a LAYERS part (its tensors are named "<layer>.<parameter>", layers counted from 0)."""
    return 1 + max(int(name.split(".", 1)[0]) for name in layers)


def at_depth(layers: Named, depth: int) -> Named:
    """A neighbour's LAYERS part laid out for a stage of `depth` layers: its layer j at position j, and past its own
    depth its last layer standing in. A split's stages differ by at most one layer (StagePlan.layer_range: 30
    layers in 4 stages are 8, 8, 7 and 7), so at most the last position of the deeper stage borrows."""
    own = layer_depth(layers)
    out = {}
    for name, tensor in layers.items():
        layer, rest = name.split(".", 1)
        if int(layer) == own - 1:
            for position in range(own - 1, depth):
                out[f"{position}.{rest}"] = tensor
        if int(layer) < depth and int(layer) != own - 1:
            out[name] = tensor
    return {name: out[name] for name in sorted(out, key=lambda n: (int(n.split(".", 1)[0]), n))}


def checkfree_weights(
    prev_layers: Named, next_layers: Named, prev_grad_norm: float, next_grad_norm: float, depth: int | None = None
) -> tuple[Named, float, float]:
    """CheckFree's neighbour average for a lost intermediate stage of `depth` layers (None: the neighbours'):
    (weights, a, b).

    a weighs the next stage and b the previous one, each by its last gradient norm: the
    neighbour that was still learning harder is assumed closer to what the stage did. Neighbours
    of another depth than the lost stage are laid out for it first (`at_depth`).
    """
    if depth is not None:
        prev_layers, next_layers = at_depth(prev_layers, depth), at_depth(next_layers, depth)
    if set(prev_layers) != set(next_layers):
        raise ValueError(
            "the neighbours' LAYERS parts have different tensor names; CheckFree needs stages of equal depth"
        )
    a, b = next_grad_norm + GRAD_NORM_EPS, prev_grad_norm + GRAD_NORM_EPS
    merged = {}
    for name, prev in prev_layers.items():
        nxt = next_layers[name]
        if prev.shape != nxt.shape:
            raise ValueError(f"{name}: neighbour shapes differ ({list(prev.shape)} vs {list(nxt.shape)})")
        merged[name] = ((a * nxt.to(torch.float32) + b * prev.to(torch.float32)) / (a + b)).to(prev.dtype)
    return merged, a, b


def choose_method(
    stage: int,
    num_stages: int,
    has_replica: bool,
    trained: bool,
    recovery: str,
    checkfree_plus: bool,
    live_stages: set[int] | None = None,
) -> tuple[str, list[int]]:
    """(method, the stages to read from) for a server taking up `stage`; `live_stages`: the stages with a live
    server now (None: assume every other stage is live)."""
    if has_replica:
        return "replica_copy", [stage]
    if not trained:
        return "initial", []
    if recovery == "random":
        return "random", []
    if num_stages == 1:
        raise RecoveryImpossible("a one-stage pipeline that lost its only server has no neighbour to recover from")
    live = set(range(num_stages)) - {stage} if live_stages is None else set(live_stages) - {stage}
    if 0 < stage < num_stages - 1:
        below, above = [i for i in live if i < stage], [i for i in live if i > stage]
        if not below or not above:
            side = "below" if not below else "above"
            raise RecoveryImpossible(
                f"CheckFree needs a live stage on each side of stage {stage}; none is live {side} it"
            )
        return "checkfree", [max(below), min(above)]
    if not checkfree_plus:
        raise RecoveryImpossible(
            f"stage {stage} is an end stage: only CheckFree+ (pipeline.checkfree_plus) can rebuild it"
        )
    partner = 1 if stage == 0 else num_stages - 2
    if partner not in live:
        raise RecoveryImpossible(
            f"CheckFree+ copies stage {stage} from stage {partner}, which has no live server either"
        )
    return "checkfree_plus", [partner]


Fetch = Callable[[StageAnnouncement, list[str]], Awaitable[tuple[dict[str, torch.Tensor], StageResult]]]


async def load_stage(
    stage: PipelineStage,
    method: str,
    sources: list[int],
    replicas: list[StageAnnouncement],
    view: StageMap,
    fetch: Fetch,
    rng: random.Random,
    fresh: Callable[[], PipelineStage],
    recovered_lr_scale: float,
) -> RecoveryEvent:
    """Load `stage`'s weights in place by `method` (from `choose_method`) from the live servers of `view`.

    `fetch(server, parts)` reads parts of a live server's stage; `fresh()` builds a randomly initialised stage.
    Raises MissingSource when a source is not live (yet), and whatever `fetch` raises for a failed call."""
    event = RecoveryEvent(stage=stage.index, method=method, cause="")
    if method == "initial":
        return event
    if method == "random":
        new = fresh()
        for part in stage.parts:
            stage.load_part_state_dict(part, new.part_state_dict(part))
        event.step = max((s.step for group in view.servers.values() for s in group), default=0)
        return event
    if method == "replica_copy":
        source = rng.choice(replicas)
        weights, result = await fetch(source, [p.value for p in stage.parts])
        event.bytes_fetched = tensor_bytes(weights)
        for part, tensors in split_parts(weights).items():
            stage.load_part_state_dict(StagePart(part), tensors)
        event.sources = [_source(stage.index, source, result, 1.0)]
        event.step, event.lr_scale = result.step, result.lr_scale
        return event
    chosen = {}
    for neighbour in sources:
        candidates = view.live(neighbour)
        if not candidates:
            raise MissingSource(f"no live server of neighbour stage {neighbour}")
        chosen[neighbour] = rng.choice(candidates)

    async def fetch_from(source: StageAnnouncement) -> tuple[StageAnnouncement, Named, StageResult]:
        wanted = ["layers"] + [
            p
            for p in ("embed", "head")
            if p in source.parts and StagePart(p) in stage.parts and method == "checkfree_plus"
        ]
        return (source, *await fetch(source, wanted))

    # both neighbours at once: each sends from its own host, so where the newcomer's downlink is faster than their
    # uplinks the rebuild waits for the slower of the two instead of for both in turn
    answers = await gather_or_cancel(*(fetch_from(chosen[n]) for n in sources), what=f"stage {stage.index}'s fetches")
    fetched = dict(zip(sources, answers))
    event.bytes_fetched = sum(tensor_bytes(weights) for _, weights, _ in answers)
    if method == "checkfree":
        (prev_src, prev_w, prev_r), (next_src, next_w, next_r) = fetched[sources[0]], fetched[sources[1]]
        if sources != [stage.index - 1, stage.index + 1]:
            log.warning(
                "stage %d: its neighbours are lost too; rebuilding it from the nearest live stages %d and %d",
                stage.index,
                *sources,
            )
        depth = len(stage.plan.layer_range(stage.index))
        merged, a, b = checkfree_weights(
            split_parts(prev_w)["layers"], split_parts(next_w)["layers"], prev_r.grad_norm, next_r.grad_norm, depth
        )
        stage.load_part_state_dict(StagePart.LAYERS, merged)
        event.sources = [
            _source(sources[0], prev_src, prev_r, b / (a + b)),
            _source(sources[1], next_src, next_r, a / (a + b)),
        ]
        event.step = max(prev_r.step, next_r.step)
    # checkfree_plus: the neighbour's layers stood in for ours on swapped micro-batches; it holds our (de)embedding copy
    else:
        source, weights, result = fetched[sources[0]]
        parts = split_parts(weights)
        parts["layers"] = at_depth(parts["layers"], len(stage.plan.layer_range(stage.index)))
        for part, tensors in parts.items():
            stage.load_part_state_dict(StagePart(part), tensors)
        own = stage.plan.parts(stage.index)
        missing = [
            p.value for p in stage.parts if p in (StagePart.EMBED, StagePart.HEAD) and p in own and p.value not in parts
        ]
        if missing:
            raise MissingSource(f"neighbour stage {sources[0]} holds no copy of {missing}")
        event.sources = [_source(sources[0], source, result, 1.0)]
        event.step = result.step
    event.lr_scale = recovered_lr_scale
    return event


def _source(stage: int, server: StageAnnouncement, result: StageResult, weight: float) -> dict:
    return {
        "stage": stage,
        "node_id": server.node_id,
        "step": result.step,
        "grad_norm": result.grad_norm,
        "weight": weight,
    }


class RecoveryImpossible(RuntimeError):
    """No live source can rebuild the stage (the server says why and keeps waiting)."""


class MissingSource(RuntimeError):
    """A recovery source is not live (yet)."""
