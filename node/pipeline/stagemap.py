"""Who serves which stage: signed stage announcements in the DHT, read into a `StageMap`.

Key: `<swarm prefix>/stages` (every model's pipeline: readers keep their model's), subkey = the announcer's node id,
value =
a signed `protocol.StageAnnouncement` envelope; readers keep those signed less than `announce_ttl_s`
ago (the DHT drops them later, records.RECORD_TTL_S). A server re-announces every
`announce_interval_s`; one that stops (killed, hung) drops out of every reader's map within
`announce_ttl_s`. Drivers route over the map, joining
servers pick their stage from it (`auto`: least live capacity), spares watch it for a
stage with no server left, and recoveries find their sources in it.

Lost reports: key `<swarm prefix>/stages-lost`, subkey = a driver's node id, value = a signed
`protocol.StageLost` naming the stages whose every server failed its calls, and when each was found so. Choosers read
both keys and count as live only what `selection.live_view` keeps: announcements refreshed
within a couple of announce intervals and not older than a lost report of their stage.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from node.config import NodeConfig
from node.transport.joining import key_prefix
from protocol import MessageKind, StageAnnouncement, StageLost
from protocol.messages import MAX_LOST_STAGES

log = logging.getLogger(__name__)

MAX_ANNOUNCEMENTS = 512  # read per key: bounds what a flood of subkeys can cost a reader


def stages_key(swarm_id: str) -> str:
    return f"{key_prefix(swarm_id)}/stages"


def lost_key(swarm_id: str) -> str:
    return f"{key_prefix(swarm_id)}/stages-lost"


@dataclass
class StageMap:
    """Live announcements of one model's pipeline, by stage."""

    num_stages: int
    servers: dict[int, list[StageAnnouncement]] = field(default_factory=dict)  # serving, by stage
    loading: dict[int, list[StageAnnouncement]] = field(default_factory=dict)  # copying or recovering weights
    spares: list[StageAnnouncement] = field(default_factory=list)
    refused: int = 0  # announcements refused while reading (bad signature, wrong model, ...)
    signed_at: dict[str, float] = field(default_factory=dict)  # node id -> unix time its announcement was signed
    # stage -> unix time of the latest driver report that it was lost
    lost: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_announcements(
        cls,
        num_stages: int,
        announcements: list[StageAnnouncement],
        signed_at: dict[str, float] | None = None,
        lost: dict[int, float] | None = None,
    ) -> "StageMap":
        stage_map = cls(num_stages, signed_at=dict(signed_at or {}), lost=dict(lost or {}))
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
        """One row per stage for `peers` and the dashboard; `lost`: a driver reported every server of it failing, and
        the servers it had then are left out (they have not announced since)."""
        rows = []
        for i in range(self.num_stages):
            lost_at = self.lost.get(i)
            servers = [
                s for s in self.servers.get(i, []) if lost_at is None or self.signed_at.get(s.node_id, 0.0) > lost_at
            ]
            loading = self.loading.get(i, [])
            first = next(iter(servers + loading + self.servers.get(i, [])), None)
            rows.append(
                {
                    "stage": i,
                    "lost": lost_at is not None,
                    "servers": [s.node_id for s in servers],
                    "loading": [s.node_id for s in loading],
                    "layers": f"{first.layer_start}-{first.layer_end - 1}" if first else "",
                    "samples_per_s": round(sum(s.samples_per_s for s in servers), 2),
                    "step": max((s.step for s in servers), default=0),
                    "grad_norm": max((s.grad_norm for s in servers), default=0.0),
                    "recoveries": sum(s.recoveries for s in servers + loading),
                }
            )
        return rows


async def read_announcements(dht, config: NodeConfig) -> tuple[list[tuple[StageAnnouncement, float]], int]:
    """Every verified stage announcement of the swarm younger than `announce_ttl_s`, with the time it was signed,
    and how many were refused."""
    from node.transport.records import read_records

    refused = []
    now = time.time()
    envelopes = await read_records(
        dht,
        stages_key(config.swarm.swarm_id),
        config.swarm.swarm_id,
        MessageKind.STAGE_ANNOUNCEMENT,
        config.swarm.dht_timeout_s,
        MAX_ANNOUNCEMENTS,
        lambda owner, rejection: refused.append(owner),
    )
    return [(e.message, e.timestamp) for e in envelopes if now - e.timestamp <= config.pipeline.announce_ttl_s], len(
        refused
    )


async def announced_addresses(dht, config: NodeConfig) -> list[list[str]]:
    """The p2p daemon addresses of every live stage announcement in the swarm (every model's pipeline), one list per
    announcer: where a stage server's or a driver's session membership finds its peers again after a partition (they
    read no heartbeats)."""
    announcements, _ = await read_announcements(dht, config)
    return [list(announcement.p2p_maddrs) for announcement, _ in announcements]


async def read_lost_reports(dht, config: NodeConfig) -> list[tuple[StageLost, float]]:
    """Drivers' verified lost reports younger than the record lifetime, with the time each was signed."""
    from node.transport.records import read_records

    envelopes = await read_records(
        dht,
        lost_key(config.swarm.swarm_id),
        config.swarm.swarm_id,
        MessageKind.STAGE_LOST,
        config.swarm.dht_timeout_s,
        MAX_ANNOUNCEMENTS,
    )
    return [(e.message, e.timestamp) for e in envelopes]


def latest_losses(reports: list[tuple[StageLost, float]], model_fingerprint: str, num_stages: int) -> dict[int, float]:
    """stage -> the latest time a report about this pipeline says it was found lost."""
    lost: dict[int, float] = {}
    for report, signed in reports:
        if report.model_fingerprint == model_fingerprint and report.num_stages == num_stages:
            for stage, found in report.times(signed).items():
                lost[stage] = max(lost.get(stage, 0.0), found)
    return lost


async def read_losses(dht, config: NodeConfig, model_fingerprint: str) -> dict[int, float]:
    """stage -> when a driver last reported it lost, for `model_fingerprint`'s pipeline (the lost key only)."""
    return latest_losses(await read_lost_reports(dht, config), model_fingerprint, config.pipeline.num_stages)


async def wait_for_lost_report(
    read_losses: Callable[[], Awaitable[dict[int, float]]], known: dict[int, float], timeout_s: float, poll_s: float
) -> bool:
    """Wait up to `timeout_s`, reading `read_losses()` (stage -> when a driver found it lost) every `poll_s`; True as
    soon as it names a stage lost later than `known` says, False at the timeout. How a spare hears of a lost stage
    within a poll of the report, while it reads the whole stage map far less often."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        await asyncio.sleep(min(poll_s, left))
        if time.monotonic() >= deadline:
            break
        lost = await read_losses()
        if any(found > known.get(stage, 0.0) for stage, found in lost.items()):
            return True
    return False


async def read_stage_map(dht, config: NodeConfig, model_fingerprint: str) -> StageMap:
    """The verified announcements (and lost reports) of `model_fingerprint`'s pipeline."""
    announcements, refused = await read_announcements(dht, config)
    num_stages = config.pipeline.num_stages
    ours = [(a, t) for a, t in announcements if a.model_fingerprint == model_fingerprint and a.num_stages == num_stages]
    lost = await read_losses(dht, config, model_fingerprint)
    stage_map = StageMap.from_announcements(num_stages, [a for a, _ in ours], {a.node_id: t for a, t in ours}, lost)
    stage_map.refused = refused + sum(
        1 for a, _ in announcements if a.model_fingerprint == model_fingerprint and a.num_stages != num_stages
    )
    return stage_map


async def read_stage_maps(dht, config: NodeConfig) -> dict[str, StageMap]:
    """Every pipeline of the swarm, by model fingerprint (what `swarm-node peers` shows)."""
    announcements, _ = await read_announcements(dht, config)
    reports = await read_lost_reports(dht, config)
    models: dict[tuple[str, int], list[tuple[StageAnnouncement, float]]] = {}
    for item, signed in announcements:
        models.setdefault((item.model_fingerprint, item.num_stages), []).append((item, signed))
    maps = {}
    for (fingerprint, stages), items in sorted(models.items()):
        lost = latest_losses(reports, fingerprint, stages)
        # a stage announced again after the report is back: only the reports still standing are shown
        standing = {
            i: t
            for i, t in lost.items()
            if not any(a.stage == i and a.state != "spare" and signed > t for a, signed in items)
        }
        maps[fingerprint] = StageMap.from_announcements(
            stages, [a for a, _ in items], {a.node_id: t for a, t in items}, standing
        )
    return maps


class LostReporter:
    """A driver's lost reports: signs and stores which stages it found with every server failing (one record,
    replaced)."""

    def __init__(self, session, model_fingerprint: str) -> None:
        self.session = session  # node.transport.session.SwarmSession: signs and stores
        self.model_fingerprint = model_fingerprint
        self.key = lost_key(session.config.swarm.swarm_id)

    async def publish(self, lost_at: dict[int, float]) -> bool:
        """Replace our report with `lost_at` (stage -> unix time we found it lost)."""
        stages = sorted(lost_at)[:MAX_LOST_STAGES]
        report = StageLost(
            node_id=self.session.identity.node_id,
            model_fingerprint=self.model_fingerprint,
            num_stages=self.session.config.pipeline.num_stages,
            stages=stages,
            lost_at=[float(lost_at[i]) for i in stages],
        )
        return await self.session.store(self.key, report)


class Announcer:
    """Signs and stores this node's stage announcements under its own subkey."""

    def __init__(self, session) -> None:
        self.session = session  # node.transport.session.SwarmSession: signs and stores
        self.key = stages_key(session.config.swarm.swarm_id)

    async def publish(self, announcement: StageAnnouncement) -> bool:
        return await self.session.store(self.key, announcement)
