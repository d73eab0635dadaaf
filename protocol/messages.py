"""Every message a node sends, as a frozen dataclass with `to_wire()` and `from_wire()`.

`from_wire` is the only validator: it checks exact types, bounds and lengths against the
receiver's `Limits` and raises `ProtocolRejection` for anything else. The sender runs
the same check before signing (`encode_message`), so a node never publishes what its
peers would refuse. On the wire a message is a map keyed by its field names, in field
order; new fields are only ever appended, in a new minor version (see `version.py`).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self

from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.refusals import Refusal
from protocol.specs import SpecError, TaskSpec
from protocol.validation import (
    check_addresses,
    check_fields,
    check_float,
    check_int,
    check_list,
    check_str,
    reject,
    since_minor,
)
from protocol.version import PROTOCOL_MINOR

MAX_TOKEN_ID = 2**31 - 1  # vocabularies are far smaller; fits an int32 on every side
MAX_FINGERPRINT_CHARS = 64  # e.g. a sha256 hex digest of the model's architecture and weights
MAX_DATASETS_REPORTED = 32  # datasets of a task mix a heartbeat reports on
# Bounds of a heartbeat's overlap fields (minor 10), far above what a round can reach: a completion resumes first in the
# round after it stopped, so it is a few versions behind at most; a round carries at most (1 + 4) * questions * G.
MAX_VERSIONS_BEHIND = 1_000_000
MAX_CARRIED = 1_000_000  # completions carried into or out of one round
MAX_AHEAD_WAIT_S = 86_400.0  # seconds one round waited for the rollouts generated during the round before
MAX_SAMPLER_IDLE_S = 86_400.0  # minor 11: seconds the sampler waited for a round to hand it the next questions
# How peers can reach a node (PeerStats.reachability): dialed at its own addresses; only through a
# circuit relay (its /p2p-circuit addresses); or not at all (behind NAT, no relay yet: it dials out,
# and peers reach it over the connections it opened). "": not measured (a minor 0-4 sender).
REACHABILITY = frozenset({"", "direct", "relayed", "outbound-only"})
FINISH_REASONS = ("stop", "length")
NODE_ID_PATTERN = re.compile(r"[0-9a-f]{40}")  # see identity.node_id_from_public_key
SPEC_FIELDS = frozenset(f.name for f in fields(TaskSpec))


def check_node_id(value: Any, name: str, limits: Limits) -> str:
    if not NODE_ID_PATTERN.fullmatch(check_str(value, name, limits.max_name_chars)):
        reject(Refusal.BAD_VALUE, f"{name} must be 40 lowercase hex characters")
    return value


class MessageKind(enum.StrEnum):
    """The envelope's `kind`: which message class its payload decodes to.

    A minor version may add kinds; an older node refuses them as `unknown_kind`, which
    says "upgrade me", not "this peer misbehaves".
    """

    ROLLOUT_BATCH = "rollout_batch"
    PEER_STATS = "peer_stats"
    STAGE_ANNOUNCEMENT = "stage_announcement"  # minor 1: a pipeline stage server (or spare) says what it serves
    AVERAGING_READY = "averaging_ready"  # minor 1: a node is (still) free to average in a round, or done
    STAGE_LOST = "stage_lost"  # minor 4: a pipeline driver found every server of some stages failing
    # Reserved for later minor versions (append here, never reuse a code):
    # "averaging_*"  NoLoCo outer-step gossip (announce, pseudo-gradient chunks, done);
    # (pipeline calls themselves travel on p2p streams: protocol/pipeline.py)


@dataclass(frozen=True)
class RolloutCompletion:
    """One sampled answer to a question."""

    text: str  # the completion as decoded text
    token_ids: list[int]  # sampled token ids, each in [0, 2^31)
    logprobs: list[float] | None  # sampler log-probability per token (finite, <= 0), None when not recorded
    finish_reason: str  # "stop": end of sequence sampled; "length": max_new_tokens reached

    def to_wire(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": list(self.token_ids),
            "logprobs": None if self.logprobs is None else list(self.logprobs),
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        token_ids = check_list(f["token_ids"], "token_ids", limits.max_tokens_per_completion)
        for token in token_ids:
            check_int(token, "token id", hi=MAX_TOKEN_ID)
        logprobs = f["logprobs"]
        if logprobs is not None:
            check_list(logprobs, "logprobs", limits.max_tokens_per_completion)
            if len(logprobs) != len(token_ids):
                reject(Refusal.BAD_STRUCTURE, f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
            for logprob in logprobs:
                check_float(logprob, "logprob", hi=0.0)
        if check_str(f["finish_reason"], "finish_reason", limits.max_name_chars) not in FINISH_REASONS:
            reject(Refusal.BAD_VALUE, f"finish_reason {f['finish_reason']!r} is not one of {FINISH_REASONS}")
        return cls(
            text=check_str(f["text"], "text", limits.max_string_chars),
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=f["finish_reason"],
        )


@dataclass(frozen=True)
class RolloutQuestion:
    """A question, named by its spec, with the completions a node sampled for it."""

    spec: TaskSpec  # re-derivable question: the receiver regenerates it and its ground truth
    completions: list[RolloutCompletion]  # 1..max_completions_per_question samples
    claimed_rewards: list[float]  # sender's reward per completion (finite); advisory, the receiver re-scores

    def to_wire(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_wire(),
            "completions": [c.to_wire() for c in self.completions],
            "claimed_rewards": list(self.claimed_rewards),
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        spec_wire = f["spec"]
        if minor > PROTOCOL_MINOR and type(spec_wire) is dict:  # a later minor may append spec fields too
            spec_wire = {key: value for key, value in spec_wire.items() if key in SPEC_FIELDS}
        try:
            spec = TaskSpec.from_wire(spec_wire)
        except (SpecError, RecursionError) as exc:  # a config nested past the recursion limit is not JSON data either
            reject(Refusal.BAD_SPEC, str(exc) or "task spec config is nested too deeply")
        completions = check_list(f["completions"], "completions", limits.max_completions_per_question, min_items=1)
        rewards = check_list(f["claimed_rewards"], "claimed_rewards", limits.max_completions_per_question)
        if len(rewards) != len(completions):
            reject(Refusal.BAD_STRUCTURE, f"{len(rewards)} claimed rewards for {len(completions)} completions")
        for reward in rewards:
            check_float(reward, "claimed reward")
        return cls(
            spec=spec,
            completions=[RolloutCompletion.from_wire(c, limits, minor=minor) for c in completions],
            claimed_rewards=rewards,
        )


@dataclass(frozen=True)
class RolloutBatch:
    """What a node shares each round: its questions and completions (SAPO rollout sharing)."""

    KIND: ClassVar[MessageKind] = MessageKind.ROLLOUT_BATCH

    round: int  # the sender's training round (>= 0) when it sampled these
    policy_version: int  # the sender's policy version that sampled them (>= 0); off-policy age = ours - this
    model_fingerprint: str  # <= 64 chars naming the model family; receivers skip batches of another model
    questions: list[RolloutQuestion]  # 0..max_questions questions

    def to_wire(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "policy_version": self.policy_version,
            "model_fingerprint": self.model_fingerprint,
            "questions": [q.to_wire() for q in self.questions],
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        questions = check_list(f["questions"], "questions", limits.max_questions)
        return cls(
            round=check_int(f["round"], "round"),
            policy_version=check_int(f["policy_version"], "policy_version"),
            model_fingerprint=check_str(f["model_fingerprint"], "model_fingerprint", MAX_FINGERPRINT_CHARS),
            questions=[RolloutQuestion.from_wire(q, limits, minor=minor) for q in questions],
        )

    def claimed_node_id(self) -> str | None:
        return None


@dataclass(frozen=True)
class PeerStats:
    """A node's heartbeat: who it is, where to reach it and how its training goes."""

    KIND: ClassVar[MessageKind] = MessageKind.PEER_STATS

    node_id: str  # must equal the node id of the envelope's signing key
    display_name: str  # human-chosen name for dashboards; not unique, not trusted
    software_version: str  # swarm-node package version
    protocol_version: str  # "major.minor" the sender speaks
    model_name: str  # model (or default-model preset) the node trains
    model_parameters: int  # its parameter count
    round: int  # current training round
    policy_version: int  # current policy version (optimizer steps applied)
    reward_mean: float  # moving average of rewards (finite; may be negative if a task penalizes)
    accuracy: float  # moving average of answers judged correct, in [0, 1]
    rollouts_published: int  # rollouts this node has shared
    rollouts_received: int  # rollouts received from peers
    rollouts_accepted: int  # received rollouts that passed checks and re-scoring
    rollouts_rejected: int  # received rollouts refused
    tokens_per_s: float  # recent sampling throughput
    uptime_s: float  # seconds since the node started
    last_seen: float  # unix time the sender composed these stats
    addresses: list[str]  # multiaddrs where the node listens, at most max_addresses
    gossip_addresses: list[str]  # libp2p gossipsub multiaddrs (empty: the node gossips over the DHT only)
    outer_steps: int  # weight-averaging rounds that succeeded (NoLoCo / DiLoCo)
    outer_steps_skipped: int  # weight-averaging rounds skipped (no partner in time, or weights refused)
    # minor 2: moving average of answers judged correct per dataset of the node's task mix (label -> [0, 1])
    accuracy_by_dataset: dict[str, float] = since_minor(2, dict)
    # minor 5: how peers can reach the node, as it measured it: one of REACHABILITY ("": not measured yet).
    # Unverifiable by the reader: a node that claims "direct" and is not only costs its callers a failed dial.
    reachability: str = since_minor(5, str)
    # minor 8: where the node trains, as it describes it: "cpu", or "cuda:0 " and the card's name ("": a minor 0-7
    # sender). For people reading the peers table; unverifiable, and nothing is decided on it.
    device: str = since_minor(8, str)
    # minor 9: times the node rebuilt its swarm connection after a part of it died (its p2p daemon, its membership):
    # a peers table shows who keeps losing it. Unverifiable, and nothing is decided on it.
    rejoins: int = since_minor(9, int)
    # minor 10: the overlap of generation with training in the node's last round; None where it is off (the default)
    # or from a minor 0-9 sender. Unverifiable, and nothing is decided on them: a peers table shows them.
    # Policy versions the oldest token of each of its own completions was behind the policy it trained, the mean and
    # the max (rollout.max_staleness, rollout.over_sample); both or neither, mean <= max.
    staleness_mean: float | None = since_minor(10, lambda: None)
    staleness_max: int | None = since_minor(10, lambda: None)
    # completions resumed from the round before, and stopped to resume in the next (rollout.over_sample): both or none
    carried_in: int | None = since_minor(10, lambda: None)
    carried_out: int | None = since_minor(10, lambda: None)
    # seconds the round waited for the rollouts generated during the round before (rollout.max_staleness 1; None in the
    # first round, which generated its own)
    ahead_wait_s: float | None = since_minor(10, lambda: None)
    # minor 11: the other side of that wait: seconds the sampler sat idle between finishing the rollouts it generated
    # ahead and being handed the next round's questions and weights (rollout.max_staleness 1; None where it is off, in
    # the node's first round, before it had generated any ahead, and from a minor 0-10 sender)
    sampler_idle_s: float | None = since_minor(11, lambda: None)
    # minor 12: times the node's process started again over its state directory after one that did not stop cleanly
    # (killed, crashed) or because a round stalled (swarm.stall_restart_s): a peers table shows who keeps restarting.
    # Unverifiable, and nothing is decided on it.
    restarts: int = since_minor(12, int)

    _COUNTS: ClassVar[tuple[str, ...]] = (
        "model_parameters",
        "round",
        "policy_version",
        "rollouts_published",
        "rollouts_received",
        "rollouts_accepted",
        "rollouts_rejected",
        "outer_steps",
        "outer_steps_skipped",
    )
    _NAMES: ClassVar[tuple[str, ...]] = ("display_name", "software_version", "protocol_version", "model_name")
    _RATES: ClassVar[tuple[str, ...]] = ("tokens_per_s", "uptime_s", "last_seen")

    def to_wire(self) -> dict[str, Any]:
        wire = {f.name: getattr(self, f.name) for f in fields(self)}
        wire["addresses"] = list(self.addresses)
        wire["gossip_addresses"] = list(self.gossip_addresses)
        wire["accuracy_by_dataset"] = dict(self.accuracy_by_dataset)
        return wire

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        check_node_id(f["node_id"], "node_id", limits)
        values: dict[str, Any] = {"node_id": f["node_id"]}
        values |= {name: check_str(f[name], name, limits.max_name_chars) for name in cls._NAMES}
        values |= {name: check_int(f[name], name) for name in cls._COUNTS}
        values |= {name: check_float(f[name], name, lo=0.0) for name in cls._RATES}
        values["reward_mean"] = check_float(f["reward_mean"], "reward_mean")
        values["accuracy"] = check_float(f["accuracy"], "accuracy", lo=0.0, hi=1.0)
        values["addresses"] = check_addresses(f["addresses"], "addresses", limits.max_addresses, limits.max_name_chars)
        values["gossip_addresses"] = check_addresses(
            f["gossip_addresses"], "gossip_addresses", limits.max_addresses, limits.max_name_chars
        )
        if "device" in f:  # absent from a minor 0-7 sender
            values["device"] = check_str(f["device"], "device", limits.max_name_chars)
        if "rejoins" in f:  # absent from a minor 0-8 sender
            values["rejoins"] = check_int(f["rejoins"], "rejoins")
        if "restarts" in f:  # absent from a minor 0-11 sender
            values["restarts"] = check_int(f["restarts"], "restarts")
        values |= cls._overlap(f)  # nil, or absent from a minor 0-9 sender (sampler_idle_s: 0-10): None
        if "reachability" in f:  # absent from a minor 0-4 sender
            values["reachability"] = check_str(f["reachability"], "reachability", limits.max_name_chars)
            if values["reachability"] not in REACHABILITY:
                reject(
                    Refusal.BAD_VALUE,
                    f"reachability must be one of {sorted(REACHABILITY)}, got {values['reachability']!r}",
                )
        if "accuracy_by_dataset" in f:  # absent from a minor 0/1 sender
            by_dataset = f["accuracy_by_dataset"]
            if type(by_dataset) is not dict:
                reject(Refusal.BAD_STRUCTURE, f"accuracy_by_dataset must be a map, got {type(by_dataset).__name__}")
            if len(by_dataset) > MAX_DATASETS_REPORTED:
                reject(
                    Refusal.TOO_MANY_ITEMS,
                    f"accuracy_by_dataset has {len(by_dataset)} items, limit {MAX_DATASETS_REPORTED}",
                )
            values["accuracy_by_dataset"] = {
                check_str(k, "dataset label", limits.max_name_chars): check_float(v, "dataset accuracy", lo=0.0, hi=1.0)
                for k, v in by_dataset.items()
            }
        return cls(**values)

    @staticmethod
    def _overlap(f: dict[str, Any]) -> dict[str, Any]:
        """The overlap fields (minor 10; sampler_idle_s minor 11), each None or in its bounds, the pairs both set or
        both None."""
        for first, second in (("staleness_mean", "staleness_max"), ("carried_in", "carried_out")):
            if (f.get(first) is None) != (f.get(second) is None):
                reject(Refusal.BAD_STRUCTURE, f"{first} and {second} must both be set or both be nil")
        values = {
            "staleness_max": optional(check_int, f.get("staleness_max"), "staleness_max", hi=MAX_VERSIONS_BEHIND),
            "carried_in": optional(check_int, f.get("carried_in"), "carried_in", hi=MAX_CARRIED),
            "carried_out": optional(check_int, f.get("carried_out"), "carried_out", hi=MAX_CARRIED),
            "ahead_wait_s": optional(check_float, f.get("ahead_wait_s"), "ahead_wait_s", lo=0.0, hi=MAX_AHEAD_WAIT_S),
            "sampler_idle_s": optional(
                check_float, f.get("sampler_idle_s"), "sampler_idle_s", lo=0.0, hi=MAX_SAMPLER_IDLE_S
            ),
        }
        hi = float(values["staleness_max"] or 0)  # a mean of counts is never above their max
        values["staleness_mean"] = optional(check_float, f.get("staleness_mean"), "staleness_mean", lo=0.0, hi=hi)
        return values

    def claimed_node_id(self) -> str | None:
        return self.node_id


def optional(check: Any, value: Any, name: str, **bounds: Any) -> Any:
    """None (nil on the wire: not measured), or a value `check` accepts."""
    return None if value is None else check(value, name, **bounds)


STAGE_STATES = ("serving", "loading", "spare")
MAX_STAGES = 4096
MAX_REPLICAS_LISTED = 32


@dataclass(frozen=True)
class StageAnnouncement:
    """A pipeline stage server's signed heartbeat: which stage it serves and how it trains.

    Stored under `<prefix>/stages/<model fingerprint>` with the node id as subkey; drivers
    build their routes from these, spares and joining nodes pick the stage to serve and the
    sources of a recovery from them (see node/pipeline/)."""

    KIND: ClassVar[MessageKind] = MessageKind.STAGE_ANNOUNCEMENT

    node_id: str  # must equal the node id of the envelope's signing key
    p2p_peer_id: str  # base58 libp2p peer id that serves the pipeline calls (authenticated by libp2p)
    model_fingerprint: str  # the whole model's fingerprint (architecture, shapes, tokenizer)
    num_stages: int  # S: how the model is split (1..MAX_STAGES)
    stage: int  # index of the stage served, in [0, S); -1 for a spare waiting to take one over
    stage_fingerprint: str  # the served stage's fingerprint ("" for a spare)
    layer_start: int  # first decoder layer of the stage (inclusive)
    layer_end: int  # last decoder layer of the stage (exclusive)
    parts: list[str]  # parts held: "embed", "layers", "head" (CheckFree+ replicas included)
    state: str  # "serving", "loading" (copying or recovering its weights) or "spare"
    step: int  # optimizer steps this server's stage has taken (carried over by copies and recoveries)
    grad_norm: float  # the stage's last gradient norm after clipping (CheckFree's neighbour weight)
    samples_per_s: float  # recent throughput of forward+backward calls, in sequences per second
    recoveries: int  # stage recoveries this server performed (replica copy, CheckFree, CheckFree+, re-init)
    replicas: list[str]  # node ids of the other live servers of its stage it knows (at most 32)
    # minor 3: multiaddrs of the p2p daemon serving the calls; a driver that is not connected to it yet
    # dials these (its daemon knows no route to a peer id alone). Empty from a minor 1/2 sender.
    p2p_maddrs: list[str] = since_minor(3, list)

    def to_wire(self) -> dict[str, Any]:
        wire = {f.name: getattr(self, f.name) for f in fields(self)}
        wire["parts"] = list(self.parts)
        wire["replicas"] = list(self.replicas)
        wire["p2p_maddrs"] = list(self.p2p_maddrs)
        return wire

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        check_node_id(f["node_id"], "node_id", limits)
        num_stages = check_int(f["num_stages"], "num_stages", lo=1, hi=MAX_STAGES)
        stage = check_int(f["stage"], "stage", lo=-1, hi=num_stages - 1)
        start, end = check_int(f["layer_start"], "layer_start"), check_int(f["layer_end"], "layer_end")
        if end < start:
            reject(Refusal.BAD_VALUE, f"layer range [{start}, {end}) is empty backwards")
        parts = check_list(f["parts"], "parts", 3)
        for part in parts:
            if check_str(part, "part", 16) not in ("embed", "layers", "head"):
                reject(Refusal.BAD_VALUE, f"part {part!r} is not embed, layers or head")
        if check_str(f["state"], "state", 16) not in STAGE_STATES:
            reject(Refusal.BAD_VALUE, f"state {f['state']!r} is not one of {STAGE_STATES}")
        replicas = check_list(f["replicas"], "replicas", MAX_REPLICAS_LISTED)
        for replica in replicas:
            check_node_id(replica, "replica", limits)
        return cls(
            node_id=f["node_id"],
            p2p_peer_id=check_str(f["p2p_peer_id"], "p2p_peer_id", 128),
            model_fingerprint=check_str(f["model_fingerprint"], "model_fingerprint", MAX_FINGERPRINT_CHARS),
            num_stages=num_stages,
            stage=stage,
            stage_fingerprint=check_str(f["stage_fingerprint"], "stage_fingerprint", MAX_FINGERPRINT_CHARS),
            layer_start=start,
            layer_end=end,
            parts=parts,
            state=f["state"],
            step=check_int(f["step"], "step"),
            grad_norm=check_float(f["grad_norm"], "grad_norm", lo=0.0),
            samples_per_s=check_float(f["samples_per_s"], "samples_per_s", lo=0.0),
            recoveries=check_int(f["recoveries"], "recoveries"),
            replicas=replicas,
            p2p_maddrs=check_addresses(
                f.get("p2p_maddrs", []), "p2p_maddrs", limits.max_addresses, limits.max_name_chars
            ),
        )

    def claimed_node_id(self) -> str | None:
        return self.node_id


MAX_LOST_STAGES = 64  # stages one report may name: a driver of a deeper pipeline names the first 64


@dataclass(frozen=True)
class StageLost:
    """A pipeline driver's signed report that every server of some stages failed its calls.

    Stored under `<prefix>/stages-lost` with the driver's node id as subkey (one report per
    driver, replaced by its next). Why: a killed server's last announcement stays readable
    until it ages out, so a joining server or a spare would count it as live and pick
    another stage. Readers honour a report until the stage announces again: a server
    announcement of a named stage signed before the stage was found lost is not counted as
    live (node/pipeline/selection.py).

    Minor 7, `lost_at`: when each stage was found lost, so that a driver can keep naming a
    stage that was rebuilt (its dead server's last announcement must stay hidden until it
    ages out) without hiding the new server, and re-publish without re-dating older losses.
    A reader takes each time no later than the envelope's timestamp; a minor 4-6 report has
    none, and its stages count as lost at its timestamp."""

    KIND: ClassVar[MessageKind] = MessageKind.STAGE_LOST

    node_id: str  # the reporting driver; must equal the node id of the envelope's signing key
    model_fingerprint: str  # the whole model's fingerprint, as in StageAnnouncement
    num_stages: int  # S: how the model is split (1..MAX_STAGES)
    stages: list[int]  # the stages found lost, each in [0, S), no repeats, at most MAX_LOST_STAGES; [] withdraws
    # minor 7: unix time each of `stages` was found lost (same length), or [] (they count from the signature)
    lost_at: list[float] = since_minor(7, list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "model_fingerprint": self.model_fingerprint,
            "num_stages": self.num_stages,
            "stages": list(self.stages),
            "lost_at": list(self.lost_at),
        }

    def times(self, signed_at: float) -> dict[int, float]:
        """stage -> when it was found lost, none later than `signed_at` (the envelope's timestamp)."""
        if not self.lost_at:
            return {stage: signed_at for stage in self.stages}
        return {stage: min(t, signed_at) for stage, t in zip(self.stages, self.lost_at)}

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        check_node_id(f["node_id"], "node_id", limits)
        num_stages = check_int(f["num_stages"], "num_stages", lo=1, hi=MAX_STAGES)
        stages = [
            check_int(stage, "stages", lo=0, hi=num_stages - 1)
            for stage in check_list(f["stages"], "stages", MAX_LOST_STAGES)
        ]
        if len(set(stages)) != len(stages):
            reject(Refusal.BAD_VALUE, f"stages {stages} repeat a stage")
        lost_at = []
        if "lost_at" in f:  # absent from a minor 4-6 sender
            lost_at = [check_float(t, "lost_at", lo=0.0) for t in check_list(f["lost_at"], "lost_at", MAX_LOST_STAGES)]
            if lost_at and len(lost_at) != len(stages):
                reject(Refusal.BAD_VALUE, f"lost_at has {len(lost_at)} times for {len(stages)} stages")
        return cls(
            node_id=f["node_id"],
            model_fingerprint=check_str(f["model_fingerprint"], "model_fingerprint", MAX_FINGERPRINT_CHARS),
            num_stages=num_stages,
            stages=stages,
            lost_at=lost_at,
        )

    def claimed_node_id(self) -> str | None:
        return self.node_id


AVERAGING_STATES = ("free", "done")


@dataclass(frozen=True)
class AveragingReady:
    """A node's averaging rendezvous entry for one round (node/averaging/matchmaking.py), stored under the
    round's key with the node id as subkey: signed, so nobody can announce, or withdraw, someone else."""

    KIND: ClassVar[MessageKind] = MessageKind.AVERAGING_READY

    p2p_peer_id: str  # base58 libp2p peer id that accepts the exchange stream (authenticated by libp2p)
    round: int  # the averaging round (>= 0)
    state: str  # "free": looking for a partner; "done": no longer looking this round (averaged, or out of time)
    # minor 3: multiaddrs of the p2p daemon that accepts the exchange: a partner on another host that
    # is not connected to it yet dials these. Empty from a minor 1/2 sender.
    p2p_maddrs: list[str] = since_minor(3, list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "p2p_peer_id": self.p2p_peer_id,
            "round": self.round,
            "state": self.state,
            "p2p_maddrs": list(self.p2p_maddrs),
        }

    @classmethod
    def from_wire(cls, obj: Any, limits: Limits = DEFAULT_LIMITS, *, minor: int = PROTOCOL_MINOR) -> Self:
        f = check_fields(obj, cls, minor)
        if check_str(f["state"], "state", 16) not in AVERAGING_STATES:
            reject(Refusal.BAD_VALUE, f"state {f['state']!r} is not one of {AVERAGING_STATES}")
        return cls(
            p2p_peer_id=check_str(f["p2p_peer_id"], "p2p_peer_id", 128),
            round=check_int(f["round"], "round"),
            state=f["state"],
            p2p_maddrs=check_addresses(
                f.get("p2p_maddrs", []), "p2p_maddrs", limits.max_addresses, limits.max_name_chars
            ),
        )

    def claimed_node_id(self) -> str | None:
        return None


Message = RolloutBatch | PeerStats | StageAnnouncement | AveragingReady | StageLost
MESSAGE_TYPES: dict[
    MessageKind, type[RolloutBatch] | type[PeerStats] | type[StageAnnouncement] | type[AveragingReady] | type[StageLost]
] = {
    MessageKind.ROLLOUT_BATCH: RolloutBatch,
    MessageKind.PEER_STATS: PeerStats,
    MessageKind.STAGE_ANNOUNCEMENT: StageAnnouncement,
    MessageKind.AVERAGING_READY: AveragingReady,
    MessageKind.STAGE_LOST: StageLost,
}
