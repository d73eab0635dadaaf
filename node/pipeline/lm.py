"""The driver's language-model objective: next-token loss on the fixed offline corpus.

One step = `micro_batches` micro-batches, each forward and backward through its own
random route (`micro_batches_in_flight` of them at once), then `step` on every server
used. A lost stage abandons the step, waits for the stage to be served again and retries
the same step (same micro-batches), so a failure costs time, never data; a try cut short
otherwise (cancelled when the connection died: `drive` takes the step again once rejoined)
has what it accumulated on its servers dropped before the retake. A try whose micro-batches
all went through is never taken again: its step call is sent again, the same call, to the
servers that did not answer it (a server that applied it answers a repeat from memory), so
no server applies a step twice and none keeps a step's gradients for the next. Each step
appends a row to metrics.jsonl: loss, the validation loss every `eval_every` steps,
retries, hop failures, the servers used and their gradient norms, and a `recovery`
record on the first step after a lost stage (`swarm-node stats` sums them up: step_metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from node.config import NodeConfig
from node.pipeline.client import HopFailed
from node.pipeline.corpus import micro_batch
from node.aio import StopRequested
from node.pipeline.driver import PipelineRouter, StageLost, route_hops, route_order
from node.state import StateStore
from protocol import StageAnnouncement

log = logging.getLogger(__name__)


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a packed [B, T] batch."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def full_masks(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, length = input_ids.shape
    return torch.arange(length).expand(batch, length).contiguous(), torch.ones((batch, length), dtype=torch.long)


@dataclass
class AccumulatedStep:
    """A step whose micro-batches all went through: the servers that hold its gradients, the one step call (the same
    id each time it is sent) that makes them apply them, and what its metrics row reports."""

    step: int
    step_id: str
    servers: dict[str, StageAnnouncement]
    losses: list[float]
    report: dict[str, Any]
    started: float  # perf_counter at its first try


class LMDriver:
    def __init__(
        self,
        config: NodeConfig,
        router: PipelineRouter,
        corpus: torch.Tensor,
        validation: torch.Tensor,
        store: StateStore,
    ) -> None:
        self.config = config
        self.pipeline = config.pipeline
        self.router = router
        self.corpus = corpus
        self.validation = validation
        self.store = store
        rows = store.read_metrics()
        self.step = rows[-1]["step"] if rows else 0  # the driver keeps no weights: its only state is where it is
        # stage -> (monotonic time it was found lost, cause, the servers that served it last)
        self.lost_since: dict[int, tuple[float, str, frozenset[str]]] = {}
        self.served_again_at = 0.0  # monotonic time the last wait for lost stages ended
        # node id -> a server a try that did not finish (cancelled: its connection died; or failed) may have left
        # gradients on: dropped before the step is taken again
        self.left_on: dict[str, StageAnnouncement] = {}
        # the step whose micro-batches went through, until every server it touched answered its step call
        self.stepping: AccumulatedStep | None = None
        # the servers of the last step that answered its step call neither, sent it once more before the next step
        self.owed: AccumulatedStep | None = None

    async def _micro_batch(self, step: int, index: int, touched: dict, report: dict) -> float:
        input_ids = micro_batch(self.corpus, step, index, self.pipeline.micro_batch_size)
        positions, mask = full_masks(input_ids)
        pipeline = self.pipeline
        order = route_order(
            pipeline.num_stages,
            (step - 1) * pipeline.micro_batches + index,  # counted over the run: one in N whatever the step's size
            pipeline.checkfree_plus,
            pipeline.checkfree_plus_swap_every,
            pipeline.checkfree_plus_swap_last,
        )
        hops = route_hops(pipeline.num_stages, order)
        for attempt in range(self.pipeline.attempts_per_micro_batch):
            route = await self.router.pick_route(hops)
            prefix = f"s{step}-m{index}-a{attempt}-{time.time_ns() % 10**9}"
            try:
                logits = await self.router.forward(route, hops, prefix, input_ids, positions, mask, train=True)
            except HopFailed as failure:
                self.router.fail(failure)
                report["retries"] += 1
                continue
            for server in route.values():
                touched[server.node_id] = server
            logits = logits.detach().float().requires_grad_(True)
            loss = lm_loss(logits, input_ids)
            (loss / self.pipeline.micro_batches).backward()
            try:
                await self.router.backward(route, hops, prefix, logits.grad.to(torch.float32))
            except HopFailed as failure:
                # Servers after the failed hop already accumulated this micro-batch; the ones before it cannot.
                self.router.fail(failure)
                report["backward_failures"] += 1
            report["servers"] = {stage: s.node_id for stage, s in route.items()}
            return loss.item()
        raise StageLost(-1, f"{self.pipeline.attempts_per_micro_batch} routes failed for one micro-batch")

    async def _micro_batches(self, step: int, touched: dict, report: dict) -> list[float]:
        """The step's micro-batches, `micro_batches_in_flight` at a time (each server runs one call at a time, so with
        more than one in flight the stages work on different micro-batches at once, as GPipe fills its pipeline). The
        losses in micro-batch order; a lost stage is raised once every micro-batch in flight has finished or failed."""
        in_flight = asyncio.Semaphore(self.pipeline.micro_batches_in_flight)

        async def one(index: int) -> float:
            async with in_flight:
                return await self._micro_batch(step, index, touched, report)

        outcomes = await asyncio.gather(
            *(one(index) for index in range(self.pipeline.micro_batches)), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    async def train_step(self) -> dict[str, Any]:
        step = self.step + 1
        if self.owed is not None:
            await self._send_owed()
        if self.left_on:
            await self._drop_left(step)
        if self.stepping is None:  # else: its step call was cut short (cancelled), sent again below
            self.stepping = await self._accumulate(step)
        taken = self.stepping
        stepped = await self.router.step(taken.servers, scale=1.0, step_id=taken.step_id)
        self.stepping = None
        if stepped.unanswered:
            self.owed = replace(taken, servers=stepped.unanswered)
        losses, report, started = taken.losses, taken.report, taken.started
        norms = stepped.grad_norms
        row: dict[str, Any] = {
            "step": step,
            "time": time.time(),
            "loss": sum(losses) / len(losses),
            "retries": report["retries"],
            "backward_failures": report["backward_failures"],
            "hop_failures": dict(self.router.hop_failures),
            "repeated_calls": dict(self.router.repeated),  # sent again to the same server after a broken stream
            # pipeline.direct_hops: chained forwards that failed and went hop by hop (driver.py)
            "chain_fallbacks": self.router.chain_fallbacks,
            "servers": report["servers"],
            "grad_norms": norms,
        }
        self.router.hop_failures.clear()
        self.router.repeated.clear()
        self.router.chain_fallbacks = 0
        recovered = self._recovered()
        if recovered:
            row["recovery"] = recovered
        every = self.pipeline.eval_every
        if every and (step % every == 0 or step == 1):
            row["val_loss"] = await self.validation_loss()
        row["step_s"] = time.perf_counter() - started
        self.store.append_metrics(row)
        self.step = step
        return row

    async def _accumulate(self, step: int) -> AccumulatedStep:
        """Every micro-batch of `step` forward and backward, its gradients accumulated on the servers it touched; a
        lost stage abandons the try and the step is tried again once the stage is served."""
        started = time.perf_counter()
        touched: dict = {}
        try:
            while True:
                touched = {}
                report: dict[str, Any] = {"retries": 0, "backward_failures": 0, "servers": {}}
                try:
                    losses = await self._micro_batches(step, touched, report)
                    break
                except StageLost as lost:
                    await self._abandon(touched, step, lost)
        except BaseException:
            # cancelled (`drive` takes the step again over a new session once rejoined) or failed: what this try
            # accumulated must not add to the next try's gradients
            self.left_on.update(touched)
            raise
        # unique per step: a driver restarted at this step must not be answered with the step its last run applied
        step_id = f"step-{step}-{time.time_ns() % 10**9}"
        return AccumulatedStep(step, step_id, touched, losses, report, started)

    async def _send_owed(self) -> None:
        """Send the last step's call once more to its servers that answered it neither (their answer lost, or the
        call): one that applied it answers from memory, one that never received it applies it now, before this step
        adds anything to its gradients. One that does not answer this either is owed nothing more."""
        owed = self.owed
        outcome = await self.router.step(owed.servers, scale=1.0, step_id=owed.step_id)
        self.owed = None
        late = sorted(owed.servers[n].stage for n in set(owed.servers) - set(outcome.unanswered))
        if late:
            log.info("step %d taken late by stage(s) %s", owed.step, ", ".join(map(str, late)))
        if outcome.unanswered:
            log.warning(
                "step %d: stage(s) %s did not answer its step call either time",
                owed.step,
                ", ".join(str(s.stage) for s in outcome.unanswered.values()),
            )

    async def _drop_left(self, step: int) -> None:
        """Drop (a step of scale 0) the gradients a try that did not finish may have left on its servers, under a call
        id of its own (a server that applied that try's step answers a repeat of it from memory, and this is no
        repeat). Best effort: a server that does not answer is not asked again; a drop cut short is sent again."""
        await self.router.step(self.left_on, scale=0.0, step_id=f"drop-{step}-{time.time_ns() % 10**9}")
        self.left_on = {}

    async def _abandon(self, touched: dict, step: int, lost: StageLost) -> None:
        """Drop the step's gradients everywhere, then wait until every stage is served again."""
        await self.router.step(touched, scale=0.0, step_id=f"abandon-{step}-{time.time_ns() % 10**9}")
        await self.router.refresh(force=True)

        def found_lost(stage: int) -> None:
            if stage >= 0 and stage not in self.lost_since:
                cause = lost.cause if stage == lost.stage else "no live server"
                # not the map's servers now: a server silent long enough has aged out of it, and would come back as
                # a "replacement" of nobody
                before = self.router.last_served.get(stage, frozenset())
                self.lost_since[stage] = (time.monotonic(), cause, before)
                log.warning("stage %d lost (%s): waiting for a server to rebuild it", stage, cause)

        for stage in self.router.missing_stages() or [lost.stage]:
            found_lost(stage)
        # a stage that dies while we wait (its neighbour killed a moment later) is recorded when it comes back too
        await self.router.wait_until_served(on_missing=found_lost)
        self.served_again_at = time.monotonic()

    def _recovered(self) -> list[dict] | None:
        """Records of the stages lost since the last step: who serves them now, whether another server than the
        ones that served it before took it (`replaced`), and how long the driver waited."""
        if not self.lost_since:
            return None
        now = time.monotonic()
        events = []
        for stage, (since, cause, before) in sorted(self.lost_since.items()):
            servers = self.router.map.live(stage)
            replaced = bool({s.node_id for s in servers} - before)
            events.append(
                {
                    "stage": stage,
                    "cause": cause,
                    "recovery_s": now - since,
                    # found lost -> every stage served again: the rebuild as this driver saw it, without the step after
                    "waited_s": self.served_again_at - since,
                    "replaced": replaced,
                    "servers": [s.node_id for s in servers],
                    "server_recoveries": sum(s.recoveries for s in servers),
                }
            )
            log.info(
                "stage %d back after %.1fs (first step after; %s)",
                stage,
                now - since,
                "a new server" if replaced else "the same servers answered again",
            )
        self.lost_since.clear()
        return events

    async def validation_loss(self) -> float:
        """Mean loss over the validation corpus, in normal stage order, without graphs."""
        hops = route_hops(self.pipeline.num_stages, list(range(self.pipeline.num_stages)))
        total, count = 0.0, 0
        size = self.pipeline.micro_batch_size
        for start in range(0, self.validation.shape[0], size):
            input_ids = self.validation[start : start + size]
            positions, mask = full_masks(input_ids)
            for attempt in range(self.pipeline.attempts_per_micro_batch):
                try:
                    route = await self.router.pick_route(hops)
                    logits = await self.router.forward(
                        route, hops, f"val-{time.time_ns() % 10**9}", input_ids, positions, mask, train=False
                    )
                except HopFailed as failure:
                    self.router.fail(failure)
                    continue
                except StageLost:
                    return math.nan  # measured again at the next evaluation
                total += float(lm_loss(logits, input_ids)) * input_ids.shape[0]
                count += input_ids.shape[0]
                break
        return total / count if count else math.nan

    async def run(self, steps: int | None, stop: asyncio.Event, on_step: Callable[[dict], None] | None = None) -> None:
        """Take `steps` more steps (None: until `stop` is set). A stop ends a step in flight only where it waits for a
        lost stage (the router's `stop`, the same event in `swarm-node drive`): that step was abandoned anyway."""
        target = None if steps is None else self.step + steps
        while not stop.is_set() and (target is None or self.step < target):
            try:
                row = await self.train_step()
            except StopRequested as stopped:
                log.info("%s", stopped)
                return
            if on_step:
                on_step(row)
