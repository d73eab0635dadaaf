"""What a soak runs and does to it: the fault kinds, the plan (topology and schedule), one fault's record, and the
settings every process of the soak runs with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.lab.presets import PIPELINE_TIMINGS, TINY_MODEL

FAULT_KINDS = (
    "p2pd_kill",  # kill -9 the p2p daemon under a live join node
    "relay_restart",  # kill -9 the bootstrap node, the NAT'd nodes' relay, and start it again
    "partition",  # cut a few public nodes off the rest for fault_s
    "node_kill",  # kill -9 a join node and start it again
    "hostile_peer",  # a DHT peer storing malformed and oversized values for fault_s
    "disk_full",  # a node's state disk filled for fault_s, then freed
    "checkpoint_damage",  # a node stopped, its newest checkpoint's weights cut in half, killed and started again
    "clock_jump",  # a node's clocks 5 minutes ahead of its peers' for fault_s, then set right and the node restarted
    "stage_kill",  # kill -9 the server of pipeline stage 1 (the spare takes it; the killed one comes back as a spare)
    "pipeline_p2pd_kill",  # kill -9 the p2p daemons under the driver and the last stage's server (both rejoin)
)
NODE_FAULTS = ("p2pd_kill", "node_kill", "disk_full", "checkpoint_damage", "clock_jump")  # each on one join node
RELAY_PORT = 40100  # the bootstrap node's: a restarted relay must be found where the others were told it is
METRICS_PORT = 9100  # every process's /metrics, /healthz and /readyz, each in its own namespace
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
STATE_DISK_MB = 64
REJOINED = "rejoined the swarm as"  # the node's line once it is joined again over a new daemon (node/loop.py)
CLOCK_JUMP_S = 300  # protocol.MAX_CLOCK_SKEW_S's bound itself
CLOCK_SAID = "this node's clock looks"  # the node's line once its clock is off its peers' (node/stats.py clock_advice)
RESUMED = "resumed from round-"  # a restarted node's line once its policy is loaded (node/policy.py)
LISTENING = " listening on "  # ...and once it is joined (node/loop.py)

JOIN_SETS = [
    *TINY_MODEL,
    "rollout.completions_per_question=4",
    "rollout.max_new_tokens=4",
    "tasks.heldout_size=8",
    "tasks.format_reward=0.1",
    "swarm.transport=dht",
    "swarm.swarm_id=soak",
    "swarm.window_s=2",
    "swarm.heartbeat_interval_s=1",
    "swarm.heartbeat_ttl_s=15",
    "swarm.local_questions=2",
    "swarm.external_questions=2",
    # a tiny model knows nothing, nor do its peers: the shipped gate would turn every peer's group away
    "swarm.external_gate=none",
    f"swarm.metrics_port={METRICS_PORT}",
    "checkpoint_every=1",
    "checkpoint_keep=3",
    "eval_every=0",
    "torch_threads=1",
]
PIPELINE_SETS = [
    *PIPELINE_TIMINGS,
    "model.default.num_layers=3",
    "swarm.swarm_id=soak-pipeline",
    f"swarm.metrics_port={METRICS_PORT}",
]


@dataclass(frozen=True)
class SoakPlan:
    """What runs and what is done to it. The lab's nodes: join nodes 0..join_nodes-1 (0 bootstraps and relays, those in
    `natted` sit each behind a home router of its own), then the stage servers, the spares, the driver, and the
    hostile peer's namespace."""

    join_nodes: int = 8
    natted: tuple[int, ...] = (6, 7)
    stages: int = 3  # 0: no pipeline (and neither stage_kill nor pipeline_p2pd_kill)
    spares: int = 1
    faults: tuple[str, ...] = FAULT_KINDS
    cycles: int = 1  # the fault list, this many times over
    gap_s: float = 60.0  # calm after each fault's recovery, before the next
    fault_s: float = 60.0  # how long a partition, a full disk and the hostile peer last
    down_s: float = 10.0  # how long a killed process stays down before the soak starts it again
    recover_timeout_s: float = 300.0
    rss_baseline_s: float = 600.0  # RSS growth is measured from this long after each process's (last) start
    poll_s: float = 5.0
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; the kinds: {', '.join(FAULT_KINDS)}")
        if not 2 <= self.join_nodes <= 64 or any(not 0 < i < self.join_nodes for i in self.natted):
            raise ValueError("2 to 64 join nodes; the NAT'd ones among 1..join_nodes-1 (node 0 is the relay)")
        if "stage_kill" in self.faults and (self.stages < 2 or self.spares < 1):
            raise ValueError("stage_kill needs a pipeline of at least 2 stages and a spare")
        if "pipeline_p2pd_kill" in self.faults and self.stages < 1:
            raise ValueError("pipeline_p2pd_kill needs a pipeline")
        if len(self.public) < 1:
            raise ValueError("at least one public join node besides node 0")

    @property
    def public(self) -> list[int]:
        """The public join nodes besides the bootstrap node."""
        return [i for i in range(1, self.join_nodes) if i not in self.natted]

    def target(self, kind: str) -> int:
        """The join node a fault hits: each kind its own public node, where there are enough of them."""
        return self.public[NODE_FAULTS.index(kind) % len(self.public)]

    @property
    def cut(self) -> set[int]:
        """The nodes a partition cuts off: the lower half of the public ones (at least one)."""
        return set(self.public[: max(1, len(self.public) // 2)])

    def stage_index(self, stage: int) -> int:
        return self.join_nodes + stage

    def spare_index(self, spare: int) -> int:
        return self.join_nodes + self.stages + spare

    @property
    def driver(self) -> int | None:
        return self.join_nodes + self.stages + self.spares if self.stages else None

    @property
    def hostile(self) -> int:
        return self.join_nodes + (self.stages + self.spares + 1 if self.stages else 0)

    @property
    def lab_nodes(self) -> int:
        return self.hostile + 1


@dataclass
class Event:
    kind: str
    target: int | list[int]
    start: float  # the fault injected
    end: float | None = None  # lifted (the process started again, the link healed, the disk freed)
    recovered: dict[int, float | None] = field(default_factory=dict)  # per process hit: its next exchange
    details: dict = field(default_factory=dict)

    def recovery_s(self) -> float | None:
        """Fault lifted to the last hit process's next exchange (None: one never exchanged again in time)."""
        if not self.recovered or any(t is None for t in self.recovered.values()):
            return None
        return max(t for t in self.recovered.values()) - (self.end or self.start)
