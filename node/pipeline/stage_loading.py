"""Loading a stage's weights from the live swarm: which way and from whom, tried again until it works.

A stage server taking up a stage (at its start, or moving) hands `StageLoader.load` the stage built from the
initial model. Each try reads the stage map (`read_view`: what spares and moving replicas count as live, within
the announcement TTL), lets `recovery.choose_method` pick the way (a replica's copy, CheckFree, CheckFree+, a
fresh start, the initial model) and `recovery.load_stage` the sources, and reads them with a pipeline `weights`
call (`fetch`, checked against the parts we hold). Never from disk. Its rules:
- a source whose call failed is left out for `pipeline.avoid_s`: its announcement may still look live, and
  the next try takes another replica or neighbour (or waits for one);
- while no way is possible (no live replica, no live neighbour on a side, a source not live yet), it waits
  half an announce interval and looks again, and says what it waits for at most every WAIT_LOG_EVERY_S;
- it never loads from itself (a moving server's last announcement may still show it serving).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable

import torch

from node.pipeline.client import HopFailed, call_stage, until_answered
from node.pipeline.driver import WAIT_LOG_EVERY_S
from node.pipeline.recovery import MissingSource, RecoveryEvent, RecoveryImpossible, choose_method, load_stage
from node.pipeline.stagemap import StageMap
from node.pipeline.stages import PipelineStage, part_tensors
from node.stats import LogThrottle
from node.weights.codec import CodecError, EncodedWeights, decode_weights
from node.weights.validation import WeightsRefused, validate_partner_weights
from protocol import StageAnnouncement
from protocol.pipeline import PIPELINE_VERSION, PipelineLimits, StageCall, StageResult

log = logging.getLogger(__name__)

# (everything announced, what counts as live): the stage map as a server loading its weights judges it
ReadView = Callable[[], Awaitable[tuple[StageMap, StageMap]]]


class StageLoader:
    """Loads stages' weights for one stage server (the rules of the module docstring)."""

    def __init__(self, session, protocol: str, limits: PipelineLimits, read_view: ReadView, rng: random.Random) -> None:
        self.session = session  # node.transport.session.SwarmSession: its p2p daemon carries the calls
        self.pipeline = session.config.pipeline
        self.node_id = session.identity.node_id
        self.protocol = protocol  # the p2p stream protocol of this model's pipeline calls
        self.limits = limits
        self.read_view = read_view
        self.rng = rng

    async def load(self, stage: PipelineStage, fingerprint: str, fresh: Callable[[], PipelineStage]) -> RecoveryEvent:
        """Load `stage`'s weights in place (its fingerprint `fingerprint`; `fresh()` builds a randomly initialised
        one); returns once loaded, with the event's cause and seconds left to the caller."""
        index, num_stages = stage.index, stage.plan.num_stages
        # source -> when its call failed: its announcement may still look live; left out for avoid_s
        failed: dict[str, float] = {}
        said = LogThrottle(WAIT_LOG_EVERY_S)  # what we wait for, said at most every WAIT_LOG_EVERY_S
        while True:
            stage_map, view = await self.read_view()
            now = time.monotonic()
            for group in view.servers.values():
                group[:] = [
                    s
                    for s in group
                    if now - failed.get(s.node_id, -math.inf) >= self.pipeline.avoid_s and s.node_id != self.node_id
                ]
            replicas = [s for s in view.live(index) if s.stage_fingerprint == fingerprint]
            live_stages = {i for i in range(num_stages) if view.live(i)}
            try:
                method, sources = choose_method(
                    index,
                    num_stages,
                    bool(replicas),
                    stage_map.trained(),
                    self.pipeline.recovery,
                    self.pipeline.checkfree_plus,
                    live_stages,
                )
                return await load_stage(
                    stage,
                    method,
                    sources,
                    replicas,
                    view,
                    lambda source, parts: self.fetch(source, parts, stage),
                    self.rng,
                    fresh,
                    self.pipeline.recovered_lr_scale,
                )
            except (RecoveryImpossible, MissingSource) as exc:
                if said.due(str(exc)):
                    log.warning("stage %d cannot be rebuilt yet: %s; waiting", index, exc)
            except HopFailed as exc:
                failed[exc.server.node_id] = time.monotonic()
                log.warning(
                    "stage %d: loading from %s failed (%s); trying again without it",
                    index,
                    exc.server.node_id[:12],
                    exc,
                )
            await asyncio.sleep(self.pipeline.announce_interval_s / 2)

    async def fetch(
        self, source: StageAnnouncement, parts: list[str], local: PipelineStage
    ) -> tuple[dict[str, torch.Tensor], StageResult]:
        """`parts` of `source`'s stage by a `weights` call; their tensors must match what `local` holds (names,
        shapes, dtypes, finite), else HopFailed, as for a call that failed."""
        call = StageCall(
            v=PIPELINE_VERSION,
            op="weights",
            stage=source.stage,
            stage_fingerprint=source.stage_fingerprint,
            call_id=f"weights-{time.time_ns()}",
            parts=parts,
            train=False,
            tensors={},
            scale=1.0,
        )
        result = await until_answered(
            lambda: call_stage(
                self.session.dht.p2p, self.protocol, source, call, self.limits, self.pipeline.call_timeout_s * 3
            )
        )
        if result.weights is None:
            raise HopFailed(source, "malformed", "a weights result without weights")
        try:
            encoded = EncodedWeights.from_bytes(
                result.weights, max_tensors=4096, max_values=self.limits.max_weights_bytes // 4
            )
            weights = decode_weights(encoded, dtype=None)
        except CodecError as exc:
            raise HopFailed(source, "malformed", str(exc)) from None
        # we only ever fetch parts we hold: their names and shapes are ours, but for the source stage's depth (a split's
        # stages differ by at most one layer)
        expected = part_tensors(local, parts, depth=len(local.plan.layer_range(source.stage)))
        try:
            validate_partner_weights(expected, weights, math.inf)  # names, shapes, dtypes, finite
        except WeightsRefused as exc:
            raise HopFailed(source, "refused_weights", str(exc)) from None
        return weights, result
