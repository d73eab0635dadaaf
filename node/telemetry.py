"""What a node says about itself: each round's metrics row, moving averages of its rounds, its signed heartbeat's
content, its Prometheus gauges."""

from __future__ import annotations

import logging
import statistics
import time
from typing import TYPE_CHECKING, Any

from node.compute import RoundWork
from node.config import NodeConfig
from node.rollouts.base import GenerationWork, RolloutGroup
from node.stats import CLOCK_WARN_S, LogThrottle, SwarmStats, clock_advice, prometheus_text
from protocol import DEFAULT_LIMITS, PROTOCOL_VERSION, PeerStats
from protocol.messages import (
    MAX_AHEAD_WAIT_S,
    MAX_CARRIED,
    MAX_DATASETS_REPORTED,
    MAX_SAMPLER_IDLE_S,
    MAX_VERSIONS_BEHIND,
)

if TYPE_CHECKING:
    from node.trainer import TrainStats

log = logging.getLogger(__name__)

SOFTWARE_VERSION = "0.1.0"
EMA_WEIGHT = 0.1  # of the newest round in the moving averages a heartbeat reports
# The overlap of generation with training a round's row has where it is on (rollout.max_staleness, rollout.over_sample):
# the heartbeat and the gauges report the last round's, None (no gauge) where the feature is off.
OVERLAP_KEYS = ("staleness_mean", "staleness_max", "carried_in", "carried_out", "ahead_wait_s", "sampler_idle_s")
# the overlap's idle seconds on each side (the round waiting for the sampler, the sampler for the round), each with the
# bound its heartbeat field is validated against
IDLE_BOUNDS = {"ahead_wait_s": MAX_AHEAD_WAIT_S, "sampler_idle_s": MAX_SAMPLER_IDLE_S}
CLOCK_SAY_EVERY_S = 600.0  # a clock that stays off is said again this often: once is easy to miss in a week's log


class Telemetry:
    """Moving averages over a node's rounds, and the heartbeat and gauges built from them.

    `accuracy_by_dataset` is shared, not copied: the peer-rollout component reads it as this node's
    capability per specialty (node/sharing.py)."""

    def __init__(self, config: NodeConfig, stats: SwarmStats):
        self.config = config
        self.stats = stats
        self.reward: float | None = None
        self.accuracy: float | None = None
        self.accuracy_by_dataset: dict[str, float] = {}  # per specialty of the task mix
        self.tokens_per_s = 0.0  # of the last round
        self.device = ""  # where the policy trains, as node.device.describe_device says it (set once it is loaded)
        self.overlap: dict[str, float | int | None] = dict.fromkeys(OVERLAP_KEYS)  # of the last round (OVERLAP_KEYS)
        self._records_decoded = 0  # stats.values_decoded at the last row: a round's work counts from here
        self._clock_throttle = LogThrottle(every_s=CLOCK_SAY_EVERY_S)
        self._clock_said = False  # the clock was said to be off, and not yet said to be back

    def round_row(
        self,
        round_: int,
        summary: dict[str, Any],
        train: TrainStats,
        *,
        policy_version: int,
        policy_report: dict[str, Any],
        own_groups: list[RolloutGroup],
        peer_groups: list[RolloutGroup],
        peers_rescored: int,
        peers_gated: int,
        peer_completions_rescored: int,
        outer_step: dict | None,
        generation_s: float,
        scoring_s: float,
        sharing_s: float,
        update_s: float,
        generation_work: GenerationWork,
    ) -> dict[str, Any]:
        """A round's metrics row (metrics.jsonl; tests, benchmarks and the dashboard read its keys), the refusals
        counted since the last row included. The keys about peers appear only on a node that takes them (J > 0), the
        trainer's optional ones when it measured them."""
        swarm = self.config.swarm
        return {
            "round": round_,
            "time": time.time(),
            **summary,
            "policy_version": policy_version,
            "loss": train.loss,
            "grad_norm": train.grad_norm,
            "clip_fraction": train.clip_fraction,
            "kl": train.kl,
            "groups_used": train.groups_used,
            "groups_dropped": train.groups_dropped,
            **(
                {"importance_weight_mean": train.importance_weight_mean}
                if train.importance_weight_mean is not None
                else {}
            ),
            **(
                {"imitation_sequences": train.imitation_sequences, "imitation_nll": train.imitation_nll}
                if train.imitation_sequences
                else {}
            ),
            **policy_report,
            "external_questions": len(peer_groups),
            **({"external_rescored": peers_rescored} if swarm.external_questions else {}),
            **({"external_gated": peers_gated} if swarm.external_gate != "none" else {}),
            "rejected": self.stats.take_round_rejections(),
            **({"outer_step": outer_step} if outer_step else {}),
            **self._clock_offset(),
            "generation_s": generation_s,
            "scoring_s": scoring_s,
            **({"sharing_s": sharing_s} if swarm.external_questions else {}),
            "update_s": update_s,
            # what the round cost in work, whatever the machine's load (node/compute.py weighs it)
            "work": RoundWork(
                prefill_tokens=generation_work.prefill_tokens,
                decode_tokens=generation_work.decode_tokens,
                decode_steps=generation_work.decode_steps,
                forward_tokens=train.forward_tokens,
                train_tokens=train.train_tokens,
                train_calls=train.train_calls,
                optimizer_steps=train.optimizer_steps,
                scored_completions=sum(len(g.completions) for g in own_groups)
                + (peer_completions_rescored if swarm.external_questions else 0),
                records_decoded=self._take_records_decoded(),
                groups_rederived=peers_rescored if swarm.external_questions else 0,
            ).as_dict(),
        }

    def _clock_offset(self) -> dict[str, float]:
        """The row's clock_offset_s: this node's clock minus the swarm's, where its peers' signed times measured it."""
        offset = self.stats.clock_totals()["clock_offset_s"]
        return {} if offset is None else {"clock_offset_s": offset}

    def clock_advice(self) -> str | None:
        """What is wrong with this node's clock, if anything (node.stats.clock_advice), for the log and /readyz."""
        reading = self.stats.clock.reading()
        return clock_advice(reading, self.config.swarm.max_batch_age_s, DEFAULT_LIMITS.max_clock_skew_s)

    def say_clock(self) -> None:
        """Log a clock that went off the swarm's (again every CLOCK_SAY_EVERY_S while it stays off), and its return."""
        advice = self.clock_advice()
        if advice is not None and self._clock_throttle.due("clock"):
            log.warning("%s", advice)
            self._clock_said = True
        elif advice is None and self._clock_said and (reading := self.stats.clock.reading()) is not None:
            log.info("this node's clock is back within %.0f s of the swarm's (%+.0f s)", CLOCK_WARN_S, reading.offset_s)
            self._clock_said = False
            self._clock_throttle = LogThrottle(every_s=CLOCK_SAY_EVERY_S)

    def _take_records_decoded(self) -> int:
        """Peers' records decoded since the last row (the transport's receiver counts them)."""
        decoded = self.stats.values_decoded - self._records_decoded
        self._records_decoded = self.stats.values_decoded
        return decoded

    def record_round(self, row: dict[str, Any]) -> None:
        ema = lambda old, new: new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new  # noqa: E731
        self.reward = ema(self.reward, row["reward_mean"])
        self.accuracy = ema(self.accuracy, row["accuracy"])
        for label, accuracy in row.get(
            "accuracy_by_dataset", {}
        ).items():  # a specialty absent this round keeps its average
            self.accuracy_by_dataset[label] = ema(self.accuracy_by_dataset.get(label), accuracy)
        self.tokens_per_s = row["tokens_per_s"]
        self.overlap = last_overlap(row)
        self.say_clock()

    def heartbeat(
        self,
        node_id: str,
        model_parameters: int,
        round_: int,
        policy_version: int,
        addresses: list[str],
        averaging=None,
    ) -> PeerStats:
        """The heartbeat's content (the transport signs it and adds its gossip addresses)."""
        totals = self.stats.totals()
        return PeerStats(
            node_id=node_id,
            display_name=self.config.name,
            software_version=SOFTWARE_VERSION,
            protocol_version=PROTOCOL_VERSION,
            model_name=self.config.model.name_or_path,
            model_parameters=model_parameters,
            round=round_,
            policy_version=policy_version,
            reward_mean=self.reward or 0.0,
            accuracy=self.accuracy or 0.0,
            accuracy_by_dataset={
                label: min(1.0, max(0.0, value))
                for label, value in list(self.accuracy_by_dataset.items())[:MAX_DATASETS_REPORTED]
            },
            rollouts_published=totals["batches_published"],
            rollouts_received=totals["batches_received"],
            rollouts_accepted=totals["batches_accepted"],
            rollouts_rejected=sum(totals["rejected"].values()),
            tokens_per_s=self.tokens_per_s,
            uptime_s=time.time() - self.stats.started,
            last_seen=time.time(),
            addresses=addresses[:8],
            gossip_addresses=[],  # the transport fills in its own
            outer_steps=averaging.stats.succeeded if averaging else 0,
            outer_steps_skipped=averaging.stats.skipped if averaging else 0,
            device=self.device,
            rejoins=self.stats.swarm_rejoins,
            restarts=self.stats.restarts,
            **self.overlap,
        )

    def prometheus(self, round_: int, policy_version: int, averaging=None) -> str:
        gauges = {
            "round": round_,
            "policy_version": policy_version,
            "reward_mean": self.reward or 0.0,
            "accuracy": self.accuracy or 0.0,
            "tokens_per_s": self.tokens_per_s,
        }
        gauges |= {name: value for name, value in self.overlap.items() if value is not None}
        if averaging:
            gauges |= {f"averaging_{k}": v for k, v in averaging.counters().items() if k != "refusals"}
        return prometheus_text(gauges, self.stats)


def last_overlap(row: dict[str, Any]) -> dict[str, float | int | None]:
    """A round row's overlap keys as the heartbeat carries them: None where absent, inside the protocol's bounds (a
    value past them is clipped, not refused: the node's own heartbeat must never fail its check)."""
    value = {key: row.get(key) for key in OVERLAP_KEYS}
    if value["staleness_max"] is not None and value["staleness_mean"] is not None:
        value["staleness_max"] = min(MAX_VERSIONS_BEHIND, max(0, int(value["staleness_max"])))
        value["staleness_mean"] = min(float(value["staleness_max"]), max(0.0, float(value["staleness_mean"])))
    else:
        value["staleness_max"] = value["staleness_mean"] = None
    if value["carried_in"] is not None and value["carried_out"] is not None:
        value["carried_in"], value["carried_out"] = (
            min(MAX_CARRIED, max(0, int(value[key]))) for key in ("carried_in", "carried_out")
        )
    else:
        value["carried_in"] = value["carried_out"] = None
    for key, bound in IDLE_BOUNDS.items():
        if value[key] is not None:
            value[key] = min(bound, max(0.0, float(value[key])))
    return value


def summarize_metrics(rows: list[dict[str, Any]]) -> dict[str, Any]:
    if not rows:
        return {"rounds": 0}
    tenth = max(1, len(rows) // 10)
    heldout = [(r["round"], r["heldout_accuracy"]) for r in rows if "heldout_accuracy" in r]
    return {
        "rounds": rows[-1]["round"],
        "policy_version": rows[-1]["policy_version"],
        "reward_mean_first_10pct": statistics.fmean(r["reward_mean"] for r in rows[:tenth]),
        "reward_mean_last_10pct": statistics.fmean(r["reward_mean"] for r in rows[-tenth:]),
        "accuracy_first_10pct": statistics.fmean(r["accuracy"] for r in rows[:tenth]),
        "accuracy_last_10pct": statistics.fmean(r["accuracy"] for r in rows[-tenth:]),
        "heldout_accuracy_first": heldout[0][1] if heldout else None,
        "heldout_accuracy_last": heldout[-1][1] if heldout else None,
        "tokens_per_s_mean": statistics.fmean(r["tokens_per_s"] for r in rows),
        "step_s_mean": statistics.fmean(r["step_s"] for r in rows),
        "external_questions_total": sum(r.get("external_questions", 0) for r in rows),
        "wall_s": rows[-1]["time"] - rows[0]["time"] + rows[0]["step_s"],
        **_overlap_summary(rows),
        "by_dataset": _by_dataset(rows, tenth),
    }


def _overlap_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The overlap of generation with training over the rounds that had it (none: no keys, the summary as without it):
    staleness of the node's own completions in policy versions (mean of the rounds' means, the max), completions
    carried in and out (rollout.over_sample), the seconds rounds waited for the rollouts generated ahead and the seconds
    the sampler waited for the rounds to hand it the next questions (rollout.max_staleness)."""
    summary: dict[str, Any] = {}
    if stale := [r for r in rows if r.get("staleness_mean") is not None]:
        summary["staleness_mean"] = statistics.fmean(r["staleness_mean"] for r in stale)
        summary["staleness_max"] = max(r["staleness_max"] for r in stale)
    if carried := [r for r in rows if r.get("carried_in") is not None]:
        summary["carried_in_total"] = sum(r["carried_in"] for r in carried)
        summary["carried_out_total"] = sum(r["carried_out"] for r in carried)
    for key in IDLE_BOUNDS:
        if seconds := [r[key] for r in rows if r.get(key) is not None]:
            summary[f"{key}_mean"] = statistics.fmean(seconds)
            summary[f"{key}_total"] = sum(seconds)
    return summary


def _by_dataset(rows: list[dict[str, Any]], tenth: int) -> dict[str, dict[str, float | None]]:
    """Per specialty of the task mix: reward of the node's own completions early and late, held-out accuracy first and
    last."""
    labels = sorted(
        {label for r in rows for label in r.get("reward_by_dataset", {})}
        | {label for r in rows for label in r.get("heldout_by_dataset", {})}
    )

    def mean_reward(part: list[dict[str, Any]], label: str) -> float | None:
        values = [r["reward_by_dataset"][label] for r in part if label in r.get("reward_by_dataset", {})]
        return statistics.fmean(values) if values else None

    summary = {}
    for label in labels:
        heldout = [r["heldout_by_dataset"][label] for r in rows if label in r.get("heldout_by_dataset", {})]
        summary[label] = {
            "reward_first_10pct": mean_reward(rows[:tenth], label),
            "reward_last_10pct": mean_reward(rows[-tenth:], label),
            "heldout_first": heldout[0] if heldout else None,
            "heldout_last": heldout[-1] if heldout else None,
        }
    return summary
