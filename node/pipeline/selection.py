"""Which stage a server takes, and when a serving server moves: pure functions over a `StageMap`.

Petals splits its server the same way (src/petals/server/block_selection.py): what to serve is
decided by functions of what the DHT shows, with no network and no torch, so every rule here
is unit-tested (tests/test_stage_selection.py) and the server only feeds them maps.

Liveness (`live_view`). A killed server's last announcement stays readable for `announce_ttl_s`;
a chooser that counted it would leave the dead stage empty (issue #24). An announcement is
therefore not counted once a driver's standing `StageLost` report of its stage is newer (the
driver found every server of that stage failing; the report stands until one announces
again). A newcomer (`--stage auto`) is stricter still: it counts only announcements signed
within `FRESH_INTERVALS` announce intervals (a live server re-signs every interval), so it
sees a dead stage even before a driver reports it; a wrong guess (a server that was only
slow to announce) just makes it a replica. Spares and moving replicas, whose mistakes cost
more, count everything within the TTL that no report superseded: on a loaded machine an
announcement can be late by more than a few intervals (measured in the tests), and replicas
that took such a stage for dead moved in a cascade.

Choosing (`choose_stage`, for `--stage auto`): a stage with no live or loading server first,
a reported-lost one before one that merely aged out, lowest index first; else Petals' rule,
the stage with the fewest servers, then the least throughput.

Spares (`spare_assignment`): the same holes, shared out by node id rank, so spares that see
the same map agree without talking.

Rebalancing (`plan_move`), checked by each serving server every announce interval:
1. a stage left with no server for `grace_s` (as this server observed it) gets a replica of
   a stage that has several: the movers are every server of such a stage but its keeper
   (the smallest node id), ranked by node id; the k-th mover takes the k-th hole; a server moves
   only while another server of its stage is fresh (a dead replica's announcement is no company);
2. else, when every stage is served and every server has measured its throughput, Petals'
   rule: the one move that raises the pipeline's bottleneck (the least total samples/s of any
   stage) the most is made if it raises it by more than 1/`balance_quality`, and only by the
   server that move names.
Why this cannot flap: a mover never leaves a stage it alone serves, so rule 1 only ever fills
holes (their number falls with each move), and rule 2 moves only when the bottleneck rises by
a factor above 1/`balance_quality` > 1; a move back would lower it again, and the bottleneck
cannot rise forever (it is bounded by the total throughput). Every server computes the same
single move from the same map, so two servers never leave one stage at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from node.pipeline.stagemap import StageMap
from protocol import StageAnnouncement

FRESH_INTERVALS = 2.5  # announce intervals after which a silent server is not counted by choosers


def fresh_window_s(announce_interval_s: float, announce_ttl_s: float) -> float:
    """How recent an announcement must be for a chooser to count it."""
    return min(announce_ttl_s, FRESH_INTERVALS * announce_interval_s)


def live_view(stage_map: StageMap, now: float, fresh_s: float) -> StageMap:
    """The part of `stage_map` a chooser counts: fresh announcements not superseded by a lost report.
    Its `lost` keeps only the reports still standing (no server of the stage announced after them)."""

    def counted(item: StageAnnouncement) -> bool:
        signed = stage_map.signed_at.get(item.node_id, now)
        lost_at = stage_map.lost.get(item.stage)
        return now - signed <= fresh_s and (lost_at is None or item.state == "spare" or signed > lost_at)

    announced = [s for group in (*stage_map.servers.values(), *stage_map.loading.values()) for s in group]
    kept = [s for s in announced + stage_map.spares if counted(s)]
    # a report is superseded by any later announcement of its stage, fresh or not: a live server that is only slow
    # to re-announce must not bring back an old report (it would rank its stage before a really dead one)
    standing = {
        i: t
        for i, t in stage_map.lost.items()
        if not any(s.stage == i and stage_map.signed_at.get(s.node_id, now) > t for s in announced)
    }
    view = StageMap.from_announcements(
        stage_map.num_stages, kept, {s.node_id: stage_map.signed_at.get(s.node_id, now) for s in kept}, standing
    )
    view.refused = stage_map.refused
    return view


def stages_to_report(stage_map: StageMap, missing: list[int], failed_at: dict[str, float]) -> list[int]:
    """The stages a driver that finds `missing` without a usable server reports lost: not those being rebuilt
    (a loading server is there), nor those with a server that announced after it failed our call (`failed_at`:
    node id -> unix time of that failure). That one is alive, only slow or briefly stuck: a report, signed now,
    would hide its earlier announcements from every chooser until it announces again, and a waiting driver
    re-reports every few seconds, so a newcomer would rebuild a stage that has a server and leave a dead one
    empty. (A dead server's clock running ahead of ours by more than the time since its last announcement could
    make it look alive here until its announcement ages out of the TTL.)"""

    def announced_since_failing(stage: int) -> bool:
        return any(
            stage_map.signed_at.get(s.node_id, 0.0) > failed_at.get(s.node_id, math.inf)
            for s in stage_map.servers.get(stage, [])
        )

    return [i for i in missing if not stage_map.loading.get(i) and not announced_since_failing(i)]


def lost_report(
    previous: dict[int, float], found: list[int], dated: set[int], now: float, hold_s: float
) -> dict[int, float]:
    """A driver's next report (stage -> when found lost) from its last one and the stages it `found` lost now.

    A stage keeps the time it was first found in this wait (`dated`: those found earlier in it), so publishing
    again does not re-date it; found again in a later wait (it was served in between), it is dated anew. A stage
    no longer found stays named for `hold_s` (the announcements' TTL) after its loss: until then its dead
    server's last announcement is readable, and dropping the stage from the report (the record is replaced)
    would let every reader count that server as live again, beside the one that rebuilt the stage."""
    report = {i: t for i, t in previous.items() if now - t < hold_s}
    for i in found:
        report[i] = previous[i] if i in dated and i in previous else now
    return report


def holes(view: StageMap) -> list[int]:
    """Stages with no serving and no loading server, reported-lost ones first, then by index."""
    empty = [i for i in range(view.num_stages) if not view.servers.get(i) and not view.loading.get(i)]
    return sorted(empty, key=lambda i: (i not in view.lost, i))


def choose_stage(view: StageMap) -> tuple[int, str]:
    """(stage, cause) for a server joining with `--stage auto`."""
    empty = holes(view)
    if empty:
        stage = empty[0]
        return stage, "auto: lost (a driver reported it)" if stage in view.lost else "auto: no live server"
    return view.least_served(), "auto: least served"


def spare_assignment(view: StageMap, node_id: str) -> int | None:
    """The hole this spare takes, or None. Spares wait while the pipeline has no server at all (not started yet)."""
    if not view.servers:
        return None
    rank = sorted({s.node_id for s in view.spares} | {node_id}).index(node_id)
    empty = holes(view)
    return empty[rank] if rank < len(empty) else None


@dataclass(frozen=True)
class Move:
    """A serving server's decision to serve another stage."""

    stage: int
    cause: str


def update_empty_since(empty_since: dict[int, float], view: StageMap, now: float) -> dict[int, float]:
    """When each current hole was first seen empty (a stage seen served again starts over)."""
    return {i: empty_since.get(i, now) for i in holes(view)}


def _serving(view: StageMap, stage: int, me: StageAnnouncement) -> list[StageAnnouncement]:
    """Serving servers of `stage`, with this server counted by its own current announcement."""
    others = [s for s in view.servers.get(stage, []) if s.node_id != me.node_id]
    return others + [me] if me.stage == stage and me.state == "serving" else others


def movers(view: StageMap, me: StageAnnouncement) -> list[StageAnnouncement]:
    """Servers free to move: those of stages served by several, except each stage's keeper (smallest node id)."""
    free = []
    for stage in range(view.num_stages):
        group = sorted(_serving(view, stage, me), key=lambda s: s.node_id)
        free += group[1:]
    return sorted(free, key=lambda s: s.node_id)


def bottleneck_move(view: StageMap, me: StageAnnouncement) -> tuple[StageAnnouncement, int, float] | None:
    """Petals' throughput rule: (mover, target stage, new bottleneck / old) of the best single move, or None
    when some stage is unserved or some server has not measured its throughput yet."""
    groups = {i: _serving(view, i, me) for i in range(view.num_stages)}
    if any(not group for group in groups.values()) or any(
        s.samples_per_s <= 0 for group in groups.values() for s in group
    ):
        return None
    totals = {i: sum(s.samples_per_s for s in group) for i, group in groups.items()}
    bottleneck = min(totals.values())
    best = None
    for mover in movers(view, me):
        after = dict(totals)
        after[mover.stage] -= mover.samples_per_s
        target = min((i for i in after if i != mover.stage), key=lambda i: (after[i], i))
        after[target] += mover.samples_per_s
        gain = min(after.values()) / bottleneck
        if best is None or gain > best[2]:  # movers are in node id order: ties go to the smallest id
            best = (mover, target, gain)
    return best


def plan_move(
    view: StageMap,
    me: StageAnnouncement,
    empty_since: dict[int, float],
    now: float,
    grace_s: float,
    balance_quality: float,
    fresh_s: float = math.inf,
) -> Move | None:
    """Should this serving server (`me`, its current announcement) move, and where? See the module docstring.

    It leaves its stage only while another server of it re-signed within `fresh_s` (see `fresh_window_s`): a
    killed replica's last announcement stays in a TTL view, and comes back into it when the driver's next report
    replaces the one that named its stage; counting it as company would move the stage's only live server away.
    """
    company = [
        s
        for s in _serving(view, me.stage, me)
        if s.node_id != me.node_id and now - view.signed_at.get(s.node_id, -math.inf) <= fresh_s
    ]
    if me.state != "serving" or not company:
        return None
    overdue = [i for i in holes(view) if now - empty_since.get(i, now) >= grace_s]
    free = [s.node_id for s in movers(view, me)]
    if overdue:
        rank = free.index(me.node_id) if me.node_id in free else len(overdue)
        if rank < len(overdue):
            stage = overdue[rank]
            return Move(stage, f"stage {stage} had no live server for {now - empty_since[stage]:.1f}s")
        return None
    if holes(view):
        return None  # a hole younger than the grace period: its newcomer or a spare may still come
    best = bottleneck_move(view, me)
    if best is not None and best[0].node_id == me.node_id and best[2] * balance_quality > 1.0:
        return Move(best[1], f"throughput: the bottleneck rises x{best[2]:.2f}")
    return None
