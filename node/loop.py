"""The node: one round loop shared by isolated training and swarm training.

One round = draw I local questions -> sample G completions each -> score locally ->
publish own groups -> collect J external groups and re-score them locally -> GRPO update
-> record metrics -> checkpoint. Torch work runs in a worker thread so the asyncio loop
(and the transport services beside it) keep running while the policy generates or trains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from node.config import NodeConfig, dump_config
from node.model import resolve_initial_policy, load_policy
from node.rollouts import build_rollout_backend
from node.state import StateStore, atomic_write_text, restore_rng
from node.tasks import Question, TaskError, TaskSource, grade, materialize
from node.trainer import GRPOTrainer, RolloutGroup
from node.transport import ExternalGroup, Transport, build_transport

log = logging.getLogger(__name__)


@dataclass
class RoundTimings:
    generation_s: float = 0.0
    scoring_s: float = 0.0
    update_s: float = 0.0
    checkpoint_s: float = 0.0


class Node:
    def __init__(self, config: NodeConfig, transport: Transport | None = None):
        self.config = config
        self.store = StateStore(config.resolved_state_dir())
        self.transport = transport or build_transport(config)
        self.tasks = TaskSource(config.tasks, seed=config.seed)
        self.round = 0  # rounds completed
        self.model = self.tokenizer = self.trainer = self.backend = None
        self._heldout: list[Question] | None = None

    # set-up ------------------------------------------------------------------

    def load(self, fresh: bool = False, progress: bool | None = None) -> None:
        """Resume from the state dir when it holds a checkpoint, else start from the initial policy."""
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        if fresh:
            self.store.wipe()
        checkpoint = self.store.latest()
        if checkpoint is not None:
            self.model, self.tokenizer = load_policy(checkpoint, self.config.model.dtype)
            state = self.store.load_trainer_state(checkpoint)
            self._build_services(state.policy_version)
            self.trainer.optimizer.load_state_dict(state.optimizer)
            restore_rng(state.rng)
            self.round = state.round
            self.store.truncate_metrics(self.round)
            log.info("resumed from %s (round %d, policy version %d)", checkpoint.name, self.round, state.policy_version)
        else:
            torch.manual_seed(self.config.seed)
            self.model, self.tokenizer = resolve_initial_policy(self.config, progress=progress)
            self._build_services(0)
            self.store.truncate_metrics(0)
            log.info("starting fresh from %s", self.config.model.name_or_path)
        self.store.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.store.root / "config.yaml", dump_config(self.config))

    def _build_services(self, policy_version: int) -> None:
        self.model.eval()
        self.trainer = GRPOTrainer(self.config.trainer, self.model, self.tokenizer.pad_token_id, self.config.rollout.temperature, policy_version)
        self.backend = build_rollout_backend(self.config, self.model, self.tokenizer, policy_version)

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    # one round ------------------------------------------------------------------

    def _generation_seed(self, round_: int) -> int:
        return (self.config.seed * 1_000_003 + round_) % (2**63)

    def score_group(self, question: Question, completions, source: str) -> RolloutGroup:
        grades = [grade(question, c.text, c.finish_reason == "stop", self.config.tasks.format_reward) for c in completions]
        return RolloutGroup(spec=question.spec, completions=completions, rewards=[g.reward for g in grades], source=source)

    def _rescore_external(self, external: list[ExternalGroup]) -> tuple[list[RolloutGroup], int]:
        """Re-derive each peer question from its spec and score it here; peers' answers are never used."""
        groups, refused = [], 0
        for item in external:
            try:
                question = materialize(item.spec)
            except TaskError as exc:
                log.warning("refused a group from %s: %s", item.peer_id, exc)
                refused += 1
                continue
            groups.append(self.score_group(question, item.completions, source=item.peer_id))
        return groups, refused

    def _generate_and_score(self, questions: list[Question], round_: int) -> tuple[list[RolloutGroup], dict[str, float], RoundTimings]:
        timings = RoundTimings()
        start = time.perf_counter()
        prompts = [self.tasks.prompt(q) for q in questions]
        completions = self.backend.generate(prompts, self.config.rollout.completions_per_question, seed=self._generation_seed(round_))
        timings.generation_s = time.perf_counter() - start
        start = time.perf_counter()
        groups, correct, total, tokens = [], 0, 0, 0
        for question, group_completions in zip(questions, completions):
            group = self.score_group(question, group_completions, source="local")
            groups.append(group)
            correct += sum(grade(question, c.text, True).correct for c in group_completions)
            total += len(group_completions)
            tokens += sum(len(c.completion_ids) for c in group_completions)
        timings.scoring_s = time.perf_counter() - start
        rewards = [r for g in groups for r in g.rewards]
        summary = {
            "reward_mean": sum(rewards) / len(rewards),
            "accuracy": correct / total,
            "tokens": tokens,
            "tokens_per_s": tokens / max(timings.generation_s, 1e-9),
            "completion_len_mean": tokens / total,
        }
        return groups, summary, timings

    async def run_round(self) -> dict[str, Any]:
        round_ = self.round + 1
        round_start = time.perf_counter()
        swarm = self.config.swarm
        questions = self.tasks.batch(first_draw=self.round * swarm.local_questions, count=swarm.local_questions)
        local_groups, summary, timings = await asyncio.to_thread(self._generate_and_score, questions, round_)
        await self.transport.publish(round_, self.policy_version, local_groups)
        external_groups, refused = [], 0
        if swarm.external_questions:
            received = await self.transport.collect(round_, swarm.external_questions)
            external_groups, refused = await asyncio.to_thread(self._rescore_external, received)
        start = time.perf_counter()
        stats = await asyncio.to_thread(self.trainer.step, local_groups + external_groups)
        timings.update_s = time.perf_counter() - start
        self.backend.sync_weights(self.model, self.policy_version)
        row: dict[str, Any] = {
            "round": round_,
            "time": time.time(),
            **summary,
            "policy_version": self.policy_version,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "clip_fraction": stats.clip_fraction,
            "kl": stats.kl,
            "groups_used": stats.groups_used,
            "groups_dropped": stats.groups_dropped,
            "external_questions": len(external_groups),
            "external_refused": refused,
            "generation_s": timings.generation_s,
            "scoring_s": timings.scoring_s,
            "update_s": timings.update_s,
        }
        every = self.config.eval_every
        if every and (round_ % every == 0 or round_ == 1):
            row["heldout_accuracy"] = await asyncio.to_thread(self.evaluate_heldout)
        row["step_s"] = time.perf_counter() - round_start
        self.store.append_metrics(row)
        self.round = round_
        if round_ % self.config.checkpoint_every == 0:
            await asyncio.to_thread(self.save)
        return row

    # evaluation and persistence -----------------------------------------------------

    def heldout_questions(self) -> list[Question]:
        if self._heldout is None:
            self._heldout = self.tasks.heldout()
        return self._heldout

    def evaluate_heldout(self, questions: list[Question] | None = None) -> float:
        """Greedy accuracy on the fixed held-out set."""
        questions = questions or self.heldout_questions()
        completions = self.backend.generate([self.tasks.prompt(q) for q in questions], n=1, seed=0, greedy=True)
        return sum(grade(q, c[0].text, True).correct for q, c in zip(questions, completions)) / len(questions)

    def save(self) -> None:
        self.store.save(self.round, self.model, self.tokenizer, self.trainer.optimizer, self.policy_version, self.config.checkpoint_keep)

    # the loop ----------------------------------------------------------------------------

    async def run(self, rounds: int | None, stop: asyncio.Event, on_round: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Run `rounds` more rounds (None: until `stop` is set); the state is saved on the way out."""
        await self.transport.start()
        target = None if rounds is None else self.round + rounds
        try:
            while not stop.is_set() and (target is None or self.round < target):
                row = await self.run_round()
                if on_round:
                    on_round(row)
            # A clean exit keeps every completed round, whatever checkpoint_every says. After an
            # error the weights may be half-updated, so the last checkpoint stands instead.
            latest = self.store.latest()
            if latest is None or self.store.load_round(latest) != self.round:
                await asyncio.to_thread(self.save)
        finally:
            await self.transport.stop()
            self.backend.close()
