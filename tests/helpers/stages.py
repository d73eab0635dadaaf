"""Stages in memory standing in for live servers, for tests of where a lost stage's weights come from
(node/pipeline/recovery.py `load_stage`) without a network."""

from __future__ import annotations

import asyncio
import random

from node.pipeline.recovery import load_stage
from node.pipeline.stages import PipelineStage, part_tensors
from protocol import StageAnnouncement
from protocol.pipeline import PIPELINE_VERSION, StageResult


def announce(stage: int, name: str, parts: list[str]) -> StageAnnouncement:
    return StageAnnouncement(
        node_id=name * 40,
        p2p_peer_id=name,
        model_fingerprint="m",
        num_stages=4,
        stage=stage,
        stage_fingerprint=f"fp{stage}",
        layer_start=stage,
        layer_end=stage + 1,
        parts=parts,
        state="serving",
        step=7,
        grad_norm=0.5,
        samples_per_s=1.0,
        recoveries=0,
        replicas=[],
    )


class LiveStages:
    """Stand-ins for live servers: `fetch` answers a weights call from a stage in memory, with its step and grad
    norm."""

    def __init__(self, stages: list[PipelineStage], grad_norms: dict[int, float]) -> None:
        self.stages, self.grad_norms, self.calls = stages, grad_norms, []
        self.in_flight = self.most_in_flight = 0

    async def fetch(self, source: StageAnnouncement, parts: list[str]):
        self.calls.append((source.stage, parts))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        for _ in range(3):  # a call over the network yields to the loop while its bytes come
            await asyncio.sleep(0)
        self.in_flight -= 1
        result = StageResult(
            v=PIPELINE_VERSION,
            tensors={},
            weights=b"",
            step=7,
            grad_norm=self.grad_norms.get(source.stage, 0.0),
            lr_scale=1.0,
        )
        return part_tensors(self.stages[source.stage], parts), result


def load(method, sources, target, view, live):
    fresh = lambda: PipelineStage.from_config(target.config, target.plan, target.index)  # noqa: E731
    return asyncio.run(
        load_stage(target, method, sources, [], view, live.fetch, random.Random(0), fresh, recovered_lr_scale=1.1)
    )
