"""Who serves which stage: signed stage announcements in the DHT, read into a `StageMap`.

Key: `<swarm prefix>/stages` (every model's pipeline: readers keep their model's), subkey = the announcer's node id, value =
a signed `protocol.StageAnnouncement` envelope; readers keep those signed less than `announce_ttl_s`
ago (the DHT drops them later, records.RECORD_TTL_S). A server re-announces every
`announce_interval_s`; one that stops (killed, hung) drops out of every reader's map within
`announce_ttl_s`. Drivers route over the map, joining
servers pick their stage from it (`auto`: least live capacity), spares watch it for a
stage with no server left, and recoveries find their sources in it.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

from node.config import NodeConfig
from node.transport.dht import key_prefix
from protocol import MessageKind, NodeIdentity, StageAnnouncement

log = logging.getLogger(__name__)

MAX_ANNOUNCEMENTS = 512  # read per key: bounds what a flood of subkeys can cost a reader


def stages_key(swarm_id: str) -> str:
    return f"{key_prefix(swarm_id)}/stages"


@dataclass
class StageMap:
    """Live announcements of one model's pipeline, by stage."""

    num_stages: int
    servers: dict[int, list[StageAnnouncement]] = field(default_factory=dict)  # serving, by stage
    loading: dict[int, list[StageAnnouncement]] = field(default_factory=dict)  # copying or recovering weights
    spares: list[StageAnnouncement] = field(default_factory=list)
    refused: int = 0  # announcements refused while reading (bad signature, wrong model, ...)

    @classmethod
    def from_announcements(cls, num_stages: int, announcements: list[StageAnnouncement]) -> "StageMap":
        stage_map = cls(num_stages)
        for item in announcements:
            if item.state == "spare":
                stage_map.spares.append(item)
            elif item.state == "loading":
                stage_map.loading.setdefault(item.stage, []).append(item)
            else:
                stage_map.servers.setdefault(item.stage, []).append(item)
        return stage_map

    def live(self, stage: int, avoid: set[str] = frozenset()) -> list[StageAnnouncement]:
        return [s for s in self.servers.get(stage, []) if s.node_id not in avoid]

    def pick(self, stage: int, rng: random.Random, avoid: set[str] = frozenset()) -> StageAnnouncement | None:
        """A random live server of `stage` (SWARM/NoLoCo routing), or None."""
        candidates = self.live(stage, avoid)
        return rng.choice(candidates) if candidates else None

    def empty_stages(self) -> list[int]:
        return [i for i in range(self.num_stages) if not self.servers.get(i)]

    def trained(self) -> bool:
        """Has this pipeline taken any step? (Then a missing stage must be recovered, not re-initialised.)"""
        return any(s.step > 0 for group in (*self.servers.values(), *self.loading.values()) for s in group)

    def least_served(self) -> int:
        """Petals' choice for a joining server: the stage with the fewest live servers, then the least throughput."""
        def capacity(i: int) -> tuple[int, float, int]:
            servers = self.servers.get(i, []) + self.loading.get(i, [])
            return (len(servers), sum(s.samples_per_s for s in servers), i)
        return min(range(self.num_stages), key=capacity)

    def rows(self) -> list[dict]:
        """One row per stage for `peers` and the dashboard."""
        return [
            {
                "stage": i,
                "servers": [s.node_id for s in self.servers.get(i, [])],
                "loading": [s.node_id for s in self.loading.get(i, [])],
                "layers": f"{s.layer_start}-{s.layer_end - 1}" if (s := next(iter(self.servers.get(i, []) + self.loading.get(i, [])), None)) else "",
                "samples_per_s": round(sum(s.samples_per_s for s in self.servers.get(i, [])), 2),
                "step": max((s.step for s in self.servers.get(i, [])), default=0),
                "grad_norm": max((s.grad_norm for s in self.servers.get(i, [])), default=0.0),
                "recoveries": sum(s.recoveries for s in self.servers.get(i, []) + self.loading.get(i, [])),
            }
            for i in range(self.num_stages)
        ]


async def read_announcements(dht, config: NodeConfig) -> tuple[list[StageAnnouncement], int]:
    """Every live, verified stage announcement of the swarm, and how many were refused."""
    from node.transport.records import read_records

    refused = []
    now = time.time()
    envelopes = await read_records(dht, stages_key(config.swarm.swarm_id), config.swarm.swarm_id, MessageKind.STAGE_ANNOUNCEMENT, config.swarm.dht_timeout_s,
                                   MAX_ANNOUNCEMENTS, lambda owner, rejection: refused.append(owner))
    return [e.message for e in envelopes if now - e.timestamp <= config.pipeline.announce_ttl_s], len(refused)


async def read_stage_map(dht, config: NodeConfig, model_fingerprint: str) -> StageMap:
    """The live, verified announcements of `model_fingerprint`'s pipeline."""
    announcements, refused = await read_announcements(dht, config)
    ours = [a for a in announcements if a.model_fingerprint == model_fingerprint and a.num_stages == config.pipeline.num_stages]
    stage_map = StageMap.from_announcements(config.pipeline.num_stages, ours)
    stage_map.refused = refused + sum(1 for a in announcements if a.model_fingerprint == model_fingerprint and a.num_stages != config.pipeline.num_stages)
    return stage_map


async def read_stage_maps(dht, config: NodeConfig) -> dict[str, StageMap]:
    """Every pipeline of the swarm, by model fingerprint (what `swarm-node peers` shows)."""
    announcements, _ = await read_announcements(dht, config)
    models: dict[tuple[str, int], list[StageAnnouncement]] = {}
    for item in announcements:
        models.setdefault((item.model_fingerprint, item.num_stages), []).append(item)
    return {fingerprint: StageMap.from_announcements(stages, items) for (fingerprint, stages), items in sorted(models.items())}


class Announcer:
    """Signs and stores this node's stage announcements under its own subkey."""

    def __init__(self, dht, config: NodeConfig, identity: NodeIdentity) -> None:
        from node.transport.records import RecordWriter

        self.dht = dht
        self.config = config
        self.key = stages_key(config.swarm.swarm_id)
        self.writer = RecordWriter(identity, config.swarm.swarm_id)

    async def publish(self, announcement: StageAnnouncement) -> bool:
        ok = await self.writer.store(self.dht, self.key, announcement, self.config.swarm.dht_timeout_s)
        if not ok:
            log.warning("the DHT did not take our stage announcement")
        return ok
