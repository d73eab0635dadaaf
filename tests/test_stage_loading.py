"""The rules of loading a stage's weights (node/pipeline/stage_loading.py), without a network: the stage map a
loader reads is scripted here, and its `weights` calls are answered by a subclass that plays the live servers."""

from __future__ import annotations

import asyncio
import random

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from node.config import load_config
from node.pipeline.client import HopFailed
from node.pipeline.stage_loading import StageLoader
from node.pipeline.stagemap import StageMap
from node.pipeline.stages import PipelineStage, StagePart, StagePlan, part_tensors
from node.transport.session import SwarmSession
from protocol import NodeIdentity, StageAnnouncement
from protocol.pipeline import PIPELINE_VERSION, StageResult

PLAN = StagePlan(4, 3)  # 4 decoder layers in 3 stages: stage 1 is in the middle
FINGERPRINT = "fp1"  # stage 1's


def model(seed: int):
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def announce(stage: int, node_id: str, state: str = "serving") -> StageAnnouncement:
    return StageAnnouncement(
        node_id=node_id,
        p2p_peer_id=node_id[:12],
        model_fingerprint="m",
        num_stages=PLAN.num_stages,
        stage=stage,
        stage_fingerprint=f"fp{stage}",
        layer_start=PLAN.layer_range(stage).start,
        layer_end=PLAN.layer_range(stage).stop,
        parts=["layers"],
        state=state,
        step=7,
        grad_norm=0.5,
        samples_per_s=1.0,
        recoveries=0,
        replicas=[],
    )


class ScriptedLoader(StageLoader):
    """Reads the stage maps of `views` in turn (the last one again and again); `donor` answers every weights call
    except those to `down` servers, which fail as a silent server does."""

    def __init__(self, views: list[list[StageAnnouncement]], donor: PipelineStage, down: set[str], seed: int):
        session = SwarmSession(
            load_config(None, ["pipeline.num_stages=3", "pipeline.announce_interval_s=0.02", "pipeline.avoid_s=600"]),
            dht=None,
            reachability="direct",
            identity=NodeIdentity.generate(),
        )
        super().__init__(session, "test/pipeline", limits=None, read_view=self.scripted_view, rng=random.Random(seed))
        self.views, self.donor, self.down = views, donor, down
        self.reads = 0
        self.calls: list[str] = []

    async def scripted_view(self) -> tuple[StageMap, StageMap]:
        announcements = self.views[min(self.reads, len(self.views) - 1)]
        self.reads += 1
        return StageMap.from_announcements(PLAN.num_stages, announcements), StageMap.from_announcements(
            PLAN.num_stages, announcements
        )

    async def fetch(self, source, parts, local):
        self.calls.append(source.node_id)
        if source.node_id in self.down:
            raise HopFailed(source, "timeout", "scripted: it never answers")
        return part_tensors(self.donor, parts), StageResult(
            v=PIPELINE_VERSION, tensors={}, weights=b"", step=7, grad_norm=0.5, lr_scale=1.0
        )


def load(loader: ScriptedLoader, target: PipelineStage):
    fresh = lambda: PipelineStage.from_config(target.config, PLAN, target.index)  # noqa: E731
    return asyncio.run(loader.load(target, FINGERPRINT, fresh))


def assert_holds(stage: PipelineStage, donor: PipelineStage) -> None:
    for name, tensor in stage.part_state_dict(StagePart.LAYERS).items():
        assert torch.equal(tensor, donor.part_state_dict(StagePart.LAYERS)[name]), name


def test_a_replica_whose_call_failed_is_left_out_and_another_one_copied():
    donor = PipelineStage.from_model(model(1), PLAN, 1)
    silent, live = "a" * 40, "b" * 40
    # a seed whose rng picks the silent replica first (of the two the loader may take)
    seed = next(s for s in range(100) if random.Random(s).choice([silent, live]) == silent)
    loader = ScriptedLoader([], donor, down={silent}, seed=seed)
    # our own announcement of stage 1 (a moving server's may still look live) is never a source
    loader.views = [[announce(1, loader.node_id), announce(1, silent), announce(1, live)]]
    target = PipelineStage.from_model(model(0), PLAN, 1)
    event = load(loader, target)
    assert loader.calls == [silent, live]  # tried once, then left out for avoid_s
    assert event.method == "replica_copy" and [s["node_id"] for s in event.sources] == [live]
    assert_holds(target, donor)


def test_a_stage_that_cannot_be_rebuilt_yet_is_loaded_once_a_source_is_live():
    donor = PipelineStage.from_model(model(1), PLAN, 1)
    # trained (a step was taken), but no replica and no live neighbour: CheckFree has nothing to average
    nothing_live = [announce(0, "c" * 40, state="loading")]
    loader = ScriptedLoader([nothing_live, nothing_live, [*nothing_live, announce(1, "b" * 40)]], donor, set(), 0)
    target = PipelineStage.from_model(model(0), PLAN, 1)
    event = load(loader, target)
    assert loader.reads == 3 and loader.calls == ["b" * 40]
    assert event.method == "replica_copy" and event.step == 7
    assert_holds(target, donor)
